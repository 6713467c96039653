"""--save-state and --save-optimizer-state: the full state, gathered to rank 0 one tensor at a time.

The files are torch.save's of the reference's full state dict, and of AdamW's {"step", "exp_avg",
"exp_avg_sq"} in reference names and shapes: torch.load reads them, and --init-state and
--init-optimizer-state place them under any layout (refimpl.lab.checkpoint.optim_reshard). They
were made by gathering every rank's whole state onto every rank (`all_gather_object` of each
rank's full state dict): at 1B parameters in fp32 on 32 ranks, ~100 GB per GPU.

    export_state(strategy, "w.pt", "adamw.pt")      # every rank calls it; rank 0 writes

Each rank lists the pieces it holds (sharded_checkpoint.rank_pieces: boxes of the reference's
tensors, views of its own state); one exchange of names and boxes, no tensor, decides who sends
which piece (rank 0 sends itself what it holds, a piece several ranks hold comes from the lowest);
then, one tensor at a time, rank 0 receives the pieces it lacks, assembles the tensor on the CPU
and appends it to the file (refimpl.lab.checkpoint.tensor_file). Beyond its own state, a rank
holds at most the tensor being written (rank 0) and one piece of it in flight: the other ranks
receive nothing. PyTorch's twins (DTensor parameters, not listed as pieces) gather their weights
one tensor at a time (their `state_items`): every rank of a stage takes part in each gather, rank 0
writes the tensor and the others drop it; a later pipeline stage's tensors reach rank 0 as
point-to-point messages, one at a time.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from refimpl.lab.checkpoint.optim_reshard import MOMENTS, UNSUPPORTED_PREFIXES, _holders
from refimpl.lab.checkpoint.sharded_checkpoint import rank_pieces
from refimpl.lab.checkpoint.tensor_file import Spec, TensorFile
from refimpl.launch import device_for


@dataclass
class Exported:
    """One tensor of the files: where each of its pieces comes from."""
    kind: str                           # "weights", "exp_avg" or "exp_avg_sq"
    name: str
    shape: tuple
    dtype: torch.dtype
    senders: dict = field(default_factory=dict)   # (offsets, lengths) -> the rank that sends it


def export_state(strategy, weights_path=None, optimizer_path=None) -> None:
    """Write the full state dict to `weights_path` and AdamW's state to `optimizer_path` (either
    may be None). Collective: every rank of the run calls it; only rank 0 writes."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if strategy.name.startswith(UNSUPPORTED_PREFIXES):    # a twin: weights only (validated)
        if weights_path:
            items = to_rank_0(strategy.state_items(), strategy.mesh)   # refimpl.lab.twins.base
            if rank != 0:
                for _ in items:               # take part in each gather, keep nothing
                    gc.collect()
                return
            with TensorFile(weights_path) as f:
                for name, tensor in items:
                    f.put(tensor.detach().cpu(), name)
                    del tensor              # before the next is gathered: one at a time
                    gc.collect()            # DTensor's gather leaves buffers in reference cycles
                    # (without it rank 0 held 11 MiB of a 19 MiB torch-fsdp2 model)
        return
    kinds = ("weights",) * bool(weights_path) + MOMENTS * bool(optimizer_path)
    pieces = [p for p in rank_pieces(strategy) if p[0] in kinds]
    tensors, step = plan(pieces, _adam_step(strategy) if optimizer_path else 0)
    mine = {(k, n, tuple(off), tuple(ln)): t for k, n, _, off, ln, t in pieces}
    device = device_for(dist.get_backend()) if dist.is_initialized() else torch.device("cpu")
    gathered = (gather(t, mine, rank, device) for t in tensors)
    if weights_path:
        weights = [t for t in tensors if t.kind == "weights"]
        _write(weights_path if rank == 0 else None, _specs(weights), gathered)
    if optimizer_path:
        tree = {"step": step, **{m: _specs([t for t in tensors if t.kind == m]) for m in MOMENTS}}
        _write(optimizer_path if rank == 0 else None, tree, gathered)


