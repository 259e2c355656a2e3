"""GEMM microkernels declared as data, and the generator that makes them TIR tensor intrinsics.

A :class:`Microkernel` says what a register tile is: the ISA it needs, its dtypes, the tile
``mr x nr`` held in accumulator registers, the vector width and how many registers it uses. One
generator, :func:`tensor_intrin`, turns a description plus a reduction length into a batch-reduce
GEMM tile intrinsic registered with ``s_tir.TensorIntrin.register``::

    C[mr, nr] (local accumulators) += sum_k A[mr, k] * B[k, nr]

with ``B`` in the packed layout the GEMM template produces (``nr`` contiguous floats per ``k``).
The implementation broadcasts one element of ``A`` per row and issues ``nr / lanes`` FMAs on full
vector registers per row and ``k`` step; LLVM keeps the ``mr * nr / lanes`` accumulators in
registers across the ``k`` loop (the assembly test checks: FMAs with broadcast loads, no spills).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from tvm import DataType, s_tir
from tvm.script import tirx as T
from tvm.target import Target

from .host import target_features


@dataclasses.dataclass(frozen=True)
class Microkernel:
    """One register-tiled GEMM microkernel.

    Attributes
    ----------
    isa
        Short ISA name (``"avx512"``, ``"avx2"``); part of the intrinsic's name.
    features
        Target features the kernel needs (all of them).
    in_dtype, acc_dtype
        Operand and accumulator dtypes.
    mr, nr
        Register tile: rows of ``A`` broadcast, columns of ``B`` held in vectors.
    vector_bits
        Vector register width.
    num_registers
        Vector registers the ISA has (32 zmm with AVX-512, 16 ymm with AVX2).
    k_step
        Reduction elements consumed per FMA (1 for fp32; 4 for VNNI int8, 2 for bf16).
    """

    isa: str
    features: tuple[str, ...]
    in_dtype: str
    acc_dtype: str
    mr: int
    nr: int
    vector_bits: int
    num_registers: int
    k_step: int = 1

    @property
    def lanes(self) -> int:
        """Accumulator elements per vector register."""
        return self.vector_bits // DataType(self.acc_dtype).bits

    @property
    def registers_used(self) -> int:
        """Accumulators, plus the ``B`` row vectors, plus one broadcast of ``A``."""
        return self.mr * self.nr // self.lanes + self.nr // self.lanes + 1

    @property
    def name(self) -> str:
        return f"hybrid_gemm_{self.isa}_{self.in_dtype}_{self.mr}x{self.nr}"

    def fits_registers(self) -> bool:
        return self.registers_used <= self.num_registers


def _family(isa, features, vector_bits, num_registers, in_dtype="float32",
            acc_dtype="float32", k_step=1) -> list[Microkernel]:
    lanes = vector_bits // 32
    out = []
    for vectors in (2, 1):  # nr = 2 vectors first: half the broadcasts per FMA
        for mr in range(16, 0, -1):
            kernel = Microkernel(isa, features, in_dtype, acc_dtype, mr, vectors * lanes,
                                 vector_bits, num_registers, k_step)
            if kernel.fits_registers():
                out.append(kernel)
    return out


#: Every fp32 microkernel, by ISA, best ISA first.
FP32_MICROKERNELS: dict[str, list[Microkernel]] = {
    "avx512": _family("avx512", ("avx512f",), 512, 32),
    "avx2": _family("avx2", ("avx2", "fma"), 256, 16),
}


#: u8 x s8 -> s32 microkernels, by ISA. AVX512-VNNI's ``vpdpbusd`` multiplies 4 adjacent ``u8``
#: of ``A`` (broadcast) by 4 ``s8`` of ``B`` per 32-bit lane and adds the 4 products to the
#: ``s32`` accumulator, exactly (no saturation), so ``B`` is packed with ``K`` in groups of 4.
#: AVX-VNNI (Alder Lake, Sierra Forest: no AVX-512) is the same instruction on 256-bit ymm.
INT8_MICROKERNELS: dict[str, list[Microkernel]] = {
    "avx512_vnni": _family("avx512_vnni", ("avx512vnni",), 512, 32, "uint8", "int32", 4),
    "avx_vnni": _family("avx_vnni", ("avxvnni",), 256, 16, "uint8", "int32", 4),
}


#: bf16 x bf16 -> fp32 microkernels. AVX512-BF16's ``vdpbf16ps`` multiplies 2 adjacent bf16 of
#: ``A`` (broadcast) by 2 of ``B`` per 32-bit lane and adds both products to the fp32
#: accumulator, so ``B`` is packed with ``K`` in pairs.
BF16_MICROKERNELS: dict[str, list[Microkernel]] = {
    "avx512_bf16": _family("avx512_bf16", ("avx512bf16",), 512, 32, "bfloat16", "float32", 2),
}

#: ``vdpbf16ps`` takes ``<32 x bfloat>`` operands, a type TIR cannot express: this LLVM IR,
#: linked into the module through the ``pragma_import_llvm`` loop annotation, takes them as
#: ``<16 x i32>`` and is always inlined.
_DPBF16PS_IR = r"""
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


