"""Exact 8-bit GEMMs without VNNI: s16 x s16 -> s32 register tiles on AVX2's ``vpmaddwd``.

On Haswell to Zen 3 there is no u8 x s8 dot product that is exact, so ``avx2_s16`` multiplies
**s16** operands with ``vpmaddwd`` (2 products per 32-bit lane, ``B`` packed in pairs
``[N / nr, K / 2, nr, 2]``): 8-bit activations are widened by a cast that fuses into their
producer, weights at compile time. Every product of 8-bit values (even ``u8`` weights, or zero
points folded in) is exact in s32, and the kernel issues two instructions per 16 products, no
conversion: 89% of the rate of ONNX Runtime's ``vpmaddubsw`` + ``vpmaddwd`` sequence in
registers (measured by ``peak.py`` on Zen 5; 70-84% on a Zen 3), which saturates s16 and is not
exact. (``vpmaddubsw`` made exact with the sign trick, ``vpmaddubsw(|a|, sign(b, a))``,
measured 80% on Zen 5 and no faster than s16 on Zen 3.) Weights whose adjacent pairs cannot
saturate ``vpmaddubsw`` (7-bit weights) take that sequence itself: ``maddubs.py``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel, vector_tiles
from ..registry import register_family
from ..tiles import Tail, grouped_tile_functions


def s16_update(kernel: Microkernel, a_words: bool = False, b_words: bool = False):
    """The vector update of :func:`~..tiles.grouped_updates` on ``vpmaddwd``: the two s16 of
    ``A[i, 2g:2g + 2]`` broadcast to every 32-bit lane, times the pairs of
    ``B[g, v * lanes:, 0:2]``, each lane's two products added into the s32 accumulator.

    With ``a_words`` (``b_words``) that operand holds its pairs as ``int32`` words instead:
    ``A[g, i]`` (``B[g, v * lanes:]``), as the quantized attention kernel packs them.
    """
    lanes = kernel.lanes
    pairs = f"int16x{2 * lanes}"

    def update(acc, A, B, i, g, v):
        a_word = A[g, i] if a_words else T.reinterpret(A.vload([i, g * 2], "int16x2"),
                                                       dtype="int32")
        b_pairs = T.reinterpret(B.vload([g, v * lanes], f"int32x{lanes}"), dtype=pairs) \
            if b_words else B.vload([g, v * lanes, 0], pairs)
        a_pairs = T.reinterpret(T.broadcast(a_word, lanes), dtype=pairs)
        return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", "llvm.x86.avx2.pmadd.wd",
                                             a_pairs, b_pairs)

    return update


def s16_tile_functions(kernel: Microkernel, kc: int, tail: Tail | None = None):
    """``C[mr, nr] (s32) += A[mr, kc] (s16) * B[kc / 2, nr, 2] (s16)`` with ``vpmaddwd``.

    Per pair of ``k`` and row: the two s16 of ``A`` broadcast to every 32-bit lane; per 8
    columns, ``vpmaddwd`` multiplies them with the columns' pairs of ``B`` and adds each pair's
    two products into one s32 lane, exactly.
    """
    nr = kernel.nr
    if kc % 2 or nr % kernel.lanes:
        raise ValueError(f"the s16 tile needs an even K and nr % {kernel.lanes} == 0; "
                         f"got {kc}, {nr}")
    return grouped_tile_functions(kernel, kc, "int16", s16_update(kernel), tail=tail)


AVX2_S16 = register_family(Family(
    "avx2", vector_tiles("avx2_s16", ("avx2",), 256, 16, "int16", "int32", 2),
    rank=10, tile_functions=s16_tile_functions))
