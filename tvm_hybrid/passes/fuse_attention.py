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

int8 (QDQ) attention, as ONNX Runtime's quantizer writes it, is matched too: ``Q``, ``KT``
and ``V`` each ``dequantize`` of a per-tensor ``u8`` tensor (read through permutations and
through ``quantize``/``dequantize`` pairs of the same parameters on either side of one), and
``P`` the ``dequantize(quantize(softmax(..)))`` of ``u8`` or ``s8``; it becomes the
preparation kernel and the int8 kernel of ``schedules/attention/quantized_kernel.py`` on
``u8`` operands (AMX's ``tdpbusd`` tiles, VNNI's ``vpdpbusd``, or AVX2's ``vpmaddwd`` on s16
words without them).
With ``precision="bf16"`` an fp32 attention becomes the bf16 preparation and kernel of
``schedules/attention/bf16_kernel.py`` where the CPU has a bf16 dot product (AVX512-BF16)
faster than its fp32 FMAs (AMD Zen 4 and 5; ``heuristics.bf16_attention_pays``), the same
preparation and ``amx_kernel.py``'s kernel on CPUs with AMX-BF16 (head dimensions that are
multiples of 32), and stays fp32 elsewhere.
ONNX's ``Attention`` op arrives in the fp32 form (``frontend/attention.py``).

