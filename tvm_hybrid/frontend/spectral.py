"""ONNX ``DFT`` and ``STFT`` (which TVM 0.27's importer lacks) as one GEMM with a constant
matrix.

A transform of static length is linear in its input, so it is a product with a constant
matrix, which runs on the GEMM engine with the matrix prepacked like any weight::

    x: [..., N (at axis), ..., c]       c = 1 (real) or 2 (complex: re, im)
    x -> [P..., N, c] -> [P..., N * c]  the transformed axis moved before the components
    y =  x @ W                          W: [N * c, K * c'], built in float64 at compile time
    y -> [P..., K, c'] -> [..., K (at axis), ..., c']

with ``W[n c + i, k c' + o]`` the weight of input component ``i`` at ``n`` in output component
``o`` at ``k`` (``theta = 2 pi k n / L``, ``L`` the DFT length; inputs past ``L`` are cut, a
shorter input is padded with zeros, as ``numpy.fft`` does):

* forward: ``re = x_re cos + x_im sin``, ``im = x_im cos - x_re sin`` for ``K = L`` bins, or
  ``L // 2 + 1`` with ``onesided``;
* ``inverse``: ``re = (x_re cos - x_im sin) / L``, ``im = (x_re sin + x_im cos) / L``;
* ``inverse`` with ``onesided`` (the inverse of a one-sided real transform, ``irfft``): a real
  output of ``L`` samples from the first ``L // 2 + 1`` bins, each bin but the first and the
  middle counted twice (its mirror image), imaginary parts of those two ignored.

``STFT`` gathers the frames (``1 + (length - frame) // step`` of them) with one ``take`` and
transforms them along the frame axis with the window folded into ``W`` (a window given at run
time multiplies the frames instead). The lengths, axis and frame step must be constants (or
graph inputs, specialized per value: ``value_inputs.py``); a matrix over
:data:`MAX_MATRIX_ELEMENTS` is refused naming the node.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter, get_constant

from ..errors import UnsupportedModelError
from .static_dims import constant_int, static_dims

#: The largest transform matrix built (elements; 64 MiB of float32).
MAX_MATRIX_ELEMENTS = 1 << 24


def _node(op: str, attr: dict) -> str:
    return f"{op} node {attr.get('tvm_custom', {}).get('name', '')!r}"


def dft_matrix(n: int, c: int, length: int, inverse: bool, onesided: bool,
               window: np.ndarray | None = None) -> np.ndarray:
    """``W`` of the module docstring (float64): ``n`` input samples of ``c`` components, DFT
    length ``length``; ``window`` (``n`` values) scales the input samples."""
    if inverse and onesided:  # irfft: bins in, L real samples out
        bins, out_c, out = length // 2 + 1, 1, length
    else:
        bins, out_c, out = (length // 2 + 1 if onesided else length), 2, None
    used = min(n, bins if out is not None else length)
    w = np.zeros((n, c, out if out is not None else bins, out_c))
    rows = np.arange(used)[:, None]
    cols = np.arange(w.shape[2])[None, :]
    # Angles reduced modulo the length first, and the roundoff of exact zeros dropped.
    theta = 2.0 * np.pi * ((rows * cols) % length) / length
    cos, sin = np.cos(theta), np.sin(theta)
    cos[np.abs(cos) < 1e-12], sin[np.abs(sin) < 1e-12] = 0.0, 0.0
    if out is not None:  # rows are bins k, columns samples n
        twice = np.where((rows == 0) | (2 * rows == length), 1.0, 2.0)
        w[:used, 0, :, 0] = twice * cos / length
        if c == 2:
            w[:used, 1, :, 0] = -twice * sin / length
    elif inverse:
        w[:used, 0, :, 0], w[:used, 0, :, 1] = cos / length, sin / length
        if c == 2:
            w[:used, 1, :, 0], w[:used, 1, :, 1] = -sin / length, cos / length
    else:
        w[:used, 0, :, 0], w[:used, 0, :, 1] = cos, -sin
        if c == 2:
            w[:used, 1, :, 0], w[:used, 1, :, 1] = sin, cos
    if window is not None:
        w *= np.asarray(window, "float64").reshape(n, 1, 1, 1)
    return w.reshape(n * c, -1)


def _check_layout(dims: list[int], axis: int, node: str) -> None:
    if dims[-1] not in (1, 2) or not 0 <= axis < len(dims) - 1:
        raise UnsupportedModelError(f"{node}: input of shape {dims} and axis {axis}: the last "
                                    "axis must be the 1 or 2 components, the transform another")


def _transform(bb, x: relax.Expr, axis: int, length: int, inverse: bool, onesided: bool,
               node: str, window=None) -> relax.Expr:
    """``x`` (its last axis the components) transformed along ``axis`` (module docstring)."""
    dims = static_dims(x, "input", node)
    _check_layout(dims, axis, node)
    rank, n, c = len(dims), dims[axis], dims[-1]
    outputs = length if inverse and onesided else 2 * (length // 2 + 1 if onesided else length)
    if n * c * outputs > MAX_MATRIX_ELEMENTS:  # checked before building it
        raise UnsupportedModelError(f"{node}: a transform of {n} samples to {length} needs a "
                                    f"{n * c}x{outputs} matrix; at most {MAX_MATRIX_ELEMENTS} "
                                    "elements are supported")
    matrix = dft_matrix(n, c, length, inverse, onesided, window)
    dtype = str(x.ty.dtype)
    compute = "float64" if dtype == "float64" else "float32"
    if dtype != compute:
        x = bb.emit(relax.op.astype(x, compute))
    perm = [i for i in range(rank - 1) if i != axis] + [axis, rank - 1]
    moved = bb.emit(relax.op.permute_dims(x, perm)) if perm != list(range(rank)) else x
    outer = [dims[i] for i in perm[:-2]]
    flat = bb.emit(relax.op.reshape(moved, (*outer, n * c)))
    product = bb.emit(relax.op.matmul(flat, relax.const(matrix.astype(compute), compute)))
    out_c = 1 if inverse and onesided else 2
    out = bb.emit(relax.op.reshape(product, (*outer, matrix.shape[1] // out_c, out_c)))
    back = [perm.index(i) for i in range(rank)]
    if back != list(range(rank)):
        out = bb.emit(relax.op.permute_dims(out, back))
    return bb.emit(relax.op.astype(out, dtype)) if dtype != compute else out


class DFT(OnnxOpConverter):
    """ONNX ``DFT`` (opset 17: ``axis`` an attribute, default 1; opset 20: an input, default
    -2), ``dft_length``, ``inverse`` and ``onesided``."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, params, int(attr.get("axis", 1)))

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        node = _node("DFT", attr)
        axis = constant_int(inputs[2] if len(inputs) > 2 else None, params, "axis", node)
        return cls._convert(bb, inputs, attr, params, -2 if axis is None else axis)

    @classmethod
    def _convert(cls, bb, inputs, attr, params, axis: int):
        node = _node("DFT", attr)
        x = inputs[0]
        dims = static_dims(x, "input", node)
        axis = axis + len(dims) if axis < 0 else axis
        _check_layout(dims, axis, node)
        inverse, onesided = bool(attr.get("inverse", 0)), bool(attr.get("onesided", 0))
        length = constant_int(inputs[1] if len(inputs) > 1 else None, params, "dft_length",
                               node)
        if length is None:
            length = 2 * (dims[axis] - 1) if inverse and onesided else dims[axis]
        if length < 1:
            raise UnsupportedModelError(f"{node}: DFT length {length} is not positive")
        return _transform(bb, x, axis, length, inverse, onesided, node)