def to_rank_0(items, mesh):
    """Rank 0: every pipeline stage's items in stage order; a rank of stage 0: its own items; a
    rank of a later stage takes part in its stage's gathers, and the one in rank 0's pp group
    sends each tensor on to rank 0 (its name and shape first), yielding nothing."""
    if mesh.size("pp") == 1:
        yield from items
        return
    group, stage, rank = mesh.group("pp"), mesh.index("pp"), dist.get_rank()
    carrier = dist.get_global_rank(group, 0) == 0        # this pp group holds rank 0
    device = device_for(dist.get_backend())
    for s in range(mesh.size("pp")):
        if s == stage == 0:
            yield from items
        elif s == stage:
            for name, tensor in items:
                if carrier:
                    dist.send_object_list([name, tuple(tensor.shape), tensor.dtype], dst=0)
                    dist.send(tensor.detach().contiguous().to(device), dst=0)
                del tensor
            if carrier:
                dist.send_object_list([None, None, None], dst=0)
        elif rank == 0:
            src = dist.get_global_rank(group, s)
            while True:
                head = [None, None, None]
                dist.recv_object_list(head, src=src)
                if head[0] is None:
                    break
                tensor = torch.empty(head[1], dtype=head[2], device=device)
                dist.recv(tensor, src=src)
                yield head[0], tensor
                del tensor


def plan(pieces: list[tuple], step: int) -> tuple[list[Exported], int]:
    """Every tensor of the export, in the files' order, and who sends each piece; the optimizer's
    step. One all_gather_object of every rank's names and boxes (no tensor moves)."""
    listing = [(k, n, tuple(full), tuple(off), tuple(ln), str(t.dtype).removeprefix("torch."))
               for k, n, full, off, ln, t in pieces]
    every = [(listing, step)]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (listing, step))
    found: dict[tuple, Exported] = {}
    for r, (listed, _) in enumerate(every):       # in rank order: rank 0 keeps what it holds
        for kind, name, full, off, length, dtype in listed:
            t = found.setdefault((kind, name), Exported(kind, name, full, getattr(torch, dtype)))
            t.senders.setdefault((off, length), r)
    order = ("weights",) + MOMENTS        # names sorted: the same file under every layout
    return (sorted(found.values(), key=lambda t: (order.index(t.kind), t.name)),
            max(s for _, s in every))


def gather(t: Exported, mine: dict, rank: int, device: torch.device) -> torch.Tensor | None:
    """Rank 0: the whole tensor `t` on the CPU, its pieces received in one fixed order; the other
    ranks send theirs (a point-to-point message each, NCCL's rules: contiguous, on the rank's
    device) and return None."""
    full = torch.empty(t.shape, dtype=t.dtype) if rank == 0 else None
    if rank == 0 and sum(math.prod(n) for _, n in t.senders) != math.prod(t.shape):
        raise RuntimeError(f"the pieces of {t.kind} {t.name} do not tile its shape {t.shape}")
    for (off, length), sender in sorted(t.senders.items()):
        if rank == 0:
            into = full[tuple(slice(o, o + n) for o, n in zip(off, length))]
            if sender == 0:
                into.copy_(mine[(t.kind, t.name, off, length)])
                continue
            # straight into the tensor where the box is one run of it; else one piece's buffer
            buf = into if device.type == "cpu" and into.is_contiguous() else \
                torch.empty(length, dtype=t.dtype, device=device)
            dist.recv(buf, src=sender)
            if buf is not into:
                into.copy_(buf)
        elif rank == sender:
            dist.send(mine[(t.kind, t.name, off, length)].contiguous().to(device), dst=0)
            if device.type == "cuda":        # sent before the next piece is copied: one at a time
                torch.cuda.current_stream(device).synchronize()
    return full


def _specs(tensors: list[Exported]) -> dict:
    return {t.name: Spec(t.shape, t.dtype) for t in tensors}


def _write(path, tree, tensors) -> None:
    """Rank 0 (a path): each tensor into the file as it comes; the others (None): take part."""
    it, count = iter(tensors), sum(isinstance(leaf, Spec) for leaf in _leaves(tree))
    if path is None:
        for _ in range(count):
            next(it)
        return
    with TensorFile(path, tree) as f:
        for _ in range(count):
            f.put(next(it))


def _leaves(tree):
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else (value,)


def _adam_step(strategy) -> int:
    """AdamW's step count (the same on every rank; 0 for a rank that holds no state)."""
    steps = [int(opt.state[master]["step"]) for opt, master, *_ in _holders(strategy)
             if "step" in opt.state.get(master, {})]
    return max(steps, default=0)
