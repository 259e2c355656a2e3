"""The int8 (QDQ) attention kernel: both products on the integer microkernels, exact.

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

Without VNNI (AVX2: Haswell to Zen 3) both products run the s16 family's ``vpmaddwd``
(:func:`~tvm_hybrid.microkernels.families.s16.s16_update`, two channels or keys per int32
word) on operands whose zero points are subtracted while packing, so no compensation is
needed (``|(a - za)(b - zb)| <= 255 * 255``, a pair of them fits s32)::

    QP[g, i] = Q[q0 + i, 2g:2g + 2] - zq          # two s16 per word, per task
    KW[g, j] = K[j, 2g:2g + 2] - zk               # preparation, once per (batch, head)
    S[j, i]  = KW[:, j] . QP[:, i]                                            # exact int32
    PP[g, i] = p[2g:2g + 2, i] - zp               # s16 words; keys past the end are 0
    VW[g, c] = V[2g:2g + 2, c] - zv               # preparation
    O[c, i]  = VW[:, c] . PP[:, i]                                            # exact int32

On CPUs with AMX-INT8 both products run on ``tdpbusd`` tiles in blocks of 2 x 2 16 x 16
int32 accumulators, with the VNNI form's operands and compensations: ``S`` with ``K``'s rows
(``u8``, read in place: 16 keys x 64 channels a tile) by ``QP``'s words (already the tile
unit's ``B`` layout: 16 queries x 4 channels a row), ``O`` with ``VT``'s rows (``V``
transposed by the preparation, ``u8``, keys padded to :data:`AMX_KEYS` with zeros) by
``PP``'s words (padded with zero words). The tiles store 32 x 32 blocks to a scratch buffer
that the same post-processing reads. It needs whole 32-key blocks, a head dimension that is
a multiple of 64 and ``K`` not transposed (:func:`~.heuristics.amx_applies`); other shapes
take the VNNI form (copying the last keys into a zero-padded block was tried: at ViT's 197
and CLIP's 77 keys it ran no faster than VNNI, 2.44 against 2.38 ms at b8 s197, 0.56 against
0.48 at b8 s77).

The integer parts are exact; the softmax is fp32 (``exp2_nonpositive``, a reciprocal of the
sum), so a probability whose scaled value falls within float rounding of a quantization boundary may
round to the neighbouring step (the tests measure how often).
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T

from ...microkernels.families.amx import block_product, configure_tiles, release_tiles
from ...microkernels.families.s16 import s16_update
from ...microkernels.families.vnni import vnni_update
from ...microkernels.tiles import grouped_updates
from .heuristics import AttentionKnobs, amx_applies
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
from .workload import AttentionShape, element_offset, row_strides

#: The bytes ``0x80`` of a word: ``u8 ^ 0x80`` is ``u8 - 128`` as ``s8``.
_SIGN_BITS = -0x7F7F7F80  # 0x80808080 as int32
_ONES = 0x01010101
#: Keys per AMX tile step of ``P . V`` (64 bytes): ``VT`` and ``PP`` are padded to a multiple.
AMX_KEYS = 64


def _word(values: list, group: int):
    """``values`` (``group`` int32 of 8 or 16 bits each, signed) packed low first into one
    int32 word."""
    bits = 32 // group
    word = T.bitwise_and(values[0], (1 << bits) - 1)
    for k in range(1, group - 1):
        word = word | T.shift_left(T.bitwise_and(values[k], (1 << bits) - 1), bits * k)
    return word | T.shift_left(values[-1], bits * (group - 1)) if group > 1 else word


def prep_shapes(shape: AttentionShape, group: int = 4,
                amx: bool = False) -> tuple[tuple[int, ...], ...]:
    """The shapes of the preparation's outputs (module docstring) for a family packing
    ``group`` values per word: ``KS``, ``VW``, ``VS`` (VNNI, 4), ``KS``, ``VT``, ``VS`` (AMX:
    ``VT[c, j] = V[j, c]``, keys padded to :data:`AMX_KEYS`) or ``KW``, ``VW`` (s16, 2)."""
    b, h, kv, d = shape.batch, shape.heads, shape.kv_len, shape.head_dim
    if group == 2:
        return (b, h, d // 2, kv), (b, h, -(-kv // 2), d)
    if amx:
        return (b, h, kv), (b, h, d, -(-kv // AMX_KEYS) * AMX_KEYS), (b, h, d)
    return (b, h, kv), (b, h, -(-kv // 4), d), (b, h, d)


def prep_dtypes(group: int = 4, amx: bool = False) -> tuple[str, ...]:
    """The dtypes of :func:`prep_shapes`' tensors."""
    if group == 2:
        return "int32", "int32"
    return "int32", "uint8" if amx else "int32", "int32"


