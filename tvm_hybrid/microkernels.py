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
    panel
        Width of the packed ``B`` panels when it differs from ``nr`` (AMX: 16-column tiles,
        two per 32-column register tile); 0 means ``nr``.
    operand_registers
        Registers held per vector of ``B`` and per broadcast of ``A`` (2 each when bf16 is
        widened to fp32: the even and the odd ``k``).
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
    panel: int = 0
    operand_registers: tuple[int, int] = (1, 1)

    @property
    def lanes(self) -> int:
        """Accumulator elements per vector register."""
        return self.vector_bits // DataType(self.acc_dtype).bits

    @property
    def panel_width(self) -> int:
        """Columns per packed ``B`` panel."""
        return self.panel or self.nr

    @property
    def is_amx(self) -> bool:
        return self.isa.startswith("amx")

    @property
    def registers_used(self) -> int:
        """Accumulators, plus the ``B`` row vectors, plus one broadcast of ``A``.

        For AMX: ``C`` tiles plus the ``A`` and ``B`` tiles feeding them (8 tile registers).
        """
        if self.is_amx:
            rows, cols = self.mr // 16, self.nr // 16
            return rows * cols + rows + cols
        per_b, per_a = self.operand_registers
        vectors = self.nr // self.lanes
        return self.mr * vectors + per_b * vectors + per_a

    @property
    def name(self) -> str:
        return f"hybrid_gemm_{self.isa}_{self.in_dtype}_{self.mr}x{self.nr}"

    def fits_registers(self) -> bool:
        return self.registers_used <= self.num_registers


def _family(isa, features, vector_bits, num_registers, in_dtype="float32",
            acc_dtype="float32", k_step=1, operand_registers=(1, 1),
            widths=(2, 1)) -> list[Microkernel]:
    lanes = vector_bits // 32
    out = []
    for vectors in widths:  # nr = 2 vectors first: half the broadcasts per FMA
        for mr in range(16, 0, -1):
            kernel = Microkernel(isa, features, in_dtype, acc_dtype, mr, vectors * lanes,
                                 vector_bits, num_registers, k_step,
                                 operand_registers=operand_registers)
            if kernel.fits_registers():
                out.append(kernel)
    return out


#: Every fp32 microkernel, by ISA, best ISA first.
FP32_MICROKERNELS: dict[str, list[Microkernel]] = {
    "avx512": _family("avx512", ("avx512f",), 512, 32),
    # With 16 registers, 3- and 4-vector tiles keep more accumulators per broadcast when M
    # is a power of two: 4 x 24 ran at 100%, 2 x 32 at 90% and 4 x 16 at 80% of the FMA peak
    # in registers (peak.py's kernel, Zen 5, ymm). Packed weights pad N to any width.
    "avx2": _family("avx2", ("avx2", "fma"), 256, 16, widths=(2, 3, 4, 1)),
}


#: Integer microkernels (s32 accumulators), by ISA, best first.
#:
#: * AVX512-VNNI's ``vpdpbusd`` multiplies 4 adjacent ``u8`` of ``A`` (broadcast) by 4 ``s8`` of
#:   ``B`` per 32-bit lane and adds the 4 products to the accumulator, exactly (no saturation);
#:   ``B`` is packed with ``K`` in groups of 4, ``[N / nr, K / 4, nr, 4]``. AVX-VNNI (Alder
#:   Lake, Sierra Forest: no AVX-512) is the same instruction on 256-bit ymm.
#: * Without VNNI (Haswell to Zen 3), ``avx2_s16`` multiplies **s16** operands with
#:   ``vpmaddwd`` (2 products per 32-bit lane, ``B`` packed in pairs ``[N / nr, K / 2, nr, 2]``):
#:   8-bit activations are widened by a cast that fuses into their producer, weights at compile
#:   time. Every product of 8-bit values (even ``u8`` weights, or zero points folded in) is exact
#:   in s32, and the kernel issues two instructions per 16 products, no conversion: 89% of the
#:   rate of ONNX Runtime's ``vpmaddubsw`` + ``vpmaddwd`` sequence in registers (measured by
#:   ``peak.py``), which saturates s16 and is not exact. (``vpmaddubsw`` made exact with the
#:   sign trick, ``vpmaddubsw(|a|, sign(b, a))``, measured 80%.)
#:
#: ``passes/integer_gemm.py`` picks the operand dtype (:func:`integer_gemm_dtype`).
INT8_MICROKERNELS: dict[str, list[Microkernel]] = {
    "avx512_vnni": _family("avx512_vnni", ("avx512vnni",), 512, 32, "uint8", "int32", 4),
    "avx_vnni": _family("avx_vnni", ("avxvnni",), 256, 16, "uint8", "int32", 4),
    "avx2_s16": _family("avx2_s16", ("avx2",), 256, 16, "int16", "int32", 2),
}


