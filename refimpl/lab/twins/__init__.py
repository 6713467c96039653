"""PyTorch's own implementations of our strategies, the twins: each runs through the same loop as
ours, so any comparison is one command (`python -m refimpl train --strategy torch-ddp ...`).

    base.py            TorchTwin: what the twins share, and the traits only a twin has
    torch_ddp.py       torch-ddp: DistributedDataParallel, the twin of dp
    torch_zero1.py     torch-zero1: DDP + ZeroRedundancyOptimizer, the twin of zero1
    torch_fsdp2.py     torch-fsdp2 (-gradop): fully_shard, the twin of zero3 / fsdp
    torch_plan.py      DTensor's parallelize_module plan for the reference GPT
    torch_tp.py        torch-tp: DTensor tensor parallelism, the twin of tp
    torch_pp.py        torch-pp-<schedule>: torch.distributed.pipelining on our stages
    torch_fsdp2_tp.py  torch-fsdp2-tp: FSDP2 over DTensor TP (with --pp, pipelining), composed
    plugin.py          their `--strategy` names, a plug-in of refimpl.registry (pyproject.toml)
"""