class STFT(OnnxOpConverter):
    """ONNX ``STFT`` (opset 17): frames of the signal, windowed, transformed."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        node = _node("STFT", attr)
        inputs = list(inputs) + [None] * (4 - len(inputs))
        signal, step_in, window, length_in = inputs[:4]
        batch, samples, c = static_dims(signal, "signal", node)
        step = constant_int(step_in, params, "frame_step", node)
        frame = constant_int(length_in, params, "frame_length", node)
        weights = None
        if window is not None:
            size = static_dims(window, "window", node)[0]
            const = get_constant(window, params)
            weights = (np.asarray(const.value.numpy(), "float64")
                       if isinstance(const, tvm.ir.GenericConst) else None)
        else:
            size = frame if frame is not None else samples
        frame = size if frame is None else frame
        if step is None or step < 1 or not 0 < size <= samples:
            raise UnsupportedModelError(f"{node}: frame step {step} and frames of {size} "
                                        f"samples do not fit a signal of {samples}")
        count = 1 + (samples - size) // step
        if count * size > MAX_MATRIX_ELEMENTS:
            raise UnsupportedModelError(f"{node}: {count} frames of {size} samples; at most "
                                        f"{MAX_MATRIX_ELEMENTS} gathered samples are supported")
        starts = np.arange(count)[:, None] * step + np.arange(size)[None, :]
        frames = bb.emit(relax.op.take(signal, relax.const(starts, "int64"), axis=1))
        if window is not None and weights is None:  # a window given at run time
            shaped = relax.op.reshape(relax.op.astype(window, str(signal.ty.dtype)),
                                      (1, 1, size, 1))
            frames = bb.emit(relax.op.multiply(frames, shaped))
        onesided = bool(attr.get("onesided", 1))
        return _transform(bb, frames, 2, frame, False, onesided, node, weights)


CONVERTERS = {"DFT": DFT, "STFT": STFT}
