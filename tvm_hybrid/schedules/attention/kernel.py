"""The fused attention kernel: one TIR function per attention shape and knob set.

One parallel task per ``(batch, head, query block)``, or with the ``copy_heads`` knob one per
``(batch, head)`` that first copies the head's ``K`` and ``V`` into consecutive rows (a head
split read in place has its rows ``heads * d`` apart) and then runs its query blocks in turn;
per query block, in L1/L2 and with no ``q_len x kv_len`` buffer anywhere::

    QT[d, i]  = scale * log2(e) * Q[q0 + i, d]      # the query block, transposed once
    m, l, O   = -inf, 0, 0                          # running max, sum, output rows
    for each key block [k0, k0 + k_block):          # online (flash-style) softmax
        ST[j, i] = K[k0 + j, :] . QT[:, i] + log2(e) * mask  # K.Q^T: qk register tiles,
        m'       = max(m, max_j ST[:, i])                    #   K read where it lies
        ST       = 2**(ST - m');  l = l * 2**(m - m') + sum_j ST
        O        = O * 2**(m - m') + ST^T . V[k0:, :]        # P.V: pv register tiles
        m        = m'
    out[q0 + i, :] = O[i, :] / l[i]

Scores are kept transposed (keys x queries) so that the row statistics of the softmax are
vector operations across queries, with no horizontal reductions, and ``K`` is the broadcast
operand of its product (read where it lies, in any layout, or from the head's copy), ``V``
the vector operand of its own. Both products run the fp32 microkernel body of the registry
(:func:`~tvm_hybrid.microkernels.tiles.broadcast_fma`) on views of the operands. Tails: keys
that do not fill a ``qk`` tile (and the last, shorter key block) run on a remainder tile of
fewer rows, and head channels that do not fill a ``pv`` tile on one tile of exactly the
remaining columns (whole vectors, then one vector of the rest's lanes: a head dimension of 15
or 24 reads no channel past its own), so nothing is padded or copied; the last query block
reads clamped rows and writes only real ones.

The scores are in base 2 (``exp(x) = 2**(x log2(e))``, the factor folded into the query block
and the masks, so the score epilogue adds the mask with no multiply), and the exponential is
:func:`exp2_nonpositive` (relative error under 1e-7; its arguments are never positive; the
int8 and bf16 kernels use it too): its reduction is one addition and a subtraction, where
the base-e form took two FMAs and a longer polynomial. Kernel alone against the base-e form, same
process, 11 rounds, on a 2-core Zen 4: BERT heads b1 s128 1.020x, b1 s384 1.025x, b32 s384
1.019x, b8 s512 with 16 heads 1.022x (AVX-512; faster in 10-11 of 11 rounds), b32 s128 within
noise; the AVX2 code b1 s384 1.031x, b32 s128 1.026x, b8 s512 within noise. The exponential
alone was 6.4% of the b8 s512 kernel there. The bf16 kernel (``vdpbf16ps``, same host, with its
preparation): b1 s128 1.014x, b1 s384 1.014x, b32 s128 1.019x, b8 s512 1.043x (11 of 11); the
int8 kernel, QDQ model calls: b1 s128 1.08x, b1 s384 1.03x, b32 rows within noise, outputs
equal but for 0.004% of elements (a probability at a quantization boundary).
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T

from ...microkernels.tiles import broadcast_fma
from .heuristics import AttentionKnobs
from .workload import AttentionShape, element_offset, row_strides

#: The running maximum's start: below every finite score, so ``exp(start - max)`` is 0.
_LOWEST = -3.0e38
#: Function attributes: the knobs in words, and the FLOPs of one call (profile report).
ATTENTION_ATTR = "hybrid.attention"
FLOPS_ATTR = "hybrid.flops"
#: Function attribute: the workload (``AttentionShape.key``), what tuning records name.
SHAPE_ATTR = "hybrid.attention_shape"


#: ``1.5 * 2**23 + 127``: ``x + ROUNDING`` (``|x| < 2**22``) rounds ``x`` to the nearest integer
#: ``n`` and leaves ``n + 127`` in the low bits of the mantissa, so those bits shifted into the
#: exponent field are the float ``2**n``.
_ROUNDING = 12582912.0 + 127.0
#: ``exp(x) = 2**(x * _LOG2E)``: the kernels' scores are in base 2.
_LOG2E = math.log2(math.e)
#: The largest float32.
_FLOAT_MAX = 3.4028234663852886e38


#: The clamp of :func:`exp2_nonpositive`: ``2**-126``, the least normal float.
_EXP2_FLOOR = -126.0
#: ``2**f`` on ``[-1/2, 1/2]``, degree 6 (a fit of the relative error; 9.7e-8 at most in
#: float32 Horner form), the coefficients of ``f`` to ``f**6``.
_EXP2_POLYNOMIAL = (6.931471824645996e-01, 2.402264773845673e-01, 5.550332367420197e-02,
                    9.618437848985195e-03, 1.339888083748519e-03, 1.535336778033525e-04)


def exp2_nonpositive(x):
    """``2**x`` for ``x <= 0`` (a score in base 2 less its maximum: the kernels take their
    scores times ``log2(e)``, folded into the query block or the scores' scale and into the
    masks), within 1e-7 relative of the exact value down to ``2**-126``: the reduction is
    exact (``n`` an integer, ``f = x - n`` with no rounding), and it takes three additions
    and six FMAs where the base-e form it replaced (the Cephes polynomial of TVM's
    ``fast_exp``, reduced by ``ln 2``) took one subtraction and nine FMAs, with an error
    growing to 3e-7 at -87. (On AMD's cores FMAs share two pipes with the products, additions
    issue on two others.)

    ``t = x + _ROUNDING`` rounds and biases ``n``; ``2**n`` is ``t``'s bits shifted by 23;
    ``2**f`` a degree-6 polynomial in Horner form. ``x`` is clamped at ``-126`` (a masked
    score's zero; ``2**-126`` stays a normal float); a NaN passes the clamp (the constant is
    the max's first operand, and ``a > b ? a : b`` is ``b`` for a NaN ``b``), and so reaches
    the result."""
    xc = T.max(T.float32(_EXP2_FLOOR), x)
    t = xc + T.float32(_ROUNDING)
    # n through t's bits: TVM's simplifier would fold (a + c) - c to a.
    n = T.reinterpret("float32", T.reinterpret("int32", t)) - T.float32(_ROUNDING)
    f = xc - n
    y = T.float32(_EXP2_POLYNOMIAL[-1])
    for c in _EXP2_POLYNOMIAL[-2::-1]:
        y = y * f + T.float32(c)
    y = y * f + T.float32(1.0)
    return T.reinterpret("float32", T.shift_left(T.reinterpret("int32", t), 23)) * y


def _transpose_stage(lanes: int, bit: int):
    """One stage of an in-register ``lanes x lanes`` transpose: rows ``a`` and ``a + 2**bit``
    (``a``'s bit clear) swap their row bit ``bit`` with the lane bit ``bit``, two two-vector
    shuffles per pair (``vshufps``, ``vpermt2pd``, ``vshuff64x2``... as LLVM picks). After the
    stages of every bit, row ``c`` holds lane ``c`` of every input row."""
    step = 1 << bit
    low = [c if not c >> bit & 1 else lanes + c - step for c in range(lanes)]
    high = [c + step if not c >> bit & 1 else lanes + c for c in range(lanes)]

    @T.macro
    def stage(src, dst):
        for pair in T.unroll(lanes // 2):
            a = T.meta_var(pair // step * 2 * step + pair % step)
            rows = T.meta_var([src[a, T.ramp(0, 1, lanes)], src[a + step, T.ramp(0, 1, lanes)]])
            dst[a, T.ramp(0, 1, lanes)] = T.Shuffle(rows, low)
            dst[a + step, T.ramp(0, 1, lanes)] = T.Shuffle(rows, high)
    return stage


def _mask_index(mask_shape: tuple[int, ...], b, h, q, k) -> tuple:
    """The index of a mask's element broadcast to ``(b, h, q, k)`` (shapes aligned right)."""
    index = (b, h, q, k)[4 - len(mask_shape):]
    return tuple(i if dim != 1 else 0 for i, dim in zip(index, mask_shape))


def apply_masks(shape: AttentionShape, value, M, C, b, h, q, k, base: float = 1.0):
    """A score after the boolean mask ``C``, then the additive mask ``M`` (those ``shape``
    has), at ``(b, h, q, k)``; with ``base`` the score is ``base`` times the scaled score
    (``log2(e)``: a score for :func:`exp2_nonpositive`), and so are the fill and the mask. A
    finite fill stays finite (the constant must be a float32); a mask of ``finfo.min`` (Hugging
    Face's padding) becomes -inf, which the running maximum's finite start (``_LOWEST``)
    meets as such a mask did in base e: every masked key of a row that has no other gets the
    exponential's floor, so the row averages the values."""
    if shape.cond_shape is not None:
        keep = C[_mask_index(shape.cond_shape, b, h, q, k)]
        fill = T.float32(_finite_times(shape.fill, base))
        value = T.if_then_else(keep, value, fill) if shape.keep_if else \
            T.if_then_else(keep, fill, value)
    if shape.mask_shape is not None:
        mask = M[_mask_index(shape.mask_shape, b, h, q, k)]
        value = value + (mask if base == 1.0 else mask * T.float32(base))
    return value


def base2_scale(shape: AttentionShape) -> float:
    """The factor on ``Q . K`` that gives a score in base 2: ``shape``'s scale times
    ``log2(e)`` (:func:`exp2_nonpositive`)."""
    return (shape.scale if shape.scale is not None else 1.0) * _LOG2E


def _finite_times(value: float, factor: float) -> float:
    """``value * factor``, within float32's range where ``value`` is finite."""
    if not math.isfinite(value):
        return value * factor
    return min(max(value * factor, -_FLOAT_MAX), _FLOAT_MAX)


def kept_params(func: tirx.PrimFunc, kept: list[bool]) -> tirx.PrimFunc:
    """``func`` with only the parameters ``kept`` marks: a kernel written with one signature
    for every form declares the operands a form lacks (one element each, never read), and
    this drops them."""
    return tirx.PrimFunc([p for p, keep in zip(func.params, kept) if keep], func.body,
                         func.ret_type, func.attrs)


def attention_kernel(shape: AttentionShape, knobs: AttentionKnobs) -> tirx.PrimFunc:
    """The fused attention PrimFunc of ``shape`` with ``knobs`` (module docstring).

    Parameters: ``Q``, ``K``, ``V``, the additive mask and the boolean mask when ``shape`` has
    them, then the output.
    """
    qk, pv = knobs.qk, knobs.pv
    lanes = qk.lanes
    q_len, kv_len, d = shape.q_len, shape.kv_len, shape.head_dim
    bq, bk, heads = knobs.q_block, knobs.k_block, shape.heads
    q_blocks = -(-q_len // bq)
    full_blocks, tail = divmod(kv_len, bk)
    # Scores in base 2: the scale and log2(e) multiply the query block.
    scale = T.float32(base2_scale(shape))
    sizes = {"q": q_len, "k": kv_len, "v": kv_len, "o": q_len}
    layouts = {"q": shape.q_layout, "k": shape.k_layout, "v": shape.v_layout,
               "o": shape.out_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], sizes[n])) for n in layouts}

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, sizes[name], b, h, row, col)

    # With copy_heads, a task copies its head's K and V into consecutive rows (KC, VC) and
    # runs all its query blocks on them: the products read those rows, not the operands'.
    copied = knobs.copy_heads
    tasks = shape.batch * heads * (1 if copied else q_blocks)
    k_row, k_col = (d, 1) if copied else row_strides(shape.k_layout, shape, kv_len)
    v_row = d if copied else row_strides(shape.v_layout, shape, kv_len)[0]

    def kv_at(name, b, h, row, col):
        return row * d + col if copied else at(name, b, h, row, col)

    qk_vectors, pv_vectors = qk.nr // lanes, pv.nr // lanes
    pv_tile = {kc: broadcast_fma(pv, kc) for kc in {bk, tail} if kc}
    # Head channels after the whole pv tiles: one tile of exactly the rest's columns.
    c_rest = d % pv.nr
    c0 = d - c_rest
    pv_rest = {kc: broadcast_fma(pv, kc, c_rest, exact=True) for kc in {bk, tail} if kc}

    # The query block is transposed (QT) a lanes x lanes tile at a time in registers where its
    # channels are consecutive and a tile of scratch fits the scores' buffer (free until the
    # first key block); the last, partial query block element by element. Measured on an
    # Emerald Rapids (2 cores), with the reciprocal of the sums below: BERT heads at s 128 and
    # 384 1.06-1.10x (AVX-512), 1.04x (AVX2 code); s 512 unchanged.
    q_channel_stride = row_strides(shape.q_layout, shape, q_len)[1]
    shuffled = q_channel_stride == 1 and d % lanes == 0 and bk * bq >= lanes * lanes
    stages = [_transpose_stage(lanes, bit) for bit in range(lanes.bit_length() - 1)]

    @T.macro
    def transpose_tile(Qf, QT, ST, b, h, q0, i0, c0):
        # QT's tile of channels c0: x queries i0: from Q's rows: loaded, then the stages
        # ping-pong between a scratch tile and QT's tile, the last landing in QT.
        scratch = T.decl_buffer((lanes, lanes), "float32", data=ST.data)
        tile = T.decl_buffer((lanes, lanes), "float32", data=QT.data, elem_offset=c0 * bq + i0,
                             strides=[bq, 1])
        x = T.meta_var(tile if len(stages) % 2 == 0 else scratch)
        y = T.meta_var(scratch if len(stages) % 2 == 0 else tile)
        for r in T.unroll(lanes):
            x[r, T.ramp(0, 1, lanes)] = Qf[T.ramp(at("q", b, h, q0 + i0 + r, c0), 1, lanes)] * \
                T.broadcast(scale, lanes)
        stages[0](x, y)
        stages[1](y, x)
        stages[2](x, y)
        if len(stages) == 4:
            stages[3](y, x)

    @T.macro
    def qk_tiles(Kf, M, C, QT, ST, mb, b, h, q0, k0, row0, rows, count):
        """``count`` tiles of ``rows`` keys from key ``k0 + row0``: scores, masks, row max."""
        tile = T.meta_var(broadcast_fma(dataclasses.replace(qk, mr=rows), d))
        for jt in range(count):
            acc = T.alloc_buffer((rows, qk.nr), "float32")
            for j in T.unroll(rows):
                for v in T.unroll(qk_vectors):
                    acc[j, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.float32(0), lanes)
            keys_in = T.decl_buffer((rows, d), "float32", data=Kf.data,
                                    elem_offset=kv_at("k", b, h, k0 + row0 + jt * rows, 0),
                                    strides=[k_row, k_col])
            tile(keys_in, QT, acc)
            for j in T.unroll(rows):
                for i in T.vectorized(bq):
                    ST[row0 + jt * rows + j, i] = apply_masks(
                        shape, acc[j, i], M, C, b, h, T.min(q0 + i, q_len - 1),
                        k0 + row0 + jt * rows + j, _LOG2E)
                    mb[i] = T.max(mb[i], ST[row0 + jt * rows + j, i])

    @T.macro
    def key_block(Kf, Vf, M, C, QT, ST, Ob, mx, ls, mb, b, h, q0, k0, keys):
        for i in T.vectorized(bq):
            mb[i] = mx[i]
        # Whole qk tiles, then one tile of the remaining rows (a remainder microkernel).
        qk_tiles(Kf, M, C, QT, ST, mb, b, h, q0, k0, 0, qk.mr, keys // qk.mr)
        if keys % qk.mr > 0:
            qk_tiles(Kf, M, C, QT, ST, mb, b, h, q0, k0, keys - keys % qk.mr, keys % qk.mr, 1)
        alpha = T.alloc_buffer((bq,), "float32")
        for i in T.vectorized(bq):
            alpha[i] = exp2_nonpositive(mx[i] - mb[i])
            mx[i] = mb[i]
            ls[i] = ls[i] * alpha[i]
        for j in range(keys):
            for i in T.vectorized(bq):
                ST[j, i] = exp2_nonpositive(ST[j, i] - mb[i])
                ls[i] = ls[i] + ST[j, i]
        # The output rows are rescaled by alpha as the P.V tiles load them.
        for it, ct in T.grid(bq // pv.mr, d // pv.nr):
            acc = T.alloc_buffer((pv.mr, pv.nr), "float32")
            for i in T.unroll(pv.mr):
                for v in T.unroll(pv_vectors):
                    acc[i, T.ramp(v * lanes, 1, lanes)] = Ob[
                        it * pv.mr + i, T.ramp(ct * pv.nr + v * lanes, 1, lanes)] * T.broadcast(
                        alpha[it * pv.mr + i], lanes)
            probs = T.decl_buffer((pv.mr, keys), "float32", data=ST.data,
                                  elem_offset=it * pv.mr, strides=[1, bq])
            values = T.decl_buffer((keys, pv.nr), "float32", data=Vf.data,
                                   elem_offset=kv_at("v", b, h, k0, ct * pv.nr),
                                   strides=[v_row, 1])
            pv_tile[keys](probs, values, acc)
            for i in T.unroll(pv.mr):
                for v in T.unroll(pv_vectors):
                    Ob[it * pv.mr + i, T.ramp(ct * pv.nr + v * lanes, 1, lanes)] = acc[
                        i, T.ramp(v * lanes, 1, lanes)]
        if c_rest > 0:
            for it in range(bq // pv.mr):
                acc = T.alloc_buffer((pv.mr, pv.nr), "float32")
                for i in T.unroll(pv.mr):
                    for c in T.vectorized(c_rest):
                        acc[i, c] = Ob[it * pv.mr + i, c0 + c] * alpha[it * pv.mr + i]
                probs = T.decl_buffer((pv.mr, keys), "float32", data=ST.data,
                                      elem_offset=it * pv.mr, strides=[1, bq])
                values = T.decl_buffer((keys, c_rest), "float32", data=Vf.data,
                                       elem_offset=kv_at("v", b, h, k0, c0),
                                       strides=[v_row, 1])
                pv_rest[keys](probs, values, acc)
                for i in T.unroll(pv.mr):
                    for c in T.vectorized(c_rest):
                        Ob[it * pv.mr + i, c0 + c] = acc[i, c]

    @T.macro
    def query_block(Qf, Kf, Vf, M, C, Of, QT, ST, Ob, mx, ls, mb, b, h, q0):
        for i in T.vectorized(bq):
            mx[i] = T.float32(_LOWEST)
            ls[i] = T.float32(0)
        for i in range(bq):
            for c in T.vectorized(d):
                Ob[i, c] = T.float32(0)
        if shuffled and q0 + bq <= q_len:
            for i0, c0 in T.grid(bq // lanes, d // lanes):
                transpose_tile(Qf, QT, ST, b, h, q0, i0 * lanes, c0 * lanes)
        else:
            for i, c in T.grid(bq, d):
                QT[c, i] = T.if_then_else(
                    q0 + i < q_len, Qf[at("q", b, h, T.min(q0 + i, q_len - 1), c)] * scale,
                    T.float32(0))
        for kb in range(full_blocks):
            key_block(Kf, Vf, M, C, QT, ST, Ob, mx, ls, mb, b, h, q0, kb * bk, bk)
        if tail > 0:
            key_block(Kf, Vf, M, C, QT, ST, Ob, mx, ls, mb, b, h, q0, full_blocks * bk, tail)
        for i in T.vectorized(bq):
            ls[i] = T.float32(1.0) / ls[i]  # one division per query, not per channel
        for i in range(bq):
            if q0 + i < q_len:
                for c in T.vectorized(d):
                    Of[at("o", b, h, q0 + i, c)] = Ob[i, c] * ls[i]

    @T.macro
    def body(Q, K, V, M, C, Out):
        # Q, K, V and the output are read through flat views (their layouts' offsets: ``at``).
        Qf = T.decl_buffer((numel["q"],), "float32", data=Q.data)
        Kf = T.decl_buffer((numel["k"],), "float32", data=K.data)
        Vf = T.decl_buffer((numel["v"],), "float32", data=V.data)
        Of = T.decl_buffer((numel["o"],), "float32", data=Out.data)
        for t in T.parallel(tasks):
            QT = T.alloc_buffer((d, bq), "float32")
            ST = T.alloc_buffer((bk, bq), "float32")
            Ob = T.alloc_buffer((bq, d), "float32")
            mx = T.alloc_buffer((bq,), "float32")
            ls = T.alloc_buffer((bq,), "float32")
            mb = T.alloc_buffer((bq,), "float32")
            if copied:
                KC = T.alloc_buffer((kv_len * d,), "float32")
                VC = T.alloc_buffer((kv_len * d,), "float32")
                b = T.meta_var(t // heads)
                h = T.meta_var(t % heads)
                for j in range(kv_len):
                    for c in T.vectorized(d):
                        KC[j * d + c] = Kf[at("k", b, h, j, c)]
                    for c in T.vectorized(d):
                        VC[j * d + c] = Vf[at("v", b, h, j, c)]
                for qb in range(q_blocks):
                    query_block(Qf, KC, VC, M, C, Of, QT, ST, Ob, mx, ls, mb, b, h, qb * bq)
            else:
                query_block(Qf, Kf, Vf, M, C, Of, QT, ST, Ob, mx, ls, mb,
                            t // (heads * q_blocks), t // q_blocks % heads,
                            t % q_blocks * bq)

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
             ATTENTION_ATTR: knobs.describe(), FLOPS_ATTR: shape.flops, SHAPE_ATTR: shape.key}
    q_shape, k_shape, v_shape, o_shape = (
        shape.tensor_shape(layouts[n], sizes[n]) for n in ("q", "k", "v", "o"))
    m_shape, c_shape = shape.mask_shape, shape.cond_shape

    # One signature per combination of masks (absent ones are not parameters).
    if m_shape is None and c_shape is None:
        @T.prim_func(private=True)
        def plain(Q: T.Buffer(q_shape, "float32"), K: T.Buffer(k_shape, "float32"),
                  V: T.Buffer(v_shape, "float32"), Out: T.Buffer(o_shape, "float32")):
            T.func_attr(attrs)
            body(Q, K, V, None, None, Out)
        return plain
    if c_shape is None:
        @T.prim_func(private=True)
        def additive(Q: T.Buffer(q_shape, "float32"), K: T.Buffer(k_shape, "float32"),
                     V: T.Buffer(v_shape, "float32"), M: T.Buffer(m_shape, "float32"),
                     Out: T.Buffer(o_shape, "float32")):
            T.func_attr(attrs)
            body(Q, K, V, M, None, Out)
        return additive
    if m_shape is None:
        @T.prim_func(private=True)
        def boolean(Q: T.Buffer(q_shape, "float32"), K: T.Buffer(k_shape, "float32"),
                    V: T.Buffer(v_shape, "float32"), C: T.Buffer(c_shape, "bool"),
                    Out: T.Buffer(o_shape, "float32")):
            T.func_attr(attrs)
            body(Q, K, V, None, C, Out)
        return boolean

    @T.prim_func(private=True)
    def both(Q: T.Buffer(q_shape, "float32"), K: T.Buffer(k_shape, "float32"),
             V: T.Buffer(v_shape, "float32"), M: T.Buffer(m_shape, "float32"),
             C: T.Buffer(c_shape, "bool"), Out: T.Buffer(o_shape, "float32")):
        T.func_attr(attrs)
        body(Q, K, V, M, C, Out)
    return both
