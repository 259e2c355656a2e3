"""``ConvToGemm``: fp32 convolutions with constant weights onto the GEMM engine.

Convolutions first move to NHWC activations and OHWI weights (TVM's ``ConvertLayout``, which
carries the layout through elementwise ops and puts one layout change at each end of a conv
chain). Then ``conv2d(x[N, H, W, C], W[O, KH, KW, C])`` with one group is the GEMM

    Y[(n, oh, ow), o] = sum_{(kh, kw, c)} X_col[(n, oh, ow), (kh, kw, c)] * W_mat[(kh, kw, c), o]

with ``X_col`` gathered from ``x`` (zero outside the padding; ``x`` itself, reshaped, for a
1x1, stride-1, unpadded convolution) and ``W_mat = W.reshape(O, -1).T`` a constant, which
``PrepackConstantWeights`` packs for the microkernel like any GEMM weight. ``Y`` reshaped is
the NHWC output, so the bias and activation after it fuse as the GEMM's epilogue.

A stride-1 convolution whose output rows a microkernel tiles skips ``X_col`` (``KH * KW``
times the input, written and read back): :func:`direct_conv` on the zero-padded input, which
``schedules/conv_template.py`` schedules as a batch-reduce GEMM over the taps with the
weights packed here (:func:`pack_conv_weight`).

TVM's own conv2d lowering runs at about 1% of the FMA peak on the fallback schedule; this puts
dense convolutions on the template. A depthwise convolution (no reduction across channels
worth a GEMM) becomes :func:`depthwise_conv`, an injective kernel vectorised along the NHWC
channels; other grouped convolutions keep TVM's lowering.

A transposed convolution (NCHW, one group) is the GEMM of every input pixel by
``W[C, (KH, KW, O)]`` followed by :func:`col2im`, which sums the taps landing on each output
pixel (without overlap, ``KH == stride``, a pure rearrangement).
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T
from tvm.target import Target

from ..errors import first_line
from ..microkernels import microkernels_for
from ..schedules.conv_template import DIRECT_CONV_BLOCK, choose_conv_kernel
from ..schedules.gemm.heuristics import panel_width
from .relax_rewrite import (
    bound_value,
    constant_value,
    is_op,
    is_static_tensor,
    rewrite_functions,
)

IM2COL = "hybrid_im2col"
DIRECT_CONV = "hybrid_direct_conv"
COL2IM = "hybrid_col2im"
DEPTHWISE = "hybrid_depthwise_conv"
_OUT_ELEMWISE_FUSABLE = 4  # TVM's OpPatternKind kOutEWiseFusable
#: Transposed and depthwise convolutions with more taps than this keep TVM's lowering (their
#: kernels unroll the taps).
_MAX_TAPS = 25
_NHWC = ("NHWC", "OHWI", "NHWC")
#: Fewer input channels than this per tap keep im2col (the microkernel's K would be too short).
_MIN_DIRECT_DEPTH = 8
_NCHW = ("NCHW", "OIHW", "NCHW")

#: What ``ConvertLayout`` is asked for; transposed convolutions stay NCHW (the only layout
#: TVM legalizes for them).
_LAYOUTS = {"relax.nn.conv2d": ["NHWC", "OHWI"],
            "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}

logger = logging.getLogger(__name__)


def im2col(x_shape: tuple[int, int, int, int], kernel: tuple[int, int],
           strides: tuple[int, int], padding: tuple[int, int, int, int],
           dilation: tuple[int, int], out_hw: tuple[int, int]) -> tirx.PrimFunc:
    """The PrimFunc ``x[N, H, W, C]`` to ``X_col[N * OH * OW, KH * KW * C]`` (zero in the
    padding).

    Channels are innermost on both sides, so each row is ``KH * KW`` contiguous copies of
    ``C`` values: scheduled here, parallel over rows, the source pixel computed once per tap
    and copied along ``c`` (vectorised), not once per element with divisions.
    """
    n, h, w, c = x_shape
    kh, kw = kernel
    oh, ow = out_hw
    sh, sw = strides
    dh, dw = dilation
    top, left = padding[0], padding[1]
    zero = tirx.const(0.0, "float32")

    @T.prim_func(private=True, s_tir=True)
    def func(x: T.Buffer((n, h, w, c), "float32"),
             cols: T.Buffer((n * oh * ow, kh * kw * c), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True,
                     "op_pattern": _OUT_ELEMWISE_FUSABLE})
        with T.sblock("root"):
            T.reads(x[0:n, 0:h, 0:w, 0:c])
            T.writes(cols[0:n * oh * ow, 0:kh * kw * c])
            for row in T.parallel(n * oh * ow):
                for ky, kx in T.grid(kh, kw):
                    if ((row // ow) % oh * sh + ky * dh >= top
                            and (row // ow) % oh * sh + ky * dh < h + top
                            and row % ow * sw + kx * dw >= left
                            and row % ow * sw + kx * dw < w + left):
                        for ch in T.vectorized(c):
                            cols[row, (ky * kw + kx) * c + ch] = x[
                                row // (oh * ow), (row // ow) % oh * sh + ky * dh - top,
                                row % ow * sw + kx * dw - left, ch]
                    else:
                        for ch in T.vectorized(c):
                            cols[row, (ky * kw + kx) * c + ch] = zero

    return func


def pack_conv_weight(w: np.ndarray, nr: int) -> np.ndarray:
    """OHWI ``w[O, KH, KW, C]`` to ``W[ceil(O / nr), KH, KW, C, nr]`` (zero-padded channels):
    for each panel of ``nr`` output channels and each tap, the ``C x nr`` matrix the
    microkernel streams, contiguous."""
    o, kh, kw, c = w.shape
    panels = -(-o // nr)
    padded = np.zeros((panels * nr, kh, kw, c), w.dtype)
    padded[:o] = w
    return np.ascontiguousarray(padded.reshape(panels, nr, kh, kw, c).transpose(0, 2, 3, 4, 1))


def direct_conv(xp: te.Tensor, packed: te.Tensor, dilation: tuple[int, int],
                out_hw: tuple[int, int], channels: int) -> te.Tensor:
    """The stride-1 NHWC convolution of the padded ``xp[N, H, W, C]`` by
    :func:`pack_conv_weight`'s ``packed``, ``channels`` outputs: the direct template's compute
    (``schedules/conv_template.py``)."""
    panels, kh, kw, c, nr = (int(d) for d in packed.shape)
    ky = te.reduce_axis((0, kh), name="ky")
    kx = te.reduce_axis((0, kw), name="kx")
    rc = te.reduce_axis((0, c), name="rc")
    out = te.compute(
        (int(xp.shape[0]), *out_hw, panels * nr),
        lambda b, y, x, o: te.sum(
            xp[b, y + ky * dilation[0], x + kx * dilation[1], rc]
            * packed[o // nr, ky, kx, rc, o % nr], axis=[ky, kx, rc]),
        name=DIRECT_CONV_BLOCK)
    if panels * nr == channels:
        return out
    return te.compute((int(xp.shape[0]), *out_hw, channels), lambda *i: out[i], name="unpad")


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
                   dilation: tuple[int, int], out_hw: tuple[int, int]) -> te.Tensor:
    """NHWC depthwise convolution of the (already padded) ``x[N, H, W, C]`` by
    ``weight[KH, KW, C]``: each output element sums its ``KH * KW`` taps, unrolled (an
    injective kernel, vectorised along the contiguous channels, with the bias and activation
    after it fused in)."""
    kh, kw, _ = (int(d) for d in weight.shape)

    def value(b, oy, ox, c):
        total = tirx.const(0.0, x.dtype)
        for ky in range(kh):
            for kx in range(kw):
                tap = x[b, oy * strides[0] + ky * dilation[0], ox * strides[1] + kx * dilation[1],
                        c]
                total = total + tap * weight[ky, kx, c]
        return total

    return te.compute((int(x.shape[0]), *out_hw, int(x.shape[3])), value, name="depthwise")


@tvm.transform.module_pass(opt_level=0, name="ConvToGemm")
class ConvToGemm:
    """Rewrite fp32 ``conv2d`` with a constant weight and one group to im2col + GEMM."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # NHWC activations, OHWI weights: a 1x1 convolution's input is already the GEMM's
        # left operand, im2col copies whole channel vectors, the GEMM's output is the next
        # layer's input, and the layout changes stay at the ends of conv chains.
        # (TVM's pass cannot carry a layout through every op; then each convolution changes
        # layout on its own, below.) A 1-D convolution is first a 2-D one of height 1, and
        # ``clip`` (no layout rule in TVM: a transpose each side) is maximum and minimum.
        mod = rewrite_functions(mod, _Conv1dAs2d(mod))
        mod = rewrite_functions(mod, _LayoutFriendly(mod))
        try:
            mod = relax.transform.ConvertLayout(_LAYOUTS)(mod)
        except Exception as err:  # noqa: BLE001 - TVM raises its C++ check failures
            logger.debug("ConvertLayout failed (%s); NHWC per convolution", first_line(err))
        mod = relax.transform.FoldConstant()(mod)
        return rewrite_functions(mod, _Rewriter(mod, self.target), eliminate_dead_code=True)


