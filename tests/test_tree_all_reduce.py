"""The tree all-reduce priced by the alpha-beta model against the ring (refimpl.cost.alpha_beta).

The multi-rank checks (equal to torch's on 2, 3 and 4 ranks, bytes and messages counted) run in
tests/test_comm.py's one launch per world size.
"""
import math

import pytest

from refimpl.comm import tree
from refimpl.cost import alpha_beta as ab
from refimpl.lab.measure.traffic import tree_sent

ALPHA, BETA = 20e-6, 10e9


@pytest.mark.parametrize("n, rounds", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (1024, 10)])
def test_rounds_are_ceil_log2(n, rounds):
    assert tree.rounds(n) == rounds
    assert tree.messages_on_critical_path(n) == 2 * rounds


@pytest.mark.parametrize("n", range(2, 17))
def test_every_rank_but_the_root_sends_up_once_and_the_broadcast_reaches_all(n):
    sent = [tree_sent(rank, n, 10) for rank in range(n)]
    assert sum(messages for _, messages in sent) == 2 * (n - 1)       # n-1 up, n-1 down
    assert sent[0] == (tree.rounds(n) * 40, tree.rounds(n))           # the root: one child a round


def test_tree_time_is_its_counts_priced():
    m = 3e6
    for n in (2, 4, 6, 8):
        want = 2 * math.ceil(math.log2(n)) * (ALPHA + m / BETA)
        assert math.isclose(ab.tree_seconds(m, n, ALPHA, BETA), want)


def test_tree_beats_the_ring_below_the_crossover_only_from_4_ranks():
    def tree_s(m, n):
        return ab.tree_seconds(m, n, ALPHA, BETA)

    def ring_s(m, n):
        return ab.ring_seconds("all_reduce", m, n, ALPHA, BETA)

    # 2 and 3 ranks: the tree takes as many steps as the ring (2 and 4) and sends more: never faster
    for n in (2, 3):
        assert ab.crossover_bytes(n, ALPHA, BETA, other="tree") == 0
        assert tree_s(1.0, n) >= ring_s(1.0, n)
    assert math.isclose(ab.crossover_bytes(4, ALPHA, BETA, other="tree"), 0.8 * ALPHA * BETA)  # 2a = 2.5 M/b
    for n in (4, 8, 64):
        m = ab.crossover_bytes(n, ALPHA, BETA, other="tree")
        assert 0 < m < math.inf
        assert math.isclose(tree_s(m, n), ring_s(m, n))
        assert tree_s(m / 10, n) < ring_s(m / 10, n) and tree_s(m * 10, n) > ring_s(m * 10, n)
    # the crossover grows with n: the ring's steps grow as n, the tree's bytes as log2 n
    sizes = [ab.crossover_bytes(n, ALPHA, BETA, other="tree") for n in (4, 8, 64, 1024)]
    assert sizes == sorted(sizes)


def test_crossover_refuses_an_unknown_algorithm():
    with pytest.raises(ValueError, match="beside the ring"):
        ab.crossover_bytes(4, ALPHA, BETA, other="butterfly")


@pytest.mark.ranks
def test_tree_vs_ring_checks_and_times_in_one_launch():
    from refimpl.lab.measure.all_reduce_algorithms import tree_vs_ring

    checked, timed = tree_vs_ring(3, [4, 4096], numel=101, repeats=2, backend="gloo")
    assert [all(r["equal"].values()) for r in checked] == [True] * 3
    assert [(r["sent"], r["messages"]) for r in checked] == [tree_sent(rank, 3, 101) for rank in range(3)]
    assert sorted(zip(timed.algorithm, timed.size_bytes)) == [("ring", 4), ("ring", 4096), ("tree", 4), ("tree", 4096)]
    assert (timed.median_s > 0).all() and (timed.min_s <= timed.median_s).all()
