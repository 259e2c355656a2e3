"""``FuseAttention``: scaled dot-product attention subgraphs to one fused kernel each.

Matches the forms BERT/ViT/GPT exports produce::

    S   = [scale *] (Q [* c1]) @ (KT [* c2])                  # scores never stored whole
    S   = [where(cond, S, fill) | where(cond, fill, S)]       # boolean (causal) mask
    P   = softmax(S [+ mask], axis=-1)                        # additive (padding) mask
    out = P @ V                                               # [b, h, sq, d] (or [n, s, d])

with the head split around it: ``Q`` and ``V`` may be ``permute_dims(x, [0, 2, 1, 3])`` of a
``[b, s, h, d]`` tensor, ``KT`` ``permute_dims(K, [0, 1, 3, 2])`` (``K`` itself such a
permutation) or ``permute_dims(x, [0, 2, 3, 1])``, and a single-use
``permute_dims(out, [0, 2, 1, 3])`` after it (the head merge) is folded into the kernel's
output. The permutations are read through, not copied. Scales are scalar constants (``/ c``
or ``* c`` on the scores, ``* c`` on each operand as PyTorch's ``scaled_dot_product_attention``
exports it); the additive mask is an fp32 tensor and the boolean mask a bool tensor, each
broadcasting to the scores, the boolean one applied first, exactly as the graph orders them.
The subgraph becomes a ``call_tir`` of the kernel of ``schedules/attention`` (knobs from its
heuristic); identical attentions share one kernel.

Declined, left to the per-op kernels: other dtypes (int8 QDQ attention), dynamic shapes, a
head dimension that is not a whole number of vectors, intermediate values used elsewhere, a
boolean mask applied after the additive one."""

from __future__ import annotations

import dataclasses
import logging

import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm

from ..schedules.attention import AttentionShape, attention_kernel, knobs_for
from .relax_rewrite import (
    TargetMutator,
    TargetPass,
    bound_value,
    constant_value,
    is_op,
    rewrite_functions,
    single_use_vars,
)

logger = logging.getLogger(__name__)

#: Name prefix of the fused attention kernels.
FUSED_ATTENTION = "hybrid_attention"


