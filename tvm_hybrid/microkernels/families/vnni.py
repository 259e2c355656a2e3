"""u8 x s8 -> s32 register tiles on VNNI's ``vpdpbusd`` (AVX512-VNNI on zmm, AVX-VNNI on ymm).

``vpdpbusd`` multiplies 4 adjacent ``u8`` of ``A`` (broadcast) by 4 ``s8`` of ``B`` per 32-bit
lane and adds the 4 products to the accumulator, exactly (no saturation); ``B`` is packed with
``K`` in groups of 4, ``[N / nr, K / 4, nr, 4]``. AVX-VNNI (Alder Lake, Sierra Forest: no
AVX-512) is the same instruction on 256-bit ymm.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel, vector_tiles
from ..registry import register_family
from ..tiles import Tail, grouped_tile_functions


def vnni_update(kernel: Microkernel, a_words: bool = False, b_words: bool = False):
    """The vector update of :func:`~..tiles.grouped_updates` on ``vpdpbusd``: the 4 ``u8`` of
    ``A[i, 4g:4g + 4]`` broadcast, times the ``s8`` of ``B[g, v * lanes:, 0:4]``.

    With ``a_words`` (``b_words``) that operand holds its groups of 4 bytes as ``int32`` words
    instead: ``A[g, i]`` (``B[g, v * lanes:]``); the quantized attention kernel's packed
    operands are such.
    """
    lanes = kernel.lanes
    byte_lanes = lanes * 4
    intrinsic = f"llvm.x86.avx512.vpdpbusd.{kernel.vector_bits}"

    def update(acc, A, B, i, g, v):
        a_word = A[g, i] if a_words else T.reinterpret(A.vload([i, g * 4], "uint8x4"),
                                                       dtype="int32")
        b_bytes = T.reinterpret(B.vload([g, v * lanes], f"int32x{lanes}"),
                                dtype=f"int8x{byte_lanes}") if b_words else B.vload(
            [g, v * lanes, 0], f"int8x{byte_lanes}")
        a_bytes = T.reinterpret(T.broadcast(a_word, lanes), dtype=f"int8x{byte_lanes}")
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(intrinsic), acc, a_bytes,
                                       b_bytes, dtype=f"int32x{lanes}")

    return update


def vnni_tile_functions(kernel: Microkernel, kc: int, tail: Tail | None = None):
    """``C[mr, nr] (s32) += A[mr, kc] (u8) * B[kc / 4, nr, 4] (s8)`` with ``vpdpbusd``."""
    if kc % 4:
        raise ValueError(f"the VNNI microkernel needs K % 4 == 0, got K = {kc}")
    return grouped_tile_functions(kernel, kc, "int8", vnni_update(kernel), tail=tail)


AVX512_VNNI = register_family(Family(
    "avx512_vnni",
    vector_tiles("avx512_vnni", ("avx512vnni",), 512, 32, "uint8", "int32", 4),
    rank=30, tile_functions=vnni_tile_functions))

AVX_VNNI = register_family(Family(
    "avx_vnni", vector_tiles("avx_vnni", ("avxvnni",), 256, 16, "uint8", "int32", 4),
    rank=25, tile_functions=vnni_tile_functions))