#: bf16 x bf16 -> fp32 microkernels. AVX512-BF16's ``vdpbf16ps`` multiplies 2 adjacent bf16 of
#: ``A`` (broadcast) by 2 of ``B`` per 32-bit lane and adds both products to the fp32
#: accumulator, so ``B`` is packed with ``K`` in pairs.
#:
#: Without AVX512-BF16 the same packed bf16 weights (half the memory and bandwidth of fp32) are
#: widened to fp32 in the microkernel: a bf16 is the top half of an fp32, so per 32-bit lane of a
#: pair the even ``k`` is ``lane << 16`` and the odd one ``lane & 0xffff0000``, each multiplied
#: with an FMA (the ``bf16emu`` families; bf16 compute is emulated, at fp32 speed). Products of
#: bf16 values are exact in fp32, so both forms agree with an fp32 GEMM on bf16-rounded inputs.
BF16_MICROKERNELS: dict[str, list[Microkernel]] = {
    "avx512_bf16": _family("avx512_bf16", ("avx512bf16",), 512, 32, "bfloat16", "float32", 2),
    "avx512_bf16emu": _family("avx512_bf16emu", ("avx512f",), 512, 32, "bfloat16", "float32",
                              2, operand_registers=(2, 2)),
    "avx2_bf16emu": _family("avx2_bf16emu", ("avx2", "fma"), 256, 16, "bfloat16", "float32",
                            2, operand_registers=(2, 2)),
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


#: AMX: 2 x 2 tiles of 16 x 16 accumulators (a 32 x 32 register tile) in 8 tile registers, fed
#: by 2 tiles of ``A`` (16 rows x 64 bytes) and 2 of ``B`` (16-column panels, ``K`` in groups of
#: 4 bytes). ``tdpbusd`` (u8 x s8 -> s32) and ``tdpbf16ps`` (bf16 -> fp32). The intrinsic covers a
#: whole block of register tiles and configures the tiles once for it (``amx_tensor_intrin``).
AMX_INT8 = Microkernel("amx", ("amx-tile", "amx-int8"), "uint8", "int32", 32, 32, 512, 8, 4, 16)
AMX_BF16 = Microkernel("amx", ("amx-tile", "amx-bf16"), "bfloat16", "float32", 32, 32, 512, 8, 2,
                       16)
#: ``K`` per AMX tile step: 64 bytes per tile row.
AMX_K_STEP = {"uint8": 64, "bfloat16": 32}


def amx_microkernels(target: Target, in_dtype: str) -> list[Microkernel]:
    """The AMX microkernel for ``in_dtype`` if ``target`` has its AMX features, else ``[]``."""
    features = target_features(target)
    kernel = {"uint8": AMX_INT8, "bfloat16": AMX_BF16}.get(in_dtype)
    if kernel is None or not all(f in features for f in kernel.features):
        return []
    return [kernel]


def bf16_microkernels(target: Target) -> list[Microkernel]:
    """The bf16 vector microkernels ``target`` can run, or ``[]``."""
    features = target_features(target)
    for family in BF16_MICROKERNELS.values():
        if all(f in features for f in family[0].features):
            return family
    return []


def int8_microkernels(target: Target, in_dtype: str = "uint8") -> list[Microkernel]:
    """The best family of integer microkernels for ``in_dtype`` operands ``target`` runs.

    ``"uint8"``: the u8 x s8 dot-product families (VNNI); ``"int16"``: the s16 one (AVX2).
    """
    return _best_family(INT8_MICROKERNELS, target, in_dtype)


def integer_gemm_dtype(target: Target, weight_min: int, weight_max: int) -> str | None:
    """The operand dtype of the best integer GEMM ``target`` has for these weights.

    ``"uint8"`` where the CPU has a u8 x s8 dot product (VNNI, AMX) and the weights fit in s8;
    else ``"int16"`` (the AVX2 s16 kernel, any 8-bit data); None when the target has neither.
    """
    if int8_microkernels(target, "uint8") and -128 <= weight_min and weight_max <= 127:
        return "uint8"
    return "int16" if int8_microkernels(target, "int16") else None


def _best_family(families: dict[str, list[Microkernel]], target: Target,
                 in_dtype: str) -> list[Microkernel]:
    features = target_features(target)
    for family in families.values():
        if family[0].in_dtype == in_dtype and all(f in features for f in family[0].features):
            return family
    return []


def microkernels_for(target: Target, in_dtype: str, include_amx: bool = True
                     ) -> list[Microkernel]:
    """The microkernels of ``target`` for GEMMs on ``in_dtype`` operands (AMX first)."""
    amx = amx_microkernels(target, in_dtype) if include_amx else []
    if in_dtype == "float32":
        return fp32_microkernels(target)
    if in_dtype in ("uint8", "int16"):
        return amx + int8_microkernels(target, in_dtype)
    if in_dtype == "bfloat16":
        return amx + bf16_microkernels(target)
    return []


def microkernel_by_name(name: str) -> Microkernel:
    """The microkernel called ``name`` (:attr:`Microkernel.name`).

    Raises
    ------
    KeyError
        When no microkernel has that name.
    """
    for family in [*FP32_MICROKERNELS.values(), *INT8_MICROKERNELS.values(),
                   *BF16_MICROKERNELS.values(), [AMX_INT8, AMX_BF16]]:
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
    found = re.fullmatch(r"(hybrid_gemm_\w+?)(?:_b(\d+)x(\d+))?_k(\d+)", intrin_name)
    if not found:
        return False
    try:
        kernel = microkernel_by_name(found.group(1))
    except KeyError:
        return False
    if kernel.is_amx:
        if found.group(2) is None:
            return False
        amx_tensor_intrin(kernel, int(found.group(2)), int(found.group(3)), int(found.group(4)))
    else:
        tensor_intrin(kernel, int(found.group(4)))
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


def amx_tensor_intrin(kernel: Microkernel, mb: int, nb: int, k: int) -> str:
    """Register (once) and return the AMX intrinsic for an ``mb x nb`` block over ``k``.

    The block is a whole number of 32 x 32 register tiles. Its implementation configures the
    tiles once (``ldtilecfg``), runs every register tile of the block over the whole ``K``
    (``tileloadd``, ``tdpbusd``/``tdpbf16ps``, ``tilestored``) and releases the tiles.
    """
    return _register_amx(kernel, int(mb), int(nb), int(k))


@functools.cache
def _register_amx(kernel: Microkernel, mb: int, nb: int, k: int) -> str:
    name = f"{kernel.name}_b{mb}x{nb}_k{k}"
    desc, impl = _amx_block_functions(kernel.in_dtype, mb, nb, k)
    s_tir.TensorIntrin.register(name, desc, impl, override=True)
    return name


@functools.cache
def _register(kernel: Microkernel, k: int) -> str:
    name = f"{kernel.name}_k{k}"
    if kernel.in_dtype == "int16":
        desc, impl = _s16_tile_functions(kernel.mr, kernel.nr, k)
    elif kernel.in_dtype == "uint8":
        desc, impl = _vnni_tile_functions(kernel.mr, kernel.nr, k, kernel.lanes,
                                          kernel.vector_bits)
    elif kernel.in_dtype == "bfloat16" and kernel.isa.endswith("bf16emu"):
        desc, impl = _bf16_widening_tile_functions(kernel.mr, kernel.nr, k, kernel.lanes)
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


def _grouped_desc(mr: int, nr: int, kc: int, a_dtype: str, b_dtype: str, acc: str, group: int):
    """The description of a tile whose ``B`` is packed with ``group`` consecutive ``k``::

        C[mr, nr] (acc) += acc(A[mr, kc]) * acc(B[kc / group, nr, group])

    shared by the VNNI (group 4), s16 (2) and bf16 (2) microkernels.
    """
    rows = kc // group

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (rows, nr, group), b_dtype, offset_factor=1,
                           strides=[ldb, group, 1])
        C = T.match_buffer(c, (mr, nr), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:rows, 0:nr, 0:group])
            T.writes(C[0:mr, 0:nr])
            for i, j, kk in T.grid(mr, nr, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + T.Cast(acc, A[vi, vk]) * T.Cast(
                        acc, B[vk // group, vj, vk % group])

    @T.prim_func(s_tir=True)
    def desc_one_row(a: T.handle, b: T.handle, c: T.handle):
        # With mr == 1 blockize keeps the unit row loop but drops its block var: match that.
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (rows, nr, group), b_dtype, offset_factor=1,
                           strides=[ldb, group, 1])
        C = T.match_buffer(c, (mr, nr), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:rows, 0:nr, 0:group])
            T.writes(C[0:mr, 0:nr])
            for _i, j, kk in T.grid(1, nr, kc):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, kk])
                    C[0, vj] = C[0, vj] + T.Cast(acc, A[0, vk]) * T.Cast(
                        acc, B[vk // group, vj, vk % group])

    return desc_one_row if mr == 1 else desc


def _grouped_impl(mr: int, nr: int, kc: int, a_dtype: str, b_dtype: str, acc: str,
                  group: int, lanes: int, update, annotations=None):
    """The implementation of a tile whose ``B`` is packed with ``group`` consecutive ``k``
    (matching :func:`_grouped_desc`): per group of ``k``, row and vector of ``lanes``
    accumulators, ``C = update(C, A, B, i, g, v)``, where ``update`` returns the vector
    expression of one ISA's instructions."""
    rows = kc // group
    vectors = nr // lanes

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (rows, nr, group), b_dtype, offset_factor=1,
                           strides=[ldb, group, 1])
        C = T.match_buffer(c, (mr, nr), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:rows, 0:nr, 0:group])
            T.writes(C[0:mr, 0:nr])
            for g in T.serial(rows, annotations=annotations):
                for i in T.unroll(mr):
                    for v in T.unroll(vectors):
                        C[i, T.ramp(v * lanes, 1, lanes)] = update(
                            C[i, T.ramp(v * lanes, 1, lanes)], A, B, i, g, v)

    return impl


