"""Each rank's peak resident memory, phase by phase, beyond what a one-block model's rank holds.

    .venv/bin/python scripts/resident_memory.py train --strategy zero3 --nproc 8 --layers 16 \\
        --d-model 512 --steps 1
    .venv/bin/python scripts/resident_memory.py --json \\
        "train --strategy zero3 --nproc 4 --layers 16 --d-model 512 --steps 1 \\
         --checkpoint-every 1 --checkpoint-dir D" \\
        "train --strategy zero3 --nproc 8 --layers 16 --d-model 512 --steps 2 \\
         --checkpoint-every 1 --checkpoint-dir D"        # a checkpoint, then loaded resharded

What the kernel counts decides whether eight ranks fit in a node's memory; the allocator's and the
dry run's accounting say what a rank keeps, not what its heap holds on to. Each rank of a `train`
command (run through the same loop, refimpl.train.train_rank) reads its own peak resident set
(VmHWM, /proc/self/status) phase by phase, the peak reset as each phase starts (5 written to
/proc/self/clear_refs):

    build   the strategy placed from the seeded init      load   ... from a checkpoint, resharded
    step    train_step                                    save   a run checkpoint, until the next step
    loop    the loop between them                         report the loop's own memory report (the
    end     the result                                           profiler behind memory[r].peak, read back)

Growth is a phase's peak minus the rank's resident set when its function started: a rank forked
from the launcher's zygote shares the zygote's pages copy-on-write and counts them from the fork,
so only what the rank adds is growth. A rank also grows by what does not depend on the model's
depth (libraries' pages, gloo's buffers, a block's own gathered buffers and activations), so every
command runs twice, as given and with --layers 1 (or the fewest blocks its pipeline takes), and
the table prints the difference: what the other blocks cost. Beside it, the rank's own model
states as the run reports them at the end (its shards, their gradients, AdamW's m and v).

Several commands run in order, each twice; every --checkpoint-dir is replaced by a fresh temporary
directory (one per directory named, another set for the one-block runs), so a sequence starts
empty. The phases are marked from outside the loop: the loop's extras (refimpl.loop_extras: the
lab's checkpoints and memory report) are subclassed in each rank, nothing in the loop is changed.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

MiB = 2 ** 20
PHASES = ("start", "build", "load", "loop", "step", "save", "report", "end")


def _status() -> dict[str, int]:
    """This process's resident set now and at its peak, and its anonymous and file-backed parts."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _heap() -> dict[str, int]:
    """glibc's own count (mallinfo2, over every arena): bytes in use, free in its heaps, mapped
    apart; beside the kernel's resident set, anonymous and mapped from files."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    status = _status()
    out = {"rss_anon": status["RssAnon"], "rss_file": status["RssFile"]}
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
    except (OSError, AttributeError):          # not glibc
        return out
    info = libc.mallinfo2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd, **out}


def _costs() -> tuple[int, float, float]:
    """This process's page faults so far (each a page the kernel had to zero or map), and its
    CPU seconds in user and system mode, every thread's."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_minflt, use.ru_utime, use.ru_stime


class PhasePeaks:
    """This process's peak growth per phase, its page faults and CPU seconds (user, system) in
    it, and glibc's count as it ends."""

    def __init__(self):
        self.start = _status()["VmRSS"]
        self.peaks: dict[str, int] = {}
        self.costs: dict[str, list] = {}
        self.heap: dict[str, dict] = {}
        self.current, self._costs = "start", _costs()
        self._reset()

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                      # VmHWM := VmRSS

    def enter(self, name: str) -> None:
        """Close the current phase (its peak and costs are added to its name's), open `name`."""
        peak, costs, closed = _status()["VmHWM"], _costs(), self.current
        self.peaks[closed] = max(self.peaks.get(closed, 0), peak - self.start)
        total = self.costs.setdefault(closed, [0, 0.0, 0.0])
        for i, (now, then) in enumerate(zip(costs, self._costs)):
            total[i] += now - then
        self.heap[closed] = _heap()
        self._reset()
        self.current, self._costs = name, _costs()


