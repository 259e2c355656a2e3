"""``ReciprocalDivisors``: division by a constant as multiplication by its reciprocal.

A QDQ graph divides every element it quantizes by the output scale (``QuantizeLinear``:
``round(x / scale)``), a BatchNormalization between quantization pairs divides by its
``sqrt(var + eps)``, HardSwish by 6. A vector division issues only every few cycles on x86
cores, a multiplication twice a cycle; the epilogue of a quantized MobileNet layer held five
such divisions per output element, and orientation_qdq_int8 ran 1.17x faster without them
(AVX2 Zen 3, same process).

``x / c`` with a constant float32 ``c`` (a scalar or a tensor broadcast against ``x``) becomes
``x * (1 / c)``, the reciprocal computed once in float64 and rounded to float32:

- where every ``c`` is a power of two the product equals the quotient bit for bit;
- otherwise it is within about one ulp of it (it differs from the correctly rounded quotient
  in a share of the elements, by one ulp): a quantized output whose scaled value lies within
  an ulp of a rounding boundary may then land one quantization step away (about one element
  in a million on random data), as with the FMA contraction the compiler already applies to
  these epilogues. ONNX Runtime's and OpenVINO's quantized kernels requantize by a
  multiplier the same way.

Divisors that are zero, infinite, NaN, or whose reciprocal is not a normal float32 keep the
division (their infinities and NaNs are the division's). Divisions by non-constants are left
alone.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .relax_rewrite import constant_value, rewrite_functions

_FLOAT32_MIN_NORMAL = float(np.finfo(np.float32).tiny)


def reciprocal(divisor: np.ndarray) -> np.ndarray | None:
    """``1 / divisor`` in float32 when every element has a normal float32 reciprocal and is
    itself finite and non-zero, else None."""
    value = np.asarray(divisor, dtype=np.float64)
    if value.size == 0 or not np.all(np.isfinite(value)) or np.any(value == 0):
        return None
    with np.errstate(over="ignore"):
        recip = (1.0 / value).astype(np.float32)
    if not np.all(np.isfinite(recip)) or np.any(np.abs(recip) < _FLOAT32_MIN_NORMAL):
        return None
    return recip


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.divide"):
            return call
        x, divisor = call.args
        constant = constant_value(self, divisor)
        if constant is None or constant.dtype != np.float32 or \
                str(getattr(call.ty, "dtype", "")) != "float32":
            return call
        recip = reciprocal(constant)
        if recip is None:
            return call
        return relax.op.multiply(x, relax.const(recip, "float32"))


@tvm.transform.module_pass(opt_level=0, name="ReciprocalDivisors")
class ReciprocalDivisors:
    """Rewrite ``x / c`` with a constant float32 ``c`` to ``x * (1 / c)`` in every Relax
    function, the fused GEMM groups included."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod), eliminate_dead_code=True)
