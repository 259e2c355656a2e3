"""``FoldScalesIntoWeights``: per-channel scales and shifts after a GEMM into its weight and bias.

An inference BatchNorm after a convolution is ``(y - mean) / sqrt(var + eps) * gamma + beta``
(``DecomposeOpsForInference`` leaves four ops; paddle2onnx exports it as ``Mul`` and ``Add``).
Once the convolution is ``matmul(x, W)`` with a constant ``W[K, N]`` (``passes/conv_gemm.py``)
and reshapes are out of the way (``passes/sink_reshapes.py``), every channel-wise constant
folds into the weight and one bias::

    matmul(x, W) * c          ->  matmul(x, W * c)       (/ c likewise)
    (y + b) * c               ->  y * c + b * c          (/ c likewise; y - b is y + (-b))
    (y + b1) + b2             ->  y + (b1 + b2)

with ``c`` and ``b`` constants of shape ``[N]`` (or broadcasting only along the last axis, or
scalars). The depthwise kernel's taps ``[KH, KW, C]`` and the direct convolution's packed
weights scale the same way; a grouped convolution's output ``[N, OH, OW, G, Og]`` has its
channels in the last two axes, its constants ``[G, Og]``. What remains is the
GEMM and a bias, which the epilogue patterns fuse. A GEMM or partial sum used elsewhere too
is left alone (rewriting it would compute it twice).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm

from .conv_computes import DEPTHWISE, DIRECT_CONV, is_grouped_conv
from .relax_rewrite import (
    bound_value,
    constant_value,
    is_op,
    rewrite_functions,
    single_use_vars,
)

#: Ops a grouped convolution's channel layout passes through (its scales and shifts).
_CHANNEL_WISE = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide")


@tvm.transform.module_pass(opt_level=0, name="FoldScalesIntoWeights")
class FoldScalesIntoWeights:
    """Fold channel-wise constant scales and shifts into GEMM weights (see the module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Folder(mod), eliminate_dead_code=True)


