"""Command line: `python -m refimpl train ...` (also under `torchrun -m refimpl train ...`).

    python -m refimpl train --strategy single --steps 5 --json
    torchrun --nproc-per-node 2 -m refimpl train --strategy dp --json
    python -m refimpl plan --model 70b --gpus 64        # the planner's table (refimpl.lab.plan)

Prints one JSON object (DESIGN.md): strategy, world_size, losses (rank 0's view of the global loss,
one per step), step_time_s (median after warm-up), n_params, memory (per rank, bytes by category,
and `peak`: the most the rank held at any moment of a step after the first), trace_dir. Invalid arguments exit 2 with one line naming the constraint, before any process starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from refimpl.model import GPTConfig

MODEL_OPTIONS = ("balance", "aux_alpha", "bias_gamma", "capacity_scope")   # --set keys that configure the MoE layer


def _parse_option(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def train_flags() -> argparse.ArgumentParser:
    """The flags of a run: train takes them, and so do bisect and dryrun (the run they examine)."""
    f = argparse.ArgumentParser(add_help=False)
    f.add_argument("--strategy", default="single")
    f.add_argument("--nproc", type=int, default=None,
                   help="ranks to start (default 1 for single, else 2; under torchrun: its size)")
    f.add_argument("--steps", type=int, default=5)
    f.add_argument("--global-batch", type=int, default=8)
    f.add_argument("--seq-len", type=int, default=32)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--lr", type=float, default=3e-3)
    f.add_argument("--micro-batches", type=int, default=1)
    f.add_argument("--mixed-precision", default="fp32", help="fp32 or bf16")
    f.add_argument("--dtype", default="float32",
                   help="float32, or float64 (exact comparisons with single on any processor)")
    f.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    f.add_argument("--profile", action="store_true", help="write torch.profiler traces")
    f.add_argument("--trace-dir", default=None)
    f.add_argument("--layers", type=int, default=GPTConfig.n_layers)
    f.add_argument("--d-model", type=int, default=GPTConfig.d_model)
    f.add_argument("--heads", type=int, default=GPTConfig.n_heads)
    f.add_argument("--vocab", type=int, default=GPTConfig.vocab_size, help="vocabulary size")
    f.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense MLP)")
    f.add_argument("--top-k", type=int, default=GPTConfig.top_k, help="experts per token (MoE)")
    f.add_argument("--capacity-factor", type=float, default=GPTConfig.capacity_factor,
                   help="MoE expert capacity = ceil(top_k x tokens / experts x factor)")
    f.add_argument("--arch", default=GPTConfig.arch,
                   help="gpt (GPT-2's block) or llama (RMSNorm, SwiGLU, rotary, grouped-query "
                        "attention; with --experts, Mixtral's block)")
    f.add_argument("--kv-heads", type=int, default=0,
                   help="--arch llama: key/value heads of grouped-query attention (0: --heads)")
    f.add_argument("--ffn-hidden", type=int, default=0,
                   help="--arch llama: SwiGLU's width (0: 2/3 of 4 x d-model, rounded up to 32)")
    f.add_argument("--rope-theta", type=float, default=GPTConfig.rope_theta,
                   help="--arch llama: the rotary embeddings' base")
    grid = f.add_argument_group("the rank grid (refimpl.mesh): dp = nproc / (pp x cp x tp)")
    grid.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    grid.add_argument("--sequence-parallel", action="store_true",
                      help="with --tp: LayerNorm regions split along the sequence")
    grid.add_argument("--pp", type=int, default=1, help="pipeline stages")
    grid.add_argument("--cp", type=int, default=1, help="context-parallel ranks")
    grid.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (divides dp x cp)")
    grid.add_argument("--schedule", default=None,
                      help="pipeline schedule with --pp: gpipe, 1f1b (default), interleaved, zb-h1, "
                           "interleaved-zb, zbv, dualpipev")
    grid.add_argument("--virtual-stages", type=int, default=1,
                      help="model chunks per pipeline rank (interleaved schedule)")
    f.add_argument("--device", default="auto",
                   help="cpu: ranks on gloo even where GPUs are enough for NCCL (under torchrun "
                   "too); auto: NCCL when every rank has a GPU; cuda: a one-process run on the GPU")
    f.add_argument("--collectives", default="torch",
                   help="torch, or refimpl: every collective rebuilt from send/recv (refimpl.comm)")
    f.add_argument("--set", dest="options", action="append", type=_parse_option, default=[],
                   metavar="KEY=VALUE", help="strategy option, e.g. --set bucket_mb=1 (repeatable)")
    f.add_argument("--save-state", default=None, metavar="PATH",
                   help="write the final full state dict (reference names: loads under any layout)")
    f.add_argument("--init-hf", default=None, metavar="PATH",
                   help="start from a Hugging Face checkpoint folder (Llama, Mixtral: config.json "
                        "and *.safetensors); its config.json gives the model's shape")
    f.add_argument("--init-state", default=None, metavar="PATH",
                   help="start from a full state dict written by --save-state under any layout")
    f.add_argument("--save-optimizer-state", default=None, metavar="PATH",
                   help="write AdamW's m, v and step in reference names (loads under any layout)")
    f.add_argument("--init-optimizer-state", default=None, metavar="PATH",
                   help="start AdamW from a state written by --save-optimizer-state")
    f.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="every K steps, save the whole run (weights, AdamW, data position, RNG) "
                   "atomically into --checkpoint-dir")
    f.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="resume from the newest checkpoint there, under any layout (and save there)")
    f.add_argument("--timeout", type=float, default=900.0)
    f.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return f


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m refimpl", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    flags = train_flags()

    def command(name: str, what: str, **kw):
        return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".", **kw)

    command("train", "train the tiny GPT with one strategy and report", parents=[flags])
    command("bisect", "run a layout and single side by side and name the first step, phase, "
            "module and rank where they part (noise or bug)", parents=[flags])
    from refimpl.lab.verify.dryrun import add_arguments as add_dryrun_arguments
    add_dryrun_arguments(command("dryrun", "one step of rank R of a full-size layout on meta "
                                 "tensors: its memory by category and its bytes per axis",
                                 parents=[flags]))
    from refimpl.lab.plan.cli import add_arguments as add_plan_arguments
    add_plan_arguments(command("plan", "rank parallel layouts of a model on a cluster by "
                               "predicted memory and step time (refimpl.lab.plan)"))
    from refimpl.lab.verify.matrix_run import add_arguments as add_matrix_arguments
    add_matrix_arguments(command("matrix", "the layout matrix: layouts the CLI accepts, each run "
                                 "against single in float64 or refused in one line "
                                 "(refimpl.lab.verify.layout_matrix)"))
    e = command("env", "this machine: cores, memory, GPUs, versions, backend per nproc")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _absolute(path: str | None) -> str | None:
    """A path the ranks resolve as this process does (a forked rank may run elsewhere)."""
    return os.path.abspath(path) if path else None


def config_from_args(args):
    from refimpl.lab.config import LabConfig
    from refimpl.mesh import LayoutError

    nproc = args.nproc
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:   # torchrun decides the world size
        nproc = int(os.environ["WORLD_SIZE"])
    if nproc is None:
        nproc = 1 if args.strategy == "single" else 2
    options = dict(args.options)
    # MoE knobs are the model's, not a strategy's: --set balance=aux|bias|none, aux_alpha, bias_gamma,
    # capacity_scope=batch|sequence
    moe = {key: options.pop(key) for key in MODEL_OPTIONS if key in options}
    fault = options.pop("fault", None)     # --set fault=<name>: a bug on purpose (refimpl.lab.faults)
    try:
        if args.init_hf:   # the checkpoint's config.json says the model, not the shape flags
            from refimpl.lab.checkpoint.hf import read_config
            hub = read_config(args.init_hf)
            model = replace(hub, **moe) if moe else hub
        else:
            model = replace(GPTConfig(), n_layers=args.layers, d_model=args.d_model,
                            n_heads=args.heads, vocab_size=args.vocab, n_experts=args.experts,
                            top_k=args.top_k, capacity_factor=args.capacity_factor,
                            arch=args.arch, n_kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                            rope_theta=args.rope_theta, **moe)
    except (ValueError, FileNotFoundError) as e:
        raise LayoutError(str(e)) from None
    return LabConfig(strategy=args.strategy, nproc=nproc, steps=args.steps,
                     global_batch=args.global_batch, seq_len=args.seq_len, seed=args.seed,
                     lr=args.lr, micro_batches=args.micro_batches,
                     mixed_precision=args.mixed_precision, dtype=args.dtype,
                     device=args.device,
                     activation_checkpointing=args.checkpointing, profile=args.profile,
                     trace_dir=args.trace_dir, model=model, options=options,
                     tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                     sequence_parallel=args.sequence_parallel, collectives=args.collectives,
                     schedule=args.schedule, virtual_stages=args.virtual_stages, fault=fault,
                     init_state=args.init_state, init_hf=args.init_hf,
                     save_state=_absolute(args.save_state),
                     init_optimizer_state=args.init_optimizer_state,
                     save_optimizer_state=_absolute(args.save_optimizer_state),
                     checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
                     record_memory=not args.profile)   # memory[r].peak (not under --profile)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "bisect":        # the train flags, then refimpl.lab.verify.bisect
        from refimpl.lab.verify.bisect import main as bisect_main
        return bisect_main(lambda: config_from_args(args), as_json=args.json, timeout=args.timeout)
    if args.command == "env":
        from refimpl.lab import env
        return env.main(as_json=args.json)
    if args.command == "dryrun":
        from refimpl.lab.verify.dryrun import main_from_args
        return main_from_args(args, config_from_args)
    if args.command == "matrix":
        from refimpl.lab.verify.matrix_run import main as matrix_main
        return matrix_main(args)
    if args.command == "plan":
        from refimpl.lab.plan.cli import plan_from_args
        return plan_from_args(args)
    from refimpl.mesh import LayoutError
    from refimpl.train import train_on_ranks, validate

    try:
        if not args.timeout > 0:
            raise LayoutError(f"--timeout must be > 0 seconds (got {args.timeout})")
        cfg = config_from_args(args)
        validate(cfg)
        from refimpl.lab.verify.files import check_files
        check_files(cfg.model, init_state=args.init_state,
                    init_optimizer_state=args.init_optimizer_state,
                    writes={"--save-state": args.save_state,
                            "--save-optimizer-state": args.save_optimizer_state},
                    trace_dir=args.trace_dir if args.profile else None,
                    checkpoint_dir=args.checkpoint_dir)
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # --save-state / --save-optimizer-state: rank 0 wrote them (refimpl.lab.checkpoint.export)
    result = train_on_ranks(cfg, timeout=args.timeout)
    result.pop("per_rank")
    if int(os.environ.get("RANK", "0")) != 0:
        return 0                                  # under torchrun, rank 0 speaks for all
    if args.json:
        print(json.dumps(result))
    else:
        for step, loss in enumerate(result["losses"]):
            print(f"step {step:3d}  loss {loss:.4f}")
        print(f"{result['strategy']} on {result['world_size']} rank(s): {result['n_params']:,} "
              f"params, median step {result['step_time_s'] * 1e3:.1f} ms")
    return 0


def _exit(code: int) -> None:
    """Under torchrun this process was a rank: once its result is printed, leave without the
    interpreter's teardown, where C++ destructors of leftover distributed objects have been seen
    to abort ("terminate called without an active exception", SIGABRT) after a successful run,
    which torchrun then reports as FAILED (refimpl._rank leaves the same way). Belt and braces:
    refimpl.launch already collects the strategies' reference cycles and destroys the process
    groups before this; `make launch-check` runs 2 x 20 torchrun jobs and wants every exit 0."""
    from refimpl.launch import under_torchrun

    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
