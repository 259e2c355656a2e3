"""``FoldQDQ``: quantized (QDQ) GEMMs to exact integer GEMMs with integer requantization.

ONNX QDQ models express int8 inference as float ops wrapped in ``QuantizeLinear`` /
``DequantizeLinear`` pairs. TVM imports them as ``relax.quantize`` / ``relax.dequantize`` and, left
alone, folds the weight dequantization into an fp32 constant and computes in fp32. This pass (the
paper's quantized-graph reschedule) runs before constant folding and rewrites, in two steps:

1. ``matmul(dequantize(xq, sx, zx), dequantize(Wq, sw, zw))`` with constant 8-bit ``Wq``
   (also transposed, as ``Gemm(transB=1)`` imports),
   per-tensor ``sx, zx`` and per-tensor or per-output-channel ``sw, zw`` becomes the exact
   integer GEMM of ``passes/integer_gemm.py`` (``u8 x s8`` with VNNI, zero-point compensation
   precomputed; ``s16`` on AVX2; ``K`` zero-padded to the kernel's group) followed by
   ``float32(acc) * (sx * sw)``.
2. ``quantize(relu?(add?(<that>, bias)), sy, zy)`` then becomes integer requantization of the
   accumulator, computed in the GEMM's epilogue (FuseOps puts it in the same kernel)::

       v  = acc * m + round(bias * m / (sx * sw))    (int64; m * 2**-s = sx * sw / sy)
       v  = max(v, 0)                                (if ReLU)
       q  = clip(((v + 2**(s - 1)) >> s) + zy)       (2**30 <= m < 2**31)

   The bias is kept with ``s`` fractional bits of an output step (rounding it to the
   accumulator's scale instead would be off by up to ``sx * sw / (2 sy)`` steps when the output
   scale is finer than the accumulator's); both terms stay below ``2**62``. Consecutive
   quantized layers pass ``u8``/``s8`` tensors to each other and never materialise fp32
   activations. :func:`requantize_reference` is the same arithmetic in numpy, the integer
   reference the results are bit-exact against. Against ONNX's float QDQ semantics the
   quantized outputs differ by at most one quantization step (ties round up, not to even).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.target import Target

from ..microkernels import has_integer_kernels
from . import relax_rewrite
from .integer_gemm import emit_int8_gemm, integer_conv_gemm
from .relax_rewrite import TargetMutator, TargetPass, bound_value, constant_value, is_op

REQUANTIZE = "hybrid_requantize"


def quantized_multiplier(real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(m, s)`` with ``m * 2**-s`` closest to ``real`` (> 0), ``2**30 <= m < 2**31``."""
    real = np.asarray(real, np.float64)
    if np.any(real <= 0) or np.any(~np.isfinite(real)):
        raise ValueError("requantization scales must be positive and finite")
    mantissa, exponent = np.frexp(real)  # real = mantissa * 2**exponent, 0.5 <= mantissa < 1
    m = np.round(mantissa * (1 << 31)).astype(np.int64)
    shift = 31 - exponent.astype(np.int64)
    full = m == (1 << 31)
    m[full] //= 2
    shift[full] -= 1
    return m, shift


