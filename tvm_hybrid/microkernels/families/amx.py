"""AMX: blocks of 32 x 32 register tiles on Intel's tile registers (``tdpbusd``, ``tdpbf16ps``).

A 32 x 32 register tile is 2 x 2 tiles of 16 x 16 accumulators in 8 tile registers, fed by 2
tiles of ``A`` (16 rows x 64 bytes) and 2 of ``B`` (16-column panels, ``K`` in groups of 4
bytes). ``tdpbusd`` multiplies u8 x s8 into s32, ``tdpbf16ps`` bf16 into fp32. The tile
configuration is per thread, so the intrinsic covers a whole block of register tiles
(``per_block``) and configures the tiles once for it.

Never run on a CPU without AMX: LLVM aborts the process there (the template checks the target's
features before lowering; tests only compile and read the assembly on such hosts).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel import Family, Microkernel
from ..registry import register_family
from ..tiles import reference_update, tile_function

#: ``K`` per AMX tile step: 64 bytes per tile row.
K_PER_TILE = {"uint8": 64, "bfloat16": 32}
#: Tile steps per ``K`` block at most (512 bytes of a row: 16 KB of ``A``'s 32 rows), see
#: :func:`k_block_steps`.
K_BLOCK_TILES = 8


def k_block_steps(k_tiles: int) -> int:
    """Tile steps per ``K`` block of a block of ``k_tiles`` steps: the largest divisor of
    ``k_tiles`` up to :data:`K_BLOCK_TILES`, if at least half that, else all of them.

    Each ``K`` block is swept over the whole block of tiles, so the 32 rows of ``A`` it reads
    stay in L1 while the ``N`` tiles pass; the accumulator tiles are loaded and stored once per
    ``K`` block instead of once. On a 2-core Emerald Rapids VM (same machine, two rounds):
    bf16 1024x3072x768 3.37-3.54 -> 2.64-2.66 ms, int8 1024^3 0.65-0.66 -> 0.58-0.64 ms;
    blocks of 4 steps were slower than 8 (2.87-3.04 and 0.70-0.71 ms).
    """
    best = max(d for d in range(1, min(k_tiles, K_BLOCK_TILES) + 1) if k_tiles % d == 0)
    return best if best * 2 >= K_BLOCK_TILES else k_tiles


@T.macro
def configure_tiles():
    """``ldtilecfg`` of palette 1 with 8 tiles of 16 rows x 64 bytes (bytes 16 + 2t: columns
    in bytes of tile t; byte 48 + t: its rows). The configuration is per thread."""
    cfg = T.alloc_buffer((64,), "uint8", scope="local")
    for z in range(64):
        cfg[z] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for t in range(8):
        cfg[16 + 2 * t] = T.uint8(64)
        cfg[48 + t] = T.uint8(16)
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))


def _tile_op(name: str, *args):
    return T.evaluate(T.call_llvm_intrin("void", f"llvm.x86.{name}", *args))


def block_product(dot: str, steps: int, a_tile, a_stride: int, b_tile, b_stride: int,
                  c_tile, c_stride: int):
    """A macro ``product(A, B, C, row, col)``: one 32 x 32 block ``C = A . B`` from zero on
    tiles configured by :func:`configure_tiles`, for kernels that are not GEMM blocks (fused
    attention). Accumulators in tiles 0-3 (row half, column half), ``A``'s two 16-row halves
    in 4-5 and ``B``'s two 16-column panels in 6-7 at each of ``steps`` tile steps; ``dot`` is
    ``"tdpbusd"`` or ``"tdpbf16ps"``. ``a_tile(A, row, half, step)``,
    ``b_tile(B, col, half, step)`` and ``c_tile(C, row, col, tile)`` give the element where a
    tile starts, the strides are in bytes."""

    @T.macro
    def product(A, B, C, row, col):
        for ct in T.unroll(4):
            _tile_op("tilezero", T.Cast("int8", ct))
        for step in range(steps):
            for a in T.unroll(2):
                _tile_op("tileloadd64", T.Cast("int8", 4 + a),
                         T.address_of(a_tile(A, row, a, step)), T.int64(a_stride))
            for n in T.unroll(2):
                _tile_op("tileloadd64", T.Cast("int8", 6 + n),
                         T.address_of(b_tile(B, col, n, step)), T.int64(b_stride))
            for ct in T.unroll(4):
                _tile_op(dot, T.Cast("int8", ct), T.Cast("int8", 4 + ct // 2),
                         T.Cast("int8", 6 + ct % 2))
        for ct in T.unroll(4):
            _tile_op("tilestored64", T.Cast("int8", ct),
                     T.address_of(c_tile(C, row, col, ct)), T.int64(c_stride))

    return product


def release_tiles():
    """``tilerelease``: the end of a thread's use of the tiles."""
    return _tile_op("tilerelease")


