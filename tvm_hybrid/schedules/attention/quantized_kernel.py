"""The int8 (QDQ) attention kernel: both products on the VNNI microkernels, exact in integers.

An ONNX QDQ attention computes ``softmax(scale * dq(Q) . dq(K)^T + mask)`` in fp32, quantizes
the probabilities ``P`` and then ``dq(P) . dq(V)``. Quantizing ``P`` needs each row's final
maximum and sum, so this kernel has no online softmax: one parallel task per ``(batch, head,
query block)`` computes the scores of every key (``kv_len x q_block`` fp32, in L2), the exact
softmax, the quantized ``P``, then ``P . V``; no ``q_len x kv_len`` buffer. With ``Q``, ``K``,
``V`` in ``u8`` of zero points ``zq``, ``zk``, ``zv`` and ``P`` of ``zp`` (``zq' = zq - 128``,
``zp' = zp - 128``)::

    QP[g, i] = Q[q0 + i, 4g:4g + 4] - 128         # s8, 4 channels per int32 word, per task
    S[j, i]  = K[j, :] . QP[:, i] - zq' KS[j] - zk QS[i] + d zk zq'           # exact int32
    s[j, i]  = float(S) * (sq sk scale) [+ mask]                              # fp32
    p[j, i]  = clip(round(exp(s - max_j s) / sum_j exp(s - max_j s) / sp) + zp, 0, 255)
    PP[g, i] = p[4g:4g + 4, i] - 128              # s8 words; keys past the end are 0
    O[c, i]  = VW[:, c] . PP[:, i] - zp' VS[c] - zv PS[i] + kv zv zp'         # exact int32
    out[q0 + i, c] = float(O[c, i]) * (sp sv)

``QS[i]`` and ``PS[i]`` are the sums of a query's ``QP`` and ``P - 128`` bytes (``vpdpbusd``
by ones, and while packing). ``K . QP`` has ``K`` as the broadcast (``u8``) operand, read in
place in its layout (``bhsd`` or ``bshd``); ``VW . PP`` has ``V``'s words ``VW[g, c] =
V[4g:4g + 4, c]`` broadcast. ``KS`` (``sum_c K[j, c]``), ``VW`` and ``VS`` (``sum_j V[j, c]``)
depend on ``(batch, head)`` only: :func:`attention_prep_kernel` computes them once per call,
not once per query block. Both products run the VNNI family's update
(:func:`~tvm_hybrid.microkernels.families.vnni.vnni_update`) in the registry's tile body
(:func:`~tvm_hybrid.microkernels.tiles.grouped_updates`), ``mr`` keys (channels) by the query
block.

The integer parts are exact; the softmax is fp32 (``fast_exp``, a reciprocal of the sum), so a
probability whose scaled value falls within float rounding of a quantization boundary may
round to the neighbouring step (the tests measure how often).
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T

from ...microkernels.families.vnni import vnni_update
from ...microkernels.tiles import grouped_updates
from .heuristics import AttentionKnobs
from .kernel import (
    _LOWEST,
    ATTENTION_ATTR,
    FLOPS_ATTR,
    SHAPE_ATTR,
    apply_masks,
    fast_exp,
)
from .workload import AttentionShape, element_offset, row_strides

#: The bytes ``0x80`` of a word: ``u8 ^ 0x80`` is ``u8 - 128`` as ``s8``.
_SIGN_BITS = -0x7F7F7F80  # 0x80808080 as int32
_ONES = 0x01010101


def prep_shapes(shape: AttentionShape) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``KS``, ``VW`` and ``VS`` (module docstring) of ``shape``."""
    b, h, kv, d = shape.batch, shape.heads, shape.kv_len, shape.head_dim
    return (b, h, kv), (b, h, -(-kv // 4), d), (b, h, d)


def attention_prep_kernel(shape: AttentionShape) -> tirx.PrimFunc:
    """``K, V -> KS, VW, VS`` of a quantized attention (module docstring), parallel over
    ``(batch, head)``, vectorised over channels."""
    kv, d, heads = shape.kv_len, shape.head_dim, shape.heads
    ks_shape, vw_shape, vs_shape = prep_shapes(shape)
    groups, tail = divmod(kv, 4)
    layouts = {"k": shape.k_layout, "v": shape.v_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], kv)) for n in layouts}
    k_shape, v_shape = (shape.tensor_shape(layouts[n], kv) for n in ("k", "v"))

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, kv, b, h, row, col)

    def byte(Vf, b, h, key, c):
        return T.Cast("int32", Vf[at("v", b, h, key, c)])

    @T.prim_func(private=True)
    def prep(K: T.Buffer(k_shape, "uint8"), V: T.Buffer(v_shape, "uint8"),
             KS: T.Buffer(ks_shape, "int32"), VW: T.Buffer(vw_shape, "int32"),
             VS: T.Buffer(vs_shape, "int32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
                     ATTENTION_ATTR: "int8 attention preparation: K's row sums, V's words and "
                     "column sums, once per (batch, head)", FLOPS_ATTR: 0.0})
        Kf = T.decl_buffer((numel["k"],), "uint8", data=K.data)
        Vf = T.decl_buffer((numel["v"],), "uint8", data=V.data)
        for t in T.parallel(shape.batch * heads):
            b = T.meta_var(t // heads)
            h = T.meta_var(t % heads)
            for j in range(kv):
                KS[b, h, j] = 0
                for c in range(d):
                    KS[b, h, j] = KS[b, h, j] + T.Cast("int32", Kf[at("k", b, h, j, c)])
            for c in T.vectorized(d):
                VS[b, h, c] = 0
            for j in range(kv):
                for c in T.vectorized(d):
                    VS[b, h, c] = VS[b, h, c] + byte(Vf, b, h, j, c)
            for g in range(groups):
                for c in T.vectorized(d):
                    VW[b, h, g, c] = (byte(Vf, b, h, 4 * g, c)
                                      | T.shift_left(byte(Vf, b, h, 4 * g + 1, c), 8)
                                      | T.shift_left(byte(Vf, b, h, 4 * g + 2, c), 16)
                                      | T.shift_left(byte(Vf, b, h, 4 * g + 3, c), 24))
            if tail > 0:
                for c in T.vectorized(d):
                    VW[b, h, groups, c] = byte(Vf, b, h, 4 * groups, c)
                    for k in T.unroll(1, tail):
                        VW[b, h, groups, c] = VW[b, h, groups, c] | T.shift_left(
                            byte(Vf, b, h, 4 * groups + k, c), 8 * k)

    return prep


def quantized_attention_kernel(shape: AttentionShape, knobs: AttentionKnobs) -> tirx.PrimFunc:
    """The int8 attention PrimFunc of ``shape`` (``shape.quant`` set) with ``knobs``.

    Parameters: ``Q``, ``K`` (``u8``), ``KS``, ``VW``, ``VS`` (:func:`attention_prep_kernel`),
    the additive mask when ``shape`` has one, then the fp32 output.
    """
    quant = shape.quant
    if quant is None or shape.cond_shape is not None or shape.k_layout == "bhds":
        raise ValueError(f"no int8 attention kernel for {shape.describe()}")
    qk, pv = knobs.qk, knobs.pv
    lanes = qk.lanes
    q_len, kv, d, heads = shape.q_len, shape.kv_len, shape.head_dim, shape.heads
    bq = knobs.q_block
    q_blocks = -(-q_len // bq)
    tasks = shape.batch * heads * q_blocks
    kv4 = -(-kv // 4)
    groups, tail = divmod(kv, 4)
    d4, vectors = d // 4, bq // lanes
    zq, zk, zv = quant.q_zero - 128, quant.k_zero, quant.v_zero
    zp = quant.p_zero
    score_scale = T.float32(quant.q_scale * quant.k_scale * (shape.scale or 1.0))
    out_scale = T.float32(quant.p_scale * quant.v_scale)
    k_row, _ = row_strides(shape.k_layout, shape, kv)
    layouts = {"q": shape.q_layout, "k": shape.k_layout, "o": shape.out_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], q_len if n != "k" else kv))
             for n in layouts}
    ks_shape, vw_shape, vs_shape = prep_shapes(shape)
    pv_tile = grouped_updates(pv, 4 * kv4, vnni_update(pv, a_words=True, b_words=True))
    dot_intrinsic = f"llvm.x86.avx512.vpdpbusd.{qk.vector_bits}"

    def at(name, b, h, row, col):
        rows = kv if name == "k" else q_len
        return element_offset(layouts[name], shape, rows, b, h, row, col)

    def quantized(e, inv):
        """``p - 128`` of a probability ``e * inv`` quantized with ``zp``."""
        p = T.Cast("int32", T.nearbyint(e * inv)) + zp
        return T.max(T.min(p, 255), 0) - 128

    @T.macro
    def qk_tiles(Kf, KS, M, QP, QS, ST, mx, b, h, q0, row0, rows, count):
        """``count`` tiles of ``rows`` keys from key ``row0``: scores, mask, row max."""
        tile = T.meta_var(grouped_updates(dataclasses.replace(qk, mr=rows), d,
                                          vnni_update(qk, b_words=True)))
        for jt in range(count):
            acc = T.alloc_buffer((rows, bq), "int32")
            for j in T.unroll(rows):
                for v in T.unroll(vectors):
                    acc[j, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
            keys = T.decl_buffer((rows, d), "uint8", data=Kf.data,
                                 elem_offset=at("k", b, h, row0 + jt * rows, 0),
                                 strides=[k_row, 1])
            tile(keys, QP, acc)
            for j in T.unroll(rows):
                for i in T.vectorized(bq):
                    ST[row0 + jt * rows + j, i] = apply_masks(
                        shape, T.Cast("float32", acc[j, i] - zq * KS[b, h, row0 + jt * rows + j]
                                      - QS[i]) * score_scale,
                        M, None, b, h, T.min(q0 + i, q_len - 1), row0 + jt * rows + j)
                    mx[i] = T.max(mx[i], ST[row0 + jt * rows + j, i])

    @T.macro
    def pack_probs(ST, PQ, PP, PS, ls, g, count):
        """Probabilities of keys ``4g .. 4g + count`` quantized into the word ``PP[g]``."""
        for k in T.unroll(4):
            for i in T.vectorized(bq):
                PQ[k, i] = T.if_then_else(
                    k < count, quantized(ST[T.min(4 * g + k, kv - 1), i], ls[i]), 0)
        for i in T.vectorized(bq):
            PP[g, i] = (T.bitwise_and(PQ[0, i], 255) | T.shift_left(T.bitwise_and(PQ[1, i], 255), 8)
                        | T.shift_left(T.bitwise_and(PQ[2, i], 255), 16)
                        | T.shift_left(PQ[3, i], 24))
            PS[i] = PS[i] + PQ[0, i] + PQ[1, i] + PQ[2, i] + PQ[3, i]

    @T.macro
    def body(Q, K, KS, VW, VS, M, Out):
        Qf = T.decl_buffer((numel["q"],), "uint8", data=Q.data)
        Kf = T.decl_buffer((numel["k"],), "uint8", data=K.data)
        Of = T.decl_buffer((numel["o"],), "float32", data=Out.data)
        VWf = T.decl_buffer((math.prod(vw_shape),), "int32", data=VW.data)
        for t in T.parallel(tasks):
            QP = T.alloc_buffer((d4, bq), "int32")
            QS = T.alloc_buffer((bq,), "int32")
            ST = T.alloc_buffer((kv, bq), "float32")
            PQ = T.alloc_buffer((4, bq), "int32")
            PP = T.alloc_buffer((kv4, bq), "int32")
            PS = T.alloc_buffer((bq,), "int32")
            OT = T.alloc_buffer((d, bq), "float32")
            mx = T.alloc_buffer((bq,), "float32")
            ls = T.alloc_buffer((bq,), "float32")
            b = T.meta_var(t // (heads * q_blocks))
            h = T.meta_var(t // q_blocks % heads)
            q0 = T.meta_var(t % q_blocks * bq)
            # Q's block as s8 words (rows past the end repeat the last query).
            for g, i in T.grid(d4, bq):
                QP[g, i] = T.bitwise_xor(T.reinterpret("int32", Qf.vload(
                    [at("q", b, h, T.min(q0 + i, q_len - 1), 4 * g)], "uint8x4")),
                    T.int32(_SIGN_BITS))
            for i in T.vectorized(bq):
                QS[i] = 0
                mx[i] = T.float32(_LOWEST)
                ls[i] = T.float32(0)
                PS[i] = 0
            for g in range(d4):
                for v in T.unroll(vectors):
                    QS[T.ramp(v * lanes, 1, lanes)] = T.call_llvm_pure_intrin(
                        T.llvm_lookup_intrinsic_id(dot_intrinsic),
                        QS[T.ramp(v * lanes, 1, lanes)],
                        T.reinterpret(T.broadcast(T.int32(_ONES), lanes),
                                      dtype=f"int8x{4 * lanes}"),
                        T.reinterpret(QP[g, T.ramp(v * lanes, 1, lanes)],
                                      dtype=f"int8x{4 * lanes}"),
                        dtype=f"int32x{lanes}")
            for i in T.vectorized(bq):
                QS[i] = zk * QS[i] - d * zk * zq
            # Scores of every key (whole tiles, then a remainder tile), then the softmax.
            qk_tiles(Kf, KS, M, QP, QS, ST, mx, b, h, q0, 0, qk.mr, kv // qk.mr)
            if kv % qk.mr > 0:
                qk_tiles(Kf, KS, M, QP, QS, ST, mx, b, h, q0, kv - kv % qk.mr, kv % qk.mr, 1)
            for j in range(kv):
                for i in T.vectorized(bq):
                    ST[j, i] = fast_exp(ST[j, i] - mx[i])
                    ls[i] = ls[i] + ST[j, i]
            for i in T.vectorized(bq):
                ls[i] = T.float32(1.0 / quant.p_scale) / ls[i]
            for g in range(groups):
                pack_probs(ST, PQ, PP, PS, ls, g, 4)
            if tail > 0:
                pack_probs(ST, PQ, PP, PS, ls, groups, tail)
            # P.V, channels by queries, then the output rows.
            for ct in range(d // pv.mr):
                acc = T.alloc_buffer((pv.mr, bq), "int32")
                for c in T.unroll(pv.mr):
                    for v in T.unroll(vectors):
                        acc[c, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
                values = T.decl_buffer((kv4, pv.mr), "int32", data=VWf.data,
                                       elem_offset=(b * heads + h) * kv4 * d + ct * pv.mr,
                                       strides=[d, 1])
                pv_tile(values, PP, acc)
                for c in T.unroll(pv.mr):
                    for i in T.vectorized(bq):
                        OT[ct * pv.mr + c, i] = T.Cast(
                            "float32", acc[c, i] - (zp - 128) * VS[b, h, ct * pv.mr + c]
                            - zv * PS[i] + kv * zv * (zp - 128)) * out_scale
            for i in range(bq):
                if q0 + i < q_len:
                    for c in T.vectorized(d):
                        Of[at("o", b, h, q0 + i, c)] = OT[c, i]

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
             ATTENTION_ATTR: knobs.describe(), FLOPS_ATTR: shape.flops, SHAPE_ATTR: shape.key}
    q_shape, k_shape, o_shape = (shape.tensor_shape(layouts[n], kv if n == "k" else q_len)
                                 for n in ("q", "k", "o"))
    m_shape = shape.mask_shape

    if m_shape is None:
        @T.prim_func(private=True)
        def plain(Q: T.Buffer(q_shape, "uint8"), K: T.Buffer(k_shape, "uint8"),
                  KS: T.Buffer(ks_shape, "int32"), VW: T.Buffer(vw_shape, "int32"),
                  VS: T.Buffer(vs_shape, "int32"), Out: T.Buffer(o_shape, "float32")):
            T.func_attr(attrs)
            body(Q, K, KS, VW, VS, None, Out)
        return plain

    @T.prim_func(private=True)
    def additive(Q: T.Buffer(q_shape, "uint8"), K: T.Buffer(k_shape, "uint8"),
                 KS: T.Buffer(ks_shape, "int32"), VW: T.Buffer(vw_shape, "int32"),
                 VS: T.Buffer(vs_shape, "int32"), M: T.Buffer(m_shape, "float32"),
                 Out: T.Buffer(o_shape, "float32")):
        T.func_attr(attrs)
        body(Q, K, KS, VW, VS, M, Out)
    return additive