def requantization_constants(acc_scale: np.ndarray, output_scale: float,
                             bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(bias_fixed, m, s)`` of the module docstring for per-channel accumulator scales.

    Raises
    ------
    ValueError
        When a scale is not positive and finite, or a value would leave the int64 range.
    """
    acc_scale = np.asarray(acc_scale, np.float64)
    m, s = quantized_multiplier(acc_scale / float(output_scale))
    bias = np.zeros(acc_scale.shape) if bias is None else np.asarray(bias, np.float64)
    bias_fixed = np.round(bias / acc_scale * m)
    if (np.abs(bias_fixed).max(initial=0) >= 2**62 or not np.all(np.isfinite(bias_fixed))
            or s.min() < 1 or s.max() > 62):
        raise ValueError("requantization constants out of range")
    return bias_fixed.astype(np.int64), m, s


def requantize_reference(acc: np.ndarray, bias_fixed: np.ndarray, m: np.ndarray, s: np.ndarray,
                         zero_point: int, dtype: str, relu: bool) -> np.ndarray:
    """The integer requantization of the module docstring, in numpy (int64)."""
    v = acc.astype(np.int64) * m + bias_fixed.astype(np.int64)
    if relu:
        v = np.maximum(v, 0)
    q = ((v + (np.int64(1) << (s - 1))) >> s) + zero_point
    info = np.iinfo(dtype)
    return np.clip(q, info.min, info.max).astype(dtype)


def requantize(acc: te.Tensor, bias_fixed: te.Tensor, mult: te.Tensor, shift: te.Tensor,
               zero_point: int, dtype: str, relu: bool) -> te.Tensor:
    """TE form of :func:`requantize_reference`."""
    info = np.iinfo(dtype)

    def compute(*idx):
        j = idx[-1]
        v = acc[idx].astype("int64") * mult[j] + bias_fixed[j]
        if relu:
            v = te.max(v, tvm.tirx.const(0, "int64"))
        half = tvm.tirx.const(1, "int64") << (shift[j] - 1)
        q = ((v + half) >> shift[j]) + tvm.tirx.const(zero_point, "int64")
        q = te.min(te.max(q, tvm.tirx.const(int(info.min), "int64")),
                   tvm.tirx.const(int(info.max), "int64"))
        return q.astype(dtype)

    return te.compute(acc.shape, compute, name="requantize")


@relax.expr_functor.mutator
class _Rewriter(TargetMutator):
    def __init__(self, mod: tvm.IRModule, target: Target):
        super().__init__(mod, target)
        # Output var of a dequantized int8 GEMM -> (acc var, sx * sw per channel).
        self.gemms: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        return relax_rewrite.rewrite_by_op(call, {"relax.matmul": self._gemm,
                                                  "relax.nn.conv2d": self._conv,
                                                  "relax.quantize": self._requantize})

    # -- step 1 for convolutions ----------------------------------------------------------------
    def _conv(self, call: relax.Call):
        """``conv2d(dequantize(xq), dequantize(Wq))`` in NCHW to the int32 convolution
        ``conv2d(astype(xq, int32) - zx, W32)`` times ``sx * sw`` per output channel, where
        the integer GEMM takes it (``integer_conv_gemm``: ``ConvToGemm`` makes it one); other
        convolutions (depthwise and grouped ones; on CPUs without VNNI all but 1x1 ones) keep
        the float path (their weights fold to fp32)."""
        attrs = call.attrs
        if not (str(attrs.data_layout) == "NCHW" and str(attrs.kernel_layout) == "OIHW"
                and str(attrs.out_layout) in ("", "NCHW")):
            return None
        rhs = bound_value(self, call.args[1])
        operands = self._dequantized(bound_value(self, call.args[0]), rhs, ndim=4)
        if operands is None:
            return None
        xq, sx, zx, wq, sw, zw = operands
        o = wq.shape[0]
        if (sw.size not in (1, o) or zw.size not in (1, o)
                or (max(sw.size, zw.size) == o > 1 and int(rhs.attrs.axis) % 4 != 0)):
            return None
        w32 = (wq.astype(np.int64) - zw.reshape(-1, 1, 1, 1).astype(np.int64)).astype(np.int32)
        bb = self.builder_
        x32 = relax.op.astype(xq, "int32")
        if int(zx.reshape(())):
            x32 = relax.op.subtract(bb.emit(x32), relax.const(int(zx.reshape(())), "int32"))
        conv = relax.op.nn.conv2d(
            bb.emit(x32), relax.const(w32), strides=attrs.strides, padding=attrs.padding,
            dilation=attrs.dilation, groups=attrs.groups, data_layout="NCHW",
            kernel_layout="OIHW", out_dtype="int32")
        conv = bb.normalize(conv)
        if integer_conv_gemm(self, conv, self.target) is None:
            return None
        scale = (np.float32(sx.reshape(())) * np.broadcast_to(sw.reshape(-1), (o,))).astype(
            np.float32)
        return relax.op.multiply(relax.op.astype(bb.emit(conv), "float32"),
                                 relax.const(scale.reshape(1, o, 1, 1)))

    # -- step 1 ----------------------------------------------------------------------------------
    def _gemm(self, call: relax.Call):
        lhs, rhs = (bound_value(self, a) for a in call.args)
        transposed = False
        if is_op(rhs, "relax.permute_dims"):  # Gemm(transB=1): W given as [N, K]
            axes = rhs.attrs.axes
            if axes is None or [int(a) for a in axes] != [1, 0]:
                return None
            transposed, rhs = True, bound_value(self, rhs.args[0])
        operands = self._dequantized(lhs, rhs, ndim=2)
        if operands is None:
            return None
        xq, sx, zx, wq, sw, zw = operands
        axis = int(rhs.attrs.axis) % 2
        if transposed:
            wq, axis = np.ascontiguousarray(wq.T), 1 - axis
        k, n = wq.shape
        if int(xq.ty.shape.values[-1]) != k:
            return None
        if sw.size not in (1, n) or zw.size not in (1, n) or (sw.size == n and axis != 1):
            return None
        w32 = wq.astype(np.int64) - zw.reshape(-1).astype(np.int64)
        acc = emit_int8_gemm(self.builder_, self.target, xq, int(zx.reshape(())), w32)
        if acc is None:
            return None
        scale = (np.float32(sx.reshape(())) * np.broadcast_to(sw.reshape(-1), (n,))).astype(
            np.float32)
        out = self.builder_.emit(relax.op.multiply(relax.op.astype(acc, "float32"),
                                                   relax.const(scale)))
        self.gemms[out] = (acc, scale)
        return out

    def _dequantized(self, lhs: relax.Expr, rhs: relax.Expr, ndim: int):
        """``(xq, sx, zx, Wq, sw, zw)`` when ``lhs`` dequantizes a static 8-bit tensor with
        per-tensor constants and ``rhs`` a constant 8-bit weight of rank ``ndim``, else None."""
        if not (is_op(lhs, "relax.dequantize") and is_op(rhs, "relax.dequantize")):
            return None
        xq = lhs.args[0]
        if not relax_rewrite.is_static_tensor(xq.ty, ("uint8", "int8"), min_ndim=ndim):
            return None
        sx, zx = constant_value(self, lhs.args[1]), constant_value(self, lhs.args[2])
        wq, sw, zw = (constant_value(self, a) for a in rhs.args)
        if any(v is None for v in (sx, zx, wq, sw, zw)) or sx.size != 1 or zx.size != 1:
            return None
        if wq.ndim != ndim or wq.dtype not in (np.int8, np.uint8):
            return None
        return xq, sx, zx, wq, sw, zw

    # -- step 2 ----------------------------------------------------------------------------------
    def _requantize(self, call: relax.Call):
        sy, zy = constant_value(self, call.args[1]), constant_value(self, call.args[2])
        if sy is None or zy is None or sy.size != 1 or zy.size != 1:
            return None
        dtype = str(call.attrs.out_dtype)
        if dtype not in ("uint8", "int8"):
            return None
        expr, relu, bias = call.args[0], False, None
        node = bound_value(self, expr)
        if is_op(node, "relax.nn.relu"):
            relu, expr = True, node.args[0]
            node = bound_value(self, expr)
        if is_op(node, "relax.add"):
            a, b = node.args
            if self._gemm_of(a) is None:
                a, b = b, a
            bias = constant_value(self, b)
            if bias is None:
                return None
            expr = a
        found = self._gemm_of(expr)
        if found is None:
            return None
        acc, scale = found
        n = scale.shape[0]
        if bias is not None:
            if bias.size not in (1, n) or bias.ndim > 1:
                return None
            bias = np.broadcast_to(bias.reshape(-1), (n,)).astype(np.float64)
        try:
            bias_fixed, mult, shift = requantization_constants(scale, float(sy.reshape(())),
                                                               bias)
        except ValueError:
            return None
        return self.builder_.call_te(
            # (relax.const narrows int64 arrays to int32 unless told the dtype)
            requantize, acc, relax.const(bias_fixed, "int64"), relax.const(mult, "int64"),
            relax.const(shift, "int64"), int(zy.reshape(())), dtype, relu,
            primfunc_name_hint=REQUANTIZE)

    def _gemm_of(self, expr: relax.Expr):
        while isinstance(expr, relax.Var):
            if expr in self.gemms:
                return self.gemms[expr]
            value = self.lookup_binding(expr)
            if value is None:
                return None
            expr = value
        return None


@tvm.transform.module_pass(opt_level=0, name="FoldQDQ")
class FoldQDQ(TargetPass):
    """Rewrite QDQ GEMMs (and their requantization) to the integer GEMM."""

    mutator = _Rewriter
    needs = staticmethod(has_integer_kernels)
