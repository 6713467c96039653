"""A flight recorder: each rank's last communication calls, readable from outside while it hangs.

NCCL keeps one (TORCH_NCCL_TRACE_BUFFER_SIZE: a ring of the collectives each rank entered and
finished, dumped when the watchdog fires); gloo has none, and a hung rank cannot be asked
anything: it sits inside a C++ wait. So each rank writes its calls into a small ring of fixed-size
slots in a memory-mapped file, one slot per call, overwritten in place when the call returns.
The launcher reads the files of ranks that never finished and names, per rank, the call it is
stuck in and the call its peer is stuck in (`hang_report`). On NCCL ranks the launcher also
switches PyTorch's recorder on (`nccl_env`), and since an NCCL call returns once posted, the
report names each rank's last posted call instead (`posted=True`, `where_nccl_waits`).

    slot   one state byte, I (in) or D (done), then the call as JSON: {"seq", "op", "bytes",
           "group": [global ranks] | "world", "peer", "tag", "phase", "t"}; leaving a call
           rewrites only the state byte

On when REFIMPL_FLIGHT_RECORDER names a folder: `refimpl.launch.run` sets it for its ranks
(pass flight_recorder=False, or REFIMPL_FLIGHT_RECORDER=0 in the caller's environment, to turn it
off); under torchrun it is off unless you set it. A call costs one JSON line and a 256-byte copy
into the page cache, twice (see `refimpl.lab.instrument.labels.comm_span`, which calls `entered`).
"""
from __future__ import annotations

import itertools
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

ENV = "REFIMPL_FLIGHT_RECORDER"
SLOT_BYTES = 256
SLOTS = 64

_ring: "_Ring | None" = None
_group_ranks: dict[int, list[int] | str] = {}


class _Ring:
    def __init__(self, path: Path):
        path.write_bytes(b" " * (SLOT_BYTES * SLOTS))
        self._file = open(path, "r+b")
        self.map = mmap.mmap(self._file.fileno(), SLOT_BYTES * SLOTS)
        self.seq = itertools.count()      # next() is atomic under the GIL: async lanes share it

    def put(self, slot: int, record: dict) -> None:
        data = b"I" + json.dumps(record, separators=(",", ":")).encode()[:SLOT_BYTES - 2]
        start = slot * SLOT_BYTES
        self.map[start:start + SLOT_BYTES] = data.ljust(SLOT_BYTES, b" ")

    def done(self, slot: int) -> None:
        self.map[slot * SLOT_BYTES] = ord("D")


def active() -> bool:
    """True in a rank whose launcher asked for a recorder (opens this rank's ring on first use)."""
    global _ring
    if _ring is None:
        folder = os.environ.get(ENV)
        if not folder or folder == "0" or "RANK" not in os.environ:
            return False
        _ring = _Ring(Path(folder) / f"rank{os.environ['RANK']}.ring")
    return True


def _ranks_of(group) -> list[int] | str:
    """A group's global ranks (cached: torch looks them up in a table), or "world"."""
    if group is None:
        return "world"
    key = id(group)
    if key not in _group_ranks:
        import torch.distributed as dist

        _group_ranks[key] = dist.get_process_group_ranks(group)
    return _group_ranks[key]


class entered:
    """Record a call as entered while the `with` block runs, then as done; `inner` (a profiler
    range) is entered inside it. A class, not a generator: it runs on every labelled call."""

    __slots__ = ("inner", "record")

    def __init__(self, op: str, nbytes: int | None, group=None, peer: int | None = None,
                 tag: int | None = None, phase: str | None = None, inner=None):
        self.inner = inner
        self.record = {"seq": next(_ring.seq), "op": op, "bytes": nbytes,
                       "group": _ranks_of(group), "peer": peer, "tag": tag, "phase": phase}

    def __enter__(self):
        self.record["t"] = round(time.time(), 3)
        _ring.put(self.record["seq"] % SLOTS, self.record)
        if self.inner is not None:
            self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        if self.inner is not None:
            self.inner.__exit__(*exc)
        _ring.done(self.record["seq"] % SLOTS)


def read(folder: str | Path, rank: int) -> list[dict]:
    """A rank's recorded calls, oldest first (empty if it recorded none)."""
    path = Path(folder) / f"rank{rank}.ring"
    if not path.exists():
        return []
    data = path.read_bytes()
    records = []
    for i in range(0, len(data), SLOT_BYTES):
        text = data[i:i + SLOT_BYTES].strip()
        if text:
            try:
                record = json.loads(text[1:])
            except ValueError:    # a slot caught mid-write: the rank was killed while writing
                continue
            records.append({**record, "state": "in" if text[:1] == b"I" else "done"})
    return sorted(records, key=lambda r: r["seq"])


def stuck_calls(records: list[dict]) -> list[dict]:
    """The calls entered and never left, outermost first (a collective, then the wait inside it)."""
    return [r for r in records if r["state"] == "in"]