@relax.expr_functor.mutator
class _Folder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self._single_use: set[relax.Var] = set()

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self._single_use = single_use_vars(func)
        return super().visit_function_(func)

    def _emit(self, expr: relax.Expr) -> relax.Var:
        """Bind ``expr``; the new variable has one reader, the expression built on it."""
        var = self.builder_.emit(expr)
        self._single_use.add(var)
        return var

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        for name, sign in (("relax.multiply", 1), ("relax.divide", -1)):
            if is_op(call, name):
                folded = self._scale(call, sign)
                if folded is not None:
                    return folded
        if is_op(call, "relax.add") or is_op(call, "relax.subtract"):
            folded = self._shift(call)
            if folded is not None:
                return folded
        return call

    def _channel_constant(self, expr: relax.Expr, dims: tuple[int, ...]) -> np.ndarray | None:
        """``expr`` as a float32 vector over the channel axes ``dims`` (``(C,)``, or a grouped
        convolution's ``(G, Og)``), flattened; a scalar broadcast; else None (a constant of
        another shape varies along other axes)."""
        value = constant_value(self, expr)
        if value is None or value.dtype != np.float32:
            return None
        size = int(np.prod(dims))
        if value.size == 1:
            return np.full(size, value.reshape(()), np.float32)
        if value.size != size or value.ndim < len(dims) \
                or tuple(value.shape[-len(dims):]) != tuple(dims):
            return None
        return value.reshape(-1)

    def _channels(self, call: relax.Expr) -> tuple[int, ...] | None:
        """The channel axes of ``call``'s output: its last, or the last two of a grouped
        convolution's ``[N, OH, OW, G, Og]`` (and of the scales and shifts after it)."""
        ty = call.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or str(ty.dtype) != "float32":
            return None
        grouped = ty.ndim == 5 and self._from_grouped_conv(call, 8)
        tail = list(ty.shape.values[-2:] if grouped else ty.shape.values[-1:])
        if not tail or not all(isinstance(d, IntImm) for d in tail):
            return None
        return tuple(int(d) for d in tail)

    def _from_grouped_conv(self, expr: relax.Expr, depth: int) -> bool:
        """Whether ``expr`` is a grouped convolution's output, through channel-wise ops."""
        value = bound_value(self, expr) if isinstance(expr, relax.Var) else expr
        if is_op(value, "relax.call_tir"):
            return is_grouped_conv(value)
        if depth and any(is_op(value, op) for op in _CHANNEL_WISE):
            return any(self._from_grouped_conv(arg, depth - 1) for arg in value.args
                       if isinstance(arg, relax.Var))
        return False

    def _channel_const(self, vector: np.ndarray, like: relax.Expr) -> relax.Constant:
        """A per-channel ``vector`` as a constant for ``like``'s output: ``[C]``, or
        ``[G, Og]`` after a grouped convolution."""
        return relax.const(np.ascontiguousarray(vector.reshape(self._channels(like))))

    def _scale(self, call: relax.Call, sign: int) -> relax.Expr | None:
        """``y * c`` (``sign`` 1) or ``y / c`` (-1) pushed into ``y``'s weight."""
        channels = self._channels(call)
        if channels is None:
            return None
        y, c = call.args
        scale = self._channel_constant(c, channels)
        if scale is None and sign == 1:  # c * y
            c, y = call.args
            scale = self._channel_constant(c, channels)
        if scale is None or not np.all(np.isfinite(scale)) or not np.all(scale != 0):
            return None
        return self._scaled(y, scale if sign == 1 else 1 / scale)

    def _scaled(self, y: relax.Expr, scale: np.ndarray) -> relax.Expr | None:
        """``y * scale`` as a new expression without the multiply, or None."""
        if not isinstance(y, relax.Var) or y not in self._single_use:
            return None
        value = bound_value(self, y)
        if is_op(value, "relax.matmul"):
            x, weight = value.args
            w = constant_value(self, weight)
            if w is None or w.dtype != np.float32 or w.ndim != 2 or w.shape[1] != scale.size:
                return None
            return relax.op.matmul(x, relax.const(np.ascontiguousarray(w * scale)))
        if is_op(value, "relax.call_tir") and value.args[0].name_hint.startswith(DEPTHWISE):
            x, taps = value.args[1].fields
            t = constant_value(self, taps)
            if t is None or t.shape[-1] != scale.size:
                return None
            return relax.call_tir(value.args[0], [x, relax.const(t * scale)], value.ty)
        if is_op(value, "relax.call_tir") and value.args[0].name_hint.startswith(DIRECT_CONV):
            x, packed = value.args[1].fields
            p = constant_value(self, packed)  # [panels, KH, KW, C, nr] or [G, panels, ...]
            if p is not None and p.ndim == 6:
                return self._scaled_groups(value, x, p, scale)
            if p is None or p.shape[0] * p.shape[-1] < scale.size:
                return None
            padded = np.zeros(p.shape[0] * p.shape[-1], np.float32)
            padded[:scale.size] = scale
            scaled = p * padded.reshape(p.shape[0], 1, 1, 1, p.shape[-1])
            return relax.call_tir(value.args[0], [x, relax.const(scaled)], value.ty)
        if is_op(value, "relax.add"):
            inner, bias = value.args
            dims = self._channels(value)
            if dims is None or int(np.prod(dims)) != scale.size:
                return None
            b = self._channel_constant(bias, dims)
            if b is None:
                inner, bias = bias, inner
                b = self._channel_constant(bias, dims)
            if b is None:
                return None
            scaled = self._scaled(inner, scale)
            if scaled is None:
                return None
            return relax.op.add(self._emit(scaled), self._channel_const(b * scale, value))
        return None

    def _scaled_groups(self, conv: relax.Call, x: relax.Expr, packed: np.ndarray,
                       scale: np.ndarray) -> relax.Expr | None:
        """The grouped convolution ``conv`` (weights ``packed[G, panels, KH, KW, Cg, nr]``,
        output ``[.., G, Og]``) with its output channels times ``scale`` (``G * Og``)."""
        groups, panels, nr = packed.shape[0], packed.shape[1], packed.shape[-1]
        per_group = int(conv.ty.shape.values[-1])
        if scale.size != groups * per_group or per_group > panels * nr:
            return None
        padded = np.zeros((groups, panels * nr), np.float32)
        padded[:, :per_group] = scale.reshape(groups, per_group)
        scaled = packed * padded.reshape(groups, panels, 1, 1, 1, nr)
        return relax.call_tir(conv.args[0], [x, relax.const(scaled)], conv.ty)

    def _shift(self, call: relax.Call) -> relax.Expr | None:
        """``(y + b1) + b2`` as ``y + (b1 + b2)``; ``y - b`` as ``y + (-b)`` when ``y`` is a
        GEMM (so that it can fold on)."""
        channels = self._channels(call)
        if channels is None:
            return None
        y, b = call.args
        shift = self._channel_constant(b, channels)
        subtract = is_op(call, "relax.subtract")
        if shift is None and not subtract:
            b, y = call.args
            shift = self._channel_constant(b, channels)
        if shift is None:
            return None
        shift = -shift if subtract else shift
        value = bound_value(self, y)
        if isinstance(y, relax.Var) and y in self._single_use and is_op(value, "relax.add"):
            inner, first = value.args
            b1 = self._channel_constant(first, channels)
            if b1 is None:
                first, inner = value.args
                b1 = self._channel_constant(first, channels)
            if b1 is not None:
                return relax.op.add(inner, self._channel_const(b1 + shift, call))
        if subtract and self._is_weighted(value):
            return relax.op.add(y, self._channel_const(shift, call))
        return None

    def _is_weighted(self, value: relax.Expr) -> bool:
        return is_op(value, "relax.matmul") or (
            is_op(value, "relax.call_tir")
            and value.args[0].name_hint.startswith((DEPTHWISE, DIRECT_CONV)))
