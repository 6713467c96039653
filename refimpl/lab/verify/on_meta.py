"""Building a rank with no storage, for the dry run (refimpl.lab.verify.dryrun): on the meta device a
tensor has a shape, a dtype and strides and no bytes, so a 70B model costs nothing to build, as long
as nothing is made for real on the way. Two guards for that: `values_not_drawn` turns nn.init's
initialisers into no-ops (there is nothing to draw), and `OnMeta` records every storage an op makes
and refuses a real one beyond a host scalar.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from refimpl.model.init import values_not_drawn  # noqa: F401  (lives with the model's init)

# The most bytes a tensor made off `meta` may have while the rank is built: the scalars torch
# keeps on the host (AdamW's step count), not a buffer that forgot its device.
HOST_BYTES = 1024


class OnMeta(TorchDispatchMode):
    """Every storage an op makes while the rank is built, and a RuntimeError for a real tensor of
    more than HOST_BYTES: on a 70B layout, an explicit `device="cpu"` would otherwise allocate for
    real what the real run puts on its GPU."""

    def __init__(self):
        super().__init__()
        self._made: dict[int, weakref.ref] = {}     # storage key -> the storage, while it lives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if t.device.type != "meta" and storage.nbytes() > HOST_BYTES:
                    raise RuntimeError(f"dry run: {func} made a real {t.device} tensor of "
                                       f"{storage.nbytes()} bytes; the rank's tensors belong "
                                       "on ctx.device")
                self.add([storage])
        return out

    def add(self, storages) -> None:
        for storage in storages:
            known = self._made.get(storage._cdata)
            if known is None or known() is None:
                self._made[storage._cdata] = weakref.ref(storage)

    def alive(self) -> list:
        """Every storage this dry run made that is alive now: what the rank holds before the
        step (its parameters, gradients, buffers, optimizer states, flat buffers, the batch,
        torch's host-side step counts), whichever object of whichever strategy keeps it, and
        nothing of another dry run's (a process running several, as
        refimpl.lab.plan.against_dryrun does, was seen to keep some of an earlier run's alive). A
        storage's Python object lives exactly as long as the storage (refimpl.lab.measure.live_memory), so
        its weak reference says whether it does; garbage in reference cycles is collected
        first."""
        gc.collect()
        return [s for s in (ref() for ref in self._made.values()) if s is not None]
