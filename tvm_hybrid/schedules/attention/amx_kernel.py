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
order the tiles store them), the softmax's row statistics reduced across vectors of keys.
The head dimension must be a multiple of 32 (one tile step of ``K``); padded keys score
nothing (their probabilities are 0). Rounding the operands and probabilities to bf16 gives
errors of about ``2**-9`` relative to the output's scale, like the vector bf16 kernel.

Never run on a CPU without AMX: LLVM aborts the process there (``fits`` and the pass check
the target; tests only compile and read the assembly on such hosts).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ...microkernels.families.amx import configure_tiles
from .bf16_kernel import _rounded, bf16_prep_shapes
from .heuristics import AttentionKnobs
from .kernel import (
    _LOWEST,
    ATTENTION_ATTR,
    FLOPS_ATTR,
    SHAPE_ATTR,
    apply_masks,
    fast_exp,
    kept_params,
)
from .workload import AttentionShape, element_offset

#: Keys per tile step of ``P . V`` (and the multiple the preparation pads keys to).
KEY_MULTIPLE = 32
#: fp32 lanes of the softmax's vectors (one zmm).
_LANES = 16


def _bits(x):
    """The bf16 bits of fp32 ``x`` (rounded to nearest even) as a ``uint16``."""
    return T.Cast("uint16", T.shift_right(_rounded(x), 16))


def _intrin(name: str, *args):
    return T.evaluate(T.call_llvm_intrin("void", f"llvm.x86.{name}", *args))


