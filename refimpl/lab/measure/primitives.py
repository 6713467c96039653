"""The nine communication primitives of the seed (section 2.1), run on labelled tensors, and the
seed's summary table (direction, main use, who owns the result) derived from what the runs did.

Every rank starts with a small tensor whose tens digit is its rank: rank 2 holds [21, 22, 23, 24].
After a primitive, the digits show where each value came from. `run_primitives` runs all nine on
every rank, through `torch.distributed` (impl="torch") or `refimpl.comm` (impl="refimpl"; the API
is the same, so the code is too), once as is and once more per rank with that rank's input
perturbed. The perturbations are what let `primitive_table` *derive* the table instead of
restating it:

* rank k's data reaches rank j  <=>  perturbing k's input changes j's result (k != j);
* an element that changes under perturbations of two or more ranks was reduced;
* a result smaller than the input is a piece of it (split), a larger one a concatenation;
* results that are all equal mean every holder owns the same data.

A rank whose result the API leaves undefined (a non-root rank of reduce or gather) gets None.
"""
from __future__ import annotations

import pandas as pd
import torch
import torch.distributed as dist

import refimpl.comm as refimpl_comm
from refimpl.launch import device_for
from refimpl.seam import lookup

PRIMITIVES = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
              "reduce_scatter", "send_recv", "all_to_all")

# The seed's "main use" column (주요 용도): not something a run can measure, so it is text.
MAIN_USE = {
    "broadcast": "parameter init / sync (파라미터 초기화/동기화)",
    "reduce": "loss aggregation (Loss 집계)",
    "all_reduce": "gradient averaging, parameter sync (그래디언트 평균, 파라미터 동기화)",
    "scatter": "batch distribution (배치 분배)",
    "gather": "collecting results (결과 모음)",
    "all_gather": "parameter sharding, tensor merge (파라미터 샤딩, 텐서 병합)",
    "reduce_scatter": "all-reduce optimisation, less traffic (All-Reduce 최적화, 통신량 절감)",
    "send_recv": "activations/gradients between pipeline stages (stage간 활성화/그래디언트 전달)",
    "all_to_all": "MoE, resharding (MoE, 샤딩 재배치)",
}

ROOT = 0
PERTURBATION = 100.0


def labelled(rank: int, length: int = 4) -> torch.Tensor:
    """[10r+1, 10r+2, ...]: the tens digit says whose value it is, the ones digit which element."""
    return torch.arange(1, length + 1, dtype=torch.float32) + 10 * rank


def _implementation(name: str):
    implementations = {"torch": dist, "refimpl": refimpl_comm}
    if name not in implementations:
        raise ValueError(f"impl must be 'torch' or 'refimpl', got {name!r}")
    backend = implementations[name]
    return backend


