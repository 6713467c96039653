"""Step time of several configurations, compared fairly in one launch (the benchmarks' method).

    median, last = step_times_in_rounds({"dp": cfg_a, "torch-ddp": cfg_b}, rounds=3)

Every configuration runs `rounds` times, interleaved (a, b, a, b, ...) on the same ranks
(refimpl.lab.loop.train_several_on_ranks), so that a slow spell of the machine hits every side. A
configuration's step time is the median over all its rounds' steps after each round's warm-up
step, each step timed by its slowest rank. Speed is compared as a ratio of these medians in one
run, never asserted in a test: timings depend on the machine.
"""
from __future__ import annotations

import statistics

from refimpl.config import TrainConfig
from refimpl.lab.loop import train_several_on_ranks


def slowest_rank_step_times(result: dict) -> list[float]:
    """Per step after the first (warm-up), the slowest rank's time: a step ends when all do."""
    per_step = [max(ts) for ts in zip(*(r["step_times"] for r in result["per_rank"]))]
    return per_step[1:]


def step_times_in_rounds(variants: dict, rounds: int, timeout: float = 1800.0
                         ) -> tuple[dict, dict]:
    """{key: TrainConfig} -> ({key: median step seconds}, {key: the last round's result})."""
    keys = list(variants)
    cfgs: list[TrainConfig] = [variants[k] for _ in range(rounds) for k in keys]
    results = train_several_on_ranks(cfgs, timeout=timeout)
    times = {k: [] for k in keys}
    last = {}
    for i, result in enumerate(results):
        key = keys[i % len(keys)]
        times[key] += slowest_rank_step_times(result)
        last[key] = result
    return {k: statistics.median(ts) for k, ts in times.items()}, last
