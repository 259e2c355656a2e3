"""bf16 x bf16 -> fp32 register tiles on AVX512-BF16's ``vdpbf16ps``.

``vdpbf16ps`` multiplies 2 adjacent bf16 of ``A`` (broadcast) by 2 of ``B`` per 32-bit lane and
adds both products to the fp32 accumulator, so ``B`` is packed with ``K`` in pairs. CPUs without
it widen the same packed weights instead (``bf16_widening.py``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel, vector_tiles
from ..registry import register_family
from ..tiles import grouped_tile_functions

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



def bf16_tile_functions(kernel: Microkernel, kc: int):
    """``C[mr, nr] (f32) += A[mr, kc] (bf16) * B[kc / 2, nr, 2] (bf16)`` with ``vdpbf16ps``."""
    lanes = kernel.lanes
    if kc % 2:
        raise ValueError(f"the bf16 microkernel needs an even K, got K = {kc}")

    def update(acc, A, B, i, g, v):
        return T.call_extern(
            f"float32x{lanes}", "hybrid_dpbf16ps_512", acc,
            T.broadcast(T.reinterpret(A.vload([i, g * 2], "bfloat16x2"), dtype="int32"), lanes),
            T.reinterpret(B.vload([g, v * lanes, 0], f"bfloat16x{2 * lanes}"),
                          dtype=f"int32x{lanes}"))

    return grouped_tile_functions(kernel, kc, "bfloat16", update,
                                  {"pragma_import_llvm": DPBF16PS_IR})


AVX512_BF16 = register_family(Family(
    "avx512_bf16",
    vector_tiles("avx512_bf16", ("avx512bf16",), 512, 32, "bfloat16", "float32", 2),
    rank=30, tile_functions=bf16_tile_functions))
