"""torch.save's file, written one tensor at a time.

`torch.save(tree, path)` pickles the tree (dicts, ints, tensors) with each tensor's storage named
by a key, then writes every storage's bytes as the record data/<key> of a zip file. It needs all
the tensors at once. `TensorFile(path, tree)` takes the tree with `Spec(shape, dtype)` in place of
each tensor, writes the same pickle at once, and then each tensor's bytes as `put` hands it over,
in the tree's order (dicts in insertion order, depth first), so a writer holds one tensor at a
time. torch.load (weights_only, mmap) reads the file as it reads torch.save's: the pickle names
only `torch._utils._rebuild_tensor_v2`, storage classes and OrderedDict, as torch.save's does, and
the records are written by torch's own zip writer (aligned, with their CRC). Written under a
temporary name and renamed when complete: a run that dies mid-export leaves no half file.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.serialization import _open_zipfile_writer

_STORAGE = {torch.float64: "DoubleStorage", torch.float32: "FloatStorage",
            torch.float16: "HalfStorage", torch.bfloat16: "BFloat16Storage",
            torch.int64: "LongStorage", torch.int32: "IntStorage", torch.int16: "ShortStorage",
            torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage"}


@dataclass
class Spec:
    """A tensor the file will hold, not made yet."""
    shape: tuple
    dtype: torch.dtype
    key: str = field(default="", compare=False)


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


class _Pickler(pickle.Pickler):
    """torch.save's pickle of a tensor, for a Spec: rebuilt from the storage data/<key>."""

    def __init__(self, file, specs: list[Spec]):
        super().__init__(file, protocol=2)
        self.specs = specs

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", getattr(torch, _STORAGE[obj.dtype]), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if not isinstance(obj, Spec):
            return NotImplemented
        if not obj.key:                     # a lazy file's Specs have their keys already
            obj.key = str(len(self.specs))
            self.specs.append(obj)
        shape = tuple(obj.shape)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))   # row-major
        storage = _Storage(obj.key, obj.dtype, math.prod(shape))
        return (torch._utils._rebuild_tensor_v2,
                (storage, 0, shape, stride, False, collections.OrderedDict()))


class TensorFile:
    """with TensorFile(path, tree) as f: f.put(t0); f.put(t1); ...  (one `put` per Spec).

    Without a tree, `put(t, name)` names each tensor as it comes and the file is the dict of them
    in sorted name order, its pickle written last (torch.load finds records by name)."""

    def __init__(self, path, tree=None):
        self.path = Path(path)
        # a folder of its own beside `path`, so that the zip's inner name is torch.save's
        self.folder = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}"
        self.folder.mkdir(exist_ok=True)
        self.tmp = self.folder / self.path.name
        self.specs: list[Spec] = []
        self.named: dict[str, Spec] | None = None if tree is not None else {}
        self._opener = _open_zipfile_writer(str(self.tmp))
        self._zip = self._opener.__enter__()
        if tree is not None:
            self._write_pickle(tree)
        self.written = 0

    def _write_pickle(self, tree) -> None:
        data = io.BytesIO()
        _Pickler(data, self.specs).dump(tree)
        self._zip.write_record("data.pkl", data.getvalue(), len(data.getvalue()))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))

    def __enter__(self) -> "TensorFile":
        return self

    def put(self, tensor: torch.Tensor, name: str | None = None) -> None:
        """The next tensor of the tree, on the CPU, of its Spec's shape and dtype (a file made
        without a tree: the tensor called `name`)."""
        if self.named is not None:
            if name is None or name in self.named:
                raise ValueError(f"{self.path}: each tensor needs a name of its own, got {name!r}")
            spec = Spec(tuple(tensor.shape), tensor.dtype, key=str(len(self.specs)))
            self.specs.append(spec)
            self.named[name] = spec
        spec = self.specs[self.written]
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor {spec.key}: got {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the file says {tuple(spec.shape)} {spec.dtype}")
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            raise ValueError(f"tensor {spec.key} is on {t.device}: put CPU tensors")
        nbytes = t.numel() * t.element_size()
        if t.storage_offset() or t.untyped_storage().nbytes() != nbytes:
            t = t.clone()                   # a view: its own bytes only
        self._zip.write_record(f"data/{spec.key}", t.untyped_storage(), nbytes)
        self.written += 1

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None and self.named is not None:
                self._write_pickle({n: self.named[n] for n in sorted(self.named)})
            self._opener.__exit__(kind, value, tb)
            if kind is None and self.written != len(self.specs):
                raise ValueError(f"{self.path}: {self.written} of {len(self.specs)} tensors put")
            if kind is None:
                os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)
            self.folder.rmdir()