def _four(padding) -> tuple[int, int, int, int]:
    """A conv2d's padding as ``(top, left, bottom, right)``."""
    pads = [int(p) for p in padding]
    return (pads[0], pads[1], pads[2], pads[3]) if len(pads) == 4 else \
        (pads[0], pads[1], pads[0], pads[1])


def _pair(values) -> tuple[int, int]:
    values = [int(v) for v in values]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def _fp32_operands(mutator: relax.PyExprMutator, call: relax.Call,
                   ndim: int) -> tuple[relax.Expr, np.ndarray] | None:
    """``(x, weight value)`` of a convolution whose input and output are static fp32 tensors of
    rank ``ndim`` and whose weight is an fp32 constant of that rank; None otherwise."""
    x, weight = call.args
    w = constant_value(mutator, weight)
    if (w is None or w.dtype != np.float32 or w.ndim != ndim
            or not is_static_tensor(x.ty, ("float32",), min_ndim=ndim)
            or not is_static_tensor(call.ty, ("float32",), min_ndim=ndim)):
        return None
    return x, w


@relax.expr_functor.mutator
class _Conv1dAs2d(relax.PyExprMutator):
    """``conv1d(x[N, C, W], w[O, C/g, KW])`` with a constant weight as
    ``squeeze(conv2d(x[N, C, 1, W], w[O, C/g, 1, KW]), 2)``."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.nn.conv1d"):
            return call
        attrs = call.attrs
        operands = _fp32_operands(self, call, ndim=3)
        if (str(attrs.data_layout) != "NCW" or str(attrs.kernel_layout) != "OIW"
                or str(attrs.out_layout) not in ("NCW", "") or operands is None):
            return call
        x, w = operands
        pads = [int(p) for p in attrs.padding]
        conv = relax.op.nn.conv2d(
            relax.op.expand_dims(x, 2), relax.const(np.ascontiguousarray(w[:, :, None, :])),
            strides=(1, int(attrs.strides[0])), padding=(0, pads[0], 0, pads[-1]),
            dilation=(1, int(attrs.dilation[0])), groups=int(attrs.groups))
        return relax.op.squeeze(self.builder_.emit(conv), [2])


@relax.expr_functor.mutator
class _LayoutFriendly(relax.PyExprMutator):
    """Forms ``ConvertLayout`` carries a layout through: float ``clip(x, lo, hi)`` as
    ``minimum(maximum(x, lo), hi)``, and a constant operand of an elementwise op with fewer
    axes than the other (``x + c[1]``, ``x * c[C, 1, 1]`` as exporters write them) as a scalar
    or at the other's rank (TVM's layout rule keeps such a pair in the old layout), and a
    per-tensor ``dequantize(quantize(x))`` (fake quantization between the convolutions of a
    QDQ model) as ``clip(round(x / s), -zp, qmax - zp) * s``, the same values bit for bit."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name in _BINARY:
            return self._ranked(call)
        if is_op(call, "relax.dequantize"):
            return self._fake_quantization(call)
        if is_op(call, "relax.clip"):
            return self._clip(call)
        return call

    def _clip(self, call: relax.Call) -> relax.Expr:
        if not is_static_tensor(call.ty, ("float32",), min_ndim=1):
            return call
        lo, hi = (_number(arg) for arg in call.args[1:])
        low = relax.op.maximum(call.args[0], relax.const(lo, "float32"))
        return relax.op.minimum(self.builder_.emit(low), relax.const(hi, "float32"))

    def _fake_quantization(self, call: relax.Call) -> relax.Expr:
        quantize = bound_value(self, call.args[0])
        if not is_op(quantize, "relax.quantize") or str(call.ty.dtype) != "float32" \
                or str(quantize.args[0].ty.dtype) != "float32":
            return call
        params = [constant_value(self, arg) for arg in (*quantize.args[1:], *call.args[1:])]
        if any(p is None or p.size != 1 for p in params):
            return call
        scale, zero, scale2, zero2 = (p.reshape(()) for p in params)
        qdtype = str(quantize.ty.dtype)
        if scale != scale2 or zero != zero2 or qdtype not in _QUANTIZED:
            return call
        qmin, qmax = _QUANTIZED[qdtype]
        zp = float(zero)
        steps = self.builder_.emit(relax.op.round(relax.op.divide(
            quantize.args[0], relax.const(np.float32(scale)))))
        low = self.builder_.emit(relax.op.maximum(steps, relax.const(qmin - zp, "float32")))
        high = self.builder_.emit(relax.op.minimum(low, relax.const(qmax - zp, "float32")))
        return relax.op.multiply(high, relax.const(np.float32(scale)))

    def _ranked(self, call: relax.Call) -> relax.Expr:
        args = list(call.args)
        if not all(isinstance(a.ty, relax.TensorType) and a.ty.ndim >= 0 for a in args):
            return call
        rank = max(a.ty.ndim for a in args)
        for i, arg in enumerate(args):
            value = constant_value(self, arg)
            if value is None or value.ndim in (0, rank):
                continue
            args[i] = relax.const(value.reshape(()) if value.size == 1 else
                                  value.reshape((1,) * (rank - value.ndim) + value.shape))
        if all(a.same_as(b) for a, b in zip(args, call.args)):
            return call
        return relax.Call(call.op, args, call.attrs)


