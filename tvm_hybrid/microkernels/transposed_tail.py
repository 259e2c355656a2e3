"""A narrow GEMM's few columns as dot products along ``K``.

A tile's broadcast update spends one FMA per row and ``k`` on a panel whatever share of its
columns the GEMM keeps, so a GEMM of N = 1 (a regression head) on a 32-column panel does one
multiply-add per FMA, into a vector of which one lane is used. With its ``c`` columns stored
transposed, ``K`` along the lanes, one FMA does ``width`` multiply-adds instead: a vector of
the copy holds ``run`` consecutive ``k`` of each of ``spread`` columns (``c`` rounded up to a
power of two, ``width = spread * run``), lane ``col * run + j`` holding ``B[k0 + j, col]``, and
is multiplied by the ``run`` elements ``A[i, k0 : k0 + run]`` repeated ``spread`` times (one
broadcast load). After the ``K`` loop each row's accumulators are summed over their ``run``
lanes per column, in halving steps, into the tile's first ``spread`` accumulators; the ``K %
run`` last ``k`` take the broadcast update.

The copy lives in the columns the GEMM drops: the ``width`` columns ``[panel - width, panel)``
of the panel, in one of the ``run`` rows of each whole group of ``K`` (:func:`copy_row`: the
group's first row ``t * run``, moved down a row for every 4 KiB, an L1 way, of the panel before
it, so that the copy's vectors fall into every set a row's second line can map to; at ``t *
run`` alone they were 256 bytes apart for ``run`` 2 on 32 columns, in a quarter of the sets,
and a 197x8x333 GEMM re-read them from L2 for every row: same process on a 2-core Zen 4, old
layout against new, 197x7 and 197x8 (K = 333) 1.14-1.16x, and the AVX2 code's 197x3 and 197x4
1.32-1.35x, in 11 of 11 rounds; with ``K`` = 768 the copy outgrows those sets and gains
nothing, and other widths are unchanged). The used columns ``[0, c)`` stay as they are, so the
packed weights still hold the GEMM the IR describes in every column the consumer reads: a
kernel that does not know the copy (the generic schedule, a record of another tile) computes
the same kept columns, with other values in the dropped ones. The packing pass writes it
(:func:`write_transposed_copy`) into the GEMM's last panel, the only one or the last of several,
unless one of its used columns equals a column of the full panels
(``passes/packed_gemm.tail_columns_distinct``): the dot products sum in another order than the
broadcast update, and columns of equal weights would then differ by rounding (onnx's light
AlexNet, whose weight columns are equal and 1000 logits 7.9e11, lost 8 classes to the softmax
when its last panel ran transposed). On the last of several panels a column costs a full vector
FMA per row and ``k`` broadcast, as much as a whole vector of columns; transposed, one FMA per
``run`` ``k``: same process on a 2-core Emerald Rapids, 9 rounds, the GEMM alone, 197x97x333
1.14x (94% of 197x96's GFLOP/s against 85%), 197x257x333 1.05x, 8 columns on 2 ``k`` per
vector beside 8-12-row tiles (200x40x384, 64x40x384, 400x72x384, 960x40x32) 1.08-1.17x, the AVX2
code's 197x97x333 1.12x and 400x75x384 1.14x; 197x96, 197x256 and 197x777 (9 columns: no copy)
unchanged. The GEMM block's
annotation (:data:`TRANSPOSED_TAIL`) says there is a copy; the template takes it when its tile
has the vector width, and each call's ``K`` is the whole ``K`` or a multiple of the rotation's
period (:func:`copy_period`: K blocks start where the rotation does).

Where that copy would hold only 2 ``k`` per column (5-8 columns on zmm, 3-4 on ymm), it holds one
column per vector instead (``per_column``), where the tile expected to run it keeps an accumulator
per row and column in registers: ``width`` consecutive ``k`` of column ``c`` in row ``c`` of the
group's ``width`` rows (rotated as above, by the columns rounded up to a power of two), each row of
``A`` loaded as a plain vector of ``width`` ``k`` and multiplied with each column's vector into that
column's accumulator; at the end a shuffle tree sums the columns' lanes pairwise (two vectors of
``m`` columns into one of ``2 m``, then halving steps) into the tile's first ``spread``
accumulators. A vector of ``A`` then serves every column (one load per FMA and a column instead of a
broadcast and a load per FMA). Same process on a 2-core Zen 4, the GEMM alone (the VM's C++ timer),
11 rounds, against the 2-``k`` copy: 197x8x333 1.22-1.24x, 197x7x333 1.24-1.35x, 197x6x333
1.47-1.51x, 197x5x333 1.60-1.66x, 197x6x4096 1.27x (zmm); the AVX2 code 197x4x333 1.24-1.27x,
197x3x333 1.35-1.37x, 389x3x768 1.25x; 197x8x768, 389x8x768, 1x8x768, 197x4x768 and 197x4x4096
0.99-1.01x (their copy outgrows the L1 sets it maps to and is read from L2 for every row either
way). As standalone kernels, 4 ``k`` of each column or more measured as fast as one column per
vector or faster (4 columns on zmm 7 against 7.9 us, 2 on ymm 5 against 6 us), so those keep the
interleaved copy.
"""

