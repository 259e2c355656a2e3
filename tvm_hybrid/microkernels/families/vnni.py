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
from ..tiles import grouped_tile_functions


def vnni_tile_functions(kernel: Microkernel, kc: int):
    """``C[mr, nr] (s32) += A[mr, kc] (u8) * B[kc / 4, nr, 4] (s8)`` with ``vpdpbusd``."""
    lanes = kernel.lanes
    if kc % 4:
        raise ValueError(f"the VNNI microkernel needs K % 4 == 0, got K = {kc}")
    byte_lanes = lanes * 4
    intrinsic = f"llvm.x86.avx512.vpdpbusd.{kernel.vector_bits}"

    def update(acc, A, B, i, g, v):
        a_bytes = T.reinterpret(T.broadcast(T.reinterpret(A.vload([i, g * 4], "uint8x4"),
                                                          dtype="int32"), lanes),
                                dtype=f"int8x{byte_lanes}")
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(intrinsic), acc, a_bytes,
                                       B.vload([g, v * lanes, 0], f"int8x{byte_lanes}"),
                                       dtype=f"int32x{lanes}")

    return grouped_tile_functions(kernel, kc, "int8", update)


AVX512_VNNI = register_family(Family(
    "avx512_vnni",
    vector_tiles("avx512_vnni", ("avx512vnni",), 512, 32, "uint8", "int32", 4),
    rank=30, tile_functions=vnni_tile_functions))

AVX_VNNI = register_family(Family(
    "avx_vnni", vector_tiles("avx_vnni", ("avxvnni",), 256, 16, "uint8", "int32", 4),
    rank=25, tile_functions=vnni_tile_functions))
