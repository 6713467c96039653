"""The machine as the workbook sees it: cores, memory, GPUs, versions, and where N ranks would run.

    from refimpl.lab.env import machine
    m = machine()
    m.summary(2)          # "this machine: 2 CPU cores, 23.5 GiB, no GPU; 2 ranks run on gloo (CPU)"
    m.backend_for(4)      # "nccl" only with >= 4 GPUs (one per rank), else "gloo"
    python -m refimpl env [--json]

Notebooks take their words from here ("this machine", "the ranks run on ...") instead of writing
"laptop" or "2 cores": the same text must be true on a 2-core CPU box and on an 8-GPU server. The
backend rule is refimpl.launch.pick_backend's (NCCL needs one GPU per rank), so what `summary`
says is what `launch.run` does.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass

GiB = 2 ** 30
SHARED_DEVICE = "REFIMPL_SHARED_DEVICE"   # refimpl.lab.runtime.shared_device.ENV (not imported: it loads torch)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class Machine:
    cpu_cores: int
    memory_bytes: int | None          # physical memory; None where the OS does not say
    gpus: tuple[GPU, ...] = ()
    torch_version: str = ""
    cuda_version: str | None = None   # the CUDA torch was built with; None for a CPU build
    nccl_version: str | None = None
    interconnect: str | None = None   # `nvidia-smi topo -m`, where nvidia-smi exists

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def backend_for(self, nproc: int) -> str:
        """The backend `launch.run(fn, nproc)` picks: the staged one when every rank shares one
        device (REFIMPL_SHARED_DEVICE, refimpl.lab.runtime.shared_device), else NCCL only when every rank has
        its own GPU."""
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        if os.environ.get(SHARED_DEVICE):
            return "staged"
        return "nccl" if self.gpu_count >= nproc else "gloo"

    def device_for(self, nproc: int) -> str:
        """The device type the ranks of an `nproc`-rank run compute on (and its reference too)."""
        if self.backend_for(nproc) == "staged":
            return os.environ[SHARED_DEVICE].split(":")[0]
        return "cuda" if self.backend_for(nproc) == "nccl" else "cpu"

    def where(self, nproc: int) -> str:
        """'gloo (CPU)' or 'nccl (one GPU per rank)': the words a notebook uses for a run."""
        backend = self.backend_for(nproc)
        if backend == "staged":
            return f"{os.environ[SHARED_DEVICE]}, shared under NCCL's rules (the staged backend)"
        if backend == "nccl":
            return "one GPU (CUDA)" if nproc == 1 else "nccl (one GPU per rank)"
        return "the CPU" if nproc == 1 else "gloo (CPU)"

    def describe(self) -> str:
        """'2 CPU cores, 23.5 GiB, no GPU' or '16 CPU cores, 125.8 GiB, 1 x NVIDIA H200 (139.8 GiB)'."""
        parts = [f"{self.cpu_cores} CPU core{'s' if self.cpu_cores != 1 else ''}"]
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / GiB:.1f} GiB")
        if not self.gpus:
            parts.append("no GPU")
        else:
            names = sorted({g.name for g in self.gpus})
            mem = self.gpus[0].memory_bytes / GiB
            parts.append(f"{self.gpu_count} x {' / '.join(names)} ({mem:.1f} GiB each)")
        return ", ".join(parts)

    def summary(self, nproc: int = 2) -> str:
        """One computed line: the machine and where `nproc` ranks run, and why when it matters."""
        line = f"this machine: {self.describe()}; {nproc} rank{'s run' if nproc != 1 else ' runs'} " \
               f"on {self.where(nproc)}"
        if self.gpus and self.backend_for(nproc) == "gloo":
            line += (f" (NCCL needs one GPU per rank: {self.gpu_count} GPU(s) < {nproc} ranks; "
                     f"the reference runs on CPU too)")
        return line

    def runs_note(self, ranks, minutes: float) -> str:
        """What a notebook launches, said at its top: its rank counts, the backend each runs on
        here, and about how long the whole notebook takes (`minutes`, on a 2-core CPU machine).
        Where some counts get NCCL and others gloo (fewer GPUs than ranks), it says so: the
        notebook then mixes backends, and its timings across those counts do not compare."""
        counts = sorted(set(ranks))
        if not counts:
            return (f"this notebook launches no ranks: everything runs in this kernel; about "
                    f"{minutes:g} min on a 2-core CPU machine. This machine: {self.describe()}.")
        by = {}
        for n in counts:
            by.setdefault(self.where(n), []).append(n)
        said = (f"on {next(iter(by))}" if len(by) == 1 else
                "; ".join(f"{_count_words(ns)} on {where}" for where, ns in by.items()))
        line = (f"this notebook launches {_count_words(counts)} ({said}); about {minutes:g} min "
                f"on a 2-core CPU machine. This machine: {self.describe()}.")
        if len({self.device_for(n) for n in counts}) > 1:
            line += (f" Mixed backends: NCCL needs one GPU per rank and this machine has "
                     f"{self.gpu_count}; the runs with more ranks than that are on gloo (CPU), so "
                     f"compare their times only with each other.")
        return line

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gpu_count"] = self.gpu_count
        d["backend_for"] = {n: self.backend_for(n) for n in (1, 2, 4, 8)}
        return d


def machine(topology: bool = True) -> Machine:
    """Read the machine now. `topology=False` skips `nvidia-smi topo -m` (a subprocess)."""
    import torch

    gpus: tuple[GPU, ...] = ()
    nccl = None
    if torch.cuda.is_available():
        gpus = tuple(GPU(p.name, int(p.total_memory))
                     for p in (torch.cuda.get_device_properties(i)
                               for i in range(torch.cuda.device_count())))
    try:
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:            # a CPU build, or NCCL present but not loadable
        nccl = None
    return Machine(cpu_cores=cpu_cores(), memory_bytes=memory_bytes(), gpus=gpus,
                   torch_version=torch.__version__, cuda_version=torch.version.cuda,
                   nccl_version=nccl,
                   interconnect=gpu_topology() if (topology and gpus) else None)


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask: what a container or taskset allows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:       # macOS has no affinity mask
        return os.cpu_count() or 1


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gpu_topology(timeout: float = 10.0) -> str | None:
    """`nvidia-smi topo -m`: which GPU pairs talk over NVLink (NV#), PCIe (PIX/PXB/PHB) or SYS."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def main(as_json: bool = False) -> int:
    """`python -m refimpl env`: the machine, one line per fact, or one JSON object."""
    import json

    m = machine()
    if as_json:
        print(json.dumps(m.as_dict()))
        return 0
    print(m.summary(2))
    print(f"torch {m.torch_version}, CUDA {m.cuda_version or '-'}, NCCL {m.nccl_version or '-'}")
    for i, g in enumerate(m.gpus):
        print(f"GPU {i}: {g.name}, {g.memory_bytes / GiB:.1f} GiB")
    for n in (1, 2, 4, 8):
        print(f"{n} rank(s): {m.where(n)}")
    if m.interconnect:
        print("interconnect (nvidia-smi topo -m):\n" + m.interconnect)
    return 0


def numerics_settings() -> dict:
    """What is in force now (for a report): the fp32 matmul mode and deterministic mode
    (refimpl.lab.runtime.numerics sets them)."""
    import torch

    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    return {"matmul_fp32": matmul if matmul is not None else torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def _count_words(ns) -> str:
    """[2, 3, 4] -> '2, 3 and 4 ranks'; [1] -> '1 rank'."""
    ns = list(ns)
    head = ", ".join(map(str, ns[:-1]))
    return f"{head + ' and ' if head else ''}{ns[-1]} rank{'s' if ns != [1] else ''}"

