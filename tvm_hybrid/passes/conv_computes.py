"""The TE computes convolutions become on the GEMM engine (``conv_gemm.py`` emits them).

:func:`im2col` gathers the GEMM's left operand (a hand-scheduled kernel), :func:`direct_conv`
is the batch-reduce GEMM over the taps that ``schedules/conv_template.py`` schedules (weights
packed by :func:`pack_conv_weight`), :func:`col2im` sums a transposed convolution's taps and
:func:`depthwise_conv` is the depthwise convolution vectorised along the NHWC channels.
"""

from __future__ import annotations

import ast

import numpy as np
from tvm import te, tirx
from tvm.script import tirx as T

from ..schedules.conv_template import DIRECT_CONV_BLOCK
from .relax_rewrite import is_op

IM2COL = "hybrid_im2col"
#: The attribute of an :func:`im2col` PrimFunc holding its arguments (to re-emit it padded).
IM2COL_ARGS = "hybrid.im2col_args"
DIRECT_CONV = "hybrid_direct_conv"
#: The block (and kernel) of :func:`phase_split`, a strided direct convolution's input.
PHASE_SPLIT = "hybrid_phase_split"
COL2IM = "hybrid_col2im"
DEPTHWISE = "hybrid_depthwise_conv"
#: The block a :func:`depthwise_conv` computes in (the profile report names its kernel by it).
DEPTHWISE_BLOCK = "depthwise"
#: TVM's OpPatternKind kOutEWiseFusable (what the hand-written im2col declares itself).
OUT_ELEMWISE_FUSABLE = 4


