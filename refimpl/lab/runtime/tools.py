"""The lab's runtime on refimpl.launch (through refimpl.launch_tools, entry-point group
"refimpl.launch"): CPU ranks forked from a warm zygote, each rank's flight recorder and the hang
report read from it (refimpl.lab.runtime.watch), PyTorch's own flight recorder on NCCL ranks, the
process group's options (refimpl.lab.runtime.group_options), the heap policy, the one-tag mode
(refimpl.lab.runtime.one_tag), the staged NCCL-rules backend registered in a rank, exact fp32 on a
GPU, and the device audit (REFIMPL_DEVICE_AUDIT) around what a rank runs."""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from pathlib import Path

import torch

from refimpl.lab.config import lab_config
from refimpl.lab.runtime import flight_recorder, group_options, numerics, one_tag, zygote_client
from refimpl.lab.runtime.host_heap import heap_policy
from refimpl.lab.runtime.watch import Watch
from refimpl.launch_tools import LaunchTools

# (flight recorder on, stall seconds) for the launches made inside `watching`
_WATCHING: contextvars.ContextVar = contextvars.ContextVar("watching", default=(None, None))


@contextlib.contextmanager
def watching(flight_recorder: bool | None = None, stall: float | None = None):
    """Around refimpl.launch.run (or train_on_ranks): every rank's calls recorded (`flight_recorder`;
    None: unless REFIMPL_FLIGHT_RECORDER=0) and, with `stall` seconds, the hang watchdog: a hang is
    every running rank waiting in the same call that long; the hang report names them."""
    token = _WATCHING.set((flight_recorder, stall))
    try:
        yield
    finally:
        _WATCHING.reset(token)


class RuntimeTools(LaunchTools):

    def backend(self, world_size: int) -> str | None:
        # several ranks on one device: the staged NCCL-rules backend (shared_device)
        return "staged" if os.environ.get("REFIMPL_SHARED_DEVICE") else None

    def device(self, backend: str) -> torch.device:
        if backend == "staged":     # every rank on the one shared device (shared_device)
            return torch.device(os.environ.get("REFIMPL_SHARED_DEVICE", "cpu"))
        if backend == "fake":       # the dry run (refimpl.lab.verify.dryrun): shapes only, no storage
            return torch.device("meta")
        return torch.device("cpu")

    def starter(self, backend: str):
        return zygote_client.for_backend(backend)

    def watch(self, folder: Path, backend: str):
        wanted, stall = _WATCHING.get()
        if wanted is None:
            wanted = os.environ.get(flight_recorder.ENV) != "0"
        if stall is not None and (stall <= 0 or not wanted):
            raise ValueError("stall needs a positive number of seconds and the flight recorder on")
        return Watch(folder / "flight" if wanted else None, backend, stall)

    def rank_env(self, env: dict, backend: str, watch) -> None:
        folder = watch.folder if watch is not None else None
        env[flight_recorder.ENV] = str(folder) if folder is not None else "0"
        if backend == "nccl":
            for key, value in flight_recorder.nccl_env(flight_recorder.nccl_dumps()).items():
                env.setdefault(key, value)      # the caller's own settings win
            # cuBLAS's deterministic mode needs a fixed workspace, set before cuBLAS starts
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", numerics.CUBLAS_WORKSPACE)
        # All ranks are on this host: keep gloo's connections on loopback instead of whatever
        # interface the hostname resolves to.
        if backend == "staged":     # one thread per CPU rank, as refimpl.launch gives gloo's
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
        if backend in ("gloo", "staged") and sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")

    def torchrun_picked(self, local_ranks: int, asked: str, chosen: str) -> None:
        if asked == "auto" and chosen == "gloo" and os.environ.get("LOCAL_RANK", "0") == "0":
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            why = group_options.gloo_fallback_warning(local_ranks, gpus, os.environ)
            if why:
                print(why, file=sys.stderr, flush=True)

    def joining(self, backend: str, launched: bool, options: dict) -> None:
        heap_policy()           # before the rank's tensors: big blocks go back when freed
        one_tag.install_if_asked()      # REFIMPL_P2P_TAGS=one: gloo pairs messages as NCCL does
        group_options.add_options(options, backend, launched)
        if backend == "nccl" and not launched:      # torchrun: no launcher set these
            job = flight_recorder.nccl_dumps(f"torchrun-{os.environ.get('MASTER_PORT', '0')}")
            for key, value in flight_recorder.nccl_env(job).items():
                os.environ.setdefault(key, value)
        # the staged backend registered in every rank: its own default group, or a gloo rank's
        # new_group(backend="staged") (tests/test_nccl_rules.py)
        from refimpl.lab.runtime import shared_device  # noqa: F401

    def device_settings(self, device, cfg) -> None:
        cfg = lab_config(cfg)
        compared = cfg.return_state or bool(cfg.save_state)
        numerics.exact_fp32_on_cuda(device, numerics.deterministic_needed(
            device, cfg.dtype, cfg.mixed_precision, compared))

    @contextlib.contextmanager
    def running(self):
        folder = os.environ.get("REFIMPL_DEVICE_AUDIT")   # a test mode (device_audit.py)
        if not folder:
            yield
            return
        from refimpl.lab.runtime.device_audit import FactoryAudit

        with FactoryAudit() as factories:
            yield
        factories.write(folder, int(os.environ["RANK"]))
