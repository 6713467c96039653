"""One folder per parallelism: its mechanism, its strategy and PyTorch's twin together.

    dp/     single, dp-naive, dp (bucketed, overlapped), torch-ddp
    zero/   ZeRO stages 1 and 2 (ShardedOptimizer, streaming reduce), torch-zero1
    fsdp/   ZeRO-3 and FSDP (sharded units, prefetch), torch-fsdp2
    tp/     tensor and sequence parallelism, torch-tp
    pp/     pipeline schedules as tables, one runner, zero bubble, torch-pp-*
    cp/     ring attention
    ep/     expert parallelism (the all-to-all dispatch)

A parallelism never imports another (dp < zero < fsdp share mechanisms); they meet in
refimpl.compose, and the `--strategy` names map to them in refimpl.registry.
"""
