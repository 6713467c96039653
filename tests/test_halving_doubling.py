"""Halving-doubling all-reduce: the rank bookkeeping, and the alpha-beta comparison with the ring
(refimpl.cost.alpha_beta).

The multi-rank checks (equal to torch's on 2, 3 and 4 ranks, bytes and messages counted) run in
tests/test_comm.py's one launch per world size.
"""
import math

import pytest

from refimpl.comm import halving_doubling as hd
from refimpl.cost import alpha_beta as ab
from refimpl.lab.measure.traffic import halving_doubling_sent
from refimpl.lab.predict.all_reduce import all_reduce_rows


@pytest.mark.parametrize("n, p, r", [(1, 1, 0), (2, 2, 0), (3, 2, 1), (4, 4, 0), (6, 4, 2), (7, 4, 3), (8, 8, 0)])
def test_fold_takes_the_largest_power_of_two(n, p, r):
    assert hd.fold(n) == (p, r)


@pytest.mark.parametrize("n", range(1, 13))
def test_virtual_ranks_are_a_bijection_onto_the_butterfly(n):
    p, r = hd.fold(n)
    members = [hd.virtual_rank(rank, n) for rank in range(n)]
    assert sorted(v for v in members if v is not None) == list(range(p))
    assert members.count(None) == r                       # one rank of each folded pair sits out
    assert all(hd.real_rank(v, n) == rank for rank, v in enumerate(members) if v is not None)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_power_of_two_sends_the_rings_bytes_in_2_log2_n_messages(n):
    numel = 1024 * n
    for rank in range(n):
        sent, messages = halving_doubling_sent(rank, n, numel)
        assert sent == 2 * (n - 1) * numel * 4 // n          # the bandwidth lower bound
        assert messages == 2 * int(math.log2(n)) == hd.messages_per_rank(n)


def test_uneven_and_tiny_tensors_skip_empty_messages():
    # 1 element on 4 ranks: only the chunk holding it ever travels
    # (ranks 2 and 3 send it in the first halving round, 0 and 1 it in both doubling rounds)
    assert [halving_doubling_sent(rank, 4, 1) for rank in range(4)] == [(8, 2), (8, 2), (4, 1), (4, 1)]


def test_alpha_beta_crossover_only_when_the_count_is_not_a_power_of_two():
    alpha, beta = 20e-6, 10e9

    def hd_s(m, n):
        return ab.halving_doubling_seconds(m, n, alpha, beta)

    def ring_s(m, n):
        return ab.ring_seconds("all_reduce", m, n, alpha, beta)

    for n in (2, 4, 8, 64):
        assert ab.crossover_bytes(n, alpha, beta) == math.inf
        assert hd_s(1e9, n) <= ring_s(1e9, n)
    # 3 ranks: fold-in + 2 rounds + fold-out = 4 messages, the ring's 2(3-1): no latency gain,
    # and the fold's extra bytes, so the ring is never slower
    assert ab.crossover_bytes(3, alpha, beta) == 0
    for n in (6, 12):
        m = ab.crossover_bytes(n, alpha, beta)
        assert 0 < m < math.inf
        assert math.isclose(hd_s(m, n), ring_s(m, n))
        assert hd_s(m / 10, n) < ring_s(m / 10, n)
        assert hd_s(m * 10, n) > ring_s(m * 10, n)


def test_latency_steps_grow_as_log2_against_the_rings_linear():
    assert [hd.messages_per_rank(n) for n in (2, 4, 8, 1024)] == [2, 4, 6, 20]
    assert hd.messages_per_rank(1024) * 100 < 2 * (1024 - 1)


def test_all_reduce_rows_cover_both_algorithms():
    rows = all_reduce_rows([4, 6], [1, 1e6], 1e-5, 1e9)
    assert len(rows) == 8 and {r["algorithm"] for r in rows} == {"ring", "halving-doubling"}
    six = {(r["size_bytes"], r["algorithm"]): r["seconds"] for r in rows if r["ranks"] == 6}
    assert six[(1, "halving-doubling")] < six[(1, "ring")] and six[(1e6, "halving-doubling")] > six[(1e6, "ring")]