def run_one(primitive: str, x: torch.Tensor, rank: int, n: int, c) -> torch.Tensor | None:
    """Run `primitive` with input `x` through backend module `c`; return this rank's result."""
    if primitive == "broadcast":
        out = x.clone()
        c.broadcast(out, src=ROOT)
        return out
    if primitive in ("reduce", "all_reduce"):
        out = x.clone()
        c.reduce(out, dst=ROOT) if primitive == "reduce" else c.all_reduce(out)
        return out if primitive == "all_reduce" or rank == ROOT else None
    if primitive == "scatter":
        out = torch.empty(x.numel() // n, device=x.device)
        c.scatter(out, list(x.chunk(n)) if rank == ROOT else None, src=ROOT)
        return out
    if primitive == "gather":
        parts = [torch.empty_like(x) for _ in range(n)] if rank == ROOT else None
        c.gather(x, parts, dst=ROOT)
        return torch.cat(parts) if rank == ROOT else None
    if primitive == "all_gather":
        parts = [torch.empty_like(x) for _ in range(n)]
        c.all_gather(parts, x)
        return torch.cat(parts)
    if primitive == "reduce_scatter":
        out = torch.empty(x.numel() // n, device=x.device)
        c.reduce_scatter(out, list(x.chunk(n)))
        return out
    if primitive == "send_recv":  # ranks 0 and 1 swap tensors, as two pipeline stages would
        if rank > 1:
            return x.clone()
        out = torch.empty_like(x)
        # rank 0 sends first and rank 1 receives first: both sending first would hang under
        # NCCL's order (a send completes once its receive has started; refimpl.lab.runtime.staged_stream)
        # (point-to-point is torch's own on both sides: refimpl.comm is built from it)
        send = lambda: lookup(c, "isend")(x, dst=1 - rank)        # noqa: E731
        recv = lambda: lookup(c, "irecv")(out, src=1 - rank)      # noqa: E731
        works = [send(), recv()] if rank == 0 else [recv(), send()]
        for w in works:
            w.wait()
        return out
    if primitive == "all_to_all":
        out = torch.empty_like(x)
        c.all_to_all_single(out, x)
        return out
    raise ValueError(f"unknown primitive {primitive!r}")


def reference(primitive: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor | None:
    """What each primitive means, written as one process's tensor algebra over every rank's input.

    The distributed runs must agree with this on every rank; it is the definition, the runs are
    the mechanism.
    """
    n, total = len(inputs), torch.stack(inputs).sum(0)
    definitions = {
        "broadcast": lambda: inputs[ROOT],
        "reduce": lambda: total if rank == ROOT else None,
        "all_reduce": lambda: total,
        "scatter": lambda: inputs[ROOT].chunk(n)[rank],
        "gather": lambda: torch.cat(inputs) if rank == ROOT else None,
        "all_gather": lambda: torch.cat(inputs),
        "reduce_scatter": lambda: total.chunk(n)[rank],
        "send_recv": lambda: inputs[1 - rank] if rank < 2 else inputs[rank],
        "all_to_all": lambda: torch.cat([x.chunk(n)[rank] for x in inputs]),  # a transpose
    }
    return definitions[primitive]()


def run_primitives(rank: int, world_size: int, impl: str = "torch", length: int = 4) -> dict:
    """On every rank (under launch.run): {primitive: {"before", "after", "perturbed": [per rank]}}."""
    import torch.distributed as dist

    c = _implementation(impl)
    x = labelled(rank, length).to(device_for(dist.get_backend()))
    results = {}
    for name in PRIMITIVES:
        after = run_one(name, x, rank, world_size, c)
        perturbed = [_cpu(run_one(name, x + PERTURBATION * (k == rank), rank, world_size, c))
                     for k in range(world_size)]
        results[name] = {"before": x.cpu(), "after": _cpu(after), "perturbed": perturbed}
    return results


def _cpu(t):
    return None if t is None else t.cpu()


def _values(t) -> list | None:
    return None if t is None else [int(v) for v in t.tolist()]


def states_table(per_rank: list[dict]) -> pd.DataFrame:
    """Who holds what before and after each primitive: one row per (primitive, rank)."""
    rows = [{"primitive": name, "rank": r, "before": _values(res[name]["before"]),
             "after": _values(res[name]["after"])}
            for name in PRIMITIVES for r, res in enumerate(per_rank)]
    return pd.DataFrame(rows).set_index(["primitive", "rank"])


def dependency(per_rank: list[dict], primitive: str) -> torch.Tensor:
    """n x n bool matrix: [k, j] is True when rank k's input reaches rank j's result (k != j)."""
    n = len(per_rank)
    reach = torch.zeros(n, n, dtype=torch.bool)
    for j, res in enumerate(per_rank):
        r = res[primitive]
        if r["after"] is None:
            continue
        for k in range(n):
            reach[k, j] = k != j and not torch.equal(r["perturbed"][k], r["after"])
    return reach


def _reduced(per_rank: list[dict], primitive: str) -> bool:
    """Does any single result element change under the perturbation of two or more ranks?"""
    for res in per_rank:
        r = res[primitive]
        if r["after"] is None:
            continue
        touched = torch.stack([p != r["after"] for p in r["perturbed"]]).sum(0)
        if bool((touched >= 2).any()):
            return True
    return False


def classify(per_rank: list[dict], primitive: str) -> dict:
    """Direction and ownership of one primitive, read off its runs (see module docstring)."""
    n = len(per_rank)
    reach = dependency(per_rank, primitive)
    senders = [k for k in range(n) if reach[k].any()]
    receivers = [j for j in range(n) if reach[:, j].any()]
    after = {j: per_rank[j][primitive]["after"] for j in range(n)}
    one_to_one = bool((reach.sum(0) <= 1).all() and (reach.sum(1) <= 1).all())
    reduced = _reduced(per_rank, primitive)
    size_in = per_rank[senders[0]][primitive]["before"].numel()
    size_out = after[receivers[0]].numel()
    split, concat = size_out < size_in, size_out > size_in
    # the result holders: every receiver, and a sender that ends up holding what they hold
    holders = sorted(set(receivers) | {k for k in senders if after[k] is not None and any(
        after[k].shape == after[j].shape and torch.equal(after[k], after[j]) for j in receivers)})
    same = all(torch.equal(after[holders[0]], after[j]) for j in holders)
    exchange = not reduced and not split and not concat and len(senders) == len(receivers) == n and not same

    if one_to_one:
        symmetric = bool(torch.equal(reach, reach.t()))
        direction, owner = ("1 ↔ 1" if symmetric else "1 → 1"), "only the addressed rank (지정된 GPU만)"
    else:
        left = "1" if len(senders) == 1 else "N"
        right = "1" if len(receivers) == 1 else "N"
        arrow = "↔" if exchange else "→"
        qualifier = ("reduce, then split 집계 후 분할" if reduced and split else
                     "split 분할" if split else "concat 합침" if concat else
                     "exchange 맞교환" if exchange else "")
        direction = f"{left} {arrow} {right}" + (f" ({qualifier})" if qualifier else "")
        if len(holders) == 1:
            owner = ("root holds the whole (루트 GPU가 전체 보유)" if concat else
                     "root only (루트 GPU만 결과)")
        elif same:
            owner = ("every rank holds the whole (모든 GPU 전체 보유)" if concat else
                     "every rank, same data (모든 GPU 동일 데이터)")
        else:
            owner = ("each rank a part (각 GPU 일부만)" if split else
                     "data tailored per rank (GPU별 맞춤 데이터)")
    return {"primitive": primitive, "direction": direction, "main use (주요 용도)": MAIN_USE[primitive],
            "result owned by (결과 데이터 소유)": owner, "senders": senders, "receivers": receivers,
            "reduced": reduced}


def primitive_table(per_rank: list[dict]) -> pd.DataFrame:
    """The seed's section 2.1 table, one row per primitive, every column but 'main use' derived."""
    return pd.DataFrame([classify(per_rank, p) for p in PRIMITIVES]).set_index("primitive")
