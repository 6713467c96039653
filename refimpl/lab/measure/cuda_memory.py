"""GPU memory against the arithmetic: what `torch.cuda.memory_allocated` says, and why, to the byte.

refimpl.memory counts model states as bytes of tensors (params + grads + AdamW's m and v: 16 bytes
per fp32 parameter). On a GPU the caching allocator hands out *blocks*, and its counters count
blocks, so measured and counted bytes differ by a rounding that can be computed exactly:

  * every allocation is rounded up to a multiple of 512 bytes (the allocator's kMinBlockSize;
    c10/cuda/CUDACachingAllocator.cpp), so a 4-byte bias takes 512 bytes and a 1000-byte one 1024;
    `memory_allocated` sums those rounded block sizes;
  * the blocks are cut from *segments* that the allocator reserves from the driver (2 MiB for
    requests up to 1 MiB, larger ones rounded to 2 MiB multiples, or carved from 20 MiB
    segments). `memory_reserved` counts segments: reserved - allocated is memory held but not in
    use, the seed's "workspace and fragmentation" term. Its peak, `max_memory_reserved -
    max_memory_allocated`, is measured here after a real training step.

`measure_model_states(cfg)` builds the model on the GPU, runs one AdamW step and returns, per
category, the bytes counted (n_params x bytes per element), the bytes the allocator must hold
(each tensor rounded to 512), and the bytes `memory_allocated` reports: the last two must be
equal, the first is the arithmetic of notebook 00.

Activations are read where their peak is, the forward/backward: the peak of that window less what
was resident *then* (`activations_at_peak`): params, the gradients landed by the peak (the first
backward makes them one by one), and the optimizer state only if it existed before the step.
AdamW makes m and v in `opt.step()`, after that peak: they are not subtracted from it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from refimpl.lab.runtime.numerics import exact_fp32_on_cuda
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch

if TYPE_CHECKING:   # annotations only: pandas is imported where a table is built
    import pandas

BLOCK = 512          # the CUDA caching allocator's rounding (kMinBlockSize)


def allocator_bytes(nbytes: int, block: int = BLOCK) -> int:
    """Bytes the CUDA caching allocator charges for a request of `nbytes` (0 for an empty one)."""
    return 0 if nbytes == 0 else math.ceil(nbytes / block) * block


def tensors_allocator_bytes(tensors) -> int:
    """Sum of allocator_bytes over the distinct storages of `tensors` (views count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += allocator_bytes(storage.nbytes())
    return total


def _allocated(device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measure_model_states(model_cfg=None, seed: int = 0, device: str = "cuda:0",
                         batch: int = 8, seq: int = 32) -> "pandas.DataFrame":
    """One fp32 AdamW step of the tiny GPT on a GPU; per category: counted, rounded, measured.

    Rows: params, grads, optimizer (m and v), and the step's peaks: `activations + temporaries`
    (the forward/backward's max_memory_allocated above the states resident at that peak:
    `activations_at_peak`) and `workspace and fragmentation` (max_memory_reserved -
    max_memory_allocated over the whole step). Needs CUDA.
    """
    import pandas as pd


    if not torch.cuda.is_available():
        raise RuntimeError("measure_model_states needs a GPU; torch sees none")
    device = torch.device(device)
    exact_fp32_on_cuda(device)
    model_cfg = model_cfg or GPTConfig()
    # Warm up first: cuBLAS keeps its workspace (from this same allocator) for the process's life,
    # and it would otherwise be charged to whatever category first ran a matmul.
    _one_step(build_model(model_cfg, seed).to(device), model_cfg, seed, device, batch, seq)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = _allocated(device)

    model = build_model(model_cfg, seed).to(device)
    params = [p for p in model.parameters()]
    rows = [_row("params", params, _allocated(device) - base - _buffer_bytes(model))]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    b = synthetic_batch(model_cfg, batch, seq, seed, 0)
    inputs, targets = b.inputs.to(device), b.targets.to(device)
    before_forward = _allocated(device)     # params, buffers, the batch: no grads, no m and v yet
    torch.cuda.reset_peak_memory_stats(device)
    landed = GradsAtPeak(params, lambda: torch.cuda.max_memory_allocated(device))
    lm_loss(model(inputs), targets).backward()
    landed.close()
    fwd_bwd_peak = torch.cuda.max_memory_allocated(device)
    fwd_bwd_reserved = torch.cuda.max_memory_reserved(device)
    rows.append(_row("grads", [p.grad for p in params], _allocated(device) - before_forward))
    before_opt = _allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    opt.step()
    states = [t for s in opt.state.values() for t in s.values()
              if torch.is_tensor(t) and t.device.type == "cuda"]
    rows.append(_row("optimizer (m, v)", states, _allocated(device) - before_opt))
    peak_alloc = max(fwd_bwd_peak, torch.cuda.max_memory_allocated(device))
    peak_reserved = max(fwd_bwd_reserved, torch.cuda.max_memory_reserved(device))
    rows.append({"category": "activations + temporaries (forward/backward peak above the states "
                             "resident then)", "counted_bytes": None, "allocator_bytes": None,
                 "measured_bytes": activations_at_peak(fwd_bwd_peak, before_forward, landed.bytes)})
    rows.append({"category": "workspace and fragmentation (peak reserved - peak allocated)",
                 "counted_bytes": None, "allocator_bytes": None,
                 "measured_bytes": peak_reserved - peak_alloc})
    del model, opt, params, states
    torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def activations_at_peak(peak: int, resident_before_forward: int, grads_at_peak: int) -> int:
    """Activations + temporaries at the forward/backward peak: the peak less the states resident
    at that moment -- what was there when the forward began (params, buffers, the batch, and the
    optimizer state only if an earlier step made it) plus the gradients landed by the peak. Not
    `peak - (params + grads + m + v)` read after `opt.step()`: AdamW makes m and v after the
    peak, so that subtracts ~8 bytes per parameter that did not exist at it."""
    return peak - resident_before_forward - grads_at_peak


class GradsAtPeak:
    """Allocator bytes of the gradients resident when the forward/backward peak was reached.

    A hook after each gradient lands reads the peak counter (`read_peak`: the allocator's host-side
    bookkeeping, no sync); if it rose since the previous landing, the peak was reached with the
    gradients landed until then. A gradient counts from the moment it lands in `.grad`: one still
    being computed when the peak is reached counts as a temporary."""

    def __init__(self, params, read_peak):
        self.read_peak, self.landed, self.bytes = read_peak, 0, 0
        self.peak = read_peak()
        self.handles = [p.register_post_accumulate_grad_hook(self._land) for p in params]

    def _settle(self) -> None:
        peak = self.read_peak()
        if peak > self.peak:
            self.peak, self.bytes = peak, self.landed

    def _land(self, p) -> None:
        self._settle()
        self.landed += allocator_bytes(p.grad.untyped_storage().nbytes())

    def close(self) -> None:
        """After the backward: count a peak reached after the last landing; remove the hooks."""
        self._settle()
        for h in self.handles:
            h.remove()


def _one_step(model, model_cfg, seed, device, batch, seq) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    b = synthetic_batch(model_cfg, batch, seq, seed, 0)
    lm_loss(model(b.inputs.to(device)), b.targets.to(device)).backward()
    opt.step()
    torch.cuda.synchronize(device)


def _buffer_bytes(model) -> int:
    return tensors_allocator_bytes(list(model.buffers()))


def _row(category: str, tensors, measured: int) -> dict:
    tensors = [t for t in tensors if t is not None]
    return {"category": category, "counted_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "allocator_bytes": tensors_allocator_bytes(tensors), "measured_bytes": int(measured)}