def measured_rank(rank: int, world_size: int, cfg) -> dict:
    """`refimpl.train.train_rank` with its phases marked by a subclass of the loop's extras (and
    the strategy's train_step wrapped), in this rank's process only."""
    import contextlib

    import refimpl.train as train

    phases, extras_class = PhasePeaks(), train.extras_class
    plugin = extras_class()

    class Measured(plugin):
        # the lab's `place` (refimpl.lab.loop.LabExtras: the shard-only build) calls `start` for
        # the state to place, then `placed` for what follows the weights
        def start(self, reference):
            phases.enter("build")
            state = super().start(reference)
            if self.first:                     # resumed from a run checkpoint
                phases.current = "load"
            return state

        def placed(self, strategy):
            super().placed(strategy)           # a checkpoint's AdamW state: still loading
            phases.enter("loop")
            step = strategy.train_step

            def train_step(batch):
                phases.enter("step")
                try:
                    return step(batch)
                finally:
                    phases.enter("loop")
            strategy.train_step = train_step

        @contextlib.contextmanager
        def steps(self, ctx, strategy, first):
            every = self.cfg.checkpoint_every
            with super().steps(ctx, strategy, first) as on_step:
                def marked(step, losses):
                    if every and (step + 1) % every == 0:
                        phases.enter("save")   # until the next step starts
                    on_step(step, losses)
                yield marked
                phases.enter("report")         # leaving the lab's steps: its report, last write
            phases.enter("end")

    train.extras_class = lambda: Measured
    try:
        result = train.train_rank(rank, world_size, cfg)
    finally:
        train.extras_class = extras_class
    phases.enter("end")
    memory = result["memory"]
    costs = {p: {"faults": f, "user_s": round(u, 3), "system_s": round(t, 3)}
             for p, (f, u, t) in phases.costs.items()}
    return {"rank": rank, "growth": phases.peaks, "costs": costs, "heap": phases.heap,
            "states": memory["params"] + memory["grads"] + memory["optimizer"],
            "n_params": result["n_params"], "step_times": result["step_times"]}


def run_command(argv: list[str], timeout: float = 900.0) -> list[dict]:
    """One `train` command (the CLI's words from `train` on), every rank measured."""
    from refimpl import launch
    from refimpl.lab.cli import build_parser, config_from_args
    from refimpl.train import launch_backend, validate

    args = build_parser().parse_args(argv)
    if args.command != "train":
        raise SystemExit(f"not a train command: {shlex.join(argv)}")
    cfg = config_from_args(args)
    validate(cfg)
    return launch.run(measured_rank, cfg.nproc, cfg, timeout=timeout, quiet=True,
                      backend=launch_backend(cfg))


def train_words(command: str | list[str]) -> list[str]:
    """A command's words from `train` on (whatever started it, `python -m refimpl`, dropped)."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    return words[words.index("train"):] if "train" in words else words


def _flag(words: list[str], flag: str) -> str | None:
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def _with(words: list[str], flag: str, value: str) -> list[str]:
    """`words` with `flag` set to `value` (its old value dropped)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == flag:
            skip = True
        elif not word.startswith(flag + "="):
            out.append(word)
    return out + [flag, value]


def fewest_layers(words: list[str]) -> int:
    """The fewest blocks the command's layout accepts (1, unless its pipeline needs more)."""
    from refimpl.lab.cli import build_parser, config_from_args
    from refimpl.mesh import LayoutError
    from refimpl.train import validate

    try:
        validate(config_from_args(build_parser().parse_args(words)))
    except LayoutError as e:
        raise SystemExit(f"error: {e}") from None
    for layers in range(1, 1 + int(_flag(words, "--layers") or 64)):
        try:
            validate(config_from_args(build_parser().parse_args(
                _with(words, "--layers", str(layers)))))
            return layers
        except LayoutError:
            continue
    raise SystemExit(f"no smaller model fits the layout of: {shlex.join(words)}")


