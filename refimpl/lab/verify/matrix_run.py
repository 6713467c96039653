"""Running the layout matrix (refimpl.lab.verify.layout_matrix): each layout equal to `single`, or
refused in one line, or named as what it is -- wrong, crashed, hung.

    outcomes = run_layouts(pairwise_cover())
    print(counts(outcomes))          # ran, equal, refused by reason, wrong

Layouts of one world size share one launch (start-up is paid once per world, not per layout):
every rank trains them one after another, rank 0 compares each with `single`'s losses and weights
(computed here, in this process, once per distinct reference) and writes a line per layout as it
goes. A layout that raises or hangs ends its launch; the launch's lines say how far it got, the
layout it was in is recorded with the error's last line, and a new launch takes the rest. A rank
whose layout runs past `layout_timeout` seconds writes its stack to stderr and exits, so one hang
costs a minute, not the whole launch.

The gate (float64): every step's loss and every weight tensor within 1e-9 of single's (relative;
reordered sums leave ~1e-14). bf16 cannot be float64: its layouts are held to the bf16 gate of
refimpl.lab.verify.equivalence against single under the same autocast.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from refimpl import launch
from refimpl.lab.verify import layout_matrix as lm
from refimpl.lab.verify.equivalence import (
    FP64_TOLERANCE,
    compare_states,
    loss_tolerance,
    reference_config,
    reference_run,
    relative_error,
    weight_tolerance,
)
from refimpl.lab.verify.layout_matrix import Layout, reason_kind, refusal
from refimpl.train import train_rank

LAYOUT_TIMEOUT = 120.0
HUNG_EXIT = 17


@dataclass
class Outcome:
    layout: Layout
    status: str                  # equal, refused, wrong, crashed, hung
    detail: str = ""             # the refusal, the error's last line, or how far off it is
    loss_err: float | None = None
    weight_err: float | None = None     # the worst tensor (float64) or the whole model (bf16)
    seconds: float = 0.0
    written_by: Layout | None = None    # resumed from this layout's checkpoint (resume_matrix)

    def label(self) -> str:
        if self.written_by is None:
            return self.layout.name()
        return f"{self.written_by.name()} -> {self.layout.name()}"

    def row(self) -> dict:
        return {"layout": self.label(), "status": self.status, "loss err": self.loss_err,
                "weight err": self.weight_err, "s": round(self.seconds, 2), "detail": self.detail}


def run_layouts(layouts: list[Layout], *, layout_timeout: float = LAYOUT_TIMEOUT,
                on_outcome=None) -> list[Outcome]:
    """Every layout's outcome, in the order given."""
    outcomes: dict[int, Outcome] = {}
    by_world: dict[int, list[int]] = {}
    for i, layout in enumerate(layouts):
        why = refusal(layout)
        if why is not None:
            outcomes[i] = Outcome(layout, "refused", why)
        else:
            by_world.setdefault(layout["world"], []).append(i)
    for world, indices in sorted(by_world.items()):
        for i, outcome in zip(indices, run_one_world([layouts[i] for i in indices],
                                                      world, layout_timeout)):
            outcomes[i] = outcome
            if on_outcome is not None:
                on_outcome(outcome)
    return [outcomes[i] for i in range(len(layouts))]


def run_one_world(layouts: list[Layout], world: int, layout_timeout: float,
                   cfgs: list | None = None) -> list[Outcome]:
    """The layouts of one world size in as few launches as a crash or a hang allows (the module
    docstring). `cfgs`: what each layout runs (default: its config(); the resume pass,
    refimpl.lab.verify.resume_matrix, adds its checkpoints)."""
    cfgs = cfgs or [layout.config() for layout in layouts]
    references = {}
    for cfg in cfgs:     # single's run, once per distinct reference, in this process
        key = reference_key(cfg)
        if key not in references:
            ref = reference_run(_plain(cfg))
            references[key] = {"losses": ref["losses"], "state_dict": ref["state_dict"]}
    outcomes: list[Outcome] = []
    while len(outcomes) < len(layouts):
        start = len(outcomes)
        with tempfile.TemporaryDirectory(prefix="refimpl-matrix-") as tmp:
            error = None
            try:
                launch.run(_train_each, world, cfgs[start:], references, tmp, layout_timeout,
                           timeout=60 + layout_timeout * (len(cfgs) - start), quiet=True)
            except (launch.RankFailedError, launch.LaunchTimeoutError) as e:
                error = e
            lines = _read_lines(Path(tmp) / "outcomes.jsonl")
        for line in lines:
            layout = layouts[start + line["index"]]
            outcomes.append(_judge(layout, cfgs[start + line["index"]], line))
        if error is not None and len(outcomes) < len(layouts):
            layout = layouts[len(outcomes)]
            hung = (isinstance(error, launch.LaunchTimeoutError)
                    or f"exit code {HUNG_EXIT}" in str(error))
            outcomes.append(Outcome(layout, "hung" if hung else "crashed", _last_line(error)))
        elif error is not None:
            raise error                # every layout reported, then the launch failed: ours
    return outcomes