def _shape(expr: relax.Expr, dtype: str = "float32") -> tuple[int, ...] | None:
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None or str(ty.dtype) != dtype:
        return None
    dims = ty.shape.values
    if not all(isinstance(d, IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def _axes(call: relax.Call) -> tuple[int, ...] | None:
    axes = call.attrs.axes
    return None if axes is None else tuple(int(a) for a in axes)


@relax.expr_functor.mutator
class _Fuser(TargetMutator):
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod, target)
        self.single_use: set[relax.Var] = set()
        #: attention outputs whose only use is a head merge ``permute_dims(.., [0, 2, 1, 3])``
        self.merged: set[relax.Var] = set()
        #: such an attention's var -> (shape, operands, absorbed), fused at its head merge
        self.fused: dict = {}
        #: fused call's var -> the original vars it replaced (the profile's ONNX nodes)
        self.absorbed: dict = {}

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.single_use = single_use_vars(func)
        self.merged = {
            binding.value.args[0]
            for block in func.body.blocks for binding in block.bindings
            if is_op(binding.value, "relax.permute_dims")
            and _axes(binding.value) == (0, 2, 1, 3) and binding.value.args[0] in self.single_use
        }
        self.fused = {}
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        fused = self._attention(value)
        if fused is not None and binding.var in self.merged:
            # The head merge after it writes [b, s, h, d]: fuse there, with it.
            self.fused[binding.var] = (*fused, binding.var)
            fused = None
        fused = fused or self._head_merge(value)
        knobs = knobs_for(self.target, fused[0]) if fused is not None else None
        if knobs is None:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        shape, operands, absorbed = fused
        gvar = self.builder_.add_func(attention_kernel(shape, knobs), FUSED_ATTENTION)
        out = relax.TensorType(shape.tensor_shape(shape.out_layout, shape.q_len), "float32")
        call = relax.call_tir(gvar, operands, out)
        if isinstance(binding.var, relax.DataflowVar):
            new = self.builder_.emit(call, name_hint=binding.var.name)
        else:
            new = self.builder_.emit_output(call, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new)
        self.absorbed[new] = [*absorbed, binding.var]
        logger.debug("fused %s: %s", shape.describe(), knobs.describe())

    # -- matching ------------------------------------------------------------------------

    def _single(self, var: relax.Expr) -> bool:
        return isinstance(var, relax.Var) and var in self.single_use

    def _attention(self, value: relax.Expr):
        """``(AttentionShape, operands)`` when ``value`` is ``softmax(...) @ V``, else None."""
        if not is_op(value, "relax.matmul") or _shape(value) is None:
            return None
        probs_var, v = value.args
        probs = bound_value(self, probs_var)
        if not (is_op(probs, "relax.nn.softmax") and self._single(probs_var)):
            return None
        rank = len(_shape(value))
        if rank not in (3, 4) or int(probs.attrs.axis) not in (-1, rank - 1):
            return None
        # Each intermediate value (scores, scaled, masked) read by the next step only.
        masked, mask = self._unmask(probs.args[0])
        scores, cond = self._unwhere(masked)
        product_var, scale = self._unscale(scores)
        product = bound_value(self, product_var)
        chain = list(dict.fromkeys([probs.args[0], masked, scores, product_var]))
        if not (is_op(product, "relax.matmul") and all(self._single(v) for v in chain)):
            return None
        q, kt = product.args
        # Scales applied to the operands (PyTorch's scaled_dot_product_attention export
        # multiplies Q and K^T by sqrt(scale) each) join the scores' scale.
        for operand in (q, kt):
            source, factor = self._scaled_operand(operand)
            if factor is not None:
                chain.append(operand)
                scale = (1.0 if scale is None else scale) * factor
        q, kt = (self._scaled_operand(x)[0] for x in (q, kt))
        shapes = [_shape(x) for x in (q, kt, v)]
        if any(s is None or len(s) != rank for s in shapes):
            return None
        (*lead, q_len, d), (*_, _, kv_len), (*_, _, dv) = shapes
        if dv != d or any(s[:-2] != tuple(lead) for s in shapes):
            return None
        batch, heads = (lead[0], lead[1]) if rank == 4 else (lead[0], 1)
        q_src, q_layout = self._split_heads(q, rank)
        k_src, k_layout = self._keys(kt, rank)
        v_src, v_layout = self._split_heads(v, rank)
        operands = [q_src, k_src, v_src]
        masks = {}
        for name, given, dtype in (("mask", mask, "float32"), ("cond", cond and cond[0], "bool")):
            if given is None:
                continue
            masks[name], expr = self._mask(given, rank, (*lead, q_len, kv_len), dtype)
            if masks[name] is None:
                return None
            operands.append(expr)
        fill, keep_if = (cond[1], cond[2]) if cond is not None else (0.0, True)
        shape = AttentionShape(batch, heads, q_len, kv_len, d, q_layout, k_layout, v_layout,
                               "bhsd", rank, masks.get("mask"), scale, masks.get("cond"),
                               fill, keep_if)
        absorbed = [probs_var, *chain]
        for start, source in ((q, q_src), (kt, k_src), (v, v_src)):
            absorbed += self._read_through(start, source)
        return shape, operands, absorbed

    def _head_merge(self, value: relax.Expr):
        """The fused attention again, writing ``[b, s, h, d]``, when ``value`` is the head
        merge ``permute_dims(out, [0, 2, 1, 3])`` of one whose output has no other use."""
        if not is_op(value, "relax.permute_dims") or _axes(value) != (0, 2, 1, 3):
            return None
        found = self.fused.get(value.args[0])
        if found is None:
            return None
        shape, operands, absorbed, attention = found
        return dataclasses.replace(shape, out_layout="bshd"), operands, [*absorbed, attention]

    def _read_through(self, var: relax.Expr, source: relax.Expr) -> list[relax.Var]:
        """The permutations' variables from ``var`` down to the ``source`` read in place."""
        out = []
        while isinstance(var, relax.Var) and not var.same_as(source):
            out.append(var)
            node = bound_value(self, var)
            if not is_op(node, "relax.permute_dims"):
                break
            var = node.args[0]
        return out

    def _unmask(self, expr: relax.Expr):
        """``(scores, mask)`` for ``scores + mask`` (either order), or ``(expr, None)``."""
        node = bound_value(self, expr)
        if is_op(node, "relax.add"):
            for scores, mask in (node.args, node.args[::-1]):
                inner = self._unscale(self._unwhere(scores)[0])[0]
                if is_op(bound_value(self, inner), "relax.matmul"):
                    return scores, mask
        return expr, None

    def _unwhere(self, expr: relax.Expr):
        """``(scores, (cond, fill, keep_if))`` for ``where(cond, scores, fill)`` or
        ``where(cond, fill, scores)`` with a scalar constant ``fill`` (``-inf``: GPT's causal
        mask); ``(expr, None)`` otherwise."""
        node = bound_value(self, expr)
        if not is_op(node, "relax.where") or not self._single(expr):
            return expr, None
        cond, a, b = node.args
        for scores, other, keep_if in ((a, b, True), (b, a, False)):
            fill = constant_value(self, other)
            if fill is None or fill.size != 1:
                continue
            if is_op(bound_value(self, self._unscale(scores)[0]), "relax.matmul"):
                return scores, (cond, float(fill.reshape(())), keep_if)
        return expr, None

    def _scaled_operand(self, expr: relax.Expr):
        """``(x, c)`` for a single-use ``x * c`` (``c`` a scalar constant); ``(expr, None)``."""
        node = bound_value(self, expr)
        if is_op(node, "relax.multiply") and self._single(expr):
            for x, factor in (node.args, node.args[::-1]):
                value = constant_value(self, factor)
                if value is not None and value.size == 1 and _shape(x) == _shape(expr):
                    return x, float(value.reshape(()))
        return expr, None

    def _unscale(self, expr: relax.Expr):
        """``(product, scale)`` for ``product / c`` or ``product * c``; ``(expr, None)``."""
        node = bound_value(self, expr)
        for name in ("relax.divide", "relax.multiply"):
            if not is_op(node, name):
                continue
            pairs = [node.args] if name == "relax.divide" else [node.args, node.args[::-1]]
            for product, factor in pairs:
                value = constant_value(self, factor)
                if value is None or value.size != 1 or not is_op(bound_value(self, product),
                                                                  "relax.matmul"):
                    continue
                c = float(value.reshape(()))
                if c == 0.0:
                    continue
                return product, (1.0 / c if name == "relax.divide" else c)
        return expr, None

    def _split_heads(self, x: relax.Expr, rank: int):
        """``x`` or, for ``permute_dims(y, [0, 2, 1, 3])``, ``y`` read as ``bshd``."""
        node = bound_value(self, x)
        if rank == 4 and is_op(node, "relax.permute_dims") and _axes(node) == (0, 2, 1, 3) \
                and _shape(node.args[0]) is not None:
            return node.args[0], "bshd"
        return x, "bhsd"

    def _keys(self, kt: relax.Expr, rank: int):
        """Where ``K`` is read from ``KT`` (``[.., d, kv]``) and its layout."""
        node = bound_value(self, kt)
        if is_op(node, "relax.permute_dims") and _shape(node.args[0]) is not None:
            axes = _axes(node)
            if axes == ((0, 1, 3, 2) if rank == 4 else (0, 2, 1)):
                return self._split_heads(node.args[0], rank)
            if rank == 4 and axes == (0, 2, 3, 1):
                return node.args[0], "bshd"
        return kt, "bhds"

    def _mask(self, mask: relax.Expr, rank: int, scores: tuple[int, ...], dtype: str):
        """The mask's 4-d broadcast shape and the mask reshaped to it, or ``(None, None)``."""
        shape = _shape(mask, dtype)
        if shape is None or len(shape) > rank:
            return None, None
        shape = (1,) * (rank - len(shape)) + shape
        if any(m not in (1, s) for m, s in zip(shape, scores)):
            return None, None
        four = shape if rank == 4 else (shape[0], 1, *shape[1:])
        if four != _shape(mask, dtype):
            mask = self.builder_.emit(relax.op.reshape(mask, list(four)))
        return four, mask


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention(TargetPass):
    """Rewrite attention subgraphs to fused kernels (module docstring)."""

    mutator = _Fuser

    def __init__(self, target: tvm.target.Target, recorder=None):
        super().__init__(target)
        self.recorder = recorder

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = self.mutator(mod, self.target)
        out = rewrite_functions(mod, fuser, eliminate_dead_code=True)
        if self.recorder is not None:
            for var, originals in fuser.absorbed.items():
                self.recorder.absorbed(var, originals)
        return out
