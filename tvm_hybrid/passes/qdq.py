"""``FoldQDQ``: quantized (QDQ) GEMMs to int8 VNNI GEMMs with integer requantization.

ONNX QDQ models express int8 inference as float ops wrapped in ``QuantizeLinear`` /
``DequantizeLinear`` pairs. TVM imports them as ``relax.quantize`` / ``relax.dequantize`` and, left
alone, folds the weight dequantization into an fp32 constant and computes in fp32. This pass (the
paper's quantized-graph reschedule) runs before constant folding and rewrites, in two steps:

1. ``matmul(dequantize(xq, sx, zx), dequantize(Wq, sw, zw))`` with constant 8-bit ``Wq``
   (also transposed, as ``Gemm(transB=1)`` imports),
   per-tensor ``sx, zx`` and per-tensor or per-output-channel ``sw, zw`` becomes the exact
   ``u8 x s8 -> s32`` VNNI GEMM of ``passes/integer_gemm.py`` (zero-point compensation
   precomputed; ``K`` zero-padded to a multiple of 4) followed by ``float32(acc) * (sx * sw)``.
2. ``quantize(relu?(add?(<that>, bias)), sy, zy)`` then becomes integer requantization of the
   accumulator, computed in the GEMM's epilogue (FuseOps puts it in the same kernel)::

       v  = acc + round(bias / (sx * sw))              (int32 bias, per channel)
       v  = max(v, 0)                                  (if ReLU)
       q  = clip(((v * m + 2**(s - 1)) >> s) + zy)     (m * 2**-s = sx * sw / sy, m < 2**31)

   so consecutive quantized layers pass ``u8``/``s8`` tensors to each other and never
   materialise fp32 activations. :func:`requantize_reference` is the same arithmetic in numpy,
   the integer reference the results are bit-exact against. Against ONNX's float QDQ semantics
   the quantized outputs differ by at most one quantization step (the bias is rounded to the
   accumulator's scale, and ties round up).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.ir.prim.expr import IntImm
from tvm.target import Target

from ..microkernels import microkernels_for, panel_for
from .integer_gemm import INT8_PACKED_MATMUL, int8_packed_matmul, pack_weight_vnni

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


def requantize_reference(acc: np.ndarray, bias_q: np.ndarray, m: np.ndarray, s: np.ndarray,
                         zero_point: int, dtype: str, relu: bool) -> np.ndarray:
    """The integer requantization of the module docstring, in numpy (int64)."""
    v = acc.astype(np.int64) + bias_q.astype(np.int64)
    if relu:
        v = np.maximum(v, 0)
    q = ((v * m + (np.int64(1) << (s - 1))) >> s) + zero_point
    info = np.iinfo(dtype)
    return np.clip(q, info.min, info.max).astype(dtype)


def requantize(acc: te.Tensor, bias_q: te.Tensor, mult: te.Tensor, shift: te.Tensor,
               zero_point: int, dtype: str, relu: bool) -> te.Tensor:
    """TE form of :func:`requantize_reference`."""
    info = np.iinfo(dtype)

    def compute(*idx):
        j = idx[-1]
        v = acc[idx].astype("int64") + bias_q[j].astype("int64")
        if relu:
            v = te.max(v, tvm.tirx.const(0, "int64"))
        half = tvm.tirx.const(1, "int64") << (shift[j] - 1)
        q = ((v * mult[j] + half) >> shift[j]) + tvm.tirx.const(zero_point, "int64")
        q = te.min(te.max(q, tvm.tirx.const(int(info.min), "int64")),
                   tvm.tirx.const(int(info.max), "int64"))
        return q.astype(dtype)

    return te.compute(acc.shape, compute, name="requantize")


@tvm.transform.module_pass(opt_level=0, name="FoldQDQ")
class FoldQDQ:
    """Rewrite QDQ GEMMs (and their requantization) to the int8 VNNI GEMM."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not microkernels_for(self.target, "uint8"):
            return mod
        rewriter = _Rewriter(mod, self.target)
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target):
        super().__init__(mod)
        self.target = target
        # Output var of a dequantized int8 GEMM -> (acc var, sx * sw per channel).
        self.gemms: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        rewritten = None
        if _is_op(call, "relax.matmul"):
            rewritten = self._gemm(call)
        elif _is_op(call, "relax.quantize"):
            rewritten = self._requantize(call)
        return call if rewritten is None else rewritten

    # -- step 1 ----------------------------------------------------------------------------------
    def _gemm(self, call: relax.Call):
        lhs, rhs = (self._bound(a) for a in call.args)
        transposed = False
        if _is_op(rhs, "relax.permute_dims"):  # Gemm(transB=1): W given as [N, K]
            axes = rhs.attrs.axes
            if axes is None or [int(a) for a in axes] != [1, 0]:
                return None
            transposed, rhs = True, self._bound(rhs.args[0])
        if not (_is_op(lhs, "relax.dequantize") and _is_op(rhs, "relax.dequantize")):
            return None
        xq = lhs.args[0]
        x_ty = xq.ty
        if not isinstance(x_ty, relax.TensorType) or str(x_ty.dtype) not in ("uint8", "int8"):
            return None
        if x_ty.shape is None or x_ty.ndim < 2 or not all(
                isinstance(d, IntImm) for d in x_ty.shape.values):
            return None
        sx, zx = self._constant(lhs.args[1]), self._constant(lhs.args[2])
        wq, sw, zw = (self._constant(a) for a in rhs.args)
        if any(v is None for v in (sx, zx, wq, sw, zw)) or sx.size != 1 or zx.size != 1:
            return None
        if wq.ndim != 2 or wq.dtype not in (np.int8, np.uint8):
            return None
        axis = int(rhs.attrs.axis) % 2
        if transposed:
            wq, axis = np.ascontiguousarray(wq.T), 1 - axis
        k, n = wq.shape
        if int(x_ty.shape.values[-1]) != k:
            return None
        if sw.size not in (1, n) or zw.size not in (1, n) or (sw.size == n and axis != 1):
            return None
        w32 = wq.astype(np.int64) - zw.reshape(-1).astype(np.int64)
        if w32.min(initial=0) < -128 or w32.max(initial=0) > 127:
            return None
        x, zero_point = xq, int(zx.reshape(()))
        if str(x_ty.dtype) == "int8":  # VNNI takes unsigned A: shift by 128
            shifted = relax.op.add(relax.op.astype(x, "int32"), relax.const(128, "int32"))
            x = self.builder_.emit(relax.op.astype(shifted, "uint8"))
            zero_point += 128
        compensation = zero_point * w32.sum(axis=0)
        if np.abs(compensation).max(initial=0) >= 2**31:
            return None
        if k % 4:  # K in groups of 4: zero rows of W (and zero columns of x) add nothing
            pad = 4 - k % 4
            w32 = np.concatenate([w32, np.zeros((pad, n), w32.dtype)])
            x = self.builder_.emit(relax.op.nn.pad(x, [0, 0] * (x_ty.ndim - 1) + [0, pad]))
        nr = panel_for(self.target, "uint8", int(x_ty.shape.values[-2]), n, w32.shape[0])
        if nr is None:
            return None
        acc = self.builder_.emit(self.builder_.call_te(
            int8_packed_matmul, x, relax.const(pack_weight_vnni(w32.astype(np.int8), nr)),
            relax.const(compensation.astype(np.int32)), n,
            primfunc_name_hint=INT8_PACKED_MATMUL))
        scale = (np.float32(sx.reshape(())) * np.broadcast_to(sw.reshape(-1), (n,))).astype(
            np.float32)
        out = self.builder_.emit(relax.op.multiply(relax.op.astype(acc, "float32"),
                                                   relax.const(scale)))
        self.gemms[out] = (acc, scale)
        return out

    # -- step 2 ----------------------------------------------------------------------------------
    def _requantize(self, call: relax.Call):
        sy, zy = self._constant(call.args[1]), self._constant(call.args[2])
        if sy is None or zy is None or sy.size != 1 or zy.size != 1:
            return None
        dtype = str(call.attrs.out_dtype)
        if dtype not in ("uint8", "int8"):
            return None
        expr, relu, bias = call.args[0], False, None
        node = self._bound(expr)
        if _is_op(node, "relax.nn.relu"):
            relu, expr = True, node.args[0]
            node = self._bound(expr)
        if _is_op(node, "relax.add"):
            a, b = node.args
            if self._gemm_of(a) is None:
                a, b = b, a
            bias = self._constant(b)
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
        else:
            bias = np.zeros(n)
        bias_q = np.round(bias / scale.astype(np.float64))
        if np.abs(bias_q).max(initial=0) >= 2**31:
            return None
        try:
            mult, shift = quantized_multiplier(scale.astype(np.float64) /
                                               float(sy.reshape(())))
        except ValueError:
            return None
        if shift.min() < 1 or shift.max() > 62:
            return None
        return self.builder_.call_te(
            requantize, acc, relax.const(bias_q.astype(np.int32)), relax.const(mult),
            relax.const(shift), int(zy.reshape(())), dtype, relu,
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

    # -- helpers ---------------------------------------------------------------------------------
    def _constant(self, expr: relax.Expr) -> np.ndarray | None:
        expr = self._bound(expr)
        if isinstance(expr, tvm.ir.GenericConst):
            return expr.value.numpy()
        return None

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if value is None:
                return expr
            expr = value
        return expr


def _is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
        expr.op.name == name
