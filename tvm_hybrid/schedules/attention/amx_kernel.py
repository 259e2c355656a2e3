"""The AMX bf16 attention kernel: both products on Intel's tile unit (``tdpbf16ps``).

With ``precision="bf16"`` on a CPU with AMX-BF16 an fp32 attention computes ``Q . K^T`` and
``P . V`` on 16 x 16 fp32 accumulator tiles fed by bf16 tiles, the softmax in fp32 between
them. One parallel task per ``(batch, head, query block)`` of a multiple of 32 queries; the
scores of every key of the block stay in L1/L2 (``q_block x keys`` fp32), no
``q_len x kv_len`` buffer::

    KW[g, j] = bf16(K[j, 2g]) | bf16(K[j, 2g + 1]) << 16   # preparation (bf16_kernel.py),
    VW[g, c] = bf16(V[2g, c]) | bf16(V[2g + 1, c]) << 16   #   keys padded to 32 with zeros
    QB[i, c] = bf16(Q[q0 + i, c])                          # per task, rows of bf16
    S[i, j]  = scale * QB[i, :] . KW[:, j]  [masks]        # tiles: A = QB, B = KW
    P[i, j]  = bf16(exp(S[i, j] - max_j S[i, :]));  l[i] = sum_j exp(..)    # fp32
    out[q0 + i, c] = (P[i, :] . VW[:, c]) / l[i]           # tiles: A = P, B = VW

Both products are blocks of 2 x 2 accumulator tiles (32 x 32), as the GEMM engine's AMX
family (``microkernels/families/amx.py``) runs them: ``KW`` and ``VW`` are already the tile
unit's ``B`` layout (pairs of ``K`` rows interleaved), and the rows of ``QB`` and ``P`` its
``A`` tiles, so nothing is transposed in the kernel. Scores are kept queries x keys (the
order the tiles store them), the softmax's row statistics reduced across vectors of keys,
rows in groups of :data:`_ROWS` so that the reductions across lanes (serial chains) of
different rows overlap. With the products on tiles the softmax is most of the kernel's time,
so it is lean: ``exp`` is ``2**t`` of the scores in units of ``log2(e)`` (one FMA with the
maximum), a degree-4 polynomial and the exponent added to its bits
(:func:`exp2_nonpositive`, relative error 2.7e-6), and the probabilities are rounded by
``vcvtneps2bf16``. The head dimension must be a multiple of 32 (one tile step of ``K``);
padded keys score nothing (their probabilities are 0). Rounding the operands and
probabilities to bf16 gives errors of about ``2**-9`` relative to the output's scale, like the
vector bf16 kernel.

Never run on a CPU without AMX: LLVM aborts the process there (``fits`` and the pass check
the target; tests only compile and read the assembly on such hosts).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ...microkernels.families.amx import block_product, configure_tiles, release_tiles
from .bf16_kernel import _rounded, bf16_prep_shapes, words_kernel
from .heuristics import AttentionKnobs, amx_applies
from .kernel import (
    _LOWEST,
    apply_masks,
)
from .workload import AttentionShape, element_offset

#: Keys per tile step of ``P . V`` (and the multiple the preparation pads keys to).
KEY_MULTIPLE = 32
#: fp32 lanes of the softmax's vectors (one zmm).
_LANES = 16
#: Rows of the softmax whose reductions across lanes overlap.
_ROWS = 8
_LOG2E = 1.4426950408889634
#: ``2**f`` on ``[-0.5, 0.5]``, highest power first: a near-minimax fit of relative error
#: (2.7e-6 evaluated in fp32).
_EXP2_POLY = (9.5699867e-3, 5.5917572e-2, 2.4024744e-1, 6.9312185e-1, 9.9999928e-1)


def exp2_nonpositive(t, lanes: int = 1):
    """``2**t`` for ``t <= 0`` (a score less its row's maximum, in units of ``log2(e)``), of
    ``lanes`` lanes: ``2**n`` added to the exponent bits of :data:`_EXP2_POLY` at ``f = t - n``
    in ``[-0.5, 0.5]`` (relative error 2.7e-6, under bf16's ``2**-9``), ``n`` the nearest
    integer to ``t``. ``t`` is clamped at -125 (``2**-125`` stands for the zero of a masked
    score)."""
    suffix = f"x{lanes}" if lanes > 1 else ""

    def const(x):
        return T.broadcast(T.float32(x), lanes) if lanes > 1 else T.float32(x)

    t = T.max(t, const(-125.0))
    n = T.nearbyint(t)
    f = t - n
    y = const(_EXP2_POLY[0])
    for c in _EXP2_POLY[1:]:
        y = y * f + const(c)
    return T.reinterpret("float32" + suffix, T.reinterpret("int32" + suffix, y)
                         + T.shift_left(T.Cast("int32" + suffix, n), 23))


def _bf16_vector(x):
    """The bf16 bits of the 16 fp32 lanes of ``x`` (AVX512-BF16's ``vcvtneps2bf16``: rounded to
    nearest even) as ``uint16`` lanes."""
    return T.reinterpret("uint16x16", T.call_llvm_pure_intrin(
        "bfloat16x16", "llvm.x86.avx512bf16.cvtneps2bf16.512", x))


def _bits(x):
    """The bf16 bits of fp32 ``x`` (rounded to nearest even) as a ``uint16``."""
    return T.Cast("uint16", T.shift_right(_rounded(x), 16))


def amx_attention_kernel(shape: AttentionShape, knobs: AttentionKnobs) -> tirx.PrimFunc:
    """The AMX bf16 attention PrimFunc of ``shape`` with ``knobs`` (module docstring).

    Parameters: ``Q`` (fp32), ``KW``, ``VW`` (:func:`~.bf16_kernel.bf16_prep_kernel` with
    keys padded to :data:`KEY_MULTIPLE`), the additive mask and the boolean mask when
    ``shape`` has them, then the fp32 output.
    """
    qk = knobs.qk
    bq, d = knobs.q_block, shape.head_dim
    if (not qk.per_block or qk.in_dtype != "bfloat16" or not amx_applies(shape) or bq % 32
            or shape.quant is not None):
        raise ValueError(f"no AMX bf16 attention kernel for {shape.describe()} with "
                         f"{knobs.describe()}")
    q_len, kv, heads = shape.q_len, shape.kv_len, shape.heads
    kw_shape, vw_shape = bf16_prep_shapes(shape, KEY_MULTIPLE)
    kvp = kw_shape[3]
    q_blocks = -(-q_len // bq)
    tasks = shape.batch * heads * q_blocks
    # Head channels come in 32s both as Q.K^T's tile steps and as P.V's column blocks.
    m_tiles, key_tiles, d_tiles = bq // 32, kvp // 32, d // 32
    chunks, full_chunks = kvp // _LANES, kv // _LANES
    scale = T.float32(shape.scale if shape.scale is not None else 1.0)
    layouts = {"q": shape.q_layout, "o": shape.out_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], q_len)) for n in layouts}

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, q_len, b, h, row, col)

    def rows_at(A, row, half, step):  # 16 rows of 32 bf16 (A tiles of QB, P)
        return A[row * 32 + half * 16, step * 32]

    def words_at(B, col, half, step):  # 16 rows of 16 words (B tiles of KW, VW)
        return B[step * 16, col * 32 + half * 16]

    def block_at(C, row, col, tile):
        return C[row * 32 + tile // 2 * 16, col * 32 + tile % 2 * 16]

    scores = block_product("tdpbf16ps", d_tiles, rows_at, d * 2, words_at, kvp * 4, block_at,
                           kvp * 4)
    values = block_product("tdpbf16ps", key_tiles, rows_at, kvp * 2, words_at, d * 4, block_at,
                           d * 4)

    @T.macro
    def body(Q, KWs, VWs, M, C, Out):
        Qf = T.decl_buffer((numel["q"],), "float32", data=Q.data)
        Of = T.decl_buffer((numel["o"],), "float32", data=Out.data)
        for t in T.parallel(tasks):
            QB = T.alloc_buffer((bq, d), "uint16")
            S = T.alloc_buffer((bq, kvp), "float32")
            P = T.alloc_buffer((bq, kvp), "uint16")
            OB = T.alloc_buffer((bq, d), "float32")
            mv = T.alloc_buffer((_ROWS, _LANES), "float32")
            mx = T.alloc_buffer((_ROWS,), "float32")
            ls = T.alloc_buffer((bq,), "float32")
            b = T.meta_var(t // (heads * q_blocks))
            h = T.meta_var(t // q_blocks % heads)
            q0 = T.meta_var(t % q_blocks * bq)
            # The head's K and V words (the tile unit's B layout).
            KW = T.decl_buffer((d // 2, kvp), "int32", data=KWs.data,
                               elem_offset=(b * heads + h) * (d // 2) * kvp)
            VW = T.decl_buffer((kvp // 2, d), "int32", data=VWs.data,
                               elem_offset=(b * heads + h) * (kvp // 2) * d)
            configure_tiles()  # per thread: once per task
            # Q's block in bf16 (rows past the end repeat the last query).
            for i, c in T.grid(bq, d // _LANES):
                QB[i, T.ramp(c * _LANES, 1, _LANES)] = _bf16_vector(Qf[T.ramp(
                    at("q", b, h, T.min(q0 + i, q_len - 1), c * _LANES), 1, _LANES)])
            # S = Q . K^T: 32 x 32 blocks, A = QB's rows, B = KW's words.
            for jt, mt in T.grid(key_tiles, m_tiles):
                scores(QB, KW, S, mt, jt)
            # The softmax of each row in fp32, rows in groups whose reductions across lanes
            # (serial chains) overlap; padded keys get probability 0.
            for i0 in range(bq // _ROWS):
                for r, v in T.grid(_ROWS, _LANES):
                    mv[r, v] = T.float32(_LOWEST)
                # Whole vectors of keys, then the tail's (masked: its mask reads are clamped,
                # which in the whole vectors would become gathers).
                for r, jc in T.grid(_ROWS, full_chunks):
                    for v in T.vectorized(_LANES):
                        S[i0 * _ROWS + r, jc * _LANES + v] = apply_masks(
                            shape, S[i0 * _ROWS + r, jc * _LANES + v] * scale, M, C, b, h,
                            T.min(q0 + i0 * _ROWS + r, q_len - 1), jc * _LANES + v)
                        mv[r, v] = T.max(mv[r, v], S[i0 * _ROWS + r, jc * _LANES + v])
                for r, jc in T.grid(_ROWS, chunks - full_chunks):
                    for v in T.vectorized(_LANES):
                        S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v] = T.if_then_else(
                            (full_chunks + jc) * _LANES + v < kv,
                            apply_masks(shape, S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v]
                                        * scale, M, C, b, h,
                                        T.min(q0 + i0 * _ROWS + r, q_len - 1),
                                        T.min((full_chunks + jc) * _LANES + v, kv - 1)),
                            T.float32(_LOWEST))
                        mv[r, v] = T.max(mv[r, v],
                                         S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v])
                for r in T.unroll(_ROWS):
                    mx[r] = T.float32(_LOWEST)
                    for v in T.unroll(_LANES):
                        mx[r] = T.max(mx[r], mv[r, v])
                    mx[r] = mx[r] * T.float32(_LOG2E)
                for r, v in T.grid(_ROWS, _LANES):
                    mv[r, v] = T.float32(0)
                # exp(s - max) = 2^(s log2(e) - max log2(e)); the rounded value in P, the
                # unrounded one summed (the keys' tail masked to 0).
                for r, jc in T.grid(_ROWS, full_chunks):
                    lanes = T.meta_var(T.ramp(jc * _LANES, 1, _LANES))
                    e = T.meta_var(exp2_nonpositive(
                        S[i0 * _ROWS + r, lanes] * T.broadcast(T.float32(_LOG2E), _LANES)
                        - T.broadcast(mx[r], _LANES), _LANES))
                    P[i0 * _ROWS + r, lanes] = _bf16_vector(e)
                    mv[r, T.ramp(0, 1, _LANES)] = mv[r, T.ramp(0, 1, _LANES)] + e
                for r, jc in T.grid(_ROWS, chunks - full_chunks):
                    for v in T.vectorized(_LANES):
                        S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v] = T.if_then_else(
                            (full_chunks + jc) * _LANES + v < kv, exp2_nonpositive(
                                S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v]
                                * T.float32(_LOG2E) - mx[r]), T.float32(0))
                        P[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v] = _bits(
                            S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v])
                        mv[r, v] = mv[r, v] + S[i0 * _ROWS + r, (full_chunks + jc) * _LANES + v]
                for r in T.unroll(_ROWS):
                    ls[i0 * _ROWS + r] = T.float32(0)
                    for v in T.unroll(_LANES):
                        ls[i0 * _ROWS + r] = ls[i0 * _ROWS + r] + mv[r, v]
                    ls[i0 * _ROWS + r] = T.float32(1) / ls[i0 * _ROWS + r]
            # O = P . V: A = P's rows, B = VW's words.
            for ct2, mt in T.grid(d_tiles, m_tiles):
                values(P, VW, OB, mt, ct2)
            release_tiles()
            for i in range(bq):
                if q0 + i < q_len:
                    for c in T.vectorized(d):
                        Of[at("o", b, h, q0 + i, c)] = OB[i, c] * ls[i]

    return words_kernel(shape, knobs, body, kw_shape, vw_shape)
