"""``SinkReshapes``: move a GEMM output's reshape after the elementwise ops that follow it.

A convolution on the GEMM engine (``passes/conv_gemm.py``) computes ``Y[N * OH * OW, O]`` and
reshapes it to ``[N, OH, OW, O]``; a transformer's projection is often reshaped into heads the
same way. The bias, BatchNorm scale and shift, activation and residual add come after the
reshape, where the GEMM epilogue patterns (``patterns.py``) cannot see them, and TVM's
``FuseOps`` does not fuse elementwise ops across a reshape into the GEMM either: each chain
became a kernel of its own that reads and writes the whole activation once more.

This pass rewrites, while the reshape's source comes from a GEMM (``matmul``, through the
elementwise ops already moved)::

    f(reshape(y, s))                        ->  reshape(f(y), s)        f unary elementwise
    g(reshape(y, s), c)                     ->  reshape(g(y, c'), s)    c a constant along the
                                                                        kept last axis, or scalar
    g(reshape(y, s), reshape(z, s))         ->  reshape(g(y, z), s)     y, z of one shape
    g(reshape(y, s), r)                     ->  reshape(g(y, reshape(r, y.shape)), s)

(``g`` binary elementwise, either operand order; ``r`` a tensor of shape ``s``.) A reshape
of a contiguous tensor is a view in Relax's VM, so the moved reshapes cost nothing.

A grouped convolution's kernel (``conv_computes.grouped_direct_conv``) computes
``Y[N, OH, OW, G, Og]``, reshaped to NHWC: its reshape moves the same way, a constant ``c``
along the ``G * Og`` channels becoming ``c'`` of shape ``[G, Og]``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .conv_computes import is_grouped_conv
from .relax_rewrite import bound_value, constant_value, is_op, is_static_tensor, rewrite_functions

#: Elementwise ops a reshape moves past.
UNARY = frozenset({"relax.sigmoid", "relax.tanh", "relax.nn.relu", "relax.nn.silu",
                   "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.leakyrelu", "relax.clip",
                   "relax.erf", "relax.exp", "relax.round", "relax.negative",
                   # an integer GEMM's accumulator to float (a quantized 1x1 convolution)
                   "relax.astype"})
BINARY = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                    "relax.maximum", "relax.minimum"})
#: How far back through moved elementwise ops a reshape's source is traced to its GEMM. A
#: quantized layer's epilogue (dequantize, BatchNorm, quantize-dequantize, HardSwish and its
#: quantize-dequantize) is about 25 ops; 16 left the reshape of a QDQ PP-LCNet's HardSwish in
#: place, one op short, so the HardSwish ran in the padding kernel after the GEMM, not in its
#: epilogue. The walk is memoised, so the depth costs nothing where chains are short.
_MAX_DEPTH = 64


@tvm.transform.module_pass(opt_level=0, name="SinkReshapes")
class SinkReshapes:
    """Move reshapes of GEMM outputs below their elementwise consumers (see the module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Sinker(mod), eliminate_dead_code=True)


def _op_name(expr: relax.Expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
        else None


@relax.expr_functor.mutator
class _Sinker(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        # Per (variable, depth left): whether it traces back to a GEMM. Without it the walk is
        # exponential in the depth where values feed several binary ops (unrolled LSTM cells).
        self._traced: dict[tuple[relax.Var, int], bool] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        name = _op_name(call)
        if name in UNARY:
            return self._unary(call)
        if name in BINARY and is_static_tensor(call.ty, ("float32",), min_ndim=1):
            return self._binary(call)
        return call

    def _reshaped_gemm(self, expr: relax.Expr) -> relax.Expr | None:
        """``y`` when ``expr`` is ``reshape(y, s)`` of a GEMM's (moved-past) output."""
        value = bound_value(self, expr)
        if not is_op(value, "relax.reshape"):
            return None
        source = value.args[0]
        if not is_static_tensor(source.ty, ("float32", "int32"), min_ndim=1):
            return None
        return source if self._from_gemm(source, _MAX_DEPTH) else None

    def _from_gemm(self, expr: relax.Expr, depth: int) -> bool:
        key = (expr, depth) if isinstance(expr, relax.Var) else None
        known = self._traced.get(key) if key is not None else None
        if known is not None:
            return known
        value = bound_value(self, expr)
        name = _op_name(value)
        found = name == "relax.matmul" or is_grouped_conv(value) or (
            depth > 0 and name in UNARY | BINARY
            and any(self._from_gemm(arg, depth - 1) for arg in value.args
                    if isinstance(arg, relax.Var)))
        if key is not None:
            self._traced[key] = found
        return found

    def _unary(self, call: relax.Call) -> relax.Expr:
        source = self._reshaped_gemm(call.args[0])
        if source is None:
            return call
        inner = self.builder_.emit(relax.Call(call.op, [source, *call.args[1:]], call.attrs))
        return relax.op.reshape(inner, call.ty.shape)

    def _binary(self, call: relax.Call) -> relax.Expr:
        a, b = call.args
        out_shape = [int(d) for d in call.ty.shape.values]
        for first, (this, other) in ((True, (a, b)), (False, (b, a))):
            source = self._reshaped_gemm(this)
            if source is None:
                continue
            other = self._other_operand(other, source, out_shape)
            if other is None:
                continue
            args = [source, other] if first else [other, source]
            inner = self.builder_.emit(relax.Call(call.op, args, call.attrs))
            return relax.op.reshape(inner, call.ty.shape)
        return call

    def _other_operand(self, other: relax.Expr, source: relax.Expr,
                       out_shape: list[int]) -> relax.Expr | None:
        """``other`` as an operand of the op on ``source`` (the un-reshaped value), or None."""
        src_shape = [int(d) for d in source.ty.shape.values]
        if not is_static_tensor(other.ty, ("float32",), min_ndim=0):
            return None
        other_shape = [int(d) for d in other.ty.shape.values]
        if other_shape == out_shape:
            twin = self._reshaped_gemm(other)
            if twin is not None and [int(d) for d in twin.ty.shape.values] == src_shape:
                return twin
            if isinstance(bound_value(self, other), tvm.ir.GenericConst):
                return None  # a full-size constant: leave the graph as it is
            return self.builder_.emit(relax.op.reshape(other, src_shape))
        value = constant_value(self, other)
        if value is None or value.ndim > len(out_shape):
            return None
        if value.size == 1:
            return relax.const(value.reshape(()))
        # A constant along the last axis only, which the reshape keeps (or merges from the
        # last two: a grouped convolution's [G, Og], whose leading axes may be merged or split
        # too: [N, 1, H * W, G, Og] of a 1x1 one to [N, H, W, G * Og]).
        lead = value.shape[:-1]
        if not all(d == 1 for d in lead) or value.shape[-1] != out_shape[-1]:
            return None
        if value.shape[-1] == src_shape[-1]:
            return relax.const(np.ascontiguousarray(value.reshape(-1)))
        if len(src_shape) >= 2 and np.prod(src_shape[:-2]) == np.prod(out_shape[:-1]) \
                and src_shape[-2] * src_shape[-1] == out_shape[-1]:  # [.., A, B] to [.., A * B]
            return relax.const(np.ascontiguousarray(value.reshape(src_shape[-2:])))
        return None