def waiting_in(folder: str | Path, ranks: list[int], posted: bool = False) -> tuple | None:
    """Each rank's innermost unfinished call, as (rank, seq) pairs, or None if any of `ranks` is
    in none: the launcher's stall watchdog sees a hang when this stays the same long enough.

    `posted` (NCCL): a collective returns once it is posted to the GPU's stream, so no call stays
    open while a rank waits; a hung rank blocks later, in a host read or synchronize. There each
    rank's last recorded call stands for where it waits (None until every rank made one)."""
    calls = []
    for rank in ranks:
        records = read(folder, rank)
        stuck = records if posted else stuck_calls(records)
        if not stuck:
            return None
        calls.append((rank, stuck[-1]["seq"]))
    return tuple(calls)


def describe(call: dict) -> str:
    """'recv-wait from rank 0 tag 5 (1024 B, in pp:F1)' / 'all_reduce on group [0, 2] (4 B)'."""
    text = call["op"]
    if call.get("peer") is not None:
        text += f" {'to' if 'send' in call['op'] else 'from'} rank {call['peer']}"
        if call.get("tag") is not None:
            text += f" tag {call['tag']}"
    else:
        text += f" on {'the world' if call['group'] == 'world' else 'group ' + str(call['group'])}"
    details = [f"{call['bytes']} B"] if call.get("bytes") is not None else []
    if call.get("phase"):
        details.append(f"in {call['phase']}")
    return text + (f" ({', '.join(details)})" if details else "")


def hang_report(folder: str | Path, ranks: list[int], posted: bool = False) -> str:
    """One line per rank still running: where it waits, and where the peer it waits on waits.
    `posted` (NCCL, see `waiting_in`): the last call each rank posted, and that it waits after it."""
    if posted:
        return "\n".join(_posted_line(r, read(folder, r)) for r in ranks)
    stuck = {r: stuck_calls(read(folder, r)) for r in ranks}
    lines = []
    for rank in ranks:
        calls = stuck[rank]
        if not calls:
            done = read(folder, rank)
            last = f"; its last call was {describe(done[-1])}" if done else ""
            lines.append(f"rank {rank} is in no recorded communication call{last}")
            continue
        line = f"rank {rank} waits in " + " > ".join(describe(c) for c in calls)
        peer = calls[-1].get("peer")
        if peer is not None and peer in stuck:
            there = stuck[peer]
            line += (f"; its peer rank {peer} waits in {describe(there[-1])}" if there
                     else f"; its peer rank {peer} is in no communication call")
        lines.append(line)
    return "\n".join(lines)


def _posted_line(rank: int, records: list[dict]) -> str:
    if not records:
        return f"rank {rank} posted no recorded communication call"
    last = records[-1]
    return (f"rank {rank} last posted {describe(last)} (its call #{last['seq']}), and waits "
            "after it in a host read or synchronize: NCCL returns once a collective is posted, "
            "so that call or an earlier one never completed on the GPU")


# --- PyTorch's own recorder on NCCL ranks ---------------------------------------------------------

# Two of its variables were renamed TORCH_FR_* by torch 2.9; the old names stay as aliases that
# warn, so a torch older than that gets the old spelling.
_FR_SIZE, _FR_FILE = "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
_FR_OLD = {_FR_SIZE: "TORCH_NCCL_TRACE_BUFFER_SIZE", _FR_FILE: "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
NCCL_ENTRIES = 2000


def nccl_env(folder: Path, torch_version: str | None = None) -> dict[str, str]:
    """The environment that switches PyTorch's c10d flight recorder on (a ring of each rank's last
    NCCL_ENTRIES collectives), set before the process group exists, dumped to `folder`/rank_<r>
    when the NCCL watchdog times a collective out. ASYNC_ERROR_HANDLING 3 ends the rank without
    aborting the communicator (aborting it loses the dump: pytorch/pytorch#121055)."""
    import torch

    version = torch.torch_version.TorchVersion(torch_version or torch.__version__)
    env = {_FR_SIZE: str(NCCL_ENTRIES), _FR_FILE: str(Path(folder) / "rank_"),
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    if version < (2, 9):
        env = {_FR_OLD.get(k, k): v for k, v in env.items()}
    return env


def nccl_dumps(job: str | None = None) -> Path:
    """Where NCCL ranks' recorders dump: one folder per launching process (refimpl.launch.run),
    or per torchrun job (`job`); it outlives the run, to be read after a hang."""
    folder = Path(tempfile.gettempdir()) / "refimpl-nccl-flight" / (job or str(os.getpid()))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def where_nccl_waits(folder: str | Path, ranks: list[int]) -> str:
    """The hang report of NCCL ranks: each one's last posted call (ours), and PyTorch's dumps."""
    given = nccl_env(nccl_dumps())                  # what refimpl.launch gave the ranks
    key = _FR_FILE if _FR_FILE in given else _FR_OLD[_FR_FILE]
    prefix = os.environ.get(key, given[key])        # unless this environment said otherwise
    return (hang_report(folder, ranks, posted=True)
            + f"\nPyTorch's NCCL flight recorder writes each rank's last collectives to "
            f"{prefix}<rank> when its watchdog times one out (python -m "
            "torch.distributed.flight_recorder.fr_trace reads them)")
