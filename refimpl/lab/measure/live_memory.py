"""The most bytes a rank holds at any moment: every storage, from its first op until it is freed.

    with LiveBytes(model_tensors) as live:
        strategy.train_step(batch)
    live.peak      # bytes: what was alive at the step's worst moment (model states included)

A TorchDispatchMode sees the output of every op; each new storage joins the live count, and a
weak reference's callback takes it out when PyTorch frees it (a storage's Python object lives
exactly as long as the storage). `UntypedStorage.resize_` is not an op the mode sees, so it is
wrapped while the mode is open: ZeRO-3 and FSDP free a gathered unit by resizing its storage to 0
and regather into the same storage (refimpl.parallel.fsdp.sharded_unit). This is the idea of
torch.distributed._tools.mem_tracker.MemTracker without its per-module bookkeeping, which refuses
a module called more than once in a step (every micro-batch of a pipeline calls it again). It
works on meta and fake tensors (the dry run, refimpl.lab.verify.dryrun) as on real ones, and counts bytes as
requested, not as an allocator rounds them.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# `tensor.device` read by C++ on a fake tensor (FakeTensorMode) is an op too: two thirds of what a
# fake step's mode is handed, and it returns a device, never a storage.
_DEVICE_QUERY = torch.ops.prim.device.default
_ALIASES: dict = {}     # op -> whether its output is a view of an input (OpOverload.is_view)


class LiveBytes(TorchDispatchMode):
    """`count_meta=False`: storages on the meta device are not bytes (a real rank's shapes-only
    reference and transforms, refimpl.lab.rank_build.values); the dry run counts them as the device's."""

    def __init__(self, tensors=(), count_meta: bool = True):
        super().__init__()
        self.count_meta = count_meta
        self._size: dict[int, int] = {}       # storage id -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self.current = self.peak = 0
        for t in tensors:                     # what is alive before the mode opens (tensors or
            if t is not None:                 # their storages)
                self._track(t)

    def storages(self) -> list[torch.UntypedStorage]:
        """The storages counted as alive now."""
        return [s for s in (ref() for ref in self._refs.values()) if s is not None]

    def _track(self, t) -> None:
        storage = t if isinstance(t, torch.UntypedStorage) else (
            getattr(t, "_local_tensor", t).untyped_storage())
        key = storage._cdata
        if key in self._size or (not self.count_meta and storage.device.type == "meta"):
            return
        self._size[key] = 0
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._resized(key, storage.nbytes())

    def _resized(self, key: int, nbytes: int) -> None:
        self.current += nbytes - self._size[key]
        self._size[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        self.current -= self._size.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE_QUERY:   # most ops a fake step sees: no tensor comes out
            return out
        # A view (its schema says its output aliases an input: view, expand, transpose, split,
        # detach, ...; over half of a dry-run step's ops) makes no storage: its input's is
        # counted already, since every storage alive as the mode opens is handed in (`tensors`)
        # and every later one comes out of an op this mode sees.
        aliasing = _ALIASES.get(func)
        if aliasing is None:
            aliasing = _ALIASES[func] = bool(getattr(func, "is_view", False))
        if aliasing:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self):
        resize, live = torch.UntypedStorage.resize_, self

        def counted_resize(storage, size):
            result = resize(storage, size)
            if storage._cdata in live._size:
                live._resized(storage._cdata, storage.nbytes())
            return result

        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)