_QUANTIZED = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535),
              "int16": (-32768, 32767)}
_BINARY = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                     "relax.maximum", "relax.minimum", "relax.power"})


def _number(value) -> float:
    """A ``PrimValue``'s number (its ``value`` is a Python number or an ``IntImm``/``FloatImm``)."""
    value = value.value
    return float(getattr(value, "value", value))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target):
        super().__init__(mod)
        self.target = target

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        rewritten = None
        if is_op(call, "relax.nn.conv2d"):
            rewritten = self._rewrite(call)
        elif is_op(call, "relax.nn.conv2d_transpose"):
            rewritten = self._rewrite_transposed(call)
        return call if rewritten is None else rewritten

    def _rewrite_depthwise(self, call: relax.Call) -> relax.Expr | None:
        """NHWC depthwise ``conv2d`` (one filter per channel) as :func:`depthwise_conv`."""
        operands = _fp32_operands(self, call, ndim=4)
        if operands is None:
            return None
        x, w = operands
        channels = int(x.ty.shape.values[3])
        o, kh, kw, per_group = w.shape
        attrs = call.attrs
        if (int(attrs.groups) != channels or o != channels or per_group != 1
                or kh * kw > _MAX_TAPS):
            return None
        oh, ow = (int(d) for d in call.ty.shape.values[1:3])
        top, left, bottom, right = _four(attrs.padding)
        if top or left or bottom or right:
            # Padded once here, the taps are plain vector loads (a bounds test per tap in
            # the vectorised loop runs about ten times slower).
            x = self.builder_.emit(relax.op.nn.pad(x, [0, 0, top, bottom, left, right, 0, 0]))
        taps = relax.const(np.ascontiguousarray(w[..., 0].transpose(1, 2, 0)))  # [KH, KW, C]
        conv = self.builder_.call_te(
            depthwise_conv, x, taps, _pair(attrs.strides), _pair(attrs.dilation), (oh, ow),
            primfunc_name_hint=DEPTHWISE)
        return self._not_inlined_into(conv)

    def _not_inlined_into(self, call: relax.Call) -> relax.Call:
        """Mark ``call``'s PrimFunc fusable like a convolution: the ops after it may join its
        kernel, the ops before it do not (inlined, they would be recomputed for every tap)."""
        gvar = call.args[0]
        func = self.builder_.get()[gvar]
        self.builder_.update_func(gvar, func.with_attr("op_pattern", _OUT_ELEMWISE_FUSABLE))
        return call

    def _rewrite_transposed(self, call: relax.Call) -> relax.Expr | None:
        """``conv2d_transpose`` (NCHW, IOHW, one group) as a GEMM of every input pixel by
        ``W[C, (KH, KW, O)]``, then :func:`col2im`."""
        attrs = call.attrs
        if (int(attrs.groups) != 1 or str(attrs.data_layout) != "NCHW"
                or str(attrs.kernel_layout) != "IOHW"
                or str(attrs.out_layout) not in ("NCHW", "")):
            return None
        operands = _fp32_operands(self, call, ndim=4)
        if operands is None:
            return None
        x, w = operands
        n, c, h, wd = (int(d) for d in x.ty.shape.values)
        _, o, kh, kw = w.shape
        if kh * kw > _MAX_TAPS:
            return None
        oh, ow = (int(d) for d in call.ty.shape.values[2:])
        pads = [int(p) for p in attrs.padding]
        bb = self.builder_
        nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
        rows = bb.emit(relax.op.reshape(nhwc, (n * h * wd, c)))
        w_mat = relax.const(np.ascontiguousarray(w.transpose(0, 2, 3, 1).reshape(c, kh * kw * o)))
        cols = bb.emit(relax.op.matmul(rows, w_mat))
        return bb.call_te(col2im, cols, n, (h, wd), (kh, kw), o, _pair(attrs.strides),
                          (pads[0], pads[1]), _pair(attrs.dilation), (oh, ow),
                          primfunc_name_hint=COL2IM)

    def _rewrite(self, call: relax.Call) -> relax.Expr | None:
        attrs = call.attrs
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout),
                   str(attrs.out_layout) or str(attrs.data_layout))
        if int(attrs.groups) != 1 and layouts == _NHWC:
            return self._rewrite_depthwise(call)
        if int(attrs.groups) != 1 or layouts not in (_NHWC, _NCHW):
            return None
        operands = _fp32_operands(self, call, ndim=4)
        if operands is None:
            return None
        x, w = operands
        bb = self.builder_
        out_shape = [int(d) for d in call.ty.shape.values]
        if layouts == _NCHW:  # to NHWC and back around the GEMM
            x = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
            w = w.transpose(0, 2, 3, 1)
            out_shape = [out_shape[0], out_shape[2], out_shape[3], out_shape[1]]
        y = self._gemm(x, w, out_shape, attrs)
        if layouts == _NCHW:
            y = relax.op.permute_dims(bb.emit(y), [0, 3, 1, 2])
        return y

    def _gemm(self, x: relax.Expr, w: np.ndarray, out_shape: list[int], attrs) -> relax.Expr:
        """The NHWC convolution of ``x`` by the OHWI constant ``w`` as im2col + GEMM."""
        n, h, wd, c = (int(d) for d in x.ty.shape.values)
        o, kh, kw, _ = w.shape
        oh, ow = out_shape[1:3]
        strides, dilation = _pair(attrs.strides), _pair(attrs.dilation)
        padding = _four(attrs.padding)
        k = c * kh * kw
        bb = self.builder_
        direct = self._direct(x, w, (oh, ow), strides, padding, dilation)
        if direct is not None:
            return direct
        if (kh, kw) == (1, 1) and strides == (1, 1) and not any(padding) and (oh, ow) == (h, wd):
            cols = bb.emit(relax.op.reshape(x, (n * h * wd, c)))
        else:
            func = im2col((n, h, wd, c), (kh, kw), strides, padding, dilation, (oh, ow))
            cols = bb.emit(relax.call_tir(bb.add_func(func, IM2COL), [x], relax.TensorType(
                (n * oh * ow, k), "float32")))
        w_mat = relax.const(np.ascontiguousarray(w.reshape(o, k).T))
        y = bb.emit(relax.op.matmul(cols, w_mat))
        return relax.op.reshape(y, (n, oh, ow, o))

    def _direct(self, x: relax.Expr, w: np.ndarray, out_hw: tuple[int, int],
                strides: tuple[int, int], padding: tuple[int, int, int, int],
                dilation: tuple[int, int]) -> relax.Expr | None:
        """The stride-1 convolution as :func:`direct_conv` on the zero-padded input, when a
        microkernel tiles the output rows (else None: im2col)."""
        o, kh, kw, c = w.shape
        if strides != (1, 1) or kh * kw == 1 or c < _MIN_DIRECT_DEPTH:
            return None
        nr = panel_width(self.target, "float32", out_hw[0] * out_hw[1], o, c)
        if nr is None or choose_conv_kernel(microkernels_for(self.target, "float32"), out_hw[1],
                                            nr) is None:
            return None
        bb = self.builder_
        top, left, bottom, right = padding
        if any(padding):
            x = bb.emit(relax.op.nn.pad(x, [0, 0, top, bottom, left, right, 0, 0]))
        packed = relax.const(pack_conv_weight(w, nr))
        return self._not_inlined_into(bb.call_te(
            direct_conv, x, packed, dilation, out_hw, o, primfunc_name_hint=DIRECT_CONV))