def _plain(cfg):
    """What a layout is compared with: single with the same model, data, steps and precision,
    without the layout's checkpointing or rebuilt collectives, and (in float64) on the whole
    batch at once: none of these may change the maths, so single without them is the stricter
    reference. Micro-batches stay where they do change it: bf16 rounds each micro-batch's
    forward, and capacity_scope=batch fills the experts per forward (refimpl.model.moe)."""
    moe = cfg.model
    per_forward = cfg.dtype != "float64" or (moe.n_experts and moe.capacity_scope == "batch")
    return cfg.with_(activation_checkpointing=False, collectives="torch",
                     micro_batches=cfg.micro_batches if per_forward else 1)


def reference_key(cfg) -> str:
    """Two configurations with the same key are held to one run of single."""
    return repr(reference_config(_plain(cfg)))


def _judge(layout: Layout, cfg, line: dict) -> Outcome:
    if cfg.checkpoint_dir and not cfg.checkpoint_every and not line["resumed_from"]:
        # a reader that found no checkpoint trained from step 0: equal to single, and no test
        return Outcome(layout, "wrong", "found no checkpoint to resume from",
                       seconds=line["seconds"])
    if not line["same_loss_on_every_rank"]:
        return Outcome(layout, "wrong", "the ranks returned different losses",
                       seconds=line["seconds"])
    float64 = cfg.dtype == "float64"
    weight_err = line["worst_tensor_err"] if float64 else line["weight_err"]
    weight_gate = FP64_TOLERANCE if float64 else weight_tolerance(cfg)
    ok = line["loss_err"] <= loss_tolerance(cfg) and weight_err <= weight_gate
    detail = "" if ok else (f"loss rel. err {line['loss_err']:.2e} (step "
                            f"{line['first_loss_step']}), weights {weight_err:.2e} "
                            f"(worst: {line['worst_tensor']})")
    return Outcome(layout, "equal" if ok else "wrong", detail, line["loss_err"], weight_err,
                   line["seconds"])


