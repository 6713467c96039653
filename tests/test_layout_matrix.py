"""The layout matrix (refimpl.lab.verify.layout_matrix): every layout the CLI accepts is equal to
`single` in float64 (losses and every weight tensor at 1e-9) or refused before launch in one line.

make test runs a pairwise cover chosen by the generator on 2, 3 and 4 ranks (every two factor
values that an accepted layout can hold together are held together by a layout it runs, in
float64), plus the layouts that were once wrong; make test-full checks the whole space's verdicts,
runs the pairwise cover of the whole space (8 ranks and PyTorch's DTensor twins too), checks that
the sampling missed no pair the whole space has, runs a three-wise cover, and resumes every float64
layout of the whole pairwise cover from another layout's checkpoint (refimpl.lab.verify.resume_matrix;
make test runs three such pairs, tests/test_resume_matrix.py).
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from refimpl.lab.cli import build_parser, config_from_args
from refimpl.lab.layout_rules import check_shorthand
from refimpl.lab.verify import layout_matrix as lm
from refimpl.lab.verify.matrix_run import counts, run_layouts
from refimpl.lab.verify.resume_matrix import resume_pairs, run_resumed
from refimpl.mesh import LayoutError
from refimpl.registry import resolve, strategies
from refimpl.train import validate

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


@functools.cache
def pairwise() -> lm.Cover:
    return lm.sampled_cover(2, strategies=lm.PAIRWISE_STRATEGIES, worlds=lm.PAIRWISE_WORLDS)


@functools.cache
def whole_pairwise() -> lm.Cover:
    return lm.sampled_cover(2)


def pairwise_on(worlds: tuple) -> list:
    """make test's pairwise cover on these world sizes (the 4-rank third runs in
    tests/test_layout_matrix_4.py, so that both pytest-xdist workers share the cover)."""
    return [layout for layout in pairwise().layouts if layout["world"] in worlds]


@functools.cache
def pairwise_outcomes():
    return run_layouts(pairwise_on((2, 3)) + [layout for _, layout in lm.REGRESSIONS])


def test_pairwise_layouts_on_2_and_3_ranks_equal_single_or_are_refused():
    found = counts(pairwise_outcomes())
    print(found)
    assert found.ran > 0 and not found.wrong, str(found)


def test_the_layouts_that_were_wrong_once_are_equal_now():
    """Each layout the matrix once found wrong (REGRESSIONS says what was wrong): equal now."""
    outcomes = pairwise_outcomes()[-len(lm.REGRESSIONS):]
    assert [o.status for o in outcomes] == ["equal"] * len(lm.REGRESSIONS), \
        [(why, o.status, o.detail) for (why, _), o in zip(lm.REGRESSIONS, outcomes)]


def test_every_refusal_the_search_met_is_one_line():
    refusals = pairwise().refusals
    assert len(refusals) > 1000
    assert not [why for _, why in refusals if "\n" in why or not why.strip()]


def test_the_cli_builds_each_layout_from_its_flags():
    """`python -m refimpl train <layout.argv()>` makes the configuration the matrix runs."""
    parser = build_parser()
    for layout in pairwise().layouts:
        from_cli = config_from_args(parser.parse_args(["train", *layout.argv()]))
        assert from_cli.with_(record_memory=False, return_state=True, device="cpu") \
            == layout.config(), layout.name()


def test_a_shorthand_gets_the_verdict_of_its_layout_spelled_out():
    """tp, pp-* and ep are registry data: a shorthand's layout is refused or run exactly as the
    data-parallel flavour with its axes spelled out (so the covers run only the distinct ones)."""
    import random

    rng, checked = random.Random(1), Counter()
    shorthands = [s for s in strategies() if s not in lm.COVER_STRATEGIES and s != "single"]
    while min(checked[s] for s in shorthands) < 20:
        layout = lm.random_layout(rng)
        if layout is None:
            continue
        name = rng.choice(shorthands)
        short = layout.config().with_(strategy=name, schedule=strategies()[name].schedule
                                      or layout.config().schedule)
        try:
            check_shorthand(resolve(short).cfg)
        except LayoutError:
            continue                        # the axes leave the shorthand's own < 2 ranks
        spelled = resolve(short).cfg.with_(strategy="dp-naive")
        assert resolve(spelled).strategy is resolve(short).strategy
        assert _verdict(short) == _verdict(spelled), (name, layout.name())
        checked[name] += 1


def _verdict(cfg) -> str | None:
    try:
        validate(cfg)
    except LayoutError as e:
        return lm.reason_kind(str(e))
    return None


# --- make test-full: the whole space --------------------------------------------------------------

@functools.cache
def whole_space() -> lm.Census:
    return lm.census()


@pytest.mark.full
def test_the_whole_space_is_accepted_or_refused_in_one_line():
    found = whole_space()
    print(f"{found.total} layouts: {len(found.accepted)} accepted, "
          f"{sum(found.refused.values())} refused")
    for why, n in found.refused.most_common():
        print(f"  {n:8d}  {why}")
    assert not found.multi_line, found.multi_line[:3]
    assert len(found.accepted) > 10000


@pytest.mark.full
def test_the_whole_pairwise_cover_equals_single_or_is_refused():
    found = counts(run_layouts(whole_pairwise().layouts))
    print(f"pairwise cover of the whole space: {len(whole_pairwise().layouts)} layouts for "
          f"{whole_pairwise().required} pairs")
    print(found)
    assert found.ran > 0 and not found.wrong, str(found)


@pytest.mark.full
def test_the_sampled_pairwise_covers_miss_no_pair_of_the_whole_space():
    """The covers are found by sampling; every pair the whole space can hold (in float64) is held
    by one of the whole pairwise cover's layouts, and every pair the space can hold on 2-4 ranks
    without the DTensor twins by one of make test's."""
    for cover, inside in ((whole_pairwise(), lambda lay: lay["strategy"] in lm.COVER_STRATEGIES),
                          (pairwise(), lambda lay: lay["strategy"] in lm.PAIRWISE_STRATEGIES
                           and lay["world"] in lm.PAIRWISE_WORLDS)):
        held = set()
        for layout in cover.layouts:
            held |= lm.vouches(layout.values, 2)
        possible = set()
        for layout in whole_space().accepted:
            if inside(layout):
                possible |= lm.vouches(layout.values, 2)
        assert not possible - held, sorted(possible - held, key=repr)[:10]


@pytest.mark.full
def test_three_wise_layouts_equal_single_or_are_refused():
    cover = lm.sampled_cover(3)
    found = counts(run_layouts(cover.layouts))
    print(f"three-wise cover: {len(cover.layouts)} layouts for {cover.required} triples")
    print(found)
    assert found.ran > 0 and not found.wrong, str(found)


@pytest.mark.full
def test_every_layout_of_the_whole_pairwise_cover_resumes_from_another_layouts_checkpoint():
    """Each float64 layout of the cover writes a checkpoint after step 1 that the next layout of
    its model and format (another world size, sharding, schedule...) resumes from: step 2 equal
    to single's uninterrupted run at 1e-9, losses and every weight."""
    pairs = resume_pairs(whole_pairwise().layouts)
    found = counts(run_resumed(pairs))
    resharded = sum(writer != reader for writer, reader in pairs)
    print(f"resume pass: {len(pairs)} pairs, {resharded} across two layouts")
    print(found)
    assert resharded > 0.9 * len(pairs) > 100
    assert found.ran == len(pairs) and not found.wrong, str(found)
