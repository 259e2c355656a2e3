"""u8 x s8 -> s32 register tiles on AVX2's ``vpmaddubsw`` + ``vpmaddwd``, for bounded weights.

``vpmaddubsw`` multiplies 32 ``u8`` of ``A`` by 32 ``s8`` of ``B`` and adds each adjacent pair
of products into an ``s16``, **saturating**; ``vpmaddwd`` with ones then adds the two ``s16`` of
each 32-bit lane into ``s32``. This is ONNX Runtime's AVX2 int8 kernel: one instruction pair per
32 products, the fastest int8 sequence without VNNI, but wrong wherever a pair sum leaves
``s16``. With ``A`` in ``[0, 255]`` a pair sum is at most ``255 * (|b0| + |b1|)``, so the
sequence is **exact** when every pair of adjacent ``k`` of every column of ``B`` has
``|b0| + |b1| <= 128`` (``255 * 128 = 32640 <= 32767``): every 7-bit weight matrix
(``[-64, 64]``, what ONNX Runtime's quantizers write with ``reduce_range``, as ONNX Runtime
advises for AVX2 CPUs) and any other whose pairs stay within the bound. The integer GEMM pass
takes this family only for such constant weights (:data:`PAIR_BOUND`,
:func:`~tvm_hybrid.microkernels.weight_pair_sum`); other 8-bit weights take the s16 kernel.

Operands are those of the VNNI family: ``u8`` activations (``s8`` shifted by 128, compensated),
``B`` packed with ``K`` in groups of 4, ``[N / nr, K / 4, nr, 4]``. Each update needs the ones
vector and a temporary besides the broadcast of ``A``: three registers per row step.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel, vector_tiles
from ..registry import register_family
from ..tiles import Tail, grouped_tile_functions

#: The largest ``|b0| + |b1|`` over pairs of adjacent ``k`` for which the sequence is exact.
PAIR_BOUND = 128


def maddubs_tile_functions(kernel: Microkernel, kc: int, tail: Tail | None = None):
    """``C[mr, nr] (s32) += A[mr, kc] (u8) * B[kc / 4, nr, 4] (s8)`` with ``vpmaddubsw`` and
    ``vpmaddwd``, exact for weights within :data:`PAIR_BOUND` (module docstring)."""
    if kc % 4:
        raise ValueError(f"the vpmaddubsw microkernel needs K % 4 == 0, got K = {kc}")
    lanes = kernel.lanes

    def update(acc, A, B, i, g, v):
        a_bytes = T.reinterpret(T.broadcast(T.reinterpret(A.vload([i, g * 4], "uint8x4"),
                                                          dtype="int32"), lanes),
                                dtype=f"int8x{lanes * 4}")
        pairs = T.call_llvm_pure_intrin(f"int16x{lanes * 2}", "llvm.x86.avx2.pmadd.ub.sw",
                                        a_bytes, B.vload([g, v * lanes, 0], f"int8x{lanes * 4}"))
        return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", "llvm.x86.avx2.pmadd.wd", pairs,
                                             T.broadcast(T.int16(1), lanes * 2))

    return grouped_tile_functions(kernel, kc, "int8", update, tail=tail)


AVX2_MADDUBS = register_family(Family(
    "avx2",
    vector_tiles("avx2_maddubs", ("avx2",), 256, 16, "uint8", "int32", 4,
                 operand_registers=(1, 3)),
    rank=10, tile_functions=maddubs_tile_functions, pair_bound=PAIR_BOUND))