def bf16_microkernels(target: Target) -> list[Microkernel]:
    """The bf16 microkernels ``target`` can run, or ``[]``."""
    features = target_features(target)
    for family in BF16_MICROKERNELS.values():
        if all(f in features for f in family[0].features):
            return family
    return []


def int8_microkernels(target: Target) -> list[Microkernel]:
    """The u8 x s8 microkernels ``target`` can run, or ``[]``."""
    features = target_features(target)
    for family in INT8_MICROKERNELS.values():
        if all(f in features for f in family[0].features):
            return family
    return []


def microkernels_for(target: Target, in_dtype: str) -> list[Microkernel]:
    """The microkernels of ``target`` for GEMMs on ``in_dtype`` operands."""
    if in_dtype == "float32":
        return fp32_microkernels(target)
    if in_dtype == "uint8":
        return int8_microkernels(target)
    if in_dtype == "bfloat16":
        return bf16_microkernels(target)
    return []


def microkernel_by_name(name: str) -> Microkernel:
    """The microkernel called ``name`` (:attr:`Microkernel.name`).

    Raises
    ------
    KeyError
        When no microkernel has that name.
    """
    for family in [*FP32_MICROKERNELS.values(), *INT8_MICROKERNELS.values(),
                   *BF16_MICROKERNELS.values()]:
        for kernel in family:
            if kernel.name == name:
                return kernel
    raise KeyError(f"unknown microkernel {name!r}")


def ensure_tensor_intrin(intrin_name: str) -> bool:
    """Register the tensor intrinsic called ``intrin_name`` if it is one of ours.

    A schedule trace names its tensor intrinsics; replaying a trace (tuning records) in a fresh
    process needs them registered first.

    Returns
    -------
    bool
        True when ``intrin_name`` is a tvm_hybrid microkernel intrinsic (now registered).
    """
    found = re.fullmatch(r"(hybrid_gemm_\w+)_k(\d+)", intrin_name)
    if not found:
        return False
    try:
        kernel = microkernel_by_name(found.group(1))
    except KeyError:
        return False
    tensor_intrin(kernel, int(found.group(2)))
    return True


def fp32_microkernels(target: Target) -> list[Microkernel]:
    """The fp32 microkernels ``target`` can run: its widest ISA's family, or ``[]``."""
    features = target_features(target)
    for family in FP32_MICROKERNELS.values():
        if all(f in features for f in family[0].features):
            return family
    return []


def tensor_intrin(kernel: Microkernel, k: int) -> str:
    """Register (once) and return the name of ``kernel``'s tensor intrinsic for reduction ``k``.

    Parameters
    ----------
    kernel
        The microkernel description.
    k
        The reduction length covered by one call (the whole ``K`` of a GEMM, any value).
    """
    return _register(kernel, int(k))


