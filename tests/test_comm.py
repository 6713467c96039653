"""refimpl.comm against torch.distributed, on 2, 3 and 4 gloo ranks.

Starting ranks costs seconds, so each world size is launched once (a module-scoped fixture) and
every check runs inside that one launch; the tests below only read its results.
"""
import functools

import pytest
import torch

from refimpl.lab.instrument.labels import CommLog
from refimpl.launch import run

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

WORLD_SIZES = (2, 3, 4)


def _async_checks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import refimpl.comm as comm
    from refimpl.lab.runtime.lane import on_lane

    x = torch.arange(10.0) + rank
    want = x.clone()
    dist.all_reduce(want)
    # refimpl.comm itself runs the collective before it returns: its Work is already complete
    direct = x.clone()
    work = comm.all_reduce(direct, async_op=True)
    out = {"direct_done": work.is_completed() and torch.equal(direct, want) and work.wait()}
    # on the lab's lane (refimpl.lab.runtime.lane.on_lane) it runs beside this thread
    all_reduce, broadcast = on_lane(comm.all_reduce), on_lane(comm.broadcast)
    a = x.clone()
    handle = all_reduce(a, async_op=True)
    busy = torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the ring runs  # noqa: F841
    out["handle_type"] = type(handle).__name__
    out["wait_returns"] = handle.wait()
    out["async_equal"] = torch.equal(a, want) and handle.is_completed()
    # two collectives in flight, then a blocking one: all three complete, in issue order
    b, c, d = x.clone(), x.clone(), x.clone()
    h1 = all_reduce(b, async_op=True)
    h2 = broadcast(c, src=world_size - 1, async_op=True)
    all_reduce(d)
    out["queued_done"] = h1.is_completed() and h2.is_completed()
    out["queued_equal"] = (torch.equal(b, want) and torch.equal(d, want)
                           and torch.equal(c, torch.arange(10.0) + world_size - 1))
    # the counter follows an asynchronous collective onto the worker thread
    with CommLog() as counted:
        all_reduce(torch.ones(12 * world_size), async_op=True).wait()
    out["async_counted"] = counted.sent["all_reduce"]
    return out


def _plain_ring(rank: int, world_size: int) -> dict:
    """The core's own reduce-scatter steps, called directly: the lab installs segmented ones in
    their place (refimpl.lab.runtime.ring_segments), which every other check here runs."""
    import torch.distributed as dist

    from refimpl.comm.p2p import GroupView
    from refimpl.comm.ring import ring_reduce_scatter_
    from refimpl.lab.runtime.ring_segments import segmented_reduce_scatter_
    from refimpl.seam import plugins

    x = torch.arange(1001.0) * (rank + 1)     # 1001 values: uneven chunks on 2, 3 and 4 ranks
    want = x.clone()
    dist.all_reduce(want)
    chunks = list(x.tensor_split(world_size))
    ring_reduce_scatter_(chunks, dist.ReduceOp.SUM, GroupView.of(None))
    return {"equal": torch.equal(chunks[rank], want.tensor_split(world_size)[rank]),
            "installed": plugins("refimpl.ring_reduce_scatter") == (segmented_reduce_scatter_,)}


def _all_checks(rank: int, world_size: int) -> dict:
    from refimpl.lab.measure import primitives
    from refimpl.lab.measure.traffic import all_reduce_messages, measure_sent
    from refimpl.lab.measure.versus_torch import compare_with_torch

    out = {"rows": compare_with_torch(rank, world_size),
           "messages": all_reduce_messages(rank, world_size, 1200),
           "sent": measure_sent(rank, world_size, 1200),
           "sent_uneven": measure_sent(rank, world_size, 1001),
           "async": _async_checks(rank, world_size),
           "plain_ring": _plain_ring(rank, world_size)}
    if world_size == 4:
        out["primitives"] = {impl: primitives.run_primitives(rank, world_size, impl)
                             for impl in ("torch", "refimpl")}
    return out


@functools.cache
def _launch(world_size: int):
    return world_size, run(_all_checks, world_size, backend="gloo", timeout=240, quiet=True)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def results(request):
    return _launch(request.param)


def test_every_collective_equals_torch(results):
    n, per_rank = results
    rows = [dict(row, rank=r) for r, res in enumerate(per_rank) for row in res["rows"]]
    bad = [row for row in rows if not row["equal"]]
    assert not bad, f"world size {n}: {bad[:5]}"
    covered = {row["collective"] for row in rows}
    assert covered >= {"all_reduce", "all_reduce (halving-doubling)", "all_reduce (tree)", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                       "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
                       "all_to_all_single", "all_to_all"}
    cases = {row["case"] for row in rows}
    assert any("subgroup" in c for c in cases) and any("uneven" in c for c in cases)
    assert any(f"numel={k}" in c for c in cases for k in (7, 13, 1001))  # not divisible by n


def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_message(results):
    n, per_rank = results
    m = 1200 * 4  # 1200 fp32 values, divisible by 2, 3 and 4
    for res in per_rank:
        assert res["sent"]["all_reduce"] == 2 * (n - 1) * m // n
        assert res["async"]["async_counted"] == 2 * (n - 1) * (12 * n * 4) // n


