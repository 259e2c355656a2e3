"""ONNX ``Resize`` where TVM's converter computes a different answer than the specification.

TVM 0.27's converter turns ``scales`` into output sizes and then interpolates with the ratio of
the sizes, while the specification maps coordinates with the given scale: where ``in * scale``
is not a whole number (a 0.6 downscale of 4 pixels to 2, a 0.5 downscale of an odd size) every
output pixel is interpolated at the wrong place. It also ignores ``antialias``, and fails on
``axes``, ``keep_aspect_ratio_policy`` and ``half_pixel_symmetric``. Those nodes are converted
here; the others (the common whole-number upsampling, ``sizes``) keep TVM's converter and its
resize kernels.

Interpolation along one axis is linear in the input, so each resized axis is a constant
``[out, in]`` matrix built at compile time by :func:`interpolation_matrix` (the coordinate
modes, coefficients, neighbour choice, edge clamping and ``exclude_outside`` of ONNX's
reference implementation, which is separable the same way): a ``take`` of one source index
per output where the matrix is a selection (nearest), a product with it otherwise; the
``tf_crop_and_resize`` outputs whose source lies outside the input get ``extrapolation_value``.
Opset 10's ``Resize`` (``X, scales``, asymmetric coordinates, which TVM read as a region of
interest and failed on) takes the same path, and so does

* ``Upsample`` (opsets 7-9, deprecated since 10 but in older detectors): TVM's converter
  reads only opset 7's ``scales`` attribute (opset 9's input failed) and rounds nearest source
  pixels to the closest where the specification takes the floor. Here: whole-number nearest
  scales repeat elements along their axes (any rank); other scales resize as opset 10's
  ``Resize`` does (asymmetric coordinates with the given scale, ``floor`` for nearest).
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter
from tvm.relax.frontend.onnx.onnx_frontend import Resize as _StockResize

from ..errors import UnsupportedModelError
from .static_dims import constant_operand, static_dims

_MODES = ("nearest", "linear", "cubic")
_COORDINATES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                "asymmetric", "tf_crop_and_resize")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
#: The largest interpolation matrix built (elements; 128 MiB of float64).
MAX_MATRIX_ELEMENTS = 1 << 24


def _text(attr: dict, name: str, default: str) -> str:
    value = attr.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _coefficient_function(mode: str, nearest_mode: str, cubic_a: float, antialias: bool):
    """``(ratio, scale) -> weights`` of the neighbours, as ONNX's reference has them."""
    if mode == "nearest":
        def nearest(ratio, _scale):
            if float(ratio).is_integer():
                return np.array([0.0, 1.0])
            return np.array({"round_prefer_floor": [ratio <= 0.5, ratio > 0.5],
                             "round_prefer_ceil": [ratio < 0.5, ratio >= 0.5],
                             "floor": [1, 0], "ceil": [0, 1]}[nearest_mode], float)
        return nearest
    if mode == "linear" and not antialias:
        return lambda ratio, _scale: np.array([1.0 - ratio, ratio])
    if mode == "linear":
        def linear_antialias(ratio, scale):
            scale = min(scale, 1.0)
            start = int(np.floor(-1 / scale) + 1)
            args = (np.arange(start, 2 - start) - ratio) * scale
            weights = np.clip(1 - np.abs(args), 0, 1)
            return weights / weights.sum()
        return linear_antialias
    a = cubic_a

    def cubic_weight(x):
        x = abs(x)
        if x <= 1:
            return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
        return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a if x < 2 else 0.0

    if not antialias:
        return lambda ratio, _scale: np.array([cubic_weight(ratio + 1), cubic_weight(ratio),
                                               cubic_weight(1 - ratio), cubic_weight(2 - ratio)])

    def cubic_antialias(ratio, scale):
        scale = min(scale, 1.0)
        start = int(np.floor(-2 / scale) + 1)
        weights = np.array([cubic_weight(scale * (i - ratio)) for i in range(start, 2 - start)])
        return weights / weights.sum()
    return cubic_antialias