The softmax may also be ``reshape(softmax(reshape(S, [n, s])), S.shape)`` with the keys' axis
kept: TVM's import of ONNX's ``Softmax`` before opset 13 (paddle2onnx's exports).

Declined, left to the per-op kernels: other dtypes, dynamic shapes, intermediate values used
elsewhere, a boolean mask applied after the additive one; for int8 also targets without AVX2,
a ``K^T`` given as such (``bhds``) and a head dimension that is not a multiple of the dot
product's group. (Masks of either kind are fused in int8 as in fp32; any head dimension in
fp32.)"""

from __future__ import annotations

import dataclasses
import logging

import tvm
from tvm import relax

from ..schedules.attention import AttentionShape, attention_kernel, knobs_for
from ..schedules.attention.amx_kernel import KEY_MULTIPLE, amx_attention_kernel
from ..schedules.attention.bf16_kernel import (
    bf16_attention_kernel,
    bf16_prep_kernel,
    bf16_prep_shapes,
)
from ..schedules.attention.heuristics import bf16_attention_pays
from ..schedules.attention.quantized_kernel import (
    attention_prep_kernel,
    prep_dtypes,
    prep_shapes,
    quantized_attention_kernel,
)
from ..schedules.attention.workload import Quantization
from .relax_rewrite import (
    TargetMutator,
    TargetPass,
    bound_value,
    constant_value,
    is_op,
    rewrite_functions,
    single_use_vars,
    static_shape,
)

logger = logging.getLogger(__name__)

#: Name prefix of the fused attention kernels.
FUSED_ATTENTION = "hybrid_attention"
#: Name prefix of an int8 attention's preparation kernel (``K``'s sums, ``V``'s words).
ATTENTION_PREP = "hybrid_attention_prep"


def _shape(expr: relax.Expr, dtype: str = "float32") -> tuple[int, ...] | None:
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or str(ty.dtype) != dtype:
        return None
    return static_shape(ty)


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
        #: fp32 attentions compute in bf16 (``precision="bf16"``) where the CPU has bf16 dots
        self.bf16 = False

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
        if fused is not None and self.bf16 and fused[0].quant is None:
            in_bf16 = dataclasses.replace(fused[0], bf16=True)
            # else fp32: no bf16 dot product, or one no faster than fp32 FMAs
            if bf16_attention_pays(self.target) and knobs_for(self.target, in_bf16) is not None:
                fused = (in_bf16, *fused[1:])
        knobs = knobs_for(self.target, fused[0]) if fused is not None else None
        if knobs is None:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        shape, operands, absorbed = fused
        call = self._kernel_call(shape, knobs, operands)
        if isinstance(binding.var, relax.DataflowVar):
            new = self.builder_.emit(call, name_hint=binding.var.name)
        else:
            new = self.builder_.emit_output(call, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new)
        self.absorbed[new] = [*absorbed, binding.var]
        logger.debug("fused %s: %s", shape.describe(), knobs.describe())

    def _kernel_call(self, shape: AttentionShape, knobs, operands: list) -> relax.Call:
        """The ``call_tir`` of the fused kernel on ``operands`` (``Q, K, V, masks``); an int8
        attention's ``K`` and ``V`` first go through its preparation kernel."""
        out = relax.TensorType(shape.tensor_shape(shape.out_layout, shape.q_len), "float32")
        if shape.bf16:
            q, k, v, *masks = operands
            # The AMX kernel's tile steps need the keys padded to 32.
            amx = knobs.qk.per_block
            multiple = KEY_MULTIPLE if amx else 1
            prep = self.builder_.add_func(bf16_prep_kernel(shape, multiple), ATTENTION_PREP)
            prepared = self.builder_.emit(relax.call_tir(
                prep, [k, v],
                [relax.TensorType(s, "int32") for s in bf16_prep_shapes(shape, multiple)]))
            words = [self.builder_.emit(relax.TupleGetItem(prepared, i)) for i in range(2)]
            kernel = amx_attention_kernel if amx else bf16_attention_kernel
            gvar = self.builder_.add_func(kernel(shape, knobs), FUSED_ATTENTION)
            return relax.call_tir(gvar, [q, *words, *masks], out)
        if shape.quant is None:
            gvar = self.builder_.add_func(attention_kernel(shape, knobs), FUSED_ATTENTION)
            return relax.call_tir(gvar, operands, out)
        q, k, v, *masks = operands
        group, amx = knobs.qk.k_step, knobs.qk.per_block
        shapes = prep_shapes(shape, group, amx)
        prep = self.builder_.add_func(attention_prep_kernel(shape, group, amx), ATTENTION_PREP)
        prepared = self.builder_.emit(relax.call_tir(
            prep, [k, v], [relax.TensorType(s, t) for s, t in zip(shapes,
                                                                 prep_dtypes(group, amx))]))
        parts = [self.builder_.emit(relax.TupleGetItem(prepared, i)) for i in range(len(shapes))]
        gvar = self.builder_.add_func(quantized_attention_kernel(shape, knobs), FUSED_ATTENTION)
        # VNNI reads K in place (its sums are compensations); s16 reads K's words instead.
        keys = [k] if group == 4 else []
        return relax.call_tir(gvar, [q, *keys, *parts, *masks], out)

    # -- matching ------------------------------------------------------------------------

    def _single(self, var: relax.Expr) -> bool:
        return isinstance(var, relax.Var) and var in self.single_use

    def _attention(self, value: relax.Expr):
        """``(AttentionShape, operands)`` when ``value`` is ``softmax(...) @ V``, else None."""
        if not is_op(value, "relax.matmul") or _shape(value) is None:
            return None
        probs_var, v = value.args
        softmax_var, p_quant, p_vars = self._quantized_probs(probs_var)
        rank = len(_shape(value))
        found = self._softmax_input(softmax_var)
        if rank not in (3, 4) or found is None:
            return None
        logits, softmax_vars = found
        # Each intermediate value (scores, scaled, masked) read by the next step only.
        masked, mask = self._unmask(logits)
        scores, cond = self._unwhere(masked)
        product_var, scale = self._unscale(scores)
        product = bound_value(self, product_var)
        chain = list(dict.fromkeys([logits, masked, scores, product_var]))
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
        quantized = p_quant is not None
        reads = [self._operand(x, rank, x is kt, quantized) for x in (q, kt, v)]
        if quantized and (any(r is None for r in reads) or reads[1][1] == "bhds"):
            return None  # int8: u8 Q, K, V read in bhsd/bshd
        (q_src, q_layout, q_quant, q_vars), (k_src, k_layout, k_quant, k_vars), \
            (v_src, v_layout, v_quant, v_vars) = reads
        quant = Quantization(*q_quant, *k_quant, *v_quant, *p_quant) if quantized else None
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
                               fill, keep_if, quant)
        absorbed = [*p_vars, *softmax_vars, *chain, *q_vars, *k_vars, *v_vars]
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

    def _softmax_input(self, var: relax.Expr):
        """``(x, vars)`` when the single-use ``var`` is ``softmax(x)`` over the last axis, or
        ``reshape(softmax(reshape(x, [n, s])), x.shape)`` with the last axis kept (how TVM
        imports ONNX's Softmax before opset 13: rows flattened to 2-D, as Paddle's exports
        have it); ``vars``: the variables read through. None otherwise."""
        node = bound_value(self, var)
        if not self._single(var) or _shape(var) is None:
            return None
        if is_op(node, "relax.nn.softmax"):
            last = int(node.attrs.axis) in (-1, len(_shape(var)) - 1)
            return (node.args[0], [var]) if last else None
        if not is_op(node, "relax.reshape"):
            return None
        flat_probs = node.args[0]
        softmax = bound_value(self, flat_probs)
        if not (self._single(flat_probs) and is_op(softmax, "relax.nn.softmax")
                and _shape(flat_probs) is not None
                and int(softmax.attrs.axis) in (-1, len(_shape(flat_probs)) - 1)):
            return None
        flat = softmax.args[0]
        flatten = bound_value(self, flat)
        if not (self._single(flat) and is_op(flatten, "relax.reshape")):
            return None
        logits = flatten.args[0]
        if _shape(logits) != _shape(var) or _shape(flat)[-1] != _shape(var)[-1]:
            return None
        return logits, [var, flat_probs, flat]

    def _quantized_probs(self, probs: relax.Expr):
        """``(softmax, (sp, zp), vars)`` for ``dequantize(quantize(softmax, sp, zp), sp, zp)``
        (``u8`` or ``s8``, each single-use; ``zp`` as a ``u8`` zero point), else
        ``(probs, None, [])``."""
        dq = bound_value(self, probs)
        params = _quant_params(self, dq)
        if params is None or not is_op(dq, "relax.dequantize") or not self._single(probs):
            return probs, None, []
        q_var = dq.args[0]
        q = bound_value(self, q_var)
        if not (is_op(q, "relax.quantize") and self._single(q_var)) \
                or _quant_params(self, q) != params:
            return probs, None, []
        return q.args[0], params, [probs, q_var]

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

    def _operand(self, expr: relax.Expr, rank: int, keys: bool, quantized: bool):
        """Where the kernel reads the operand ``expr`` (``[.., s, d]``, or ``K^T``'s
        ``[.., d, s]`` when ``keys``): ``(source, layout, quantization, vars)``, reading
        through ``permute_dims`` (composed) and, when ``quantized``, one per-tensor ``u8``
        ``dequantize`` (``quantization``: its ``(scale, zero)``; a ``quantize`` and
        ``dequantize`` of the same parameters around a permutation, as QDQ quantizers leave
        them, read through too). ``vars``: the variables read through. The deepest source
        whose order is a layout (``workload``) wins; None when none is (``quantized``: none
        dequantized)."""
        perm, dq, pending, read = tuple(range(rank)), None, None, []
        found = None if quantized else (expr, _layout(perm, keys), None, [])
        while isinstance(expr, relax.Var):
            node = bound_value(self, expr)
            params = _quant_params(self, node)
            if is_op(node, "relax.permute_dims") and _axes(node) is not None:
                perm = tuple(_axes(node)[p] for p in perm)
            elif quantized and is_op(node, "relax.dequantize") and params is not None \
                    and (dq is None or params == pending):
                dq, pending = params, None
            elif dq is not None and pending is None and is_op(node, "relax.quantize") \
                    and params == dq:
                pending = dq  # requantized with the same parameters: the identity
            else:
                break
            read.append(expr)
            expr = node.args[0]
            layout = _layout(perm, keys)
            dtype = "uint8" if dq is not None else "float32"
            if layout and pending is None and (dq is not None) == quantized \
                    and _shape(expr, dtype) is not None:
                found = (expr, layout, dq, list(read))
        return found

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


