"""Run every rebuilt collective next to torch.distributed's own on the same inputs; report any gap.

`compare_with_torch(rank, world_size)` is meant to run on every rank under `refimpl.launch.run`;
it returns one row per (collective, case) with this rank's largest absolute difference between
`refimpl.comm.<name>` and `torch.distributed.<name>`. Inputs are small integers stored as floats,
so sums are exact in any order and "equal" can mean bit-for-bit, whatever order the ring or tree
combines in. The cases are the ones that break naive implementations: sizes that do not divide by
the world size, sizes smaller than it, a non-contiguous tensor (ours only: torch's side gets a
contiguous copy, as NCCL requires), uneven all-to-all splits, every root, and a subgroup whose
members are not ranks 0..k-1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import refimpl.comm as comm
from refimpl.lab.measure.traffic import all_reduce_messages, measure_sent
from refimpl.launch import device_for


def _ints(shape, seed: int, lo: int = -8, hi: int = 9, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on any device
    values = torch.randint(lo, hi, shape, generator=gen, device="cpu")
    return values.to(dtype=dtype, device=torch.get_default_device())


def _row(rows: list, name: str, case: str, ours, theirs) -> None:
    ours, theirs = torch.as_tensor(ours), torch.as_tensor(theirs)
    same_shape = ours.shape == theirs.shape
    diff = (ours.double() - theirs.double()).abs().max().item() if same_shape and ours.numel() else 0.0
    rows.append({"collective": name, "case": case, "max_abs_diff": diff if same_shape else float("inf"),
                 "equal": same_shape and torch.equal(ours, theirs)})


def compare_with_torch(rank: int, world_size: int, sizes=(1, 7, 13, 1001)) -> list[dict]:
    """Every collective x every case on this rank; returns rows (see module docstring)."""
    n, rows = world_size, []
    seed = 1000 * rank
    with torch.device(device_for(dist.get_backend())):  # new tensors on this rank's device
        for numel in sizes:
            _all_reduce_cases(rows, numel, seed, n)
            _rooted_cases(rows, numel, seed, n)
            _gather_scatter_cases(rows, numel, seed, n, rank)
        _large_cases(rows, seed, n)
        _all_to_all_cases(rows, seed, n, rank)
        _subgroup_cases(rows, seed, n, rank)
    return rows


# Every all-reduce algorithm faces the same cases; rows name the ring's alternatives apart.
ALL_REDUCE_ROWS = {"ring": "all_reduce", "halving-doubling": "all_reduce (halving-doubling)",
                   "tree": "all_reduce (tree)"}


def _all_reduce_cases(rows, numel, seed, n):
    for algorithm, name in ALL_REDUCE_ROWS.items():
        _all_reduce_cases_of(rows, numel, seed, n, algorithm, name)


def _all_reduce_cases_of(rows, numel, seed, n, algorithm, name):
    ops = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "product": ReduceOp.PRODUCT}
    for label, op in ops.items():
        lo, hi = (-1, 3) if op == ReduceOp.PRODUCT else (-8, 9)  # keep products exact
        x = _ints((numel,), seed + numel, lo, hi)
        a, b = x.clone(), x.clone()
        comm.all_reduce(a, op=op, algorithm=algorithm)
        dist.all_reduce(b, op=op)
        _row(rows, name, f"{label} numel={numel}", a, b)
    # AVG: gloo has no AVG, so its twin is SUM / n
    x = _ints((numel,), seed + 1)
    a, b = x.clone(), x.clone()
    comm.all_reduce(a, op=ReduceOp.AVG, algorithm=algorithm)
    dist.all_reduce(b)
    _row(rows, name, f"avg numel={numel}", a, b / n)
    # a non-contiguous view (a transposed matrix) and an integer dtype. Ours takes the view as
    # it is; torch's gets a contiguous copy of the same values: ProcessGroupNCCL refuses a
    # non-contiguous tensor ("Tensors must be contiguous"), gloo forgives it (issue 35).
    m = _ints((3, numel), seed + 2).t()
    a, b = m.clone().t().t(), m.contiguous()  # a: same strides as m (non-contiguous)
    comm.all_reduce(a, algorithm=algorithm)
    dist.all_reduce(b)
    _row(rows, name, f"transposed {tuple(m.shape)}", a, b)
    a = _ints((numel,), seed + 3, dtype=torch.int64)
    b = a.clone()
    comm.all_reduce(a, algorithm=algorithm)
    dist.all_reduce(b)
    _row(rows, name, f"int64 numel={numel}", a, b)


def _large_cases(rows, seed, n, numel=3 * 2**20 + 1):
    """12 MB: large enough that a reduce-scatter step is split into several segments."""
    x = _ints((numel,), seed + 4)
    for algorithm, name in ALL_REDUCE_ROWS.items():
        a, b = x.clone(), x.clone()
        comm.all_reduce(a, algorithm=algorithm)
        dist.all_reduce(b)
        _row(rows, name, f"sum numel={numel}", a, b)


def _rooted_cases(rows, numel, seed, n):
    for root in sorted({0, n - 1}):
        x = _ints((numel,), seed + 10 + root)
        a, b = x.clone(), x.clone()
        comm.broadcast(a, src=root)
        dist.broadcast(b, src=root)
        _row(rows, "broadcast", f"src={root} numel={numel}", a, b)
        a, b = x.clone(), x.clone()
        comm.reduce(a, dst=root)
        dist.reduce(b, dst=root)
        if dist.get_rank() == root:  # only the root's tensor is defined afterwards
            _row(rows, "reduce", f"dst={root} numel={numel}", a, b)


def _gather_scatter_cases(rows, numel, seed, n, rank):
    x = _ints((numel,), seed + 20)
    ours, theirs = [torch.empty(numel) for _ in range(n)], [torch.empty(numel) for _ in range(n)]
    comm.all_gather(ours, x)
    dist.all_gather(theirs, x)
    _row(rows, "all_gather", f"numel={numel}", torch.stack(ours), torch.stack(theirs))
    a, b = torch.empty(n * numel), torch.empty(n * numel)
    comm.all_gather_into_tensor(a, x)
    dist.all_gather_into_tensor(b, x)
    _row(rows, "all_gather_into_tensor", f"numel={numel}", a, b)

    inputs = [_ints((numel,), seed + 30 + i) for i in range(n)]
    a, b = torch.empty(numel), torch.empty(numel)
    comm.reduce_scatter(a, inputs)
    dist.reduce_scatter(b, inputs)
    _row(rows, "reduce_scatter", f"numel={numel}", a, b)
    comm.reduce_scatter_tensor(a, torch.cat(inputs))
    dist.reduce_scatter_tensor(b, torch.cat(inputs))
    _row(rows, "reduce_scatter_tensor", f"numel={numel}", a, b)

    root = n - 1
    is_root = rank == root
    ours = [torch.empty(numel) for _ in range(n)] if is_root else None
    theirs = [torch.empty(numel) for _ in range(n)] if is_root else None
    comm.gather(x, ours, dst=root)
    dist.gather(x, theirs, dst=root)
    if is_root:
        _row(rows, "gather", f"dst={root} numel={numel}", torch.stack(ours), torch.stack(theirs))
    pieces = [_ints((numel,), 40 + i) for i in range(n)] if is_root else None
    a, b = torch.empty(numel), torch.empty(numel)
    comm.scatter(a, pieces, src=root)
    dist.scatter(b, pieces, src=root)
    _row(rows, "scatter", f"src={root} numel={numel}", a, b)


def uneven_splits(rank: int, n: int) -> tuple[list[int], list[int]]:
    """Rows rank r sends to rank i: (r + 2i) mod 3, which is 0 for some pairs (empty pieces)."""
    send = [(rank + 2 * i) % 3 for i in range(n)]
    recv = [(i + 2 * rank) % 3 for i in range(n)]
    return send, recv


def _all_to_all_cases(rows, seed, n, rank):
    x = _ints((2 * n, 3), seed + 50)
    a, b = torch.empty_like(x), torch.empty_like(x)
    comm.all_to_all_single(a, x)
    dist.all_to_all_single(b, x)
    _row(rows, "all_to_all_single", "even", a, b)
    send, recv = uneven_splits(rank, n)
    x = _ints((sum(send), 3), seed + 51)
    a, b = torch.empty(sum(recv), 3), torch.empty(sum(recv), 3)
    comm.all_to_all_single(a, x, recv, send)
    dist.all_to_all_single(b, x, recv, send)
    _row(rows, "all_to_all_single", f"uneven send={send}", a, b)
    # the list form, checked against torch's all_to_all_single (gloo has no list all_to_all)
    ins = list(x.split(send))
    outs = [torch.empty(k, 3) for k in recv]
    comm.all_to_all(outs, ins)
    _row(rows, "all_to_all", f"uneven send={send}", torch.cat(outs), b)


def _subgroup_cases(rows, seed, n, rank):
    """Odd ranks and even ranks form two groups; on 3 ranks rank 1 is alone with itself."""
    groups = [dist.new_group([r for r in range(n) if r % 2 == parity]) for parity in (0, 1)]
    group = groups[rank % 2]
    members = dist.get_process_group_ranks(group)
    k = len(members)
    x = _ints((11,), seed + 60)
    a, b = x.clone(), x.clone()
    comm.all_reduce(a, group=group)
    dist.all_reduce(b, group=group)
    _row(rows, "all_reduce", f"subgroup {members}", a, b)
    for algorithm in ("halving-doubling", "tree"):
        a = x.clone()
        comm.all_reduce(a, group=group, algorithm=algorithm)
        _row(rows, ALL_REDUCE_ROWS[algorithm], f"subgroup {members}", a, b)
    a, b = x.clone(), x.clone()
    comm.broadcast(a, src=members[-1], group=group)  # src is a global rank, as in torch
    dist.broadcast(b, src=members[-1], group=group)
    _row(rows, "broadcast", f"subgroup {members} src={members[-1]}", a, b)
    inputs = [_ints((5,), seed + 61 + i) for i in range(k)]
    a, b = torch.empty(5), torch.empty(5)
    comm.reduce_scatter(a, inputs, group=group)
    dist.reduce_scatter(b, inputs, group=group)
    _row(rows, "reduce_scatter", f"subgroup {members}", a, b)
    x = _ints((2 * k, 2), seed + 62)
    a, b = torch.empty_like(x), torch.empty_like(x)
    comm.all_to_all_single(a, x, group=group)
    dist.all_to_all_single(b, x, group=group)
    _row(rows, "all_to_all_single", f"subgroup {members}", a, b)
    root = members[-1]  # roots are global ranks, as in torch
    a, b = x.clone(), x.clone()
    comm.reduce(a, dst=root, group=group)
    dist.reduce(b, dst=root, group=group)
    if rank == root:
        _row(rows, "reduce", f"subgroup {members} dst={root}", a, b)
    ours, theirs = [torch.empty_like(x) for _ in range(k)], [torch.empty_like(x) for _ in range(k)]
    comm.all_gather(ours, x, group=group)
    dist.all_gather(theirs, x, group=group)
    _row(rows, "all_gather", f"subgroup {members}", torch.stack(ours), torch.stack(theirs))
    ours = [torch.empty_like(x) for _ in range(k)] if rank == root else None
    theirs = [torch.empty_like(x) for _ in range(k)] if rank == root else None
    comm.gather(x, ours, dst=root, group=group)
    dist.gather(x, theirs, dst=root, group=group)
    if rank == root:
        _row(rows, "gather", f"subgroup {members} dst={root}", torch.stack(ours), torch.stack(theirs))
    pieces = [_ints((2,), 70 + i) for i in range(k)] if rank == root else None
    a, b = torch.empty(2), torch.empty(2)
    comm.scatter(a, pieces, src=root, group=group)
    dist.scatter(b, pieces, src=root, group=group)
    _row(rows, "scatter", f"subgroup {members} src={root}", a, b)
    # a rank outside the group does nothing and gets None, like torch
    other = groups[1 - rank % 2]
    _row(rows, "all_reduce", "non-member returns None", comm.all_reduce(x.clone(), group=other) is None,
         True)


def check_and_count(rank: int, world_size: int, numel: int = 1200) -> tuple:
    """One launch, three answers (notebook 01): every collective against torch's, the bytes each
    sent on a `numel`-element tensor, and every all-reduce algorithm's bytes and messages."""
    return (compare_with_torch(rank, world_size), measure_sent(rank, world_size, numel),
            all_reduce_messages(rank, world_size, numel))