from __future__ import annotations

import math

import numpy as np
from tvm.script import tirx as T

from .kernel import Microkernel

#: The packed GEMM block's annotation: ``run`` of the copy in its last panel (0 or absent: none).
TRANSPOSED_TAIL = "hybrid.transposed_tail"
#: ...and, set to 1, that the copy holds one column per vector (``per_column``).
TRANSPOSED_PER_COLUMN = "hybrid.transposed_per_column"
#: Independent accumulators a tile keeps at least (FMA latency x pipes): a 1-row tile (M
#: prime) sums each row in that many interleaved partial sums.
MIN_CHAINS = 8
#: The narrowest vector of a copy (xmm).
_MIN_WIDTH = 4
#: An interleaved copy of this many ``k`` per column or fewer holds one column per vector
#: instead (module docstring).
PER_COLUMN_RUN = 2
#: Bytes of one way of an L1 data cache (its sets times its lines: 64 x 64 B on every x86 core
#: this targets): addresses this far apart share a set.
_L1_WAY_BYTES = 4096


def _rotation_rows(run: int, panel: int) -> int:
    """Rows of a ``panel``-column fp32 panel per L1 way (:data:`_L1_WAY_BYTES`; 32 for 32
    columns), after which the copy's rows move down one row within their groups of ``run``
    (:func:`copy_row`); 0 (no rotation) when a row's bytes do not divide a way (its rows then
    fall into every set anyway) or ``run`` does not divide those rows."""
    row_bytes = panel * 4
    rows = _L1_WAY_BYTES // row_bytes if _L1_WAY_BYTES % row_bytes == 0 else 0
    return rows if rows and rows % run == 0 else 0


def copy_period(run: int, panel: int, step: int = 1) -> int:
    """Rows after which :func:`copy_row`'s rotation (by ``step`` rows) repeats: a call of the
    tail must start ``K`` on a multiple of it to find its groups where the packing put them."""
    rows = _rotation_rows(run, panel)
    return rows * run // math.gcd(step, run) if rows else run


