"""``IntegerGemmToVNNI``: integer matmuls with constant 8-bit weights to the integer GEMM engine.

TVM imports ONNX ``MatMulInteger`` (and the integer core of quantized graphs) as an int32
``matmul(astype(x, int32) - x_zp, W32)``, where phase 1 has already folded the weight side,
``W32 = int32(W) - w_zp``, into a constant. That is rewritten to a GEMM on narrow operands that
a microkernel computes exactly; which one depends on the target
(:func:`~tvm_hybrid.microkernels.integer_gemm_dtype`):

* **u8 x s8** (VNNI, AMX), when every value of ``W32`` fits in ``s8``; on AVX2 CPUs without
  VNNI, ``vpmaddubsw`` when every pair of adjacent ``k`` of every column of ``W32`` has
  ``|w0| + |w1| <= 128`` (7-bit weights, for one), where its pair sums cannot saturate
  (``microkernels/families/maddubs.py``)::

      y[i, j] = sum_k (x[i, k] - zp) * W32[k, j]
              = sum_k xu[i, k] * W32[k, j] - zp_u * colsum(W32)[j]

  ``xu`` is ``x`` itself for ``u8`` activations, or ``x + 128`` (as ``u8``) for ``s8``
  activations with ``zp_u = zp + 128``: VNNI multiplies unsigned by signed bytes. The
  compensation ``zp_u * colsum(W32)`` is a constant computed here with numpy; ``W32`` is stored
  packed, ``W_packed[N_pad / nr, K / 4, nr, 4]`` (``K`` in groups of 4).
* **s16 x s16** (AVX2 without VNNI, other weights), for any 8-bit data: ``x - zp`` as ``s16``
  (a cast that fuses into the producer of ``x``) times ``W32`` as ``s16``, packed in pairs,
  ``W_packed[N_pad / nr, K / 2, nr, 2]``; no compensation.

Both are the packed GEMM of ``packed_gemm.py`` (this module prepares its operands): ``N`` is
zero-padded to whole panels and the padded columns are sliced off inside the kernel; ``K`` is
zero-padded to the group. The result is bit-exact.

Non-constant weights and weights that fit no kernel keep TVM's int32 matmul.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from ..microkernels import (
    best_vector_family,
    has_integer_kernels,
    integer_gemm_dtype,
    weight_pair_sum,
)
from ..schedules.gemm.heuristics import weight_layout
from .packed_gemm import emit_packed_gemm
from .relax_rewrite import (
    TargetMutator,
    TargetPass,
    bound_value,
    constant_value,
    is_op,
    is_static_tensor,
)


def emit_int8_gemm(builder: relax.BlockBuilder, target: Target, x: relax.Expr,
                   zero_point: int | relax.Expr, w32: np.ndarray,
                   pad_rows: bool = True) -> relax.Expr | None:
    """Emit ``(x - zero_point) @ w32`` (int32) as an integer GEMM; None if it cannot be.

    ``x`` is a static ``u8``/``s8`` tensor ``[..., M, K]``; ``w32`` holds the (zero-point
    adjusted) integer weights. ``zero_point`` is a constant, or a 0-d int32 Relax expression
    known only at run time (dynamic quantization: ``DynamicQuantizeLinear``); then the
    compensation ``zp * colsum(W)`` is computed in the kernel from the constant ``colsum(W)``.
    ``pad_rows=False`` when ``x`` is a hand-written kernel's output (im2col's), which the u8
    GEMM reads as it is (``packed_gemm.emit_packed_gemm``).
    See the module docstring for the two forms.
    """
    x_ty = x.ty
    signed = str(x_ty.dtype) == "int8"
    dtype = integer_gemm_plan(target, int(x_ty.shape.values[-2]), w32, zero_point, signed)
    if dtype == "int16":
        return _emit_s16_gemm(builder, target, x, zero_point, w32)
    if dtype is None:
        return None
    colsum = w32.astype(np.int64).sum(axis=0)
    runtime_zp = None
    if isinstance(zero_point, relax.Expr):
        runtime_zp = zero_point
        if signed:
            runtime_zp = relax.op.add(runtime_zp, relax.const(128, "int32"))
        runtime_zp = builder.emit(runtime_zp)
        compensation = colsum
    else:
        compensation = (zero_point + (128 if signed else 0)) * colsum
    if signed:  # VNNI takes unsigned A
        shifted = relax.op.add(relax.op.astype(x, "int32"), relax.const(128, "int32"))
        x = builder.emit(relax.op.astype(shifted, "uint8"))
    return builder.emit(emit_packed_gemm(
        builder, target, x, w32, weight_dtype=np.int8, acc_dtype="int32", out_dtype="int32",
        compensation=compensation.astype(np.int32), zero_point=runtime_zp,
        pad_rows=pad_rows or signed))


def integer_gemm_plan(target: Target, m: int, w32: np.ndarray, zero_point: int | relax.Expr,
                      signed: bool) -> str | None:
    """The operand dtype :func:`emit_int8_gemm` computes ``(x - zero_point) @ w32`` in
    (``"uint8"`` or ``"int16"``) for ``m`` rows of ``u8`` (``signed``: ``s8``) data; None when
    it cannot (no kernel for these weights or this shape, or a compensation beyond int32)."""
    k, n = w32.shape
    dtype = integer_gemm_dtype(target, int(w32.min(initial=0)), int(w32.max(initial=0)),
                               weight_pair_sum(w32))
    if dtype == "int16":
        if np.abs(w32).max(initial=0) > 2**15 - 1:
            return None
        return dtype if weight_layout(target, "int16", m, n, k) is not None else None
    if dtype is None or weight_layout(target, "uint8", m, n, k) is None:
        return None
    colsum = np.abs(w32.astype(np.int64).sum(axis=0)).max(initial=0)
    if isinstance(zero_point, relax.Expr):
        # |zp_u| <= 255 + 128: the compensation must fit int32 for any zero point.
        return dtype if 383 * colsum < 2**31 else None
    return dtype if abs(zero_point + (128 if signed else 0)) * colsum < 2**31 else None


def _emit_s16_gemm(builder: relax.BlockBuilder, target: Target, x: relax.Expr,
                   zero_point: int | relax.Expr, w32: np.ndarray) -> relax.Expr | None:
    """``(x - zero_point) @ w32`` on s16 operands (the AVX2 integer GEMM)."""
    x16 = relax.op.astype(x, "int16")
    if isinstance(zero_point, relax.Expr):
        x16 = relax.op.subtract(x16, relax.op.astype(zero_point, "int16"))
    elif zero_point:
        x16 = relax.op.subtract(x16, relax.const(zero_point, "int16"))
    x16 = builder.emit(x16)
    return builder.emit(emit_packed_gemm(builder, target, x16, w32, weight_dtype=np.int16,
                                         acc_dtype="int32", out_dtype="int32"))


@relax.expr_functor.mutator
class _Rewriter(TargetMutator):

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.matmul"):
            return call
        matched = self._match(*call.args)
        if matched is None:
            return call
        # An im2col's output (a hand-written kernel) keeps its rows (PrepackConstantWeights has
        # an fp32 im2col write padded rows itself; the integer im2col is not re-emitted).
        pad_rows = not is_op(bound_value(self, matched[0]), "relax.call_tir")
        gemm = emit_int8_gemm(self.builder_, self.target, *matched, pad_rows=pad_rows)
        return call if gemm is None else gemm

    def _match(self, lhs: relax.Expr, weight: relax.Expr):
        """``(x, zero_point, W32)`` when the matmul is an 8-bit GEMM we can take, else None."""
        w32 = constant_value(self, weight)
        if w32 is None or w32.dtype != np.int32 or w32.ndim != 2:
            return None
        if w32.min(initial=0) < -(2**15) or w32.max(initial=0) >= 2**15:
            return None
        shifted = shifted_8bit(self, lhs)
        if shifted is None:
            return None
        x, _, zero_point = shifted
        if isinstance(zero_point, relax.Expr):
            zero_point = _scalar(zero_point)  # dynamic quantization's zero point
        if int(x.ty.shape.values[-1]) != w32.shape[0]:
            return None
        return x, zero_point, w32


def shifted_8bit(mutator: relax.PyExprMutator, expr: relax.Expr):
    """``(x8, zp expression or None, zero point)`` when ``expr`` is ``astype(x8, int32) - zp``
    or ``astype(x8, int32)`` of a static 8-bit tensor ``x8``; the zero point is an int (0
    without the subtraction) or, computed at run time, the one-element int32 tensor. Else
    None."""
    zp_expr, zero_point = None, 0
    expr = bound_value(mutator, expr)
    if is_op(expr, "relax.subtract"):
        zp_expr = expr.args[1]
        zp = constant_value(mutator, zp_expr)
        if zp is not None and zp.size == 1:
            zero_point = int(zp.reshape(()))
        elif zp is None and _is_runtime_scalar(zp_expr):
            zero_point = zp_expr
        else:
            return None
        expr = bound_value(mutator, expr.args[0])
    if not is_op(expr, "relax.astype") or str(expr.ty.dtype) != "int32":
        return None
    x8 = expr.args[0]
    if not is_static_tensor(x8.ty, ("uint8", "int8")):
        return None
    return x8, zp_expr, zero_point


@tvm.transform.module_pass(opt_level=0, name="IntegerGemmToVNNI")
class IntegerGemmToVNNI(TargetPass):
    """Rewrite int32 matmuls of 8-bit data with constant 8-bit weights to the integer GEMM."""

    mutator = _Rewriter
    needs = staticmethod(has_integer_kernels)

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        # A rewritten matmul's binding becomes an alias of the GEMM's variable; FuseOps does
        # not fuse the epilogue across such an alias, so aliases are resolved here.
        return relax.transform.CanonicalizeBindings()(super().transform_module(mod, ctx))


def _is_runtime_scalar(expr: relax.Expr) -> bool:
    """A one-element int32 tensor (a zero point computed at run time)."""
    ty = expr.ty
    if not is_static_tensor(ty, ("int32",), min_ndim=0):
        return False
    return all(int(d) == 1 for d in ty.shape.values)


def _scalar(expr: relax.Expr) -> relax.Expr:
    return expr if expr.ty.ndim == 0 else relax.op.reshape(expr, ())


@dataclasses.dataclass(frozen=True)
class IntegerConv:
    """An int32 convolution of 8-bit data that the integer GEMM computes
    (:func:`integer_conv_gemm`)."""

    x8: relax.Expr             # the 8-bit data, before ``permutation``
    permutation: list | None   # what ConvertLayout put between the data and the convolution
    zp_expr: relax.Expr | None  # the zero point subtracted, as written (None: zero)
    zero_point: int | relax.Expr  # its value, or the run-time scalar
    w32: np.ndarray            # the weight as the GEMM's ``[K, O]``, ``K`` in (kh, kw, c) order
    layout: str                # "NCHW" or "NHWC"
    pointwise: bool            # 1x1, unit strides, no padding: the pixels are the GEMM's rows
    extra_columns: int         # zero rows appended to ``w32`` (im2col writes the columns)


def integer_conv_gemm(mutator: relax.PyExprMutator, call: relax.Call,
                      target: Target) -> IntegerConv | None:
    """The integer GEMM form of an int32 convolution of 8-bit data, else None.

    ``call`` is ``conv2d(astype(x8, int32) - zp, W32)`` (``zp`` a constant or a run-time
    scalar, as ``ConvInteger`` and the QDQ rewrite of ``passes/qdq.py`` write it; ``x8`` an
    8-bit tensor, possibly permuted to the convolution's layout) with a constant int32 weight
    and one group, in NCHW/OIHW or NHWC/OHWI, whose GEMM (:func:`integer_gemm_plan`) a kernel
    of ``target`` takes. A 1x1 convolution with unit strides and no padding is a GEMM of its
    pixels on any integer kernel; other convolutions are an im2col of ``x8`` (padded with the
    zero point, so a constant one) and a GEMM on a dot-product kernel (VNNI, AMX) only: on
    AVX2 CPUs the fp32 engine's direct convolution, which writes no im2col buffer, is as fast.
    ``IntegerConvToFloat`` leaves these to ``ConvToGemm``, which rewrites them to the int32
    matmul that :class:`IntegerGemmToVNNI` then takes.
    """
    if not is_op(call, "relax.nn.conv2d") or str(call.ty.dtype) != "int32":
        return None
    attrs = call.attrs
    layout = str(attrs.data_layout)
    if (int(attrs.groups) != 1
            or (layout, str(attrs.kernel_layout)) not in (("NCHW", "OIHW"), ("NHWC", "OHWI"))
            or str(attrs.out_layout) not in ("", layout)):
        return None
    w = constant_weight(mutator, call.args[1])
    if w is None or w.dtype != np.int32 or w.ndim != 4:
        return None
    ohwi = w.transpose(0, 2, 3, 1) if layout == "NCHW" else w
    padded = any(int(p) for p in attrs.padding)
    pointwise = ohwi.shape[1:3] == (1, 1) and not padded and all(
        int(v) == 1 for v in attrs.strides)
    x = call.args[0]
    permutation = None
    permuted = bound_value(mutator, x)
    if is_op(permuted, "relax.permute_dims") and permuted.attrs.axes is not None:
        permutation = [int(a) for a in permuted.attrs.axes]
        x = permuted.args[0]
    shifted = shifted_8bit(mutator, x)
    if shifted is None or shifted[0].ty.ndim != 4:
        return None
    x8, zp_expr, zero_point = shifted
    dtype = str(x8.ty.dtype)
    if isinstance(zero_point, relax.Expr) and padded:
        return None  # the padding (im2col's fill) holds the zero point: a constant
    if isinstance(zero_point, int) and not (
            np.iinfo(dtype).min <= zero_point <= np.iinfo(dtype).max):
        return None
    w32 = np.ascontiguousarray(ohwi.reshape(ohwi.shape[0], -1).T)
    extra = 0
    if not pointwise:
        family = best_vector_family(target, "uint8")
        if family is None or family.pair_bound or dtype != "uint8":
            # (s8 data would be shifted to u8 by an op that FuseOps puts into the im2col
            # kernel, which FuseTIR cannot merge: those keep the fp32 path)
            return None
        extra = -w32.shape[0] % 4
        w32 = np.concatenate([w32, np.zeros((extra, w32.shape[1]), w32.dtype)])
    shape = [int(d) for d in call.ty.shape.values]
    rows = int(np.prod(shape)) // w32.shape[1]
    plan = integer_gemm_plan(target, rows, w32, zero_point, dtype == "int8")
    if plan is None or (not pointwise and plan != "uint8"):
        return None
    return IntegerConv(x8, permutation, zp_expr, zero_point, w32, layout, pointwise, extra)


def constant_weight(mutator: relax.PyExprMutator, weight: relax.Expr) -> np.ndarray | None:
    """A convolution's constant weight, also through the transpose that ``ConvertLayout``
    puts on an unfolded ``W - w_zp`` (TVM's FoldConstant leaves the zero point's cast)."""
    value = constant_value(mutator, weight)
    if value is not None:
        return value
    expr = bound_value(mutator, weight)
    if not is_op(expr, "relax.permute_dims") or expr.attrs.axes is None:
        return None
    value = constant_value(mutator, expr.args[0])
    return None if value is None else value.transpose([int(a) for a in expr.attrs.axes])