def amx_block_functions(kernel: Microkernel, mb: int, nb: int, kc: int):
    """``C[mb, nb] += A[mb, kc] * B[nb / 16, kc / g, 16, g]`` on AMX tiles (module docstring),
    where ``C`` is zero on entry: the implementation starts its accumulator tiles with
    ``tilezero`` and never reads ``C`` before its first ``K`` block has stored it, so the
    template zeroes ``C`` with the intrinsic of ``tiles.zero_block_functions``, which writes
    nothing (the per-block contract, ``kernel.Family``)."""
    in_dtype = kernel.in_dtype
    int8 = in_dtype == "uint8"
    group = 4 if int8 else 2
    b_dtype, acc = ("int8", "int32") if int8 else ("bfloat16", "float32")
    step = K_PER_TILE[in_dtype]
    if mb % 32 or nb % 32 or kc % step:
        raise ValueError(f"AMX blocks need mb, nb multiples of 32 and K of {step}; got "
                         f"{mb}x{nb}, K = {kc}")
    dot = "tdpbusd" if int8 else "tdpbf16ps"
    panels, rows, esize = nb // 16, kc // group, 1 if int8 else 2
    m_tiles, n_tiles, k_tiles = mb // 32, nb // 32, kc // step
    k_per = k_block_steps(k_tiles)
    k_blocks = k_tiles // k_per

    @T.macro
    def tiles(A, B, C):
        configure_tiles()  # once for the whole block
        for kb, mt, nt in T.grid(k_blocks, m_tiles, n_tiles):
            for ct in T.unroll(4):  # C tiles 0-3: (row half, column half)
                if kb == 0:  # the block starts from zero (module docstring), not from C
                    _tile_op("tilezero", T.Cast("int8", ct))
                else:
                    _tile_op("tileloadd64", T.Cast("int8", ct),
                             T.address_of(C[mt * 32 + ct // 2 * 16, nt * 32 + ct % 2 * 16]),
                             T.Cast("int64", C.strides[0] * 4))
            for kt in range(kb * k_per, kb * k_per + k_per):
                # Loads interleaved with the products that need them (A0 B0 C00 B1 C01 A1
                # C10 C11): a product starts while the next operand tile loads.
                for ct in T.unroll(4):
                    if ct == 0 or ct == 2:  # A tiles 4, 5: the two 16-row halves
                        _tile_op("tileloadd64", T.Cast("int8", 4 + ct // 2),
                                 T.address_of(A[mt * 32 + ct // 2 * 16, kt * step]),
                                 T.Cast("int64", A.strides[0] * esize))
                    if ct < 2:  # B tiles 6, 7: the two 16-column panels
                        _tile_op("tileloadd64", T.Cast("int8", 6 + ct),
                                 T.address_of(B[nt * 2 + ct, kt * 16, 0, 0]), T.int64(64))
                    _tile_op(dot, T.Cast("int8", ct), T.Cast("int8", 4 + ct // 2),
                             T.Cast("int8", 6 + ct % 2))
            for ct in T.unroll(4):
                _tile_op("tilestored64", T.Cast("int8", ct),
                         T.address_of(C[mt * 32 + ct // 2 * 16, nt * 32 + ct % 2 * 16]),
                         T.Cast("int64", C.strides[0] * 4))
        release_tiles()

    buffers = ((mb, kc), (panels, rows, 16, group), (16 * group, group, 1),
               (in_dtype, b_dtype, acc), (mb, nb))
    desc = reference_update(mb, nb, kc, acc,
                            lambda B, j, k: B[j // 16, k // group, j % 16, k % group])
    return tile_function(*buffers, desc), tile_function(*buffers, tiles)


AMX_INT8 = Microkernel("amx", ("amx-tile", "amx-int8"), "uint8", "int32", 32, 32, 512, 8, 4, 16,
                       k_multiple=K_PER_TILE["uint8"], per_block=True)
AMX_BF16 = Microkernel("amx", ("amx-tile", "amx-bf16"), "bfloat16", "float32", 32, 32, 512, 8,
                       2, 16, k_multiple=K_PER_TILE["bfloat16"], per_block=True)

register_family(Family("amx_int8", (AMX_INT8,), rank=40, block_functions=amx_block_functions))
register_family(Family("amx_bf16", (AMX_BF16,), rank=40, block_functions=amx_block_functions))
