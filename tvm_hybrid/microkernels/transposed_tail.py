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
(:func:`write_transposed_copy`) only where that panel is the GEMM's only one (``N`` under a
panel): the dot products sum in another order than the broadcast update, and on a wider GEMM's
last panel they would make columns of equal weights differ by rounding (onnx's light AlexNet,
whose 1000 logits are equal to rounding, then lost 8 classes to the softmax). The GEMM block's
annotation (:data:`TRANSPOSED_TAIL`) says there is a copy; the template takes it when its tile
has the vector width, and each call's ``K`` is the whole ``K`` or a multiple of the rotation's
period (:func:`copy_period`: K blocks start where the rotation does).
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from .kernel import Microkernel

#: The packed GEMM block's annotation: ``run`` of the copy in its last panel (0 or absent: none).
TRANSPOSED_TAIL = "hybrid.transposed_tail"
#: Independent accumulators a tile keeps at least (FMA latency x pipes): a 1-row tile (M
#: prime) sums each row in that many interleaved partial sums.
MIN_CHAINS = 8
#: The narrowest vector of a copy (xmm).
_MIN_WIDTH = 4
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


def copy_period(run: int, panel: int) -> int:
    """Rows after which :func:`copy_row`'s rotation repeats: a call of the tail must start
    ``K`` on a multiple of it to find its groups where the packing put them."""
    return run * (_rotation_rows(run, panel) or 1)


def copy_row(group, run: int, panel: int):
    """The row of the panel holding the copy's vector of ``group`` (an int or a TIR index):
    the group's first row, moved down by one row (within the group's ``run`` rows) for every
    L1 way the rows before it span. At ``group * run`` alone, a copy of 2 ``k`` per vector on
    a 32-column panel would sit every 256 bytes, in a quarter of the L1's sets, whose 8 ways
    then hold 128 of its vectors (``K`` = 256); rotated, its vectors spread over the half of
    the sets that a panel's second line of each row maps to."""
    rows = _rotation_rows(run, panel)
    return group * run + (group * run // rows) % run if rows else group * run


def spread_of(columns: int) -> int:
    """The columns a copy's vector covers: ``columns`` rounded up to a power of two."""
    return 1 << (columns - 1).bit_length()


def transposed_layout(lanes: int, panel: int, columns: int) -> tuple[int, int] | None:
    """``(width, run)`` of the copy of a last panel keeping ``columns`` of ``panel`` on
    vectors of ``lanes``: the widest vector (at most ``lanes``) that fits beside the used
    columns, holding at least two ``k`` per column; None when none does (then the broadcast
    update is as good: ``run`` 1)."""
    spread = spread_of(columns)
    width = lanes
    while width > panel - columns:
        width //= 2
    if width < max(_MIN_WIDTH, 2 * spread):
        return None
    return width, width // spread


def write_transposed_copy(packed: np.ndarray, weight: np.ndarray, width: int,
                          run: int) -> np.ndarray:
    """Write the copy (module docstring) of the last panel's used columns into ``packed``
    (``[panels, K, panel]`` of the fp32 ``weight[K, N]``) in place, and return it."""
    k, n = weight.shape
    panels, _, panel = packed.shape
    columns = n - (panels - 1) * panel
    spread, groups = width // run, k // run
    used = weight[: groups * run, n - columns:].reshape(groups, run, columns)
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


def transposed_dot(kernel: Microkernel, kc: int, columns: int, run: int):
    """The tail's body (a ``T.macro`` over ``A[mr, kc]``, ``B[kc, panel]`` and ``C[mr, nr]``):
    the copy's dot products over the whole groups of ``kc``, reduced into ``C[:, :spread]``,
    then the broadcast update of the used columns for the ``kc % run`` last ``k``."""
    mr, panel = kernel.mr, kernel.panel_width
    spread = spread_of(columns)
    width = spread * run
    groups, rest = divmod(kc, run)
    sets = accumulator_sets(kernel, groups)
    loops, leftover = divmod(groups, sets)
    start = panel - width

    def a_operand(A, i, k0):
        piece = A[i, T.ramp(k0, 1, run)]
        return piece if spread == 1 else T.Shuffle([piece] * spread, list(range(width)))

    def halve(value, n):  # [spread, n] lanes -> [spread, n / 2], each pair of halves summed
        half = n // 2
        low = [c * n + j for c in range(spread) for j in range(half)]
        high = [c * n + half + j for c in range(spread) for j in range(half)]
        return T.Shuffle([value], low) + T.Shuffle([value], high)

    @T.macro
    def update(A, B, acc, group, u):
        for i in T.unroll(mr):
            acc[i * sets + u, T.ramp(0, 1, width)] = acc[i * sets + u, T.ramp(0, 1, width)] + \
                a_operand(A, i, group * run) * B[copy_row(group, run, panel),
                                                 T.ramp(start, 1, width)]

    def reduced(acc, i):
        value = acc[i * sets, T.ramp(0, 1, width)]
        for u in range(1, sets):
            value = value + acc[i * sets + u, T.ramp(0, 1, width)]
        n = run
        while n > 1:
            value = halve(value, n)
            n //= 2
        return value

    @T.macro
    def body(A, B, C):
        acc = T.alloc_buffer((mr * sets, width), "float32")
        for z in T.unroll(mr * sets):
            acc[z, T.ramp(0, 1, width)] = T.broadcast(T.float32(0), width)
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
        for kk in T.unroll(rest):
            for i in T.unroll(mr):
                if spread == 1:
                    C[i, 0] = C[i, 0] + A[i, groups * run + kk] * B[groups * run + kk, 0]
                else:
                    C[i, T.ramp(0, 1, spread)] = C[i, T.ramp(0, 1, spread)] + T.broadcast(
                        A[i, groups * run + kk], spread) * B[groups * run + kk,
                                                              T.ramp(0, 1, spread)]

    return body
