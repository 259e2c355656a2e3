"""The bf16 attention kernel: both products on the bf16 microkernels, the softmax in fp32.

With ``precision="bf16"`` on a CPU with a bf16 dot product (AVX512-BF16's ``vdpbf16ps``), an
fp32 attention computes ``Q . K^T`` and ``P . V`` in bf16 (operands rounded to nearest even,
products accumulated in fp32), as the GEMMs with constant weights do in that mode. One
parallel task per ``(batch, head, query block)``; the scores of every key of the block stay in
L2 (``kv_len x q_block`` fp32), no ``q_len x kv_len`` buffer::

    KW[g, j] = bf16(K[j, 2g]) | bf16(K[j, 2g + 1]) << 16    # preparation, once per (b, h)
    VW[g, c] = bf16(V[2g, c]) | bf16(V[2g + 1, c]) << 16    # keys past the end are 0
    QP[g, i] = bf16(Q[q0 + i, 2g]) | bf16(Q[q0 + i, 2g + 1]) << 16          # per task
    S[j, i]  = scale * KW[:, j] . QP[:, i]  [masks]         # bf16 products, fp32 sums
    e[j, i]  = exp(S[j, i] - max_j S[:, i]);  l[i] = sum_j e[j, i]          # fp32, in base 2
    PP[g, i] = bf16(e[2g, i]) | bf16(e[2g + 1, i]) << 16
    out[q0 + i, c] = (VW[:, c] . PP[:, i]) / l[i]

Both products run a bf16 family's update in the registry's tile body
(:func:`~tvm_hybrid.microkernels.tiles.grouped_updates`) on words of two bf16: ``vdpbf16ps``
(:func:`~tvm_hybrid.microkernels.families.bf16_dot.dpbf16_update`), or, for the tests on CPUs
without it, the widening family's FMAs
(:func:`~tvm_hybrid.microkernels.families.bf16_widening.widening_update`), which compute the
same sums of exact products. Rounding the operands and probabilities to bf16 (8 significant
bits) gives errors of about ``2**-9`` relative to the output's scale, like the bf16 GEMMs.
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T

from ...microkernels.families.bf16_dot import DPBF16PS_IR, dpbf16_update
from ...microkernels.families.bf16_widening import widening_update
from ...microkernels.tiles import grouped_updates
from .heuristics import AttentionKnobs
from .kernel import (
    _LOG2E,
    _LOWEST,
    ATTENTION_ATTR,
    FLOPS_ATTR,
    SHAPE_ATTR,
    apply_masks,
    base2_scale,
    exp2_nonpositive,
    kept_params,
)
from .workload import AttentionShape, element_offset


def native(kernel) -> bool:
    """Whether ``kernel``'s family has a bf16 dot product (else it widens to fp32)."""
    return "avx512bf16" in kernel.features


def _rounded(x):
    """The bits of fp32 ``x`` rounded to nearest even at bf16 (the bf16 in the top half)."""
    bits = T.reinterpret("int32", x)
    return bits + 0x7FFF + T.bitwise_and(T.shift_right(bits, 16), 1)


def pair_word(low, high):
    """One int32 word of two bf16: ``low`` (fp32, rounded) in the low half, ``high`` in the
    high half."""
    return T.bitwise_and(T.shift_right(_rounded(low), 16), 0xFFFF) | \
        T.bitwise_and(_rounded(high), -65536)