def _vnni_tile_functions(mr: int, nr: int, kc: int, lanes: int, vector_bits: int):
    """``C[mr, nr] (s32) += A[mr, kc] (u8) * B[kc / 4, nr, 4] (s8)`` with ``vpdpbusd``."""
    if kc % 4:
        raise ValueError(f"the VNNI microkernel needs K % 4 == 0, got K = {kc}")
    byte_lanes = lanes * 4
    intrinsic = f"llvm.x86.avx512.vpdpbusd.{vector_bits}"

    def update(acc, A, B, i, g, v):
        a_bytes = T.reinterpret(T.broadcast(T.reinterpret(A.vload([i, g * 4], "uint8x4"),
                                                          dtype="int32"), lanes),
                                dtype=f"int8x{byte_lanes}")
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(intrinsic), acc, a_bytes,
                                       B.vload([g, v * lanes, 0], f"int8x{byte_lanes}"),
                                       dtype=f"int32x{lanes}")

    return (_grouped_desc(mr, nr, kc, "uint8", "int8", "int32", 4),
            _grouped_impl(mr, nr, kc, "uint8", "int8", "int32", 4, lanes, update))


def _bf16_tile_functions(mr: int, nr: int, kc: int, lanes: int):
    """``C[mr, nr] (f32) += A[mr, kc] (bf16) * B[kc / 2, nr, 2] (bf16)`` with ``vdpbf16ps``."""
    if kc % 2:
        raise ValueError(f"the bf16 microkernel needs an even K, got K = {kc}")

    def update(acc, A, B, i, g, v):
        return T.call_extern(
            f"float32x{lanes}", "hybrid_dpbf16ps_512", acc,
            T.broadcast(T.reinterpret(A.vload([i, g * 2], "bfloat16x2"), dtype="int32"), lanes),
            T.reinterpret(B.vload([g, v * lanes, 0], f"bfloat16x{2 * lanes}"),
                          dtype=f"int32x{lanes}"))

    return (_grouped_desc(mr, nr, kc, "bfloat16", "bfloat16", "float32", 2),
            _grouped_impl(mr, nr, kc, "bfloat16", "bfloat16", "float32", 2, lanes, update,
                          {"pragma_import_llvm": _DPBF16PS_IR}))