def _source_coordinates(coord: str, out: int, size: int, scale: float, roi) -> tuple:
    """Each output index's source coordinate, and which lie outside (``tf_crop_and_resize``)."""
    y = np.arange(out, dtype=np.float64)
    width = scale * size
    outside = None
    if coord == "align_corners":
        x = np.zeros(out) if width == 1 else y * (size - 1) / (width - 1)
    elif coord == "asymmetric":
        x = y / scale
    elif coord == "tf_crop_and_resize":
        start, end = roi
        x = (np.full(out, (end - start) * (size - 1) / 2) if width == 1
             else y * (end - start) * (size - 1) / (width - 1)) + start * (size - 1)
        outside = (x < 0) | (x > size - 1)
    elif coord == "pytorch_half_pixel":
        x = np.full(out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
    elif coord == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    else:  # half_pixel_symmetric
        x = size / 2 * (1 - out / width) + (y + 0.5) / scale - 0.5
    return x, outside


def interpolation_matrix(size: int, out: int, scale: float, mode: str = "nearest",
                         coord: str = "half_pixel", nearest_mode: str = "round_prefer_floor",
                         cubic_a: float = -0.75, exclude_outside: bool = False,
                         antialias: bool = False, roi=(0.0, 1.0)) -> tuple:
    """The ``[out, size]`` matrix (float64) of one axis's interpolation and the outputs whose
    source lies outside the input (None unless ``tf_crop_and_resize`` finds some)."""
    weights_of = _coefficient_function(mode, nearest_mode, cubic_a, antialias)
    x, outside = _source_coordinates(coord, out, size, scale, roi)
    floor = np.floor(x).astype(np.int64)
    ratios = np.where(x == floor, 1.0, x - floor)
    weights = np.stack([np.asarray(weights_of(float(r), scale), np.float64) for r in ratios])
    n = weights.shape[1]
    # The n neighbours nearest x, ties to the smaller index, in edge-padded coordinates.
    pad = int(np.ceil(n / 2))
    padded = x + pad
    p = np.floor(padded).astype(np.int64)
    frac = padded - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        offset = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    neighbours = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        weights = np.where((neighbours < 0) | (neighbours >= size), 0.0, weights)
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    matrix = np.zeros((out, size))
    np.add.at(matrix, (np.repeat(np.arange(out), n), np.clip(neighbours, 0, size - 1).ravel()),
              weights.ravel())
    if outside is not None and outside.any():
        matrix[outside] = 0.0
        return matrix, outside
    return matrix, None


def _plan(dims: list[int], scales, sizes, axes, roi, policy: str) -> list[tuple]:
    """Per axis: (scale, output size, roi pair), as the reference's ``_interpolate_nd``."""
    rank = len(dims)
    axes = list(range(rank)) if axes is None else [a + rank if a < 0 else a for a in axes]
    full_roi = [0.0] * rank + [1.0] * rank
    if roi is not None and len(roi):
        for i, a in enumerate(axes):
            full_roi[a], full_roi[rank + a] = float(roi[i]), float(roi[len(axes) + i])
    if sizes is not None:
        out = list(dims)
        for i, a in enumerate(axes):
            out[a] = int(sizes[i])
        factors = [out[i] / dims[i] for i in range(rank)]
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            shared = pick(factors[a] for a in axes)
            factors = [shared if i in axes else 1.0 for i in range(rank)]
            out = [int(shared * dims[i] + 0.5) if i in axes else dims[i] for i in range(rank)]
    else:
        factors = [1.0] * rank
        for i, a in enumerate(axes):
            factors[a] = float(scales[i])
        out = [int(f * d) for f, d in zip(factors, dims)]
    return [(factors[a], out[a], (full_roi[a], full_roi[rank + a])) for a in range(rank)]


def _constant(value, params, what: str, node: str):
    data = constant_operand(value, params, what, node)
    return data if data is not None and data.size else None


class Resize(OnnxOpConverter):
    """ONNX ``Resize`` (opsets 10 to 19): TVM's converter where it is right, else the
    interpolation matrices (module docstring)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        attr = {**attr, "coordinate_transformation_mode": "asymmetric",
                "nearest_mode": "floor"}
        return cls.convert(bb, [inputs[0], None, inputs[1], None], attr, params, stock=False)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls.convert(bb, list(inputs) + [None] * (4 - len(inputs)), attr, params)

    @classmethod
    def convert(cls, bb, inputs, attr, params, stock: bool = True):
        """The conversion of a node with these ``inputs`` (``X, roi, scales, sizes``) and
        attributes; ``stock=False`` never uses TVM's converter (opset 10, ``Upsample``)."""
        node = f"Resize node {attr.get('tvm_custom', {}).get('name', '')!r}"
        x = inputs[0]
        dims = static_dims(x, "input", node)
        mode = _text(attr, "mode", "nearest")
        coord = _text(attr, "coordinate_transformation_mode", "half_pixel")
        nearest_mode = _text(attr, "nearest_mode", "round_prefer_floor")
        policy = _text(attr, "keep_aspect_ratio_policy", "stretch")
        antialias = bool(attr.get("antialias", 0))
        axes = attr.get("axes")
        if mode not in _MODES or coord not in _COORDINATES or nearest_mode not in _NEAREST or \
                policy not in ("stretch", "not_larger", "not_smaller"):
            raise UnsupportedModelError(f"{node}: mode {mode!r}, coordinate transformation "
                                        f"{coord!r}, nearest mode {nearest_mode!r}, policy "
                                        f"{policy!r}: not in the specification")
        roi = _constant(inputs[1], params, "roi", node)
        scales = _constant(inputs[2], params, "scales", node)
        sizes = _constant(inputs[3], params, "sizes", node)
        if (scales is None) == (sizes is None):
            raise UnsupportedModelError(f"{node}: exactly one of scales and sizes must be given")
        plan = _plan(dims, None if scales is None else scales.reshape(-1).tolist(),
                              None if sizes is None else sizes.reshape(-1).tolist(), axes,
                              None if roi is None else roi.reshape(-1).tolist(), policy)
        moved = [a for a, (scale, out, window) in enumerate(plan)
                 if not (math.isclose(scale, 1.0) and out == dims[a]
                         and window == (0.0, 1.0))]
        # TVM interpolates with the ratio of the sizes: right for sizes, and for scales that
        # give whole sizes.
        exact = sizes is not None or all(out == scale * dims[a]
                                         for a, (scale, out, _) in enumerate(plan))
        # TVM's kernels where they were checked right (a fuzzer against ONNX's reference found
        # wrong values or a division by zero with spatial sizes of 1, cubic exclude_outside,
        # tf_crop_and_resize and 3-d or 5-d inputs): 4-d inputs, NCHW's spatial axes only.
        spatial = [dims[a] for a in (2, 3)] + [plan[a][1] for a in (2, 3)] if len(dims) == 4 \
            else []
        if stock and not antialias and axes is None and policy == "stretch" and exact and \
                coord not in ("half_pixel_symmetric", "tf_crop_and_resize") and spatial and \
                min(spatial) > 1 and not set(moved) & {0, 1} and \
                not (mode == "cubic" and attr.get("exclude_outside", 0)):
            return _StockResize._impl_v18(bb, inputs, attr, params)
        dtype = str(x.ty.dtype)
        if dtype not in ("float32", "float16", "float64", "bfloat16"):
            raise UnsupportedModelError(f"{node}: resizing {dtype} data with these attributes "
                                        "is not supported (float types are)")
        compute = "float64" if dtype == "float64" else "float32"
        y = bb.emit(relax.op.astype(x, compute)) if dtype != compute else x
        kept = np.ones([1] * len(dims), bool)
        for a in moved:
            scale, out, window = plan[a]
            if out < 1:
                raise UnsupportedModelError(f"{node}: scale {scale} leaves axis {a} of "
                                            f"{dims[a]} elements empty")
            if out * dims[a] > MAX_MATRIX_ELEMENTS:
                raise UnsupportedModelError(f"{node}: resizing axis {a} from {dims[a]} to {out} "
                                            f"needs a {out}x{dims[a]} interpolation matrix; at "
                                            f"most {MAX_MATRIX_ELEMENTS} elements are supported")
            matrix, outside = interpolation_matrix(
                dims[a], out, scale, mode, coord, nearest_mode,
                float(attr.get("cubic_coeff_a", -0.75)), bool(attr.get("exclude_outside", 0)),
                antialias, window)
            y = _apply(bb, y, matrix, a, len(dims), compute)
            if outside is not None:
                shape = [1] * len(dims)
                shape[a] = out
                kept = kept & ~outside.reshape(shape)
        fill = float(attr.get("extrapolation_value", 0.0))
        if not kept.all() and fill != 0.0:
            y = bb.emit(relax.op.add(y, relax.const((~kept * fill).astype(compute), compute)))
        return bb.emit(relax.op.astype(y, dtype)) if dtype != compute else y


def _apply(bb, y: relax.Expr, matrix: np.ndarray, axis: int, rank: int, dtype: str):
    """``y`` interpolated along ``axis`` by ``matrix`` (``[out, in]``): a ``take`` where each
    output copies one input, else a product."""
    ones = (matrix == 1.0).sum(axis=1) == 1
    if ones.all() and ((matrix == 0.0) | (matrix == 1.0)).all():
        source = matrix.argmax(axis=1).astype("int64")
        return bb.emit(relax.op.take(y, relax.const(source, "int64"), axis=axis))
    last = rank - 1
    perm = list(range(rank))
    perm[axis], perm[last] = last, axis
    moved = bb.emit(relax.op.permute_dims(y, perm)) if axis != last else y
    product = bb.emit(relax.op.matmul(moved, relax.const(matrix.T.astype(dtype), dtype)))
    return bb.emit(relax.op.permute_dims(product, perm)) if axis != last else product


class Upsample(OnnxOpConverter):
    """ONNX ``Upsample`` (opsets 7 and 9): ``out[i] = x[floor(i / scale)]`` for ``nearest``,
    asymmetric linear interpolation for ``linear``."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return cls._upsample(bb, inputs[0], [float(v) for v in attr.get("scales", [])], attr,
                             params)

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        node = f"Upsample node {attr.get('tvm_custom', {}).get('name', '')!r}"
        values = constant_operand(inputs[1], params, "scales", node).astype(
            "float64").reshape(-1).tolist()
        return cls._upsample(bb, inputs[0], values, attr, params)

    @classmethod
    def _upsample(cls, bb, x, scales, attr, params):
        name = attr.get("tvm_custom", {}).get("name", "")
        mode = attr.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        shape = [int(d) for d in x.ty.shape]
        if len(scales) != len(shape) or mode not in ("nearest", "linear"):
            raise UnsupportedModelError(f"Upsample node {name!r}: mode {mode!r} with scales "
                                        f"{scales} on an input of shape {shape} is not "
                                        "supported (nearest or linear, a scale per axis)")
        if mode == "nearest" and all(s == int(s) and s >= 1 for s in scales):
            for axis, scale in enumerate(scales):
                if scale != 1:
                    x = bb.emit(relax.op.repeat(x, int(scale), axis=axis))
            return x
        # Opset 10's Resize is this op renamed: asymmetric coordinates, the floor for nearest.
        resize_attr = {**attr, "mode": mode, "coordinate_transformation_mode": "asymmetric",
                       "nearest_mode": "floor"}
        scales_const = relax.const(np.array(scales, np.float32), "float32")
        return Resize.convert(bb, [x, None, scales_const, None], resize_attr, params,
                              stock=False)


CONVERTERS = {"Resize": Resize, "Upsample": Upsample}
