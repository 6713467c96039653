"""torch.distributed under the names the installed torch calls current.

torch 2.13 renamed two collectives (all_gather_into_tensor -> all_gather_single,
reduce_scatter_tensor -> reduce_scatter_single) and warns on every call of the old names
(FutureWarning); the torch of many GPU servers (2.11) has only the old ones. refimpl's strategies
call the old names, which refimpl.comm's own twins keep. `torch_collectives` stands for
torch.distributed: every attribute is looked up on it at call time (so code that wraps
torch.distributed's functions, the dry run's counter or a test's guard, still sees each call), and
the two renamed ones go to the current name where the installed torch has it (feature-detected).
"""
from __future__ import annotations

import torch.distributed as dist

RENAMED = {"all_gather_into_tensor": "all_gather_single",
           "reduce_scatter_tensor": "reduce_scatter_single"}


def current_name(name: str) -> str:
    """The name torch.distributed's `name` has in the installed torch."""
    new = RENAMED.get(name)
    return new if new is not None and hasattr(dist, new) else name


class _TorchCollectives:
    def __getattr__(self, name):
        return getattr(dist, current_name(name))

    def __repr__(self) -> str:
        return "<torch.distributed, current names>"


torch_collectives = _TorchCollectives()