def _bf16_widening_tile_functions(mr: int, nr: int, kc: int, lanes: int):
    """``C[mr, nr] (f32) += A[mr, kc] (bf16) * B[kc / 2, nr, 2] (bf16)`` with fp32 FMAs.

    Each 32-bit lane of ``B`` (and the broadcast pair of ``A``) holds the bf16 of an even and an
    odd ``k``; shifting left by 16 gives the even one as fp32, masking the low half the odd one.
    """
    if kc % 2:
        raise ValueError(f"the bf16 microkernel needs an even K, got K = {kc}")
    f32 = f"float32x{lanes}"

    def even(word):
        return T.reinterpret(T.shift_left(word, T.broadcast(T.int32(16), lanes)), dtype=f32)

    def odd(word):
        return T.reinterpret(T.bitwise_and(word, T.broadcast(T.int32(-65536), lanes)), dtype=f32)

    def update(acc, A, B, i, g, v):
        a = T.broadcast(T.reinterpret(A.vload([i, g * 2], "bfloat16x2"), dtype="int32"), lanes)
        b = T.reinterpret(B.vload([g, v * lanes, 0], f"bfloat16x{2 * lanes}"),
                          dtype=f"int32x{lanes}")
        return acc + even(a) * even(b) + odd(a) * odd(b)

    return (_grouped_desc(mr, nr, kc, "bfloat16", "bfloat16", "float32", 2),
            _grouped_impl(mr, nr, kc, "bfloat16", "bfloat16", "float32", 2, lanes, update))


