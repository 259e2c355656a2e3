"""bf16 weights on CPUs without a bf16 dot product: widened to fp32 in the microkernel.

Without AVX512-BF16 the same packed bf16 weights (half the memory and bandwidth of fp32) are
widened to fp32 in the microkernel: a bf16 is the top half of an fp32, so per 32-bit lane of a
pair the even ``k`` is ``lane << 16`` and the odd one ``lane & 0xffff0000``, each multiplied with
an FMA (the ``bf16emu`` families; bf16 compute is emulated, at fp32 speed). Products of bf16
values are exact in fp32, so both forms agree with an fp32 GEMM on bf16-rounded inputs.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel, vector_tiles
from ..registry import register_family
from ..tiles import Tail, grouped_tile_functions
from .bf16_dot import pair_operands


def widening_update(kernel: Microkernel, a_words: bool = False, b_words: bool = False):
    """The vector update of :func:`~..tiles.grouped_updates` on fp32 FMAs: per 32-bit lane of
    a pair (``B``'s, and ``A``'s broadcast one), shifting left by 16 gives the even ``k`` as
    fp32, masking the low half the odd one. ``a_words``/``b_words`` as for
    :func:`~.bf16_dot.dpbf16_update`."""
    lanes = kernel.lanes
    f32 = f"float32x{lanes}"

    def even(word):
        return T.reinterpret(T.shift_left(word, T.broadcast(T.int32(16), lanes)), dtype=f32)

    def odd(word):
        return T.reinterpret(T.bitwise_and(word, T.broadcast(T.int32(-65536), lanes)), dtype=f32)

    def update(acc, A, B, i, g, v):
        a, b = pair_operands(kernel, A, B, i, g, v, a_words, b_words)
        return acc + even(a) * even(b) + odd(a) * odd(b)

    return update


def bf16_widening_tile_functions(kernel: Microkernel, kc: int, tail: Tail | None = None):
    """``C[mr, nr] (f32) += A[mr, kc] (bf16) * B[kc / 2, nr, 2] (bf16)`` with fp32 FMAs
    (:func:`widening_update`)."""
    if kc % 2:
        raise ValueError(f"the bf16 microkernel needs an even K, got K = {kc}")
    return grouped_tile_functions(kernel, kc, "bfloat16", widening_update(kernel),
                                  tail=tail)


#: Logged when the family is chosen: the CPU has no bf16 dot product.
EMULATED = ("no AVX512-BF16, so bf16 compute is emulated: weights are stored in bf16 and widened "
            "to fp32 in the microkernel")

AVX512_BF16EMU = register_family(Family(
    "avx512",
    vector_tiles("avx512_bf16emu", ("avx512f",), 512, 32, "bfloat16", "float32", 2,
                 operand_registers=(2, 2)),
    rank=20, tile_functions=bf16_widening_tile_functions, note=EMULATED))

AVX2_BF16EMU = register_family(Family(
    "avx2",
    vector_tiles("avx2_bf16emu", ("avx2", "fma"), 256, 16, "bfloat16", "float32", 2,
                 operand_registers=(2, 2)),
    rank=10, tile_functions=bf16_widening_tile_functions, note=EMULATED))
