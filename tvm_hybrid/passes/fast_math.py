"""``FastMath``: exp, erf, tanh, sigmoid and softmax to TVM's vectorisable polynomial forms.

The same rewrite as ``relax.transform.FastMathTransform`` (``topi.fast_exp``, ``fast_erf``,
``fast_tanh``, ``nn.fast_softmax``; relative error below 1e-6 in fp32), but it also enters the
fused GEMM functions and leaves calls to functions alone (TVM's pass assumes every callee is an
operator). Without it these ops become scalar libm calls that stall GELU epilogues and softmax.
``fast_erf`` clamps its argument, which turns NaN into 1: a NaN input keeps its NaN here
(``where(isnan(x), x, fast_erf(x))``), as exp, tanh and softmax already do. Sigmoid is
``1 / (1 + fast_exp(-x))`` (SiLU epilogues of YOLO-style convolutions), NaN kept likewise.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.transform.fast_math import FastMathCodeGenerator


@relax.expr_functor.mutator
class _FastMathRewriter(FastMathCodeGenerator._cls):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not isinstance(call.op, tvm.ir.Op):
            return self.visit_expr_post_order(call)
        if call.op.name == "relax.sigmoid" and str(call.ty.dtype) == "float32":
            x = self.visit_expr(call.args[0])
            negated = self.builder_.emit(relax.op.negative(x))
            exp = self.builder_.emit(super().visit_call_(relax.op.exp(negated)))
            one = relax.const(1.0, "float32")
            fast = self.builder_.emit(relax.op.divide(one, relax.op.add(one, exp)))
            return relax.op.where(relax.op.isnan(x), x, fast)
        fast = super().visit_call_(call)
        if call.op.name != "relax.erf":
            return fast
        x = self.visit_expr(call.args[0])
        return relax.op.where(relax.op.isnan(x), x, self.builder_.emit(fast))


@tvm.transform.module_pass(opt_level=0, name="FastMath")
class FastMath:
    """Rewrite exp/erf/tanh/sigmoid/softmax in every Relax function to their fast forms."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _FastMathRewriter(mod)
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()