def _amx_block_functions(in_dtype: str, mb: int, nb: int, kc: int):
    """``C[mb, nb] += A[mb, kc] * B[nb / 16, kc / g, 16, g]`` on AMX tiles (see the intrinsic)."""
    int8 = in_dtype == "uint8"
    group = 4 if int8 else 2
    b_dtype, acc = ("int8", "int32") if int8 else ("bfloat16", "float32")
    step = AMX_K_STEP[in_dtype]
    if mb % 32 or nb % 32 or kc % step:
        raise ValueError(f"AMX blocks need mb, nb multiples of 32 and K of {step}; got "
                         f"{mb}x{nb}, K = {kc}")
    dot = "llvm.x86.tdpbusd" if int8 else "llvm.x86.tdpbf16ps"
    panels, rows, esize = nb // 16, kc // group, 1 if int8 else 2
    m_tiles, n_tiles, k_tiles = mb // 32, nb // 32, kc // step

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mb, kc), in_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (panels, rows, 16, group), b_dtype, offset_factor=1,
                           strides=[ldb, 16 * group, group, 1])
        C = T.match_buffer(c, (mb, nb), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mb, 0:nb], A[0:mb, 0:kc], B[0:panels, 0:rows, 0:16, 0:group])
            T.writes(C[0:mb, 0:nb])
            for i, j, kk in T.grid(mb, nb, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + T.Cast(acc, A[vi, vk]) * T.Cast(
                        acc, B[vj // 16, vk // group, vj % 16, vk % group])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mb, kc), in_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (panels, rows, 16, group), b_dtype, offset_factor=1,
                           strides=[ldb, 16 * group, group, 1])
        C = T.match_buffer(c, (mb, nb), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mb, 0:nb], A[0:mb, 0:kc], B[0:panels, 0:rows, 0:16, 0:group])
            T.writes(C[0:mb, 0:nb])
            # Tile configuration, once for the whole block: palette 1, 8 tiles of 16 rows x 64
            # bytes (bytes 16 + 2t: columns in bytes of tile t; byte 48 + t: its rows).
            cfg = T.alloc_buffer((64,), "uint8", scope="local")
            for z in range(64):
                cfg[z] = T.uint8(0)
            cfg[0] = T.uint8(1)
            for t in range(8):
                cfg[16 + 2 * t] = T.uint8(64)
                cfg[48 + t] = T.uint8(16)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            for mt, nt in T.grid(m_tiles, n_tiles):
                for ct in T.unroll(4):  # C tiles 0-3: (row half, column half)
                    T.evaluate(T.call_llvm_intrin(
                        "void", "llvm.x86.tileloadd64", T.Cast("int8", ct),
                        T.address_of(C[mt * 32 + ct // 2 * 16, nt * 32 + ct % 2 * 16]),
                        T.Cast("int64", ldc * 4)))
                for kt in range(k_tiles):
                    for at in T.unroll(2):  # A tiles 4, 5: the two 16-row halves
                        T.evaluate(T.call_llvm_intrin(
                            "void", "llvm.x86.tileloadd64", T.Cast("int8", 4 + at),
                            T.address_of(A[mt * 32 + at * 16, kt * step]),
                            T.Cast("int64", lda * esize)))
                    for bt in T.unroll(2):  # B tiles 6, 7: the two 16-column panels
                        T.evaluate(T.call_llvm_intrin(
                            "void", "llvm.x86.tileloadd64", T.Cast("int8", 6 + bt),
                            T.address_of(B[nt * 2 + bt, kt * 16, 0, 0]), T.int64(64)))
                    for ct in T.unroll(4):
                        T.evaluate(T.call_llvm_intrin(
                            "void", dot, T.Cast("int8", ct), T.Cast("int8", 4 + ct // 2),
                            T.Cast("int8", 6 + ct % 2)))
                for ct in T.unroll(4):
                    T.evaluate(T.call_llvm_intrin(
                        "void", "llvm.x86.tilestored64", T.Cast("int8", ct),
                        T.address_of(C[mt * 32 + ct // 2 * 16, nt * 32 + ct % 2 * 16]),
                        T.Cast("int64", ldc * 4)))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return desc, impl


def _s16_tile_functions(mr: int, nr: int, kc: int):
    """``C[mr, nr] (s32) += A[mr, kc] (s16) * B[kc / 2, nr, 2] (s16)`` with ``vpmaddwd``.

    Per pair of ``k`` and row: the two s16 of ``A`` broadcast to every 32-bit lane; per 8
    columns, ``vpmaddwd`` multiplies them with the columns' pairs of ``B`` and adds each pair's
    two products into one s32 lane, exactly.
    """
    if kc % 2 or nr % 8:
        raise ValueError(f"the s16 tile needs an even K and nr % 8 == 0; got {kc}, {nr}")

    def update(acc, A, B, i, g, v):
        a = T.reinterpret(T.broadcast(T.reinterpret(A.vload([i, g * 2], "int16x2"),
                                                    dtype="int32"), 8), dtype="int16x16")
        return acc + T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a,
                                             B.vload([g, v * 8, 0], "int16x16"))

    return (_grouped_desc(mr, nr, kc, "int16", "int16", "int32", 2),
            _grouped_impl(mr, nr, kc, "int16", "int16", "int32", 2, 8, update))