@functools.cache
def _register(kernel: Microkernel, k: int) -> str:
    name = f"{kernel.name}_k{k}"
    if kernel.in_dtype == "uint8":
        desc, impl = _vnni_tile_functions(kernel.mr, kernel.nr, k, kernel.lanes,
                                          kernel.vector_bits)
    elif kernel.in_dtype == "bfloat16":
        desc, impl = _bf16_tile_functions(kernel.mr, kernel.nr, k, kernel.lanes)
    else:
        desc, impl = _tile_functions(kernel.mr, kernel.nr, k, kernel.lanes, kernel.in_dtype)
    s_tir.TensorIntrin.register(name, desc, impl, override=True)
    return name


def _tile_functions(mr: int, nr: int, kc: int, lanes: int, dtype: str):
    """The (description, implementation) pair of an ``mr x nr`` tile over ``kc`` steps."""
    vectors = nr // lanes

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (kc, nr), dtype, offset_factor=1, strides=[ldb, 1])
        C = T.match_buffer(c, (mr, nr), dtype, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:kc, 0:nr])
            T.writes(C[0:mr, 0:nr])
            for i, j, kk in T.grid(mr, nr, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (kc, nr), dtype, offset_factor=1, strides=[ldb, 1])
        C = T.match_buffer(c, (mr, nr), dtype, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:kc, 0:nr])
            T.writes(C[0:mr, 0:nr])
            for kk in T.serial(kc):
                for i in T.unroll(mr):
                    for v in T.unroll(vectors):
                        C[i, T.ramp(v * lanes, 1, lanes)] = C[
                            i, T.ramp(v * lanes, 1, lanes)
                        ] + T.broadcast(A[i, kk], lanes) * B[kk, T.ramp(v * lanes, 1, lanes)]

    @T.prim_func(s_tir=True)
    def desc_one_row(a: T.handle, b: T.handle, c: T.handle):
        # With mr == 1 blockize keeps the unit row loop but drops its block var: match that.
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (kc, nr), dtype, offset_factor=1, strides=[ldb, 1])
        C = T.match_buffer(c, (mr, nr), dtype, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:kc, 0:nr])
            T.writes(C[0:mr, 0:nr])
            for _i, j, kk in T.grid(1, nr, kc):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, kk])
                    C[0, vj] = C[0, vj] + A[0, vk] * B[vk, vj]

    return (desc_one_row if mr == 1 else desc), impl


