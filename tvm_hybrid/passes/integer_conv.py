"""``IntegerConvToFloat``: integer convolutions computed exactly on the fp32 convolution engine.

ONNX ``ConvInteger`` (every Conv of ONNX Runtime's ``quantize_dynamic``) imports as an int32
``conv2d(x - x_zp, W - w_zp)`` (``frontend/conv_integer.py``), which TVM lowers to a scalar
int32 loop nest: 80% of a dynamically quantized OCR model's time. Its result is consumed as
``float32(conv)`` (times the scales). The same sums in fp32 are *exact* when no partial sum
can exceed ``2**24`` (every integer up to it is a float32): with ``|x - x_zp| <= X`` (the
activation's 8-bit range) and the constant weight, the largest partial sum of output channel
``o`` is at most ``X * sum_k |W[o, k]|``. Where that bound holds for every channel::

    float32(conv2d_int32(x', W'))  ->  conv2d_fp32(float32(x'), float32(W'))

bit for bit, and the convolution runs on the fp32 engine (direct, im2col or depthwise kernels
of ``passes/conv_gemm.py``) with its scale and bias fused as the epilogue. Convolutions whose
bound fails keep the int32 form, and so do the convolutions that the integer GEMM of the
target computes (:func:`~tvm_hybrid.passes.integer_gemm.integer_conv_gemm`: 1x1 ones on any
integer kernel, others on VNNI or AMX; ``ConvToGemm`` makes them int32 matmuls on 8-bit
operands): a ``vpdpbusd`` does four times the work of an fp32 FMA, a ``vpmaddwd`` two.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from ..microkernels import has_integer_kernels
from .integer_gemm import constant_weight, integer_conv_gemm
from .relax_rewrite import bound_value, constant_value, is_op, rewrite_functions

#: Every integer of magnitude up to this is exactly representable in float32.
EXACT_LIMIT = 2 ** 24
_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}


@tvm.transform.module_pass(opt_level=0, name="IntegerConvToFloat")
class IntegerConvToFloat:
    """Rewrite exactly representable integer convolutions to fp32 (see the module doc).

    Parameters
    ----------
    target
        The CPU: the convolutions its integer GEMM takes stay integer
        (:func:`~tvm_hybrid.passes.integer_gemm.integer_conv_gemm`). None converts every
        exact convolution.
    """

    def __init__(self, target: Target | None = None):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod, self.target), eliminate_dead_code=True)


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target | None):
        super().__init__(mod)
        self.target = target if target is not None and has_integer_kernels(target) else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.astype") or str(call.ty.dtype) != "float32":
            return call
        conv = bound_value(self, call.args[0])
        if not is_op(conv, "relax.nn.conv2d") or str(conv.ty.dtype) != "int32":
            return call
        if self.target is not None and integer_conv_gemm(self, conv, self.target):
            return call
        x, weight = conv.args
        w = constant_weight(self, weight)
        bounds = self.interval(x)
        # (O first: the sums per output channel below; OHWI after ConvToGemm's layout change)
        if w is None or bounds is None or w.ndim != 4 or \
                str(conv.attrs.kernel_layout) not in ("OIHW", "OHWI"):
            return call
        reach = max(abs(bounds[0]), abs(bounds[1]))
        if reach * float(np.abs(w.astype(np.int64)).reshape(w.shape[0], -1).sum(1).max()) \
                > EXACT_LIMIT:
            return call
        attrs = conv.attrs
        return relax.op.nn.conv2d(
            self.builder_.emit(relax.op.astype(x, "float32")),
            relax.const(w.astype(np.float32)), strides=attrs.strides, padding=attrs.padding,
            dilation=attrs.dilation, groups=attrs.groups, data_layout=attrs.data_layout,
            kernel_layout=attrs.kernel_layout, out_layout=attrs.out_layout,
            out_dtype="float32")

    def interval(self, expr: relax.Expr) -> tuple[int, int] | None:
        """Bounds ``(lo, hi)`` of the integer tensor ``expr``'s values, or None if unknown:
        casts of 8/16-bit tensors, integer constants, their sums and differences, and their
        transposes."""
        value = constant_value(self, expr)
        if value is not None and value.size and np.issubdtype(value.dtype, np.integer):
            return int(value.min()), int(value.max())
        expr = bound_value(self, expr)
        if is_op(expr, "relax.permute_dims"):  # a layout change keeps the values
            return self.interval(expr.args[0])
        if is_op(expr, "relax.astype"):
            source = str(expr.args[0].ty.dtype)
            if source in _RANGES:
                return _RANGES[source]
            return self.interval(expr.args[0]) if "int" in source else None
        for name, sign in (("relax.add", 1), ("relax.subtract", -1)):
            if is_op(expr, name):
                a, b = (self.interval(arg) for arg in expr.args)
                if a is None or b is None:
                    return None
                if sign == 1:
                    return a[0] + b[0], a[1] + b[1]
                return a[0] - b[1], a[1] - b[0]
        return None
