"""Reading detectron2 ``.pkl`` detector weights without running code from the file.

A pickle is a small program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes import any callable and ``REDUCE`` calls
it, so ``pickle.load`` on a foreign file runs whatever the file asks for. The unpickler here resolves globals
from a fixed allowlist only - the handful that detectron2 model-zoo and Caffe2-converted checkpoints are made
of (numpy arrays, dtypes and scalars, ``collections.OrderedDict``; dicts, lists, tuples, strings and numbers
need no globals) - and each admitted callable is wrapped so that it can only build what such a file holds
(an ``ndarray``, a non-object dtype, a latin-1 byte string). Anything else is refused *before* it is looked up:
:class:`UnsafePickleError` names the file and the forbidden global. Persistent ids are refused as well.

:func:`load_detectron2_pkl` then gives the checkpoint the structure detectron2's ``DetectionCheckpointer`` gives
it (``{"model": state_dict, "__author__": ...}``; a Caffe2/Detectron1 file's ``blobs`` without ``*_momentum``
and marked ``matching_heuristics`` so that detectron2's name-matching conversion still renames its keys when
the weights are loaded), with every numpy array turned into a torch tensor (as fvcore's checkpointer does).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioning.errors import InputError

try:  # numpy >= 2 ("numpy.core" is a deprecated alias there)
    from numpy._core import multiarray as _multiarray
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]


class UnsafePickleError(InputError, pickle.UnpicklingError, ValueError):
    """A pickle asked for something a weights file has no business with (or is not a weights file at all)."""


def _reconstruct(subtype, shape, dtype):
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"array reconstruction of {subtype!r} (only numpy.ndarray is allowed)")
    return _multiarray._reconstruct(np.ndarray, shape, dtype)


def _dtype(spec, align=False, copy=False):
    if not isinstance(spec, str | bytes):
        raise pickle.UnpicklingError(f"numpy dtype from {type(spec).__name__} (only type codes are allowed)")
    dt = np.dtype(spec.decode("latin-1") if isinstance(spec, bytes) else spec, align=bool(align), copy=bool(copy))
    if dt.hasobject:
        raise pickle.UnpicklingError(f"numpy dtype {dt} holds Python objects")
    return dt


def _scalar(dtype, data):
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes | str):
        raise pickle.UnpicklingError(f"numpy scalar of {dtype!r} from {type(data).__name__}")
    return _multiarray.scalar(dtype, data)


def _frombuffer(buf, dtype, shape, order="C"):
    """``numpy._core.numeric._frombuffer``, as numpy writes arrays into protocol-5 pickles."""
    if not isinstance(buf, bytes | bytearray) or not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise pickle.UnpicklingError(f"array from a {type(buf).__name__} buffer of dtype {dtype!r}")
    if order not in ("C", "F"):
        raise pickle.UnpicklingError(f"array order {order!r}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def _encode(text, encoding="latin1"):
    """``_codecs.encode``, as Python 3 writes ``bytes`` into protocol-2 pickles: latin-1 only."""
    if not isinstance(text, str) or str(encoding).replace("-", "").replace("_", "").lower() != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} (only latin1 is allowed)")
    return text.encode("latin-1")


def _bytes(*args):
    """``bytes()``, as Python 3 writes an empty byte string (an empty array's data) into protocol 0-2 pickles."""
    if args:
        raise pickle.UnpicklingError(f"bytes{args!r} (only the empty byte string is allowed)")
    return b""


_ARRAY = {"_reconstruct": _reconstruct, "scalar": _scalar}
ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _encode,
    ("builtins", "bytes"): _bytes,
    ("__builtin__", "bytes"): _bytes,  # protocols 0-2 name Python 3's builtins module the Python 2 way
    **{(mod, name): fn for mod in ("numpy.core.multiarray", "numpy._core.multiarray") for name, fn in _ARRAY.items()},
    **{(mod, "_frombuffer"): _frombuffer for mod in ("numpy.core.numeric", "numpy._core.numeric")},
}
"""(module, name) -> what the unpickler gets for it; every other global is refused."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, origin: str):
        super().__init__(file, encoding="latin1")  # Python 2 pickles (detectron2's model zoo), as detectron2 reads them
        self.origin = origin

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self.origin}: refused to unpickle: it asks for {module}.{name}, which is not part of a detector "
                "weights file (allowed: numpy arrays/dtypes/scalars and collections.OrderedDict). The file may be "
                "malicious; nothing from it was run. Use weights from a source you trust, or a .pth file."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.origin}: refused to unpickle: persistent id {pid!r} (not a weights file)")


def safe_load(path: str | Path) -> Any:
    """Unpickle ``path`` admitting only :data:`ALLOWED` globals; UnsafePickleError names the file and the global."""
    p = Path(path)
    with open(p, "rb") as f:
        try:
            return _RestrictedUnpickler(f, str(p)).load()
        except UnsafePickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                KeyError, UnicodeDecodeError, MemoryError, OverflowError) as e:
            raise UnsafePickleError(f"{p}: not a readable detector weights pickle: {type(e).__name__}: {e}") from None


def _tensors(state: dict[Any, Any], origin: str) -> OrderedDict[str, torch.Tensor]:
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, v in state.items():
        if not isinstance(k, str):
            raise UnsafePickleError(f"{origin}: weight name {k!r} is not a string")
        if isinstance(v, np.generic):
            v = np.asarray(v)
        if not isinstance(v, np.ndarray):
            raise UnsafePickleError(f"{origin}: weight {k!r} is a {type(v).__name__}, not an array")
        if v.dtype.kind not in "biuf":
            raise UnsafePickleError(f"{origin}: weight {k!r} has dtype {v.dtype} (numbers only)")
        # an owned, writable copy in native byte order (what torch.from_numpy accepts)
        out[k] = torch.from_numpy(np.array(v, dtype=v.dtype.newbyteorder("="), copy=True))
    return out


def load_detectron2_pkl(path: str | Path) -> dict[str, Any]:
    """A detectron2 ``.pkl`` checkpoint, read with :func:`safe_load`, shaped as detectron2's checkpointer
    shapes it: ``{"model": OrderedDict[str, Tensor], "__author__": str[, "matching_heuristics": True]}``."""
    origin = str(path)
    data = safe_load(path)
    if not isinstance(data, dict):
        raise UnsafePickleError(f"{origin}: expected a dict of weights, got {type(data).__name__}")
    if "model" in data and ("__author__" in data or isinstance(data["model"], dict)):  # detectron2 model-zoo format
        if not isinstance(data["model"], dict):
            raise UnsafePickleError(f"{origin}: 'model' is a {type(data['model']).__name__}, not a dict of weights")
        out = {k: v for k, v in data.items() if k != "model" and isinstance(k, str)}
        out["model"] = _tensors(data["model"], origin)
        out["__author__"] = str(data.get("__author__", "unknown"))
        return out
    blobs = data.get("blobs", data)  # Caffe2 / Detectron1 (detection models keep their weights under "blobs")
    if not isinstance(blobs, dict):
        raise UnsafePickleError(f"{origin}: 'blobs' is a {type(blobs).__name__}, not a dict of weights")
    blobs = {k: v for k, v in blobs.items() if not (isinstance(k, str) and k.endswith("_momentum"))}
    return {"model": _tensors(blobs, origin), "__author__": "Caffe2", "matching_heuristics": True}


__all__ = ["ALLOWED", "UnsafePickleError", "load_detectron2_pkl", "safe_load"]