def amx_attention_kernel(shape: AttentionShape, knobs: AttentionKnobs) -> tirx.PrimFunc:
    """The AMX bf16 attention PrimFunc of ``shape`` with ``knobs`` (module docstring).

    Parameters: ``Q`` (fp32), ``KW``, ``VW`` (:func:`~.bf16_kernel.bf16_prep_kernel` with
    keys padded to :data:`KEY_MULTIPLE`), the additive mask and the boolean mask when
    ``shape`` has them, then the fp32 output.
    """
    qk = knobs.qk
    bq, d = knobs.q_block, shape.head_dim
    if (not qk.per_block or qk.in_dtype != "bfloat16" or not shape.bf16 or bq % 32
            or d % 32 or shape.quant is not None):
        raise ValueError(f"no AMX bf16 attention kernel for {shape.describe()} with "
                         f"{knobs.describe()}")
    q_len, kv, heads = shape.q_len, shape.kv_len, shape.heads
    kw_shape, vw_shape = bf16_prep_shapes(shape, KEY_MULTIPLE)
    kvp = kw_shape[3]
    q_blocks = -(-q_len // bq)
    tasks = shape.batch * heads * q_blocks
    m_tiles, key_tiles, d_steps, d_tiles = bq // 32, kvp // 32, d // 32, d // 32
    chunks = kvp // _LANES
    scale = T.float32(shape.scale if shape.scale is not None else 1.0)
    layouts = {"q": shape.q_layout, "o": shape.out_layout}
    numel = {n: math.prod(shape.tensor_shape(layouts[n], q_len)) for n in layouts}

    def at(name, b, h, row, col):
        return element_offset(layouts[name], shape, q_len, b, h, row, col)

    @T.macro
    def body(Q, KW, VW, M, C, Out):
        Qf = T.decl_buffer((numel["q"],), "float32", data=Q.data)
        Of = T.decl_buffer((numel["o"],), "float32", data=Out.data)
        for t in T.parallel(tasks):
            QB = T.alloc_buffer((bq, d), "uint16")
            S = T.alloc_buffer((bq, kvp), "float32")
            P = T.alloc_buffer((bq, kvp), "uint16")
            OB = T.alloc_buffer((bq, d), "float32")
            mv = T.alloc_buffer((_LANES,), "float32")
            mx = T.alloc_buffer((bq,), "float32")
            ls = T.alloc_buffer((bq,), "float32")
            b = T.meta_var(t // (heads * q_blocks))
            h = T.meta_var(t // q_blocks % heads)
            q0 = T.meta_var(t % q_blocks * bq)
            configure_tiles()  # per thread: once per task
            # Q's block in bf16 (rows past the end repeat the last query).
            for i in range(bq):
                for c in T.vectorized(d):
                    QB[i, c] = _bits(Qf[at("q", b, h, T.min(q0 + i, q_len - 1), c)])
            # S = Q . K^T: 2 x 2 accumulator tiles (0-3), A tiles 4-5 (QB), B tiles 6-7 (KW).
            for jt, mt in T.grid(key_tiles, m_tiles):
                for ct in T.unroll(4):
                    _intrin("tilezero", T.Cast("int8", ct))
                for ds in range(d_steps):
                    for a in T.unroll(2):
                        _intrin("tileloadd64", T.Cast("int8", 4 + a),
                                T.address_of(QB[mt * 32 + a * 16, ds * 32]), T.int64(d * 2))
                    for n in T.unroll(2):
                        _intrin("tileloadd64", T.Cast("int8", 6 + n),
                                T.address_of(KW[b, h, ds * 16, jt * 32 + n * 16]),
                                T.int64(kvp * 4))
                    for ct in T.unroll(4):
                        _intrin("tdpbf16ps", T.Cast("int8", ct), T.Cast("int8", 4 + ct // 2),
                                T.Cast("int8", 6 + ct % 2))
                for ct in T.unroll(4):
                    _intrin("tilestored64", T.Cast("int8", ct),
                            T.address_of(S[mt * 32 + ct // 2 * 16, jt * 32 + ct % 2 * 16]),
                            T.int64(kvp * 4))
            # The softmax of each row in fp32; padded keys get probability 0.
            for i in range(bq):
                for v in T.vectorized(_LANES):
                    mv[v] = T.float32(_LOWEST)
                for jc in range(chunks):
                    for v in T.vectorized(_LANES):
                        S[i, jc * _LANES + v] = T.if_then_else(
                            jc * _LANES + v < kv,
                            apply_masks(shape, S[i, jc * _LANES + v] * scale, M, C, b, h,
                                        T.min(q0 + i, q_len - 1),
                                        T.min(jc * _LANES + v, kv - 1)),
                            T.float32(_LOWEST))
                        mv[v] = T.max(mv[v], S[i, jc * _LANES + v])
                mx[i] = T.float32(_LOWEST)
                for v in range(_LANES):
                    mx[i] = T.max(mx[i], mv[v])
                for v in T.vectorized(_LANES):
                    mv[v] = T.float32(0)
                for jc in range(chunks):
                    for v in T.vectorized(_LANES):
                        S[i, jc * _LANES + v] = T.if_then_else(
                            jc * _LANES + v < kv, fast_exp(S[i, jc * _LANES + v] - mx[i]),
                            T.float32(0))
                        mv[v] = mv[v] + S[i, jc * _LANES + v]
                        P[i, jc * _LANES + v] = _bits(S[i, jc * _LANES + v])
                ls[i] = T.float32(0)
                for v in range(_LANES):
                    ls[i] = ls[i] + mv[v]
                ls[i] = T.float32(1) / ls[i]
            # O = P . V: A tiles 4-5 (P), B tiles 6-7 (VW).
            for ct2, mt in T.grid(d_tiles, m_tiles):
                for ct in T.unroll(4):
                    _intrin("tilezero", T.Cast("int8", ct))
                for kt in range(key_tiles):
                    for a in T.unroll(2):
                        _intrin("tileloadd64", T.Cast("int8", 4 + a),
                                T.address_of(P[mt * 32 + a * 16, kt * 32]), T.int64(kvp * 2))
                    for n in T.unroll(2):
                        _intrin("tileloadd64", T.Cast("int8", 6 + n),
                                T.address_of(VW[b, h, kt * 16, ct2 * 32 + n * 16]),
                                T.int64(d * 4))
                    for ct in T.unroll(4):
                        _intrin("tdpbf16ps", T.Cast("int8", ct), T.Cast("int8", 4 + ct // 2),
                                T.Cast("int8", 6 + ct % 2))
                for ct in T.unroll(4):
                    _intrin("tilestored64", T.Cast("int8", ct),
                            T.address_of(OB[mt * 32 + ct // 2 * 16, ct2 * 32 + ct % 2 * 16]),
                            T.int64(d * 4))
            _intrin("tilerelease")
            for i in range(bq):
                if q0 + i < q_len:
                    for c in T.vectorized(d):
                        Of[at("o", b, h, q0 + i, c)] = OB[i, c] * ls[i]

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
             ATTENTION_ATTR: knobs.describe(), FLOPS_ATTR: shape.flops, SHAPE_ATTR: shape.key}
    q_shape, o_shape = (shape.tensor_shape(layouts[n], q_len) for n in ("q", "o"))
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
