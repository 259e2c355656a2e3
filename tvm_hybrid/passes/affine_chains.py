"""``FoldAffineChains``: a chain of constant scales and shifts as one multiply and one add.

A QDQ graph that quantizes between a convolution and its BatchNormalization (as ONNX
Runtime's ``quantize_static`` leaves a PaddlePaddle MobileNet) applies, to every element between
two roundings, the dequantization's scale, BatchNorm's ``- mean``, ``/ sqrt(var + eps)``,
``* gamma``, ``+ beta`` and the next quantization's ``/ scale``: six vector operations where
``x * a + b`` (one FMA) computes the same affine map. The depthwise convolutions of
orientation_qdq_int8, which run such chains, took 1.7x the time of the fp32 model's.

Every float32 ``add``, ``subtract`` or ``multiply`` of a value and a constant (divisions by
constants are products after :class:`ReciprocalDivisors`) whose value operand is such an op
read by nothing else is composed with it; a chain of two or more becomes
``x * a + b``, ``a`` and ``b`` composed in float64 and rounded once to float32 (the product or
sum left out where ``a`` is 1 or ``b`` is 0). The result differs from the chain's by float
rounding (a few ulps): before a quantization's rounding an element may move one step, as
with FMA contraction. Constants that are not all finite stop a chain.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .relax_rewrite import rewrite_functions, single_use_vars

_AFFINE = ("relax.add", "relax.subtract", "relax.multiply")


def _constant(expr: relax.Expr) -> np.ndarray | None:
    if not isinstance(expr, tvm.ir.GenericConst) or str(expr.value.dtype) != "float32":
        return None
    value = expr.value.numpy().astype(np.float64)
    return value if np.all(np.isfinite(value)) else None


def _step(expr: relax.Expr):
    """``(x, a, b)`` with ``expr = x * a + b`` for one float32 affine op of a constant, else
    None."""
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name in _AFFINE and str(getattr(expr.ty, "dtype", "")) == "float32"):
        return None
    lhs, rhs = expr.args
    name = expr.op.name
    c = _constant(rhs)
    if c is not None:
        return {"relax.add": (lhs, 1.0, c), "relax.subtract": (lhs, 1.0, -c),
                "relax.multiply": (lhs, c, 0.0)}[name]
    c = _constant(lhs)
    if c is not None:
        return {"relax.add": (rhs, 1.0, c), "relax.subtract": (rhs, -1.0, c),
                "relax.multiply": (rhs, c, 0.0)}[name]
    return None


def compose(expr: relax.Expr, values: dict, single_use: set):
    """``(x, a, b, ops, first)``: ``expr = x * a + b`` through ``ops`` affine ops of constants,
    each op's value operand a variable bound (in ``values``) to the next one and read by
    nothing else (``single_use``); ``first`` is the variable of the chain's first op (None when
    ``expr`` is the only one)."""
    step = _step(expr)
    if step is None:
        return expr, 1.0, 0.0, 0, None
    x, a, b = step
    ops, first = 1, None
    while x in single_use and (inner := _step(values.get(x))) is not None:
        first = x
        x, a_in, b_in = inner
        a, b = np.multiply(a_in, a), np.multiply(b_in, a) + b
        ops += 1
    return x, a, b, ops, first


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.values, self.single_use = {}, set()
        if isinstance(func.body, relax.SeqExpr):
            self.values = {b.var: b.value for block in func.body.blocks for b in block.bindings
                           if isinstance(b, relax.VarBinding)}
            self.single_use = single_use_vars(func)
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        x, a, b, ops, first = compose(binding.value, self.values, self.single_use)
        if ops <= int(np.any(np.asarray(a) != 1.0)) + int(np.any(np.asarray(b) != 0.0)):
            super().visit_var_binding_(binding)
            return
        # The ops of the chain before this one are left unused, hence removed. The multiply
        # takes the name of the chain's first op, the add this binding's: the ONNX nodes they
        # came from (attribution.py) stay with the kernel that computes them.
        x = self.visit_expr(x)
        a, b = np.asarray(a), np.asarray(b)
        if np.all(a == 1.0):
            value = relax.op.add(x, relax.const(b.astype(np.float32)))
        elif np.all(b == 0.0) and np.broadcast_shapes(a.shape, b.shape) == a.shape:
            value = relax.op.multiply(x, relax.const(a.astype(np.float32)))
        else:
            scaled = self.builder_.emit(relax.op.multiply(x, relax.const(a.astype(np.float32))),
                                        name_hint=first.name if first is not None else "lv")
            value = relax.op.add(scaled, relax.const(b.astype(np.float32)))
        if isinstance(binding.var, relax.DataflowVar):
            new = self.builder_.emit(value, name_hint=binding.var.name)
        else:
            new = self.builder_.emit_output(value, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new)


@tvm.transform.module_pass(opt_level=0, name="FoldAffineChains")
class FoldAffineChains:
    """Compose chains of constant scales and shifts into ``x * a + b`` in every Relax
    function, the fused GEMM groups included."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod), eliminate_dead_code=True)