def _train_each(rank: int, world: int, cfgs: list, references: dict, outdir: str,
                layout_timeout: float) -> None:
    """On every rank: train each layout; rank 0 compares it with single's and writes its line."""
    clock = _Watchdog(layout_timeout, rank)
    for index, cfg in enumerate(cfgs):
        clock.start(index)
        began = time.perf_counter()
        result = train_rank(rank, world, cfg)
        everyone: list = [None] * world        # each rank's view of the global loss
        dist.all_gather_object(everyone, result["losses"])
        if rank == 0:
            line = _compare(result, references[reference_key(cfg)])
            line.update(index=index, seconds=time.perf_counter() - began,
                        resumed_from=result["resumed_from"],
                        same_loss_on_every_rank=all(e == everyone[0] for e in everyone))
            with open(Path(outdir) / "outcomes.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        del result
        if index % 16 == 15:      # the runs' reference cycles (hooks, handles), now and then
            gc.collect()
    clock.stop()


def _compare(result: dict, ref: dict) -> dict:
    errors = [abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"])]
    whole, _, _ = compare_states(result["state_dict"], ref["state_dict"])
    per_tensor = {k: relative_error(result["state_dict"][k], v) for k, v in ref["state_dict"].items()}
    worst = max(per_tensor, key=per_tensor.get)
    return {"loss_err": max(errors), "first_loss_step": errors.index(max(errors)),
            "weight_err": whole, "worst_tensor_err": per_tensor[worst], "worst_tensor": worst}


class _Watchdog:
    """Exits the rank (code 17) with its stack on stderr if one layout runs past `limit`."""

    def __init__(self, limit: float, rank: int):
        self.limit, self.rank, self.since, self.index = limit, rank, None, None
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, index: int) -> None:
        self.index, self.since = index, time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if self.since is not None and time.monotonic() - self.since > self.limit:
                print(f"rank {self.rank}: layout {self.index} ran past {self.limit:.0f} s",
                      file=sys.stderr)
                faulthandler.dump_traceback(file=sys.stderr)
                sys.stderr.flush()
                os._exit(HUNG_EXIT)


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_line(error: Exception) -> str:
    text = getattr(error, "child_traceback", None) or str(error)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


# --- the counts ------------------------------------------------------------------------------------

@dataclass
class Counts:
    ran: int = 0
    equal: int = 0
    refused: Counter = field(default_factory=Counter)
    wrong: list = field(default_factory=list)     # outcomes neither equal nor refused
    seconds: float = 0.0

    def __str__(self) -> str:
        lines = [f"{self.ran + sum(self.refused.values())} layouts: {self.ran} ran, "
                 f"{self.equal} equal to single, {len(self.wrong)} not, "
                 f"{sum(self.refused.values())} refused ({self.seconds:.0f} s of runs)"]
        lines += [f"  refused {n:5d}  {why}" for why, n in self.refused.most_common()]
        lines += [f"  {o.status.upper():8s} {o.label()}: {o.detail}" for o in self.wrong]
        return "\n".join(lines)


def counts(outcomes: list[Outcome]) -> Counts:
    out = Counts()
    for o in outcomes:
        if o.status == "refused":
            out.refused[reason_kind(o.detail)] += 1
            continue
        out.ran += 1
        out.seconds += o.seconds
        if o.status == "equal":
            out.equal += 1
        else:
            out.wrong.append(o)
    return out


# --- python -m refimpl matrix ---------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--strength", type=int, default=2,
                        help="run a cover in which every STRENGTH factor values that can occur "
                             "together do (2: pairwise, 3: three-wise, make test-full's)")
    parser.add_argument("--quick", action="store_true",
                        help="make test's pairwise cover: 2-4 ranks, no DTensor twins")
    parser.add_argument("--all", action="store_true",
                        help="run every accepted layout of the whole space instead (hours)")
    parser.add_argument("--shard", default="1/1", metavar="I/N",
                        help="with --all: the I-th of N equal parts (1-based), for several machines")
    parser.add_argument("--count", action="store_true",
                        help="only count the whole space: accepted, refused by reason (minutes)")
    parser.add_argument("--list", action="store_true",
                        help="print the layouts (and their train flags) instead of running them")
    parser.add_argument("--world", type=int, default=None, help="only the layouts of this world size")


def main(args) -> int:
    """Print the counts (and every layout that is neither equal nor refused); exit 1 if any."""
    if args.count or args.all:
        space = lm.census()
        print(f"{space.total} layouts: {len(space.accepted)} accepted, "
              f"{sum(space.refused.values())} refused")
        for why, n in space.refused.most_common():
            print(f"  refused {n:8d}  {why}")
        if args.count:
            return 0
        index, parts = (int(x) for x in args.shard.split("/"))
        layouts = [lay for k, lay in enumerate(space.accepted) if k % parts == index - 1]
    else:
        part = (dict(strategies=lm.PAIRWISE_STRATEGIES, worlds=lm.PAIRWISE_WORLDS) if args.quick
                else {})
        layouts = lm.sampled_cover(args.strength, **part).layouts
    if args.world is not None:
        layouts = [lay for lay in layouts if lay["world"] == args.world]
    if args.list:
        for layout in layouts:
            print(f"{layout.name():60s}  {' '.join(layout.argv())}")
        return 0
    done = [0]

    def progress(outcome: Outcome) -> None:
        done[0] += 1
        print(f"[{done[0]}/{len(layouts)}] {outcome.status:7s} {outcome.seconds:6.2f} s  "
              f"{outcome.layout.name()}  {outcome.detail}", flush=True)

    found = counts(run_layouts(layouts, on_outcome=progress))
    print(found)
    return 1 if found.wrong else 0