def measure(commands: list, baseline_layers: int | None = None,
            timeout: float = 900.0) -> list[dict]:
    """Every command in order, then every command again with `--layers baseline_layers`
    (default: the fewest all their layouts accept). One record per command: per rank, the
    growth per phase of both runs and its difference, the rank's states, what each phase cost
    (page faults, CPU seconds) and glibc's count at its end."""
    commands = [train_words(c) for c in commands]
    if baseline_layers is None:
        baseline_layers = max(fewest_layers(words) for words in commands)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="resident-") as tmp:
        for kind in ("model", "baseline"):
            dirs: dict[str, str] = {}
            runs[kind] = []
            for words in commands:
                named = _flag(words, "--checkpoint-dir")
                if named is not None:
                    dirs.setdefault(named, str(Path(tmp) / kind / str(len(dirs))))
                    words = _with(words, "--checkpoint-dir", dirs[named])
                if kind == "baseline":
                    words = _with(words, "--layers", str(baseline_layers))
                runs[kind].append(run_command(words, timeout))
    records = []
    for words, model, base in zip(commands, runs["model"], runs["baseline"]):
        ranks = []
        for m, b in zip(model, base):
            ranks.append({
                "rank": m["rank"], "states": m["states"], "baseline_states": b["states"],
                "growth": m["growth"], "baseline_growth": b["growth"],
                "beyond_baseline": {p: g - b["growth"].get(p, 0) for p, g in m["growth"].items()},
                "costs": m["costs"], "heap": m["heap"], "step_times": m["step_times"]})
        records.append({"command": shlex.join(words), "n_params": model[0]["n_params"],
                        "model_bytes": 4 * model[0]["n_params"],
                        "baseline_layers": baseline_layers, "ranks": ranks})
    return records


def print_table(records: list[dict]) -> None:
    for rec in records:
        print(f"\n{rec['command']}\n  {rec['n_params'] / 1e6:.1f} M parameters, "
              f"{rec['model_bytes'] / MiB:.0f} MiB in fp32. MiB per rank: its model states; "
              f"per phase, growth beyond a {rec['baseline_layers']}-block model's rank "
              "(in brackets, the rank's own)")
        phases = [p for p in PHASES if p in rec["ranks"][0]["growth"] and p != "start"]
        print(f"  {'rank':>4} {'states':>6} " + "".join(f"{p:>13}" for p in phases))
        for r in rec["ranks"]:
            cells = "".join(f"{r['beyond_baseline'][p] / MiB:>6.0f} ({r['growth'][p] / MiB:>4.0f})"
                            for p in phases)
            print(f"  {r['rank']:>4} {r['states'] / MiB:>6.0f} {cells}")
        steps = [(len(r["step_times"]), r["costs"].get("step")) for r in rec["ranks"]]
        if all(n and c for n, c in steps):
            per = [(c["faults"] / n, c["user_s"] / n, c["system_s"] / n) for n, c in steps]
            print("  a step, per rank (mean): {:,.0f} page faults, {:.2f} s user, {:.2f} s system"
                  .format(*(sum(x) / len(per) for x in zip(*per))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-layers", type=int, default=None,
                   help="the small model's blocks (default: 1, or the fewest the layout takes)")
    p.add_argument("--timeout", type=float, default=900.0, help="per launch, in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON list, a record a command")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="a train command's words, or several commands, each one quoted")
    args = p.parse_args(argv)
    if not args.command:
        p.error("no train command given")
    several = all(" " in c for c in args.command)
    records = measure(args.command if several else [args.command], args.baseline_layers,
                      args.timeout)
    if args.json:
        print(json.dumps(records))
    else:
        print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