def im2col(x_shape: tuple[int, int, int, int], kernel: tuple[int, int],
           strides: tuple[int, int], padding: tuple[int, int, int, int],
           dilation: tuple[int, int], out_hw: tuple[int, int], dtype: str = "float32",
           fill: float | int = 0, extra_columns: int = 0, extra_rows: int = 0) -> tirx.PrimFunc:
    """The PrimFunc ``x[N, H, W, C]`` to ``X_col[N * OH * OW, KH * KW * C]`` (``fill``, zero
    by default, in the padding).

    Channels are innermost on both sides, so each row is ``KH * KW`` contiguous copies of
    ``C`` values: scheduled here, parallel over rows, the source pixel computed once per tap
    and copied along ``c`` (vectorised), not once per element with divisions. An integer
    convolution's 8-bit data is padded with its zero point (``fill``), and its rows get
    ``extra_columns`` more of it, so ``K`` is a whole number of the integer kernel's groups
    (times zero rows of the weight). ``extra_rows`` rows of ``fill`` follow the
    ``N * OH * OW`` rows, so that a better register tile divides the GEMM's rows
    (:func:`im2col_padding_rows`; the GEMM slices their results off).
    """
    n, h, w, c = x_shape
    kh, kw = kernel
    oh, ow = out_hw
    sh, sw = strides
    dh, dw = dilation
    top, left = padding[0], padding[1]
    zero = tirx.const(fill, dtype)
    k = kh * kw * c

    # int64 extents, as Relax's: FuseTIR compares a fused kernel's buffers with the Relax
    # tensors' types, and int32 ones failed the compile where a cast fused into the im2col
    # (precision="bf16": "Inconsistent buffers cols and lv mapped to the same relax var").
    i64 = T.int64
    rows, width = n * oh * ow, k + extra_columns

    @T.prim_func(private=True, s_tir=True)
    def func(x: T.Buffer((i64(n), i64(h), i64(w), i64(c)), dtype),
             cols: T.Buffer((i64(rows + extra_rows), i64(width)), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True,
                     "op_pattern": OUT_ELEMWISE_FUSABLE})
        with T.sblock("root"):
            T.reads(x[0:i64(n), 0:i64(h), 0:i64(w), 0:i64(c)])
            T.writes(cols[0:i64(rows + extra_rows), 0:i64(width)])
            for row in T.parallel(i64(rows)):
                for ky, kx in T.grid(i64(kh), i64(kw)):
                    if ((row // ow) % oh * sh + ky * dh >= top
                            and (row // ow) % oh * sh + ky * dh < h + top
                            and row % ow * sw + kx * dw >= left
                            and row % ow * sw + kx * dw < w + left):
                        for ch in T.vectorized(i64(c)):
                            cols[row, (ky * kw + kx) * c + ch] = x[
                                row // (oh * ow), (row // ow) % oh * sh + ky * dh - top,
                                row % ow * sw + kx * dw - left, ch]
                    else:
                        for ch in T.vectorized(i64(c)):
                            cols[row, (ky * kw + kx) * c + ch] = zero
                for e in T.serial(i64(extra_columns)):
                    cols[row, k + e] = zero
            for row, e in T.grid(i64(extra_rows), i64(width)):
                cols[rows + row, e] = zero

    if not isinstance(fill, (int, float, np.number)) or not np.isfinite(fill) or extra_rows:
        return func  # (only an unpadded im2col of a constant, finite fill can be re-emitted)
    args = (*(tuple(int(v) for v in a) for a in (x_shape, kernel, strides, padding, dilation,
                                                 out_hw)),
            str(dtype), int(fill) if "int" in str(dtype) else float(fill), int(extra_columns))
    return func.with_attr(IM2COL_ARGS, repr(args))


def im2col_padding_rows(func: tirx.PrimFunc, extra_rows: int) -> tirx.PrimFunc | None:
    """:func:`im2col` ``func`` again with ``extra_rows`` rows of its fill appended, or None when
    ``func`` is not an unpadded one (no :data:`IM2COL_ARGS` attribute: a padded im2col, or one
    whose fill is not a finite constant, is not re-emitted).

    The GEMM on an im2col's output may want more rows than the convolution has pixels (a
    prime count such as 13 x 13 = 169 leaves only thin tiles, ``heuristics.padded_rows``); a
    padding op after a hand-written kernel cannot share its buffer (FuseTIR), so the im2col
    writes the padded rows itself.
    """
    attrs = func.attrs
    if attrs is None or IM2COL_ARGS not in attrs:
        return None
    return im2col(*ast.literal_eval(str(attrs[IM2COL_ARGS])), extra_rows=extra_rows)


def pack_conv_weight(w: np.ndarray, nr: int) -> np.ndarray:
    """OHWI ``w[O, KH, KW, C]`` to ``W[ceil(O / nr), KH, KW, C, nr]`` (zero-padded channels):
    for each panel of ``nr`` output channels and each tap, the ``C x nr`` matrix the
    microkernel streams, contiguous."""
    o, kh, kw, c = w.shape
    panels = -(-o // nr)
    padded = np.zeros((panels * nr, kh, kw, c), w.dtype)
    padded[:o] = w
    return np.ascontiguousarray(padded.reshape(panels, nr, kh, kw, c).transpose(0, 2, 3, 4, 1))


def pack_grouped_conv_weight(w: np.ndarray, groups: int, nr: int) -> np.ndarray:
    """OHWI ``w[G * Og, KH, KW, Cg]`` of a grouped convolution to
    ``W[G, ceil(Og / nr), KH, KW, Cg, nr]``: :func:`pack_conv_weight` per group."""
    per_group = w.shape[0] // groups
    return np.stack([pack_conv_weight(w[g * per_group:(g + 1) * per_group], nr)
                     for g in range(groups)])


def phase_split(x: te.Tensor, padding: tuple[int, int, int, int], stride: int) -> te.Tensor:
    """NHWC ``x`` zero-padded by ``(top, left, bottom, right)`` with its columns dealt into
    ``stride`` phases: ``Xs[n, y, p, q, c] = Xp[n, y, q * stride + p, c]`` (``Xp`` the padded
    input, zero past its width). A convolution of column stride ``stride`` reads, for one tap,
    the pixels ``x * stride + kx`` of an output row's ``x``: in ``Xs`` they are consecutive
    (phase ``kx % stride``, from ``q = x + kx // stride``), an ``mr x C`` matrix of leading
    dimension ``C`` that the microkernel reads in place, as in a stride-1 convolution. The
    copy replaces the padding's (the same bytes), not im2col's ``KH * KW / stride**2`` times
    the input."""
    n, h, w, c = (int(d) for d in x.shape)
    top, left, bottom, right = padding
    width = -(-(left + w + right) // stride)

    def value(b, y, p, q, ch):
        col = q * stride + p - left
        inside = tirx.all(y >= top, y < h + top, col >= 0, col < w)
        return tirx.if_then_else(
            inside, x[b, tirx.min(tirx.max(y - top, 0), h - 1),
                      tirx.min(tirx.max(col, 0), w - 1), ch], tirx.const(0, x.dtype))

    return te.compute((n, top + h + bottom, stride, width, c), value, name=PHASE_SPLIT)


def direct_conv(xp: te.Tensor, packed: te.Tensor, dilation: tuple[int, int],
                out_hw: tuple[int, int], channels: int,
                strides: tuple[int, int] = (1, 1)) -> te.Tensor:
    """The NHWC convolution of the padded ``xp[N, H, W, C]`` (or, for a column stride over 1,
    :func:`phase_split`'s ``xp[N, H, stride, W', C]``) by :func:`pack_conv_weight`'s
    ``packed``, ``channels`` outputs: the direct template's compute
    (``schedules/conv_template.py``)."""
    panels, kh, kw, c, nr = (int(d) for d in packed.shape)
    (sh, sw), (dh, dw) = strides, dilation
    if (len(xp.shape) == 5) != (sw > 1):
        raise ValueError(f"direct_conv: column stride {sw} needs a phase-split input "
                         f"(5-d) exactly when over 1; got {len(xp.shape)}-d")
    ky = te.reduce_axis((0, kh), name="ky")
    kx = te.reduce_axis((0, kw), name="kx")
    rc = te.reduce_axis((0, c), name="rc")

    def pixel(b, y, x):
        if sw == 1:
            return xp[b, y * sh + ky * dh, x + kx * dw, rc]
        return xp[b, y * sh + ky * dh, kx * dw % sw, x + kx * dw // sw, rc]

    out = te.compute(
        (int(xp.shape[0]), *out_hw, panels * nr),
        lambda b, y, x, o: te.sum(
            pixel(b, y, x) * packed[o // nr, ky, kx, rc, o % nr], axis=[ky, kx, rc]),
        name=DIRECT_CONV_BLOCK)
    if panels * nr == channels:
        return out
    return te.compute((int(xp.shape[0]), *out_hw, channels), lambda *i: out[i], name="unpad")


def grouped_direct_conv(xp: te.Tensor, packed: te.Tensor, dilation: tuple[int, int],
                        out_hw: tuple[int, int], channels: int,
                        width: int | None = None) -> te.Tensor:
    """The stride-1 NHWC convolution of the padded ``xp[N, H, W, G * Cg]`` in ``G`` groups by
    :func:`pack_grouped_conv_weight`'s ``packed``, ``channels`` outputs per group, as
    ``Y[N, OH, OW, G, channels]`` (reshaped, the NHWC output: no concatenation): the direct
    template's compute with a group axis, each group's ``mr x Cg`` input rows read in place
    (leading dimension ``G * Cg``). With ``width`` the output keeps only that many of the
    ``OW`` pixels of a row computed (rows padded to whole tiles)."""
    groups, panels, kh, kw, c, nr = (int(d) for d in packed.shape)
    ky = te.reduce_axis((0, kh), name="ky")
    kx = te.reduce_axis((0, kw), name="kx")
    rc = te.reduce_axis((0, c), name="rc")
    out = te.compute(
        (int(xp.shape[0]), *out_hw, groups, panels * nr),
        lambda b, y, x, g, o: te.sum(
            xp[b, y + ky * dilation[0], x + kx * dilation[1], g * c + rc]
            * packed[g, o // nr, ky, kx, rc, o % nr], axis=[ky, kx, rc]),
        name=DIRECT_CONV_BLOCK)
    width = out_hw[1] if width is None else width
    if panels * nr == channels and width == out_hw[1]:
        return out
    return te.compute((int(xp.shape[0]), out_hw[0], width, groups, channels),
                      lambda *i: out[i], name="unpad")


def is_grouped_conv(value) -> bool:
    """Whether the Relax expression ``value`` calls a :func:`grouped_direct_conv` kernel
    (output ``[N, OH, OW, G, Og]``)."""
    return (is_op(value, "relax.call_tir") and value.args[0].name_hint.startswith(DIRECT_CONV)
            and value.ty.ndim == 5)


def col2im(cols: te.Tensor, batch: int, in_hw: tuple[int, int], kernel: tuple[int, int],
           out_channels: int, strides: tuple[int, int], padding: tuple[int, int],
           dilation: tuple[int, int], out_hw: tuple[int, int]) -> te.Tensor:
    """The transposed convolution's output ``Y[N, O, OH, OW]`` from the GEMM's
    ``cols[N * H * W, KH * KW * O]``: each output pixel sums the (at most ``KH * KW``) taps
    whose input pixel lands on it (an injective kernel: the taps are unrolled)."""
    h, w = in_hw
    kh, kw = kernel
    if ((kh, kw) == tuple(strides) and not any(padding) and tuple(dilation) == (1, 1)
            and tuple(out_hw) == (h * kh, w * kw)):
        # No overlap (DBNet's 2x2 stride-2 upsampling): one tap per output pixel, a pure
        # rearrangement without a bounds test per tap.
        return te.compute(
            (batch, out_channels, *out_hw),
            lambda b, o, oy, ox: cols[(b * h + oy // kh) * w + ox // kw,
                                      ((oy % kh) * kw + ox % kw) * out_channels + o],
            name="col2im")

    def value(b, o, oy, ox):
        total = tirx.const(0.0, cols.dtype)
        for ky in range(kh):
            for kx in range(kw):
                ny = oy + padding[0] - ky * dilation[0]
                nx = ox + padding[1] - kx * dilation[1]
                iy, ix = ny // strides[0], nx // strides[1]
                hit = tirx.all(ny >= 0, nx >= 0, ny % strides[0] == 0, nx % strides[1] == 0,
                               iy < h, ix < w)
                row = (b * h + tirx.min(iy, h - 1)) * w + tirx.min(ix, w - 1)
                col = (ky * kw + kx) * out_channels + o
                total = total + tirx.if_then_else(hit, cols[tirx.max(row, 0), col],
                                                  tirx.const(0.0, cols.dtype))
        return total

    return te.compute((batch, out_channels, *out_hw), value, name="col2im")


def depthwise_conv(x: te.Tensor, weight: te.Tensor, strides: tuple[int, int],
                   dilation: tuple[int, int], out_hw: tuple[int, int],
                   padding: tuple[int, int, int, int] = (0, 0, 0, 0)) -> te.Tensor:
    """NHWC depthwise convolution of ``x[N, H, W, C]``, zero-padded by ``padding`` (top,
    left, bottom, right), by ``weight[KH, KW, C]``: each output element sums its ``KH * KW``
    taps, unrolled (an injective kernel, vectorised along the contiguous channels, with the
    bias and activation after it fused in).

    A tap in the padding reads ``x`` at its index clamped into the input and selects zero
    (``Select``, no branch): every load stays in bounds, the loads of one input column are
    the same expression for every pixel of a register block that reads it, and no padded copy
    of ``x`` is written. (The 3x3 HardSwish kernel of a 200x152x64 map, 2-core Emerald
    Rapids VM: 0.54 ms on a padded input, 0.86 ms with a bounds test per tap as
    ``if_then_else``, a branch around each load, 0.69 ms with the select; the padding kernel
    it saves costs more where it cannot fuse into its producer: see ``conv_gemm.py``.)"""
    kh, kw, _ = (int(d) for d in weight.shape)
    _, height, width, _ = (int(d) for d in x.shape)
    top, left = padding[0], padding[1]
    zero = tirx.const(0.0, x.dtype)

    def padded_tap(b, iy, ix, c):
        iy, ix = iy - top, ix - left
        inside = tirx.all(iy >= 0, iy < height, ix >= 0, ix < width)
        clamped = x[b, tirx.max(tirx.min(iy, height - 1), 0),
                    tirx.max(tirx.min(ix, width - 1), 0), c]
        return tirx.Select(inside, clamped, zero)

    tap = padded_tap if any(padding) else (lambda b, iy, ix, c: x[b, iy, ix, c])

    def value(b, oy, ox, c):
        total = zero
        for ky in range(kh):
            for kx in range(kw):
                total = total + tap(b, oy * strides[0] + ky * dilation[0],
                                    ox * strides[1] + kx * dilation[1], c) * weight[ky, kx, c]
        return total

    return te.compute((int(x.shape[0]), *out_hw, int(x.shape[3])), value, name=DEPTHWISE_BLOCK)
