"""The one table of what each collective puts on the wire: bytes a rank sends per byte of message."""
from __future__ import annotations

import math


def bytes_per_rank_factor(op: str, n: float) -> float:
    """Bytes one rank sends per byte of message; n may be math.inf (the paper's large-n limit)."""
    if op in ("broadcast", "reduce", "send_recv"):     # the whole message, once
        return 1.0
    share = 1.0 if n == math.inf else (n - 1) / n
    if op in ("all_reduce", "all_reduce_max"):
        return 2 * share
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return share
    raise ValueError(f"no bytes-per-rank factor for {op!r}")


def sent_per_rank(op: str, n: int, message_bytes: float) -> float:
    return bytes_per_rank_factor(op, n) * message_bytes