def _vnni_tile_functions(mr: int, nr: int, kc: int, lanes: int, vector_bits: int):
    """``C[mr, nr] (s32) += A[mr, kc] (u8) * B[kc / 4, nr, 4] (s8)`` with ``vpdpbusd``."""
    if kc % 4:
        raise ValueError(f"the VNNI microkernel needs K % 4 == 0, got K = {kc}")
    vectors = nr // lanes
    groups = kc // 4
    byte_lanes = lanes * 4
    intrinsic = f"llvm.x86.avx512.vpdpbusd.{vector_bits}"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), "uint8", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (groups, nr, 4), "int8", offset_factor=1, strides=[ldb, 4, 1])
        C = T.match_buffer(c, (mr, nr), "int32", offset_factor=1, strides=[ldc, 1],
                           scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:groups, 0:nr, 0:4])
            T.writes(C[0:mr, 0:nr])
            for i, j, kk in T.grid(mr, nr, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + T.Cast("int32", A[vi, vk]) * T.Cast(
                        "int32", B[vk // 4, vj, vk % 4])

    @T.prim_func(s_tir=True)
    def desc_one_row(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), "uint8", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (groups, nr, 4), "int8", offset_factor=1, strides=[ldb, 4, 1])
        C = T.match_buffer(c, (mr, nr), "int32", offset_factor=1, strides=[ldc, 1],
                           scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:groups, 0:nr, 0:4])
            T.writes(C[0:mr, 0:nr])
            for _i, j, kk in T.grid(1, nr, kc):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, kk])
                    C[0, vj] = C[0, vj] + T.Cast("int32", A[0, vk]) * T.Cast(
                        "int32", B[vk // 4, vj, vk % 4])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), "uint8", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (groups, nr, 4), "int8", offset_factor=1, strides=[ldb, 4, 1])
        C = T.match_buffer(c, (mr, nr), "int32", offset_factor=1, strides=[ldc, 1],
                           scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:groups, 0:nr, 0:4])
            T.writes(C[0:mr, 0:nr])
            for g in T.serial(groups):
                for i in T.unroll(mr):
                    for v in T.unroll(vectors):
                        C[i, T.ramp(v * lanes, 1, lanes)] = T.call_llvm_pure_intrin(
                            T.llvm_lookup_intrinsic_id(intrinsic),
                            C[i, T.ramp(v * lanes, 1, lanes)],
                            T.reinterpret(
                                T.broadcast(
                                    T.reinterpret(A.vload([i, g * 4], "uint8x4"), dtype="int32"),
                                    lanes),
                                dtype=f"int8x{byte_lanes}"),
                            B.vload([g, v * lanes, 0], f"int8x{byte_lanes}"),
                            dtype=f"int32x{lanes}")

    return (desc_one_row if mr == 1 else desc), impl


def _bf16_tile_functions(mr: int, nr: int, kc: int, lanes: int):
    """``C[mr, nr] (f32) += A[mr, kc] (bf16) * B[kc / 2, nr, 2] (bf16)`` with ``vdpbf16ps``."""
    if kc % 2:
        raise ValueError(f"the bf16 microkernel needs an even K, got K = {kc}")
    vectors = nr // lanes
    pairs = kc // 2

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), "bfloat16", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (pairs, nr, 2), "bfloat16", offset_factor=1, strides=[ldb, 2, 1])
        C = T.match_buffer(c, (mr, nr), "float32", offset_factor=1, strides=[ldc, 1],
                           scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:pairs, 0:nr, 0:2])
            T.writes(C[0:mr, 0:nr])
            for i, j, kk in T.grid(mr, nr, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast(
                        "float32", B[vk // 2, vj, vk % 2])

    @T.prim_func(s_tir=True)
    def desc_one_row(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), "bfloat16", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (pairs, nr, 2), "bfloat16", offset_factor=1, strides=[ldb, 2, 1])
        C = T.match_buffer(c, (mr, nr), "float32", offset_factor=1, strides=[ldc, 1],
                           scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:pairs, 0:nr, 0:2])
            T.writes(C[0:mr, 0:nr])
            for _i, j, kk in T.grid(1, nr, kc):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, kk])
                    C[0, vj] = C[0, vj] + T.Cast("float32", A[0, vk]) * T.Cast(
                        "float32", B[vk // 2, vj, vk % 2])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), "bfloat16", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (pairs, nr, 2), "bfloat16", offset_factor=1, strides=[ldb, 2, 1])
        C = T.match_buffer(c, (mr, nr), "float32", offset_factor=1, strides=[ldc, 1],
                           scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:pairs, 0:nr, 0:2])
            T.writes(C[0:mr, 0:nr])
            for g in T.serial(pairs, annotations={"pragma_import_llvm": _DPBF16PS_IR}):
                for i in T.unroll(mr):
                    for v in T.unroll(vectors):
                        C[i, T.ramp(v * lanes, 1, lanes)] = T.call_extern(
                            f"float32x{lanes}", "hybrid_dpbf16ps_512",
                            C[i, T.ramp(v * lanes, 1, lanes)],
                            T.broadcast(T.reinterpret(A.vload([i, g * 2], "bfloat16x2"),
                                                      dtype="int32"), lanes),
                            T.reinterpret(B.vload([g, v * lanes, 0], f"bfloat16x{2 * lanes}"),
                                          dtype=f"int32x{lanes}"))

    return (desc_one_row if mr == 1 else desc), impl
