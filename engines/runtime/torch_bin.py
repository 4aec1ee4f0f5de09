"""Reading a torch `pytorch_model.bin` state dict without torch and without running pickle code.

torch.save (>= 1.6) writes a zip archive: `<prefix>/data.pkl` (a pickle of the state dict),
`<prefix>/data/<key>` (one raw storage per key) and `<prefix>/byteorder`. A pickle can
call any importable function while it loads, so a checkpoint from the internet is code.
The unpickler here admits exactly what a state dict needs -- `collections.OrderedDict`,
`torch._utils._rebuild_tensor_v2` (answered by a numpy view builder) and the typed
storage class names inside persistent ids -- and refuses every other global with a
DrafterError naming it. Nothing from the file is ever imported or called.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from engines.errors import DrafterError

# Typed storage class -> (numpy dtype of its elements, mlx dtype the tensor becomes)
STORAGES = {
    "FloatStorage": ("<f4", mx.float32), "HalfStorage": ("<f2", mx.float16), "BFloat16Storage": ("<u2", mx.bfloat16),
    "DoubleStorage": ("<f8", mx.float32), "LongStorage": ("<i8", mx.int64), "IntStorage": ("<i4", mx.int32),
    "ShortStorage": ("<i2", mx.int16), "CharStorage": ("|i1", mx.int8), "ByteStorage": ("|u1", mx.uint8),
    "BoolStorage": ("|b1", mx.bool_),
}


class _Storage:
    def __init__(self, kind: str):
        self.kind = kind


class _Tensor:
    """A rebuilt tensor: a strided numpy view of its storage and the mlx dtype it stands for."""

    def __init__(self, array: np.ndarray, dtype):
        self.array, self.dtype = array, dtype


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    flat, dtype = storage
    size, stride = tuple(size), tuple(stride)
    if not size:
        return _Tensor(flat[offset: offset + 1].reshape(()), dtype)
    end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    if end > flat.size:
        raise DrafterError(f"a tensor of size {size} reads past the end of its storage ({flat.size} elements)")
    view = np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=[s * flat.itemsize for s in stride])
    return _Tensor(np.ascontiguousarray(view), dtype)


class _StateDictUnpickler(pickle.Unpickler):
    def __init__(self, fh, archive: zipfile.ZipFile, prefix: str, where: Path, big_endian: bool):
        super().__init__(fh)
        self.archive, self.prefix, self.where, self.big_endian = archive, prefix, where, big_endian

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if module == "torch" and name in STORAGES:
            return _Storage(name)
        raise DrafterError(f"{self.where} is not a plain state dict: its pickle asks for {module}.{name}, "
                           "which this loader refuses to import (only tensors and storages are read); "
                           "convert it to safetensors with a trusted tool")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise DrafterError(f"{self.where}: unexpected persistent id {pid!r:.80} in a state dict")
        _, storage, key, _location, numel = pid
        np_dtype, mx_dtype = STORAGES[storage.kind]
        raw = self.archive.read(f"{self.prefix}/data/{key}")
        flat = np.frombuffer(raw, dtype=np_dtype)
        if flat.size != numel:
            raise DrafterError(f"{self.where}: storage {key} holds {flat.size} elements, the pickle says {numel}")
        return (flat.byteswap() if self.big_endian else flat), mx_dtype


def read_torch_bin(path: Path) -> dict[str, mx.array]:
    """name -> mx.array for every tensor of the state dict in `path`; DrafterError on anything else."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise DrafterError(f"{path} is not a zip-format torch checkpoint (torch >= 1.6); the legacy format is not read: "
                           "convert it to safetensors")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise DrafterError(f"{path} holds {len(pkl)} data.pkl records; a torch state dict has exactly one")
        prefix = pkl[0][: -len("/data.pkl")]
        order = archive.read(f"{prefix}/byteorder").decode().strip() if f"{prefix}/byteorder" in names else "little"
        with archive.open(pkl[0]) as fh:
            state = _StateDictUnpickler(fh, archive, prefix, path, order == "big").load()
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, _Tensor) for k, v in state.items()):
        raise DrafterError(f"{path} does not hold a dict of named tensors")
    return {k: _to_mx(v) for k, v in state.items()}


def _to_mx(t: _Tensor) -> mx.array:
    if t.dtype == mx.bfloat16:  # bf16 bits travel as uint16; mlx reinterprets them
        return mx.array(t.array).view(mx.bfloat16)
    return mx.array(t.array).astype(t.dtype) if t.array.dtype == np.float64 else mx.array(t.array)
