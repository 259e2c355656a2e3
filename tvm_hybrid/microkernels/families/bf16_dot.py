"""bf16 x bf16 -> fp32 register tiles on AVX512-BF16's ``vdpbf16ps``.

``vdpbf16ps`` multiplies 2 adjacent bf16 of ``A`` (broadcast) by 2 of ``B`` per 32-bit lane and
adds both products to the fp32 accumulator, so ``B`` is packed with ``K`` in pairs. CPUs without
it widen the same packed weights instead (``bf16_widening.py``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel, vector_tiles
from ..registry import register_family
from ..tiles import Tail, grouped_tile_functions

#: ``vdpbf16ps`` takes ``<32 x bfloat>`` operands, a type TIR cannot express: this LLVM IR,
#: linked into the module through the ``pragma_import_llvm`` loop annotation, takes them as
#: ``<16 x i32>`` and is always inlined.
DPBF16PS_IR = r"""
define internal <16 x float> @hybrid_dpbf16ps_512(<16 x float> %acc, <16 x i32> %a,
                                                   <16 x i32> %b) alwaysinline {
  %av = bitcast <16 x i32> %a to <32 x bfloat>
  %bv = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc,
                                                          <32 x bfloat> %av, <32 x bfloat> %bv)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>,
                                                        <32 x bfloat>)
"""



def pair_operands(kernel: Microkernel, A, B, i, g, v, a_words: bool, b_words: bool):
    """The broadcast pair of ``A[i, 2g:2g + 2]`` and ``B[g, v * lanes:, 0:2]``'s pairs, as
    int32 vectors (``a_words``/``b_words``: that operand holds its pairs as int32 words,
    ``A[g, i]`` and ``B[g, v * lanes:]``, as the bf16 attention kernel packs them)."""
    lanes = kernel.lanes
    a_word = A[g, i] if a_words else T.reinterpret(A.vload([i, g * 2], "bfloat16x2"),
                                                   dtype="int32")
    b_pairs = B.vload([g, v * lanes], f"int32x{lanes}") if b_words else T.reinterpret(
        B.vload([g, v * lanes, 0], f"bfloat16x{2 * lanes}"), dtype=f"int32x{lanes}")
    return T.broadcast(a_word, lanes), b_pairs


def dpbf16_update(kernel: Microkernel, a_words: bool = False, b_words: bool = False):
    """The vector update of :func:`~..tiles.grouped_updates` on ``vdpbf16ps`` (the loop
    running it needs :data:`DPBF16PS_IR` imported, ``{"pragma_import_llvm": DPBF16PS_IR}``)."""
    lanes = kernel.lanes

    def update(acc, A, B, i, g, v):
        a, b = pair_operands(kernel, A, B, i, g, v, a_words, b_words)
        return T.call_extern(f"float32x{lanes}", "hybrid_dpbf16ps_512", acc, a, b)

    return update


def bf16_tile_functions(kernel: Microkernel, kc: int, tail: Tail | None = None):
    """``C[mr, nr] (f32) += A[mr, kc] (bf16) * B[kc / 2, nr, 2] (bf16)`` with ``vdpbf16ps``."""
    if kc % 2:
        raise ValueError(f"the bf16 microkernel needs an even K, got K = {kc}")
    return grouped_tile_functions(kernel, kc, "bfloat16", dpbf16_update(kernel),
                                  {"pragma_import_llvm": DPBF16PS_IR}, tail)


AVX512_BF16 = register_family(Family(
    "avx512_bf16",
    vector_tiles("avx512_bf16", ("avx512bf16",), 512, 32, "bfloat16", "float32", 2),
    rank=30, tile_functions=bf16_tile_functions))
