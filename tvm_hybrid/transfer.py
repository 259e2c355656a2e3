"""Arrays into and out of the Relax VM without needless copies.

A model call used to copy every input into a freshly allocated TVM tensor and every output back
into a fresh numpy array. For large tensors that dominated: an attention over three
``32 x 12 x 384 x 64`` inputs spent ~50 ms of a ~95 ms call copying (page faults of the fresh
allocations, single-threaded memcpy), more than the fused kernel itself.

* An input already laid out as TVM needs (C-contiguous, 64-byte aligned: what TVM's kernels
  assume) is passed zero-copy through DLPack.
* Other inputs (numpy aligns large arrays to 16 bytes) are copied into a staging tensor kept per
  thread and input, so the copy reuses memory already mapped.

Outputs are still copied into new numpy arrays: a view of the VM's result could alias a model
constant or an input.
"""

from __future__ import annotations

import numpy as np
import tvm

#: The data alignment TVM's kernels assume of their arguments.
ALIGNMENT = 64
_DLPACK_KINDS = "biuf"


def to_device(arrays: list[np.ndarray], staging: dict) -> list[tvm.runtime.Tensor]:
    """TVM tensors holding ``arrays``: zero-copy when possible, else copied into the
    ``staging`` tensors (one per position, reused while shape and dtype stay)."""
    out = []
    for position, array in enumerate(arrays):
        # np.require keeps 0-d inputs 0-d (np.ascontiguousarray would make them 1-d).
        array = np.require(array, requirements="C")
        tensor = _zero_copy(array)
        if tensor is None:
            tensor = _staged(array, position, staging)
        out.append(tensor)
    return out


def _zero_copy(array: np.ndarray) -> tvm.runtime.Tensor | None:
    if (array.ndim == 0 or array.dtype.kind not in _DLPACK_KINDS or array.size == 0
            or array.ctypes.data % ALIGNMENT):
        return None
    try:
        return tvm.runtime.from_dlpack(array)
    except Exception:  # read-only arrays, dtypes DLPack lacks: copy instead
        return None


def _staged(array: np.ndarray, position: int, staging: dict) -> tvm.runtime.Tensor:
    if array.dtype.kind not in _DLPACK_KINDS or array.size == 0:
        return tvm.runtime.tensor(array, tvm.cpu())
    held = staging.get(position)
    if held is None or held[1].shape != array.shape or held[1].dtype != array.dtype:
        tensor = tvm.runtime.empty(array.shape, str(array.dtype))
        held = staging[position] = (tensor, np.from_dlpack(tensor))  # a view, for np.copyto
    np.copyto(held[1], array, casting="no")
    return held[0]