def _layout(perm: tuple[int, ...], keys: bool) -> str | None:
    """The layout of a tensor whose dimensions, permuted by ``perm``, are ``[.., s, d]``
    (``[.., d, s]`` when ``keys``), or None."""
    if len(perm) == 3:
        table = {(0, 2, 1): "bhsd", (0, 1, 2): "bhds"} if keys else {(0, 1, 2): "bhsd"}
    else:
        table = ({(0, 1, 3, 2): "bhsd", (0, 2, 3, 1): "bshd", (0, 1, 2, 3): "bhds"} if keys
                 else {(0, 1, 2, 3): "bhsd", (0, 2, 1, 3): "bshd"})
    return table.get(perm)


def _quant_params(mutator, node) -> tuple[float, int] | None:
    """``(scale, zero)`` of a per-tensor ``quantize`` to / ``dequantize`` from ``u8`` or
    ``s8`` (its zero point as a ``u8`` one: ``s8`` plus 128), else None."""
    if not (is_op(node, "relax.quantize") or is_op(node, "relax.dequantize")):
        return None
    dtype = str(node.attrs.out_dtype) if is_op(node, "relax.quantize") else \
        str(getattr(node.args[0].ty, "dtype", ""))
    scale, zero = (constant_value(mutator, a) for a in node.args[1:3])
    if dtype not in ("uint8", "int8") or scale is None or zero is None or scale.size != 1 \
            or zero.size != 1 or not float(scale.reshape(())) > 0:
        return None
    return float(scale.reshape(())), int(zero.reshape(())) + (128 if dtype == "int8" else 0)


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention(TargetPass):
    """Rewrite attention subgraphs to fused kernels (module docstring)."""

    mutator = _Fuser

    def __init__(self, target: tvm.target.Target, recorder=None, precision: str = "fp32"):
        super().__init__(target)
        self.recorder = recorder
        self.precision = precision

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = self.mutator(mod, self.target)
        fuser.bf16 = self.precision == "bf16"
        out = rewrite_functions(mod, fuser, eliminate_dead_code=True)
        if self.recorder is not None:
            for var, originals in fuser.absorbed.items():
                self.recorder.absorbed(var, originals)
        return out
