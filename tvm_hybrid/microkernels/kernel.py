"""What a GEMM microkernel is: a register tile (or a block of matrix tiles) declared as data.

A :class:`Microkernel` says what a register tile is: the ISA it needs, its dtypes, the tile
``mr x nr`` held in accumulator registers, the vector width, how many registers it uses and the
layout of the packed weights it reads. A :class:`Family` is the set of tiles one ISA offers
for one operand dtype, with the generator of their TIR tensor intrinsics; families register
themselves with :mod:`~tvm_hybrid.microkernels.registry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tvm import DataType

#: Bytes under which TVM's ``LowerTVMBuiltin`` keeps a ``"global"`` allocation on the stack
#: (``runtime::kMaxStackAlloca``); any ``"local"`` one, and larger ones, it takes from the
#: runtime's workspace pool (``TVMBackendAllocWorkspace`` and a free, once per parallel task).
#: Only a stack array stays in registers across a call LLVM cannot see into.
STACK_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class Microkernel:
    """One register-tiled GEMM microkernel.

    Attributes
    ----------
    isa
        Short ISA name (``"avx512"``, ``"avx2"``); with ``in_dtype`` it names the family.
    features
        Target features the kernel needs (all of them).
    in_dtype, acc_dtype
        Operand and accumulator dtypes.
    mr, nr
        Register tile: rows of ``A`` broadcast, columns of ``B`` held in vectors.
    vector_bits
        Vector register width.
    num_registers
        Vector registers the ISA has (32 zmm with AVX-512, 16 ymm with AVX2; 8 AMX tiles).
    k_step
        Reduction elements consumed per instruction and 32-bit lane (1 for fp32; 4 for VNNI
        int8, 2 for bf16 and s16): ``B`` is packed with ``K`` in groups of ``k_step``.
    panel
        Width of the packed ``B`` panels when it differs from ``nr`` (AMX: 16-column tiles,
        two per 32-column register tile); 0 means ``nr``.
    operand_registers
        Registers held per vector of ``B`` and per broadcast of ``A`` (2 each when bf16 is
        widened to fp32: the even and the odd ``k``).
    k_multiple
        ``K`` must be a multiple of this (AMX: a whole tile row of 64 bytes); 0 means
        ``k_step``.
    per_block
        The intrinsic covers a whole block of register tiles, not one (AMX: the tile
        configuration is set once per block).
    whole_panels
        Taken only where ``N`` is a whole number of its panels (no tail panel).
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
    k_multiple: int = 0
    per_block: bool = False
    whole_panels: bool = False

    @property
    def lanes(self) -> int:
        """Accumulator elements per vector register."""
        return self.vector_bits // DataType(self.acc_dtype).bits

    @property
    def panel_width(self) -> int:
        """Columns per packed ``B`` panel."""
        return self.panel or self.nr

    @property
    def k_granule(self) -> int:
        """What ``K`` must be a multiple of."""
        return self.k_multiple or self.k_step

    @property
    def weight_layout(self) -> tuple[int, int]:
        """``(panel width, k group)``: ``B`` packed as ``[N / panel, K / group, panel, group]``
        (``[N / panel, K, panel]`` when the group is 1)."""
        return self.panel_width, self.k_step

    @property
    def registers_used(self) -> int:
        """Accumulators, plus the ``B`` row vectors, plus one broadcast of ``A``.

        For a per-block (AMX) kernel: ``C`` tiles plus the ``A`` and ``B`` tiles feeding them.
        """
        if self.per_block:
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

    def takes_columns(self, n: int) -> bool:
        """Whether the tile may compute ``n`` columns: any ``n`` (padded to whole panels),
        unless it is a ``whole_panels`` tile and ``n`` would leave a tail panel."""
        return not self.whole_panels or n % self.panel_width == 0


#: ``(kernel, k, tail) -> (description, implementation)`` PrimFuncs of one register tile over
#: ``k``; ``tail`` (a ``tiles.Tail`` or None): the last weight panel's used columns only.
TileFunctions = Callable[[Microkernel, int, object], tuple]
#: ``(kernel, mb, nb, k) -> (description, implementation)`` of an ``mb x nb`` block over ``k``.
BlockFunctions = Callable[[Microkernel, int, int, int], tuple]


@dataclasses.dataclass(frozen=True)
class Family:
    """The microkernels one ISA offers for one operand dtype, and how to generate them.

    Attributes
    ----------
    tier
        The ISA tier shown to users (``tvm-hybrid info``), e.g. ``"avx512_vnni"``.
    kernels
        Every tile the family offers (those that fit the register file).
    rank
        Preference among families of the same operand dtype a target has (higher first).
    tile_functions, block_functions
        The intrinsic generator: per register tile, or per block (``per_block`` kernels). A
        block function's implementation must not read its accumulators ``C`` on entry (it
        starts them from zero): the template zeroes them with an intrinsic that writes
        nothing (``tiles.zero_block_functions``).
    note
        What a user should know when the family is chosen (logged at compile time), or "".
    pair_bound
        0 when the family is exact for any weights of its dtype; else it is exact only for
        weights whose pairs of adjacent ``k`` have ``|b0| + |b1| <= pair_bound`` in every
        column (AVX2's saturating ``vpmaddubsw``), and is chosen only for such constants.
    """

    tier: str
    kernels: tuple[Microkernel, ...]
    rank: int
    tile_functions: TileFunctions | None = None
    block_functions: BlockFunctions | None = None
    note: str = ""
    pair_bound: int = 0

    @property
    def first(self) -> Microkernel:
        return self.kernels[0]

    @property
    def key(self) -> tuple[str, str]:
        """``(isa, in_dtype)``: what names the family."""
        return self.first.isa, self.first.in_dtype

    @property
    def features(self) -> tuple[str, ...]:
        return self.first.features

    @property
    def in_dtype(self) -> str:
        return self.first.in_dtype


def vector_tiles(isa: str, features: tuple[str, ...], vector_bits: int, num_registers: int,
                 in_dtype: str = "float32", acc_dtype: str = "float32", k_step: int = 1,
                 operand_registers: tuple[int, int] = (1, 1),
                 widths: tuple[int, ...] = (2, 1),
                 whole_panel_widths: tuple[int, ...] = ()) -> tuple[Microkernel, ...]:
    """Every ``mr x (vectors * lanes)`` tile that fits the register file, ``vectors`` in
    ``widths`` order (2 vectors first: half the broadcasts per FMA), then ``mr`` descending;
    tiles of ``vectors`` in ``whole_panel_widths`` are marked ``whole_panels``."""
    lanes = vector_bits // 32
    out = []
    for vectors in widths:
        for mr in range(16, 0, -1):
            kernel = Microkernel(isa, features, in_dtype, acc_dtype, mr, vectors * lanes,
                                 vector_bits, num_registers, k_step,
                                 operand_registers=operand_registers,
                                 whole_panels=vectors in whole_panel_widths)
            if kernel.fits_registers():
                out.append(kernel)
    return tuple(out)