@pytest.mark.parametrize("numel", [1200, 1001])
def test_counted_bytes_match_the_algorithms_prediction(results, numel):
    from refimpl.lab.measure.traffic import traffic_table

    n, per_rank = results
    key = "sent" if numel == 1200 else "sent_uneven"
    table = traffic_table([res[key] for res in per_rank], numel)
    assert (table.sent_bytes == table.predicted_bytes).all(), table[table.sent_bytes != table.predicted_bytes]


def test_halving_doubling_sends_log2_p_messages_and_the_rings_bytes(results):
    """On 2 and 4 ranks: 2 log2 n messages (the ring: 2(n-1)) for the same 2(n-1)/n * M bytes.
    On 3 ranks the fold-in costs the folded pair a whole M each, the price of a non-power of two."""
    from refimpl.lab.measure.traffic import halving_doubling_sent

    n, per_rank = results
    m = 1200 * 4
    for rank, res in enumerate(per_rank):
        ring, butterfly = res["messages"]["ring"], res["messages"]["halving-doubling"]
        assert ring == (2 * (n - 1) * m // n, 2 * (n - 1))
        assert butterfly == halving_doubling_sent(rank, n, 1200)
        if n in (2, 4):
            assert butterfly == (ring[0], 2 * (n.bit_length() - 1))
    if n == 3:
        assert [res["messages"]["halving-doubling"][0] for res in per_rank] == [m, m + m // 2 + m // 2, m]


def test_the_cores_plain_ring_reduce_scatter_equals_torch(results):
    n, per_rank = results
    assert all(res["plain_ring"]["installed"] for res in per_rank)   # the others ran the lab's
    assert all(res["plain_ring"]["equal"] for res in per_rank), n


def test_tree_all_reduce_sends_whole_messages_up_then_down_the_tree(results):
    """Every rank but the root sends its partial result once, then the result to its broadcast
    children: each message the whole M. The root receives ceil(log2 n) of them and sends as many:
    the alpha-beta formula's 2 ceil(log2 n) messages on the critical path."""
    from refimpl.comm import tree
    from refimpl.lab.measure.traffic import tree_sent

    n, per_rank = results
    m = 1200 * 4
    for rank, res in enumerate(per_rank):
        assert res["messages"]["tree"] == tree_sent(rank, n, 1200)
    root_sent, root_messages = per_rank[0]["messages"]["tree"]
    assert 2 * root_messages == tree.messages_on_critical_path(n) == 2 * (n - 1).bit_length()
    assert 2 * root_sent == tree.bytes_on_critical_path(n, m)
    assert sum(res["messages"]["tree"][0] for res in per_rank) == 2 * (n - 1) * m   # n-1 up, n-1 down


def test_async_handle(results):
    n, per_rank = results
    for res in per_rank:
        a = res["async"]
        assert a["handle_type"] == "Work" and a["wait_returns"] is True
        assert a["async_equal"] and a["queued_done"] and a["queued_equal"]


def test_primitive_table_derived_from_runs_matches_the_seed():
    from refimpl.lab.measure import primitives
    _, per_rank = _launch(4)              # the seed's table is shown on 4 ranks
    torch_runs = [res["primitives"]["torch"] for res in per_rank]
    ours = [res["primitives"]["refimpl"] for res in per_rank]
    assert primitives.states_table(torch_runs).equals(primitives.states_table(ours))
    table = primitives.primitive_table(torch_runs)
    assert [d.split(" (")[0] for d in table.direction] == [
        "1 → N", "N → 1", "N → N", "1 → N", "N → 1", "N → N", "N → N", "1 ↔ 1", "N ↔ N"]
    assert table.loc["reduce_scatter", "direction"].endswith("(reduce, then split 집계 후 분할)")
    owners = table["result owned by (결과 데이터 소유)"].str.split(" \\(").str[0].tolist()
    assert owners == ["every rank, same data", "root only", "every rank, same data", "each rank a part",
                      "root holds the whole", "every rank holds the whole", "each rank a part",
                      "only the addressed rank", "data tailored per rank"]


def test_single_rank_group_is_a_no_op():
    """World size 1 needs no launch: every collective returns at once and leaves data as is."""
    def body(rank, world_size):
        import refimpl.comm as comm

        x = torch.arange(5.0)
        comm.all_reduce(x)
        comm.broadcast(x, src=0)
        out = torch.empty(5)
        comm.reduce_scatter(out, [x])
        return x.tolist(), out.tolist()

    same = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert run(body, 1, backend="gloo", quiet=True) == [(same, same)]


def test_async_all_reduce_leaves_the_thread_free_to_compute():
    from refimpl.lab.measure.async_demo import overlap_demo

    for res in run(overlap_demo, 2, backend="gloo", timeout=120, quiet=True):
        assert res["handle"] == "Work" and res["blocking_result_ok"] and res["async_result_ok"]
        assert res["iterations_while_in_flight"] >= 1


def test_without_a_lane_an_asynchronous_collective_is_done_when_its_work_returns(results):
    """refimpl.comm's own async_op=True (off the lab's lane): the collective runs on the caller's
    thread before the call returns, and its Work is already complete."""
    _, per_rank = results
    assert all(res["async"]["direct_done"] for res in per_rank)
