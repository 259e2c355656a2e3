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
of the panel, in its rows ``t * run`` (the group of ``k = t * run ...``), for every whole group
of ``K``. The used columns ``[0, c)`` stay as they are, so the packed weights still hold the
GEMM the IR describes in every column the consumer reads: a kernel that does not know the copy
(the generic schedule, a record of another tile) computes the same kept columns, with other
values in the dropped ones. The packing pass writes it (:func:`write_transposed_copy`) only
where that panel is the GEMM's only one (``N`` under a panel): the dot products sum in another
order than the broadcast update, and on a wider GEMM's last panel they would make columns of
equal weights differ by rounding (onnx's light AlexNet, whose 1000 logits are equal to
rounding, then lost 8 classes to the softmax). The GEMM block's annotation
(:data:`TRANSPOSED_TAIL`) says there is a copy; the template takes it when its tile has the
vector width, and each call's ``K`` is the whole ``K`` or a multiple of ``run`` (K blocks
start on a group).
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
    packed[-1, 0: groups * run: run, panel - width:] = copy.reshape(groups, width)
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
                a_operand(A, i, group * run) * B[group * run, T.ramp(start, 1, width)]

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