def bf16_prep_shapes(shape: AttentionShape,
                     key_multiple: int = 1) -> tuple[tuple[int, ...], ...]:
    """The shapes of the preparation's outputs: ``KW`` and ``VW`` (module docstring), keys
    padded to a multiple of ``key_multiple`` (the AMX kernel's 32; even for ``VW``)."""
    b, h, kv, d = shape.batch, shape.heads, shape.kv_len, shape.head_dim
    keys = -(-kv // key_multiple) * key_multiple
    return (b, h, d // 2, keys), (b, h, -(-keys // 2), d)


def bf16_prep_kernel(shape: AttentionShape, key_multiple: int = 1) -> tirx.PrimFunc:
    """``K, V -> KW, VW`` of a bf16 attention (module docstring): both operands as words of
    two bf16, once per call, parallel over ``(batch, head)``; keys past the end (up to a
    multiple of ``key_multiple``) are zero words."""
    kv, d, heads = shape.kv_len, shape.head_dim, shape.heads
    kw_shape, vw_shape = bf16_prep_shapes(shape, key_multiple)
    keys, words = kw_shape[3], vw_shape[2]
    pairs, tail = divmod(kv, 2)
    layouts = {"k": shape.k_layout, "v": shape.v_layout}
    k_shape, v_shape = (shape.tensor_shape(layouts[n], kv) for n in ("k", "v"))
    numel = {n: math.prod(shape.tensor_shape(layouts[n], kv)) for n in layouts}

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, kv, b, h, row, col)

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8, FLOPS_ATTR: 0.0,
             ATTENTION_ATTR: "bf16 attention preparation: K's and V's bf16 pairs, once per "
             "(batch, head)"}

    @T.prim_func(private=True)
    def prep(K: T.Buffer(k_shape, "float32"), V: T.Buffer(v_shape, "float32"),
             KW: T.Buffer(kw_shape, "int32"), VW: T.Buffer(vw_shape, "int32")):
        T.func_attr(attrs)
        Kf = T.decl_buffer((numel["k"],), "float32", data=K.data)
        Vf = T.decl_buffer((numel["v"],), "float32", data=V.data)
        for t in T.parallel(shape.batch * heads):
            b = T.meta_var(t // heads)
            h = T.meta_var(t % heads)
            for j in range(kv):
                for g in range(d // 2):
                    KW[b, h, g, j] = pair_word(Kf[at("k", b, h, j, 2 * g)],
                                               Kf[at("k", b, h, j, 2 * g + 1)])
            for g, j in T.grid(d // 2, keys - kv):
                KW[b, h, g, kv + j] = 0
            for g in range(pairs):
                for c in T.vectorized(d):
                    VW[b, h, g, c] = pair_word(Vf[at("v", b, h, 2 * g, c)],
                                               Vf[at("v", b, h, 2 * g + 1, c)])
            if tail > 0:
                for c in T.vectorized(d):
                    VW[b, h, pairs, c] = pair_word(Vf[at("v", b, h, kv - 1, c)],
                                                   T.float32(0))
            for g in range(words - pairs - tail):
                for c in T.vectorized(d):
                    VW[b, h, pairs + tail + g, c] = 0

    return prep


def bf16_attention_kernel(shape: AttentionShape, knobs: AttentionKnobs) -> tirx.PrimFunc:
    """The bf16 attention PrimFunc of ``shape`` with ``knobs`` (tiles of a bf16 family).

    Parameters: ``Q`` (fp32), ``KW``, ``VW`` (:func:`bf16_prep_kernel`), the additive mask and
    the boolean mask when ``shape`` has them, then the fp32 output.
    """
    qk, pv = knobs.qk, knobs.pv
    if qk.k_step != 2 or shape.head_dim % 2 or shape.quant is not None:
        raise ValueError(f"no bf16 attention kernel for {shape.describe()} with "
                         f"{knobs.describe()}")
    updates = dpbf16_update if native(qk) else widening_update
    annotations = {"pragma_import_llvm": DPBF16PS_IR} if native(qk) else None
    lanes = qk.lanes
    q_len, kv, d, heads = shape.q_len, shape.kv_len, shape.head_dim, shape.heads
    bq = knobs.q_block
    q_blocks = -(-q_len // bq)
    tasks = shape.batch * heads * q_blocks
    words = -(-kv // 2)
    pairs, tail = divmod(kv, 2)
    dg, vectors = d // 2, bq // lanes
    scale = T.float32(base2_scale(shape))  # scores in base 2, as are the masks
    layouts = {"q": shape.q_layout, "o": shape.out_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], q_len)) for n in layouts}
    kw_shape, vw_shape = bf16_prep_shapes(shape)
    pv_tile = grouped_updates(pv, 2 * words, updates(pv, a_words=True, b_words=True),
                              annotations)

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, q_len, b, h, row, col)

    @T.macro
    def qk_tiles(KW, M, C, QP, ST, mx, b, h, q0, row0, rows, count):
        """``count`` tiles of ``rows`` keys from key ``row0``: scores, masks, row max."""
        tile = T.meta_var(grouped_updates(dataclasses.replace(qk, mr=rows), d,
                                          updates(qk, a_words=True, b_words=True), annotations))
        for jt in range(count):
            acc = T.alloc_buffer((rows, bq), "float32")
            for j in T.unroll(rows):
                for v in T.unroll(vectors):
                    acc[j, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.float32(0), lanes)
            keys = T.decl_buffer((dg, rows), "int32", data=KW.data,
                                 elem_offset=(b * heads + h) * dg * kv + row0 + jt * rows,
                                 strides=[kv, 1])
            tile(keys, QP, acc)
            for j in T.unroll(rows):
                for i in T.vectorized(bq):
                    ST[row0 + jt * rows + j, i] = apply_masks(
                        shape, acc[j, i] * scale, M, C, b, h, T.min(q0 + i, q_len - 1),
                        row0 + jt * rows + j, _LOG2E)
                    mx[i] = T.max(mx[i], ST[row0 + jt * rows + j, i])

    @T.macro
    def body(Q, KW, VW, M, C, Out):
        Qf = T.decl_buffer((numel["q"],), "float32", data=Q.data)
        Of = T.decl_buffer((numel["o"],), "float32", data=Out.data)
        VWf = T.decl_buffer((math.prod(vw_shape),), "int32", data=VW.data)
        for t in T.parallel(tasks):
            QP = T.alloc_buffer((dg, bq), "int32")
            ST = T.alloc_buffer((kv, bq), "float32")
            PP = T.alloc_buffer((words, bq), "int32")
            OT = T.alloc_buffer((d, bq), "float32")
            mx = T.alloc_buffer((bq,), "float32")
            ls = T.alloc_buffer((bq,), "float32")
            b = T.meta_var(t // (heads * q_blocks))
            h = T.meta_var(t // q_blocks % heads)
            q0 = T.meta_var(t % q_blocks * bq)
            # Q's block as words (rows past the end repeat the last query).
            for g, i in T.grid(dg, bq):
                QP[g, i] = pair_word(Qf[at("q", b, h, T.min(q0 + i, q_len - 1), 2 * g)],
                                     Qf[at("q", b, h, T.min(q0 + i, q_len - 1), 2 * g + 1)])
            for i in T.vectorized(bq):
                mx[i] = T.float32(_LOWEST)
                ls[i] = T.float32(0)
            qk_tiles(KW, M, C, QP, ST, mx, b, h, q0, 0, qk.mr, kv // qk.mr)
            if kv % qk.mr > 0:
                qk_tiles(KW, M, C, QP, ST, mx, b, h, q0, kv - kv % qk.mr, kv % qk.mr, 1)
            for j in range(kv):
                for i in T.vectorized(bq):
                    ST[j, i] = exp2_nonpositive(ST[j, i] - mx[i])
                    ls[i] = ls[i] + ST[j, i]
            for g in range(pairs):
                for i in T.vectorized(bq):
                    PP[g, i] = pair_word(ST[2 * g, i], ST[2 * g + 1, i])
            if tail > 0:
                for i in T.vectorized(bq):
                    PP[pairs, i] = pair_word(ST[kv - 1, i], T.float32(0))
            for i in T.vectorized(bq):
                ls[i] = T.float32(1) / ls[i]
            # P.V, channels by queries, then the output rows.
            for ct in range(d // pv.mr):
                acc = T.alloc_buffer((pv.mr, bq), "float32")
                for c in T.unroll(pv.mr):
                    for v in T.unroll(vectors):
                        acc[c, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.float32(0), lanes)
                values = T.decl_buffer((words, pv.mr), "int32", data=VWf.data,
                                       elem_offset=(b * heads + h) * words * d + ct * pv.mr,
                                       strides=[d, 1])
                pv_tile(values, PP, acc)
                for c in T.unroll(pv.mr):
                    for i in T.vectorized(bq):
                        OT[ct * pv.mr + c, i] = acc[c, i] * ls[i]
            for i in range(bq):
                if q0 + i < q_len:
                    for c in T.vectorized(d):
                        Of[at("o", b, h, q0 + i, c)] = OT[c, i]

    return words_kernel(shape, knobs, body, kw_shape, vw_shape)


def words_kernel(shape: AttentionShape, knobs: AttentionKnobs, body, kw_shape: tuple,
                 vw_shape: tuple) -> tirx.PrimFunc:
    """The PrimFunc of a kernel on the preparation's words: ``body(Q, KW, VW, M, C, Out)``
    (a macro) with the attention's attributes; the masks ``shape`` lacks are not parameters."""
    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
             ATTENTION_ATTR: knobs.describe(), FLOPS_ATTR: shape.flops, SHAPE_ATTR: shape.key}
    q_shape, o_shape = (shape.tensor_shape(layout, shape.q_len)
                        for layout in (shape.q_layout, shape.out_layout))
    m_shape, c_shape = shape.mask_shape or (1,), shape.cond_shape or (1,)

    # One signature; absent masks are declared with one element, never read, and dropped.
    @T.prim_func(private=True)
    def kernel(Q: T.Buffer(q_shape, "float32"), KW: T.Buffer(kw_shape, "int32"),
               VW: T.Buffer(vw_shape, "int32"), M: T.Buffer(m_shape, "float32"),
               C: T.Buffer(c_shape, "bool"), Out: T.Buffer(o_shape, "float32")):
        T.func_attr(attrs)
        body(Q, KW, VW, M, C, Out)

    kept = [True, True, True, shape.mask_shape is not None, shape.cond_shape is not None, True]
    return kept_params(kernel, kept)