def attention_prep_kernel(shape: AttentionShape, group: int = 4,
                          amx: bool = False) -> tirx.PrimFunc:
    """``K, V -> KS, VW, VS`` (``group`` 4, VNNI), ``K, V -> KS, VT, VS`` (AMX) or
    ``K, V -> KW, VW`` (``group`` 2, s16) of a quantized attention (module docstring), parallel
    over ``(batch, head)``, vectorised over channels."""
    kv, d, heads = shape.kv_len, shape.head_dim, shape.heads
    out_shapes = prep_shapes(shape, group, amx)
    groups, tail = divmod(kv, group)
    layouts = {"k": shape.k_layout, "v": shape.v_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], kv)) for n in layouts}
    k_shape, v_shape = (shape.tensor_shape(layouts[n], kv) for n in ("k", "v"))
    # The VNNI form keeps zero points out of the words (compensated by the sums); s16 words
    # hold the values less their zero points.
    zk, zv = (0, 0) if group == 4 else (shape.quant.k_zero, shape.quant.v_zero)

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, kv, b, h, row, col)

    def key(Kf, b, h, j, c):
        return T.Cast("int32", Kf[at("k", b, h, j, c)]) - zk

    def value(Vf, b, h, j, c):
        return T.Cast("int32", Vf[at("v", b, h, j, c)]) - zv

    def value_word(Vf, b, h, g, c, count):
        """The word of keys ``group * g + k``, ``k < count``, of channel ``c`` of ``V``."""
        return _word([value(Vf, b, h, group * g + k, c) if k < count else 0
                      for k in range(group)], group)

    @T.macro
    def value_words(Vf, VW, b, h):
        for g in range(groups):
            for c in T.vectorized(d):
                VW[b, h, g, c] = value_word(Vf, b, h, g, c, group)
        if tail > 0:
            for c in T.vectorized(d):
                VW[b, h, groups, c] = value_word(Vf, b, h, groups, c, tail)

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8, FLOPS_ATTR: 0.0,
             ATTENTION_ATTR: "int8 attention preparation: " + (
                 "K's row sums, V transposed for AMX tiles and V's column sums" if amx else
                 "K's row sums, V's words and column sums" if group == 4 else
                 "K's and V's s16 pairs less their zero points") + ", once per (batch, head)"}
    if group == 2:
        kw_shape, vw_shape = out_shapes

        @T.prim_func(private=True)
        def prep_s16(K: T.Buffer(k_shape, "uint8"), V: T.Buffer(v_shape, "uint8"),
                     KW: T.Buffer(kw_shape, "int32"), VW: T.Buffer(vw_shape, "int32")):
            T.func_attr(attrs)
            Kf = T.decl_buffer((numel["k"],), "uint8", data=K.data)
            Vf = T.decl_buffer((numel["v"],), "uint8", data=V.data)
            for t in T.parallel(shape.batch * heads):
                b = T.meta_var(t // heads)
                h = T.meta_var(t % heads)
                for j in range(kv):
                    for g in range(d // 2):
                        KW[b, h, g, j] = _word([key(Kf, b, h, j, 2 * g),
                                                key(Kf, b, h, j, 2 * g + 1)], 2)
                value_words(Vf, VW, b, h)

        return prep_s16

    ks_shape, vw_shape, vs_shape = out_shapes
    keys = vw_shape[3] if amx else kv

    @T.macro
    def values_transposed(Vf, VT, b, h):
        # VT's row c is channel c's words of 4 keys: the VNNI words (built across channels,
        # vectorised) transposed as 32-bit words, 4x fewer moves than bytes.
        VW4 = T.alloc_buffer((keys // 4, d), "int32")
        for g in range(groups):
            for c in T.vectorized(d):
                VW4[g, c] = value_word(Vf, b, h, g, c, group)
        if tail > 0:
            for c in T.vectorized(d):
                VW4[groups, c] = value_word(Vf, b, h, groups, c, tail)
        for g in range(keys // 4 - groups - (1 if tail > 0 else 0)):
            for c in T.vectorized(d):
                VW4[keys // 4 - 1 - g, c] = 0
        VTw = T.decl_buffer((d, keys // 4), "int32", data=VT.data,
                            elem_offset=(b * heads + h) * d * (keys // 4))
        for c, g in T.grid(d, keys // 4):
            VTw[c, g] = VW4[g, c]

    @T.prim_func(private=True)
    def prep(K: T.Buffer(k_shape, "uint8"), V: T.Buffer(v_shape, "uint8"),
             KS: T.Buffer(ks_shape, "int32"), VW: T.Buffer(vw_shape, prep_dtypes(4, amx)[1]),
             VS: T.Buffer(vs_shape, "int32")):
        T.func_attr(attrs)
        Kf = T.decl_buffer((numel["k"],), "uint8", data=K.data)
        Vf = T.decl_buffer((numel["v"],), "uint8", data=V.data)
        for t in T.parallel(shape.batch * heads):
            b = T.meta_var(t // heads)
            h = T.meta_var(t % heads)
            for j in range(kv):
                KS[b, h, j] = 0
                for c in range(d):
                    KS[b, h, j] = KS[b, h, j] + key(Kf, b, h, j, c)
            for c in T.vectorized(d):
                VS[b, h, c] = 0
            for j in range(kv):
                for c in T.vectorized(d):
                    VS[b, h, c] = VS[b, h, c] + value(Vf, b, h, j, c)
            if amx:
                values_transposed(Vf, VW, b, h)
            else:
                value_words(Vf, VW, b, h)

    return prep


def quantized_attention_kernel(shape: AttentionShape, knobs: AttentionKnobs) -> tirx.PrimFunc:
    """The int8 attention PrimFunc of ``shape`` (``shape.quant`` set) with ``knobs``.

    Parameters: ``Q`` (``u8``), then on VNNI tiles ``K`` (``u8``), ``KS``, ``VW``, ``VS``, on
    s16 tiles ``KW``, ``VW`` (:func:`attention_prep_kernel`), the additive mask and the
    boolean mask when ``shape`` has them (as the fp32 kernel), then the fp32 output.
    """
    quant = shape.quant
    if quant is None or shape.k_layout == "bhds":
        raise ValueError(f"no int8 attention kernel for {shape.describe()}")
    qk, pv = knobs.qk, knobs.pv
    group = qk.k_step
    amx = qk.per_block  # tdpbusd tiles: the VNNI form's arithmetic
    vnni = group == 4
    update = vnni_update if vnni else s16_update
    lanes = qk.lanes
    q_len, kv, d, heads = shape.q_len, shape.kv_len, shape.head_dim, shape.heads
    bq = knobs.q_block
    q_blocks = -(-q_len // bq)
    tasks = shape.batch * heads * q_blocks
    words = -(-kv // group)
    # P's words, with AMX padded to whole tile steps of zero words.
    p_words = -(-kv // AMX_KEYS) * AMX_KEYS // group if amx else words
    groups, tail = divmod(kv, group)
    dg, vectors = d // group, bq // lanes
    # VNNI: Q shifted to s8, P less 128, zero points compensated by sums; s16: the words hold
    # each value less its zero point.
    zq = quant.q_zero - 128 if vnni else quant.q_zero
    zk, zv, zp = quant.k_zero, quant.v_zero, quant.p_zero
    p_offset = 128 if vnni else zp
    # Scores in base 2 (kernel.exp2_nonpositive): log2(e) in their scale and the masks.
    score_scale = T.float32(quant.q_scale * quant.k_scale * base2_scale(shape))
    out_scale = T.float32(quant.p_scale * quant.v_scale)
    k_row, _ = row_strides(shape.k_layout, shape, kv)
    layouts = {"q": shape.q_layout, "k": shape.k_layout, "o": shape.out_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], q_len if n != "k" else kv))
             for n in layouts}
    prepared = prep_shapes(shape, group, amx)
    if amx and (not amx_applies(shape) or bq % 32):
        raise ValueError(f"no AMX int8 attention kernel for {shape.describe()} with "
                         f"{knobs.describe()}")
    # The keys' operand: K itself (u8, read in place) or its s16 words KW[b, h, d / 2, kv].
    keys_dtype, keys_numel = ("uint8", numel["k"]) if vnni else ("int32",
                                                                 math.prod(prepared[0]))
    pv_tile = None if amx else grouped_updates(pv, group * words,
                                                update(pv, a_words=True, b_words=True))
    dot_intrinsic = f"llvm.x86.avx512.vpdpbusd.{qk.vector_bits}"

    def at(name, b, h, row, col):
        rows = kv if name == "k" else q_len
        return element_offset(layouts[name], shape, rows, b, h, row, col)

    def query_word(Qf, b, h, i, g):
        """Query ``i``'s channels ``group * g ..`` as one word (module docstring)."""
        if vnni:
            return T.bitwise_xor(T.reinterpret("int32", Qf.vload([at("q", b, h, i, 4 * g)],
                                                                 "uint8x4")),
                                 T.int32(_SIGN_BITS))
        return _word([T.Cast("int32", Qf[at("q", b, h, i, 2 * g + k)]) - zq for k in (0, 1)], 2)

    def keys_at(b, h, j):
        """Shape, offset and strides of the keys' operand from key ``j`` (``rows`` keys)."""
        if vnni:
            return lambda rows: (rows, d), at("k", b, h, j, 0), [k_row, 1]
        return lambda rows: (dg, rows), (b * heads + h) * dg * kv + j, [kv, 1]

    def score(acc, KS, QS, b, h, j, i, key):
        return acc[j, i] - zq * KS[b, h, key] - QS[i] if vnni else acc[j, i]

    def output(acc, VS, PS, b, h, c, i, channel):
        if not vnni:
            return acc[c, i]
        return acc[c, i] - (zp - 128) * VS[b, h, channel] - zv * PS[i] + kv * zv * (zp - 128)

    def quantized(e, inv):
        """``p - p_offset`` of a probability ``e * inv`` quantized with ``zp``."""
        p = T.Cast("int32", T.nearbyint(e * inv)) + zp
        return T.max(T.min(p, 255), 0) - p_offset

    def probs_word(PQ, i):
        return _word([PQ[k, i] for k in range(group)], group)

    def probs_sum(PQ, i):
        return sum((PQ[k, i] for k in range(1, group)), PQ[0, i])

    @T.macro
    def qk_tiles(Kf, KS, M, C, QP, QS, ST, mx, b, h, q0, row0, rows, count):
        """``count`` tiles of ``rows`` keys from key ``row0``: scores, masks, row max."""
        tile = T.meta_var(grouped_updates(dataclasses.replace(qk, mr=rows), d,
                                          update(qk, a_words=not vnni, b_words=True)))
        for jt in range(count):
            acc = T.alloc_buffer((rows, bq), "int32")
            for j in T.unroll(rows):
                for v in T.unroll(vectors):
                    acc[j, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
            where = T.meta_var(keys_at(b, h, row0 + jt * rows))
            keys = T.decl_buffer(where[0](rows), keys_dtype, data=Kf.data,
                                 elem_offset=where[1], strides=where[2])
            tile(keys, QP, acc)
            for j in T.unroll(rows):
                for i in T.vectorized(bq):
                    ST[row0 + jt * rows + j, i] = apply_masks(
                        shape, T.Cast("float32", score(acc, KS, QS, b, h, j, i,
                                                       row0 + jt * rows + j)) * score_scale,
                        M, C, b, h, T.min(q0 + i, q_len - 1), row0 + jt * rows + j, _LOG2E)
                    mx[i] = T.max(mx[i], ST[row0 + jt * rows + j, i])

    def rows_at(A, row, half, step):  # 16 rows of 64 bytes (A tiles of K, VT)
        return A[row * 32 + half * 16, step * AMX_KEYS]

    def words_at(B, col, half, step):  # 16 rows of 16 words (B tiles of QP, PP)
        return B[step * 16, col * 32 + half * 16]

    def block_at(C, row, col, tile):  # the scratch block SA: 32 rows by the query block
        return C[tile // 2 * 16, col * 32 + tile % 2 * 16]

    amx_scores = block_product("tdpbusd", d // AMX_KEYS, rows_at, k_row, words_at, bq * 4,
                               block_at, bq * 4)
    amx_values = block_product("tdpbusd", p_words // 16, rows_at, p_words * 4, words_at,
                               bq * 4, block_at, bq * 4)

    @T.macro
    def qk_amx(Kf, KS, M, C, QP, QS, ST, SA, mx, b, h, q0):
        """Scores of every key on AMX tiles: ``K``'s rows (u8, in place) by ``QP``'s words,
        32 keys by 32 queries a block, then as :func:`qk_tiles` post-processes them."""
        Kh = T.decl_buffer((kv, d), "uint8", data=Kf.data, elem_offset=at("k", b, h, 0, 0),
                           strides=[k_row, 1])
        for jt in range(kv // 32):
            for mt in range(bq // 32):
                amx_scores(Kh, QP, SA, jt, mt)
            for j in range(32):
                for i in T.vectorized(bq):
                    ST[jt * 32 + j, i] = apply_masks(
                        shape, T.Cast("float32", score(SA, KS, QS, b, h, j, i, jt * 32 + j))
                        * score_scale, M, C, b, h, T.min(q0 + i, q_len - 1), jt * 32 + j,
                        _LOG2E)
                    mx[i] = T.max(mx[i], ST[jt * 32 + j, i])

    @T.macro
    def pv_amx(VT, VS, PP, PS, OT, SA, b, h):
        """``P . V`` on AMX tiles: ``VT``'s rows (channels, u8) by ``PP``'s words, 32
        channels by 32 queries a block, compensated as the VNNI form."""
        VTh = T.decl_buffer((d, p_words * 4), "uint8", data=VT.data,
                            elem_offset=(b * heads + h) * d * p_words * 4)
        for ct2 in range(d // 32):
            for mt in range(bq // 32):
                amx_values(VTh, PP, SA, ct2, mt)
            for c in range(32):
                for i in T.vectorized(bq):
                    OT[ct2 * 32 + c, i] = T.Cast(
                        "float32", output(SA, VS, PS, b, h, c, i, ct2 * 32 + c)) * out_scale

    @T.macro
    def pv_vector(VW, VS, PP, PS, OT, b, h):
        """``P . V`` on the vector family's tiles: channels by queries."""
        VWf = T.decl_buffer((math.prod(prepared[1]),), "int32", data=VW.data)
        for ct in range(d // pv.mr):
            acc = T.alloc_buffer((pv.mr, bq), "int32")
            for c in T.unroll(pv.mr):
                for v in T.unroll(vectors):
                    acc[c, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
            values = T.decl_buffer((words, pv.mr), "int32", data=VWf.data,
                                   elem_offset=(b * heads + h) * words * d + ct * pv.mr,
                                   strides=[d, 1])
            pv_tile(values, PP, acc)
            for c in T.unroll(pv.mr):
                for i in T.vectorized(bq):
                    OT[ct * pv.mr + c, i] = T.Cast(
                        "float32", output(acc, VS, PS, b, h, c, i, ct * pv.mr + c)
                    ) * out_scale

    @T.macro
    def pack_probs(ST, PQ, PP, PS, ls, g, count):
        """Probabilities of keys ``group * g .. + count`` quantized into the word ``PP[g]``."""
        for k in T.unroll(group):
            for i in T.vectorized(bq):
                PQ[k, i] = T.if_then_else(
                    k < count, quantized(ST[T.min(group * g + k, kv - 1), i], ls[i]), 0)
        for i in T.vectorized(bq):
            PP[g, i] = probs_word(PQ, i)
            if vnni:
                PS[i] = PS[i] + probs_sum(PQ, i)

    @T.macro
    def body(Q, K, KS, VW, VS, M, C, Out):
        Qf = T.decl_buffer((numel["q"],), "uint8", data=Q.data)
        Kf = T.decl_buffer((keys_numel,), keys_dtype, data=K.data)
        Of = T.decl_buffer((numel["o"],), "float32", data=Out.data)
        for t in T.parallel(tasks):
            QP = T.alloc_buffer((dg, bq), "int32")
            QS = T.alloc_buffer((bq,), "int32")
            ST = T.alloc_buffer((kv, bq), "float32")
            PQ = T.alloc_buffer((group, bq), "int32")
            PP = T.alloc_buffer((p_words, bq), "int32")
            SA = T.alloc_buffer((32, bq if amx else 1), "int32")
            PS = T.alloc_buffer((bq,), "int32")
            OT = T.alloc_buffer((d, bq), "float32")
            mx = T.alloc_buffer((bq,), "float32")
            ls = T.alloc_buffer((bq,), "float32")
            b = T.meta_var(t // (heads * q_blocks))
            h = T.meta_var(t // q_blocks % heads)
            q0 = T.meta_var(t % q_blocks * bq)
            # Q's block as words (rows past the end repeat the last query).
            for g, i in T.grid(dg, bq):
                QP[g, i] = query_word(Qf, b, h, T.min(q0 + i, q_len - 1), g)
            for i in T.vectorized(bq):
                QS[i] = 0
                mx[i] = T.float32(_LOWEST)
                ls[i] = T.float32(0)
                PS[i] = 0
            if vnni:
                for g in range(dg):
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
            if amx:
                configure_tiles()  # per thread: once per task
                qk_amx(Kf, KS, M, C, QP, QS, ST, SA, mx, b, h, q0)
            else:
                qk_tiles(Kf, KS, M, C, QP, QS, ST, mx, b, h, q0, 0, qk.mr, kv // qk.mr)
                if kv % qk.mr > 0:
                    qk_tiles(Kf, KS, M, C, QP, QS, ST, mx, b, h, q0, kv - kv % qk.mr,
                             kv % qk.mr, 1)
            for j in range(kv):
                for i in T.vectorized(bq):
                    ST[j, i] = exp2_nonpositive(ST[j, i] - mx[i])
                    ls[i] = ls[i] + ST[j, i]
            for i in T.vectorized(bq):
                ls[i] = T.float32(1.0 / quant.p_scale) / ls[i]
            for g in range(groups):
                pack_probs(ST, PQ, PP, PS, ls, g, group)
            if tail > 0:
                pack_probs(ST, PQ, PP, PS, ls, groups, tail)
            for g, i in T.grid(p_words - words, bq):
                PP[words + g, i] = 0
            # P.V, channels by queries, then the output rows.
            if amx:
                pv_amx(VW, VS, PP, PS, OT, SA, b, h)
                release_tiles()
            else:
                pv_vector(VW, VS, PP, PS, OT, b, h)
            for i in range(bq):
                if q0 + i < q_len:
                    for c in T.vectorized(d):
                        Of[at("o", b, h, q0 + i, c)] = OT[c, i]

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
             ATTENTION_ATTR: knobs.describe(), FLOPS_ATTR: shape.flops, SHAPE_ATTR: shape.key}
    q_shape, k_shape, o_shape = (shape.tensor_shape(layouts[n], kv if n == "k" else q_len)
                                 for n in ("q", "k", "o"))
    # One signature for every form: the keys are K (VNNI) or its words (s16); operands a form
    # lacks (VNNI's sums on s16, absent masks) are declared with one element, never read, and
    # dropped from the parameters below.
    keys_shape = k_shape if vnni else prepared[0]
    ks_shape, vw_shape, vs_shape = prepared if vnni else ((1,), prepared[1], (1,))
    vw_dtype = prep_dtypes(group, amx)[1]
    m_shape, c_shape = shape.mask_shape or (1,), shape.cond_shape or (1,)

    @T.prim_func(private=True)
    def kernel(Q: T.Buffer(q_shape, "uint8"), K: T.Buffer(keys_shape, keys_dtype),
               KS: T.Buffer(ks_shape, "int32"), VW: T.Buffer(vw_shape, vw_dtype),
               VS: T.Buffer(vs_shape, "int32"), M: T.Buffer(m_shape, "float32"),
               C: T.Buffer(c_shape, "bool"), Out: T.Buffer(o_shape, "float32")):
        T.func_attr(attrs)
        body(Q, K, KS, VW, VS, M, C, Out)

    kept = [True, True, vnni, True, vnni, shape.mask_shape is not None,
            shape.cond_shape is not None, True]
    return kept_params(kernel, kept)
