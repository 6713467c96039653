"""`python -m refimpl plan --model 70b --gpus 64`: the planner's table in a terminal.

    python -m refimpl plan --model 70b --gpus 64                 # the seed's 70B example
    python -m refimpl plan --model gpt3-175b --gpus 1024 --gpu h100-sxm --top 5
    python -m refimpl plan --layers 24 --d-model 2048 --heads 16 --vocab 50304 --seq-len 2048 \\
        --global-batch 512 --gpus 32
    python -m refimpl plan --model megatron-1t --gpus 3072 --zero-stages 0 --recompute full \\
        --cp 1 --no-sequence-parallel                             # the techniques of 2021
    python -m refimpl plan --model mixtral-8x7b --gpus 64 --ep 1,8  # a mixture of experts

Bad arguments exit 2 with one line naming the constraint.
"""
from __future__ import annotations

import argparse
import sys

from refimpl.lab.plan.search import RECOMPUTE, plan
from refimpl.lab.predict.hardware import GPUS
from refimpl.lab.predict.presets import MODELS, get_model

SHOWN = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero_stage": "zero",
         "micro_batch_size": "mbs", "micro_batches": "m", "recompute": "recompute",
         "sequence_parallel": "sp", "memory_gb": "mem GB", "fits": "fits",
         "step_time_s": "step s", "tflops_per_gpu": "TFLOP/s/GPU", "mfu": "MFU",
         "bubble_fraction": "bubble"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="a100-80gb", choices=sorted(GPUS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the preset's)")
    for flag in ("--layers", "--d-model", "--heads", "--vocab", "--seq-len"):
        p.add_argument(flag, type=int, help="override the preset (or give all five)")
    p.add_argument("--zero-stages", type=_ints, default=(0, 1, 2, 3))
    p.add_argument("--cp", type=_ints, default=(1, 2, 4, 8), help="cp sizes to consider")
    p.add_argument("--micro-batch-sizes", type=_ints, default=(1, 2, 4, 8))
    p.add_argument("--ep", type=_ints, default=None,
                   help="ep sizes to consider (a MoE preset; default: every divisor of dp x cp "
                        "that divides the experts)")
    p.add_argument("--recompute", default=",".join(RECOMPUTE),
                   help="comma-separated subset of none,selective,full")
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--all", action="store_true", help="also print layouts that do not fit")
    p.add_argument("--json", action="store_true", help="print the rows as JSON records")


def _shape_args(args) -> dict:
    given = {"n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
             "vocab_size": args.vocab, "seq_len": args.seq_len}
    if args.model:
        shape, batch = get_model(args.model)
        base = {**shape.to_dict(), "global_batch": batch}
    else:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"without --model give --layers --d-model --heads --vocab --seq-len "
                             f"(missing {', '.join(missing)})")
        base = {"global_batch": None}
    base.update({k: v for k, v in given.items() if v is not None})
    if args.global_batch is not None:
        base["global_batch"] = args.global_batch
    if not base["global_batch"]:
        raise ValueError("--global-batch is required without --model")
    return base


def run_plan(args):
    """The DataFrame the CLI prints (args as parsed by add_arguments)."""
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1 (got {args.gpus})")
    recompute = tuple(args.recompute.split(","))
    bad = [r for r in recompute if r not in RECOMPUTE]
    if bad:
        raise ValueError(f"--recompute takes none, selective, full (got {', '.join(bad)})")
    sp = (False,) if args.no_sequence_parallel else (False, True)
    shape = _shape_args(args)
    experts = shape.get("n_experts", 0)
    if args.ep and any(e > 1 for e in args.ep) and not experts:
        raise ValueError("--ep needs a mixture-of-experts preset (e.g. --model mixtral-8x7b)")
    if args.ep and any(e < 1 or experts % e for e in args.ep):
        raise ValueError(f"--ep sizes must divide the {experts} experts (got "
                         f"{', '.join(map(str, args.ep))})")
    return plan(**shape, gpus=args.gpus, gpu=args.gpu,
                gpus_per_node=args.gpus_per_node, zero_stages=args.zero_stages,
                cp_sizes=args.cp, micro_batch_sizes=args.micro_batch_sizes, ep_sizes=args.ep,
                recompute=recompute, sequence_parallel=sp)


def format_table(df, top: int = 10, show_all: bool = False) -> str:
    rows = df if show_all else df[df.fits]
    if rows.empty:
        return "no layout fits in memory; --all shows the closest"
    rows = rows.head(top).assign(memory_gb=lambda d: d.memory_bytes / 1e9)
    return rows[list(SHOWN)].rename(columns=SHOWN).to_string(
        index=False, float_format=lambda x: f"{x:.3g}")


def plan_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m refimpl plan",
                                description="rank parallel layouts by predicted step time")
    add_arguments(p)
    return plan_from_args(p.parse_args(argv))


def plan_from_args(args) -> int:
    """Print the table for parsed arguments; 2 with one line on bad input (both entry points)."""
    try:
        df = run_plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if df.empty:
        print(f"error: no layout of this model divides onto {args.gpus} GPUs "
              "(heads % tp, layers % pp, global batch % (dp x micro-batch))", file=sys.stderr)
        return 2
    if args.json:
        rows = df if args.all else df[df.fits]
        print(rows.head(args.top).to_json(orient="records"))
    else:
        print(format_table(df, args.top, args.all))
    return 0


if __name__ == "__main__":
    sys.exit(plan_main())
