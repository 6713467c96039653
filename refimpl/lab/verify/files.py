"""Bad files get the answer bad flags get: one line, before any rank starts.

A corrupt `--init-state` used to end in a 20-line traceback from inside a rank; one saved from
another model shape in a size-mismatch traceback; `--save-state` into a missing folder trained the
whole run and then lost it. `check_files` tries what can be tried in the launching process: the
state files load and their names and shapes are the model's, the folders a run will write into
exist (or can be made) and take a file. Every failure is a LayoutError, which the CLI prints as one line (exit 2).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from refimpl.mesh import LayoutError
from refimpl.model import GPT, GPTConfig


def check_files(model: GPTConfig, *, init_state: str | None = None,
                init_optimizer_state: str | None = None, writes: dict[str, str | None] = (),
                trace_dir: str | None = None, checkpoint_dir: str | None = None) -> None:
    """Raise LayoutError naming the flag and the problem; `writes` maps a flag to the file it
    will write (its folder must exist and take a file); `trace_dir` and `checkpoint_dir` are
    folders the run will write into, made here if missing (as the run would)."""
    if init_state:
        _check_state(init_state, model)
    if init_optimizer_state:
        state = _load("--init-optimizer-state", init_optimizer_state)
        if not isinstance(state, dict):
            raise LayoutError(f"--init-optimizer-state {init_optimizer_state}: not an optimizer "
                              f"state saved by --save-optimizer-state")
    for flag, path in dict(writes).items():
        if path:
            folder = Path(path).resolve().parent
            if not folder.is_dir():
                raise LayoutError(f"{flag} {path}: the folder {folder} does not exist")
            _takes_a_file(flag, path, folder)
    for flag, folder in (("--trace-dir", trace_dir), ("--checkpoint-dir", checkpoint_dir)):
        if folder:
            _make_folder(flag, folder)


def _make_folder(flag: str, path: str) -> None:
    """Make the folder (and its parents), or say in one line why it cannot be: a file in the way,
    a file system that takes no folders (/proc), no permission."""
    folder = Path(path).resolve()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise LayoutError(f"{flag} {path}: {existing} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LayoutError(f"{flag} {path}: cannot make the folder ({e.strerror or e})") from None
    _takes_a_file(flag, path, folder)


def _takes_a_file(flag: str, path: str, folder: Path) -> None:
    """Write and remove a file there: permission bits say nothing to root (containers run as
    root), and some file systems refuse files whatever the bits say."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise LayoutError(f"{flag} {path}: {folder} is not writable ({e.strerror or e})") from None


def _load(flag: str, path: str):
    if not os.path.isfile(path):
        raise LayoutError(f"{flag} {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:     # a truncated zip, a pickle of something else: say so in one line
        text = str(e).strip()
        if "Weights only load failed" in text:     # torch's long advice; the short of it:
            reason = "not a torch.save file of tensors"
        else:
            reason = text.split(". ")[0].splitlines()[0][:100] if text else type(e).__name__
        raise LayoutError(f"{flag} {path}: not a state dict torch.load can read ({reason})") from None


def _check_state(path: str, model: GPTConfig) -> None:
    state = _load("--init-state", path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LayoutError(f"--init-state {path}: not a state dict (names -> tensors) as "
                          f"--save-state writes")
    with torch.device("meta"):            # the model's names and shapes, no memory
        want = {k: tuple(v.shape) for k, v in GPT(model).state_dict().items()}
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        first = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise LayoutError(f"--init-state {path}: its names are not this model's ({first}; "
                          f"{len(missing)} missing, {len(extra)} unexpected)")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise LayoutError(f"--init-state {path}: {name} is {tuple(state[name].shape)} in the "
                              f"file, {shape} in this model (other --layers/--d-model/--heads?)")