def copy_row(group, run: int, panel: int, column=0, step: int = 1):
    """The row of the panel holding the copy's vector ``column`` (a per-column copy's column,
    else 0) of ``group`` (an int or a TIR index): row ``column`` of the group's ``run`` rows,
    moved down by ``step`` rows (within the group; a per-column copy's columns rounded up to a
    power of two, else 1) for every L1 way the rows before it span. At ``group * run`` alone,
    a copy of 2 ``k`` per vector on a 32-column panel would sit every 256 bytes, in a quarter
    of the L1's sets, whose 8 ways then hold 128 of its vectors (``K`` = 256); rotated, its
    vectors spread over the half of the sets that a panel's second line of each row maps to.
    (With a power-of-two ``step`` a group's rows are its first plus constants; a step of 3
    rows cost integer arithmetic at every FMA.)"""
    rows = _rotation_rows(run, panel)
    if not rows:
        return group * run + column
    return group * run + (column + (group * run // rows) * step) % run


def spread_of(columns: int) -> int:
    """The columns a copy's vector covers: ``columns`` rounded up to a power of two."""
    return 1 << (columns - 1).bit_length()


def transposed_layout(lanes: int, panel: int, columns: int, rows: int = 1,
                      registers: int = 32) -> tuple[int, int, bool] | None:
    """``(width, run, per_column)`` of the copy of a last panel keeping ``columns`` of
    ``panel`` on vectors of ``lanes``: the widest vector (at most ``lanes``) that fits beside
    the used columns, holding at least two ``k`` per column; where that would be
    :data:`PER_COLUMN_RUN` ``k`` or fewer, ``width`` ``k`` of one column per vector
    (``per_column``, ``run`` = ``width``) if the tile expected to run it (``rows`` rows, a
    register file of ``registers`` vectors) holds an accumulator per row and column. None when
    no vector fits (then the broadcast update is as good: ``run`` 1)."""
    spread = spread_of(columns)
    width = lanes
    while width > panel - columns:
        width //= 2
    if width < max(_MIN_WIDTH, 2 * spread):
        return None
    run = width // spread
    if run <= PER_COLUMN_RUN and per_column_fits(rows, columns, registers):
        return width, width, True
    return width, run, False


def per_column_fits(rows: int, columns: int, registers: int) -> bool:
    """Whether a tile of ``rows`` rows and a register file of ``registers`` vectors runs a
    per-column copy of ``columns`` columns: an accumulator per row and column, and two vectors
    for the operands."""
    return columns > 1 and rows * columns + 2 <= registers


def write_transposed_copy(packed: np.ndarray, weight: np.ndarray, width: int,
                          run: int, per_column: bool = False) -> np.ndarray:
    """Write the copy (module docstring) of the last panel's used columns into ``packed``
    (``[panels, K, panel]`` of the fp32 ``weight[K, N]``) in place, and return it."""
    k, n = weight.shape
    panels, _, panel = packed.shape
    columns = n - (panels - 1) * panel
    groups = k // run
    used = weight[: groups * run, n - columns:].reshape(groups, run, columns)
    if per_column:
        group = np.arange(groups)[:, None]
        rows = copy_row(group, run, panel, np.arange(columns)[None, :], spread_of(columns))
        packed[-1, rows, panel - width:] = used.transpose(0, 2, 1)
        return packed
    spread = width // run
    copy = np.zeros((groups, spread, run), packed.dtype)
    copy[:, :columns] = used.transpose(0, 2, 1)
    rows = copy_row(np.arange(groups), run, panel)
    packed[-1, rows, panel - width:] = copy.reshape(groups, width)
    return packed


def accumulator_sets(kernel: Microkernel, groups: int) -> int:
    """Partial sums per row: enough for :data:`MIN_CHAINS` independent FMAs with few rows, within
    the registers (one vector of the copy and one of ``A`` besides) and the groups of ``K``."""
    want = -(-MIN_CHAINS // kernel.mr)
    fit = max(1, (kernel.num_registers - 2) // kernel.mr)
    return max(1, min(want, fit, groups))


def transposed_dot(kernel: Microkernel, kc: int, columns: int, run: int,
                   per_column: bool = False, rows: int | None = None):
    """The tail's body (a ``T.macro`` over ``A[mr, kc]``, ``B[kc, panel]`` and ``C[mr, nr]``):
    the broadcast update of the used columns for the ``kc % run`` last ``k``, then the copy's
    dot products over the whole groups of ``kc``, reduced into ``C[:, :spread]``. With
    ``per_column`` the copy holds ``run`` ``k`` of one column per vector (module docstring).
    ``rows``: only the tile's first ``rows`` rows (a last row tile, ``tiles.RowTail``), each
    summed in the same order as a full tile's rows (the full tile's partial sums)."""
    mr, panel = rows or kernel.mr, kernel.panel_width
    spread = spread_of(columns)
    width = run if per_column else spread * run
    vectors = columns if per_column else 1  # accumulators per row and set
    groups, rest = divmod(kc, run)
    # A per-column copy: one sum per column (its columns are the independent FMAs; with two
    # partial sums each, LLVM unrolled the K loop of 5-7 columns fully and hoisted the
    # copy's vectors out of the row loop into stack slots: 0.85-1.0x); else partial sums, a
    # group of K for each in turn.
    sets = 1 if per_column else accumulator_sets(kernel, groups)
    loops, leftover = divmod(groups, sets)
    start = panel - width

    def a_operand(A, i, k0):
        piece = A[i, T.ramp(k0, 1, run)]
        return piece if spread == 1 or per_column else \
            T.Shuffle([piece] * spread, list(range(width)))

    def halve(value, n):  # [spread, n] lanes -> [spread, n / 2], each pair of halves summed
        half = n // 2
        low = [c * n + j for c in range(spread) for j in range(half)]
        high = [c * n + half + j for c in range(spread) for j in range(half)]
        return T.Shuffle([value], low) + T.Shuffle([value], high)

    def merge(a, b, m, n):  # two vectors of [m, n] lanes -> one of [2 m, n / 2]
        half = n // 2
        low = [v * width + c * n + j for v in (0, 1) for c in range(m) for j in range(half)]
        high = [v * width + c * n + half + j for v in (0, 1) for c in range(m)
                for j in range(half)]
        return T.Shuffle([a, b], low) + T.Shuffle([a, b], high)

    @T.macro
    def update(A, B, acc, group, u):
        for i in T.unroll(mr):
            if per_column:
                for c in T.unroll(columns):
                    acc[i * columns + c, T.ramp(0, 1, width)] = acc[
                        i * columns + c, T.ramp(0, 1, width)] + A[
                        i, T.ramp(group * run, 1, run)] * B[
                        copy_row(group, run, panel, c, spread), T.ramp(start, 1, width)]
            else:
                acc[i * sets + u, T.ramp(0, 1, width)] = acc[
                    i * sets + u, T.ramp(0, 1, width)] + a_operand(A, i, group * run) * B[
                    copy_row(group, run, panel), T.ramp(start, 1, width)]

    def summed(acc, i, c):  # row i's accumulator of vector c over its partial sums
        value = acc[i * sets * vectors + c, T.ramp(0, 1, width)]
        for u in range(1, sets):
            value = value + acc[(i * sets + u) * vectors + c, T.ramp(0, 1, width)]
        return value

    def reduced(acc, i):
        if per_column:  # the columns' vectors (zeros up to spread) merged pairwise
            values = [summed(acc, i, c) for c in range(columns)]
            values += [T.broadcast(T.float32(0), width)] * (spread - columns)
            m, n = 1, width
            while len(values) > 1:
                values = [merge(values[2 * j], values[2 * j + 1], m, n)
                          for j in range(len(values) // 2)]
                m, n = 2 * m, n // 2
            value = values[0]
        else:
            value, n = summed(acc, i, 0), run
        while n > 1:
            value = halve(value, n)
            n //= 2
        return value

    @T.macro
    def rest_update(A, B, C):
        for kk in T.unroll(rest):
            for i in T.unroll(mr):
                if spread == 1:
                    C[i, 0] = C[i, 0] + A[i, groups * run + kk] * B[groups * run + kk, 0]
                else:
                    C[i, T.ramp(0, 1, spread)] = C[i, T.ramp(0, 1, spread)] + T.broadcast(
                        A[i, groups * run + kk], spread) * B[groups * run + kk,
                                                              T.ramp(0, 1, spread)]

    @T.macro
    def body(A, B, C):
        acc = T.alloc_buffer((mr * sets * vectors, width), "float32")
        for z in T.unroll(mr * sets * vectors):
            acc[z, T.ramp(0, 1, width)] = T.broadcast(T.float32(0), width)
        # The last ``kc % run`` k first: their FMAs (one chain per row) then overlap the
        # groups' instead of waiting for the lanes' sum (197x1x333 1.10x, 197x5x333 1.05x).
        rest_update(A, B, C)
        for t in T.serial(loops):
            for u in T.unroll(sets):
                update(A, B, acc, t * sets + u, u)
        for u in T.unroll(leftover):
            update(A, B, acc, loops * sets + u, u)
        for i in T.unroll(mr):
            if spread == 1:
                C[i, 0] = C[i, 0] + reduced(acc, i)
            else:
                C[i, T.ramp(0, 1, spread)] = C[i, T.ramp(0, 1, spread)] + reduced(acc, i)

    return body
