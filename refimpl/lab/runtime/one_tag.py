"""REFIMPL_P2P_TAGS=one: every point-to-point message reaches its process group with tag 0, so gloo
pairs messages in posting order, as NCCL does (docs/core_notes.md, "Tags"): the test mode in which
every schedule, ring and rebuilt collective must still equal single (tests/test_nccl_rules.py).
Installed in a rank as it joins its group (refimpl.lab.runtime.tools)."""
from __future__ import annotations

import os

import torch.distributed as dist

ENV = "REFIMPL_P2P_TAGS"
_installed = []


def wire_tag(tag: int) -> int:
    """The tag a message really carries: 0 under REFIMPL_P2P_TAGS=one."""
    return 0 if os.environ.get(ENV) == "one" else tag


def install_if_asked() -> None:
    """Under REFIMPL_P2P_TAGS=one, every process group's send and recv in this process carry
    `wire_tag` (torch.distributed's isend, irecv and batch_isend_irecv all post through them)."""
    if os.environ.get(ENV) != "one" or _installed:
        return
    send, recv = dist.ProcessGroup.send, dist.ProcessGroup.recv

    def send_on_wire(group, tensors, dst: int, tag: int = 0):
        return send(group, tensors, dst, wire_tag(tag))

    def recv_on_wire(group, tensors, src: int, tag: int = 0):
        return recv(group, tensors, src, wire_tag(tag))

    dist.ProcessGroup.send, dist.ProcessGroup.recv = send_on_wire, recv_on_wire
    _installed.append(True)
