"""The expert GEMM template: one schedule function whose knobs are MetaSchedule decisions.

For a block ``C[b..., M, N] += A[b..., M, K] * B[K, N]`` (``B`` plain or prepacked), the loop
nest is::

    parallel for (b..., m_block, n_block):        # blocks spread over the cores
      for n_tile in n_block:                      # one K x nr panel of B stays hot
        for m_tile in m_block:                    # A block stays in L2 (L3: rule 5)
          acc[mr, nr] = 0
          acc += A[m_tile, :] @ B[:, n_tile]      # tensorized microkernel, whole K
          C[m_tile, n_tile] = epilogue(acc)       # bias, activation, residual... while hot

With ``K`` blocks (``knobs.k_block``, rule 3 of ``heuristics.py``) the reduction is split
and its outer loop goes between the two tile loops; the accumulator then holds the block's
column of tiles (order ``nm``; its row with ``mn``) in L1 between ``K`` blocks::

    parallel for (b..., m_block, n_block):
      for n_tile in n_block:
        acc[m_block * mr, nr] = 0
        for k_block in K / kc:                    # one kc x nr piece of B, hot in L1
          for m_tile in m_block:
            acc[m_tile] += A[m_tile, k_block] @ B[k_block, n_tile]   # microkernel over kc
        C[:, n_tile] = epilogue(acc)

The block sizes are ``sample_perfect_tile`` decisions (the heuristic's values are passed as the
decisions, so a tuner can search exactly these knobs); the microkernel comes from the registry
(``microkernels/``), ranked by ``heuristics.select``. The elementwise consumers FuseOps put in
the same function (the fusion group's epilogue) are inlined into the tile's write-back, or
computed at the tile (the paper's "anchor") when they cannot be inlined, e.g. the slice that
drops the packing's padded columns. ``space.py`` is the knob space a tuner searches.

**Tails.** ``M`` and ``N`` are whole tiles: the packing passes pad ``N`` to whole panels (and
``M`` to whole rows of a better tile, ``heuristics.padded_rows``). The padded columns cost no
FMAs: where the consumer keeps fewer than ``N`` (``analysis.used_columns``), the microkernel
branches on the last panel and updates only the vectors covering its used columns
(:func:`gemm_tail`; a 197 x 97 GEMM on 32-column panels computes 100 columns, not 128). A last
panel of a few columns whose packed weights hold them transposed runs dot products along ``K``
instead (``microkernels/transposed_tail.py``). Likewise the padded rows
cost no loads: where only the last row tile holds padding, its microkernel branches on ``A``'s
offset and updates only the rows ``x`` has (:func:`gemm_row_tail`), the tile loop says so
(:data:`ROWS_READ`), and ``passes/row_padding.py`` then drops the copy that padded ``x``.
"""

from __future__ import annotations

import dataclasses
import logging
import random

from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_sblock_info
from tvm.target import Target

from ...host import cache_sizes, target_features
from ...microkernels import Microkernel, has_gemm_kernels, microkernel_by_name, tensor_intrin
from ...microkernels.registry import (
    row_tail_fits,
    supports_prefetch,
    supports_tail,
    transposed_fits,
    zero_intrin,
)
from ...microkernels.tiles import RowTail, Tail
from ...microkernels.transposed_tail import copy_period, spread_of
from ..accumulate import (
    accumulate_in_tile,
    attach_accumulator,
    decompose_accumulator,
    keep_accumulator_on_stack,
    reduction_blocks,
)
from ..parallel_vectorize import inline_free_producers
from ..template import Template
from . import space
from .analysis import GemmBlock, match_gemm
from .heuristics import (
    GemmKnobs,
    choose_knobs,
    prefetches_weights,
    select,
    stack_accumulator,
    target_threads,
)

logger = logging.getLogger(__name__)

#: Loop annotation naming the microkernel and blocks the template chose.
TEMPLATE_ANNOTATION = "hybrid.gemm_template"
#: Loop annotation ``"<buffer of A>:<rows>"``: the tile loop reads only the first rows of
#: ``A`` (a row tail, :func:`gemm_row_tail`), so ``A`` needs no zero rows past them
#: (``passes/row_padding.py``).
ROWS_READ = "hybrid.rows_read"


class GemmTemplate(Template):
    """Schedule functions holding a GEMM with the expert template (heuristic knobs)."""

    name = "gemm"
    title = "GEMM template"

    def available(self, target: Target) -> bool:
        return has_gemm_kernels(target)

    def match(self, sch: s_tir.Schedule, target: Target) -> list[GemmBlock] | None:
        return prepare(sch)

    def heuristic(self, workload: GemmBlock, target: Target) -> GemmKnobs | None:
        return knobs_for(workload, target)

    def fits(self, workload: GemmBlock, knobs: GemmKnobs, target: Target) -> bool:
        if not set(knobs.kernel.features) <= target_features(target):
            # Never lower a microkernel the target lacks (AMX on a non-AMX CPU aborts LLVM):
            # knobs from elsewhere (records, a caller) are declined here.
            logger.warning("microkernel %s needs %s, which the target lacks; declined",
                           knobs.kernel.name, "/".join(knobs.kernel.features))
            return False
        return knobs_fit(workload, knobs)

    def schedule(self, sch: s_tir.Schedule, workload: GemmBlock, knobs: GemmKnobs):
        return schedule_gemm(sch, workload, knobs)

    def flops(self, workload: GemmBlock) -> float:
        shape = workload.shape  # the columns the GEMM keeps, not the padded panels'
        return float(2 * shape.batch * shape.m * (workload.columns or shape.n) * shape.k)

    def variants(self, workload: GemmBlock, target: Target) -> list[GemmKnobs]:
        return space.variants(workload.shape, self._ranked(workload, target),
                              target_threads(target))

    def neighbours(self, workload: GemmBlock, knobs: GemmKnobs,
                   target: Target) -> list[GemmKnobs]:
        return space.neighbours(workload.shape, knobs, self._ranked(workload, target),
                                target_threads(target))

    def random(self, workload: GemmBlock, target: Target, rng: random.Random) -> GemmKnobs:
        return space.random_knobs(workload.shape, self._ranked(workload, target), rng)

    def size(self, workload: GemmBlock, target: Target) -> int:
        return space.size(workload.shape, self._ranked(workload, target))

    @staticmethod
    def _ranked(workload: GemmBlock, target: Target) -> list[Microkernel]:
        return space.ranked_kernels(workload.shape, candidate_kernels(workload, target))

    def knobs_from_dict(self, data: dict) -> GemmKnobs:
        return GemmKnobs(microkernel_by_name(data["kernel"]), int(data["m_block"]),
                         int(data["n_block"]), str(data.get("order", "nm")),
                         int(data.get("k_block", 0)))


def knobs_fit(gemm: GemmBlock, knobs: GemmKnobs) -> bool:
    """Whether ``knobs`` tile ``gemm`` exactly (what the template can apply)."""
    kernel, shape = knobs.kernel, gemm.shape
    if gemm.packed_nr is not None and kernel.panel_width != gemm.packed_nr:
        return False
    if shape.k % kernel.k_granule or knobs.order not in space.ORDERS:
        return False
    if knobs.k_block and (kernel.per_block or knobs.k_block % kernel.k_granule
                          or shape.k % knobs.k_block or knobs.k_block >= shape.k):
        return False
    return (shape.m % (kernel.mr * knobs.m_block) == 0
            and shape.n % (kernel.nr * knobs.n_block) == 0)


def candidate_kernels(gemm: GemmBlock, target: Target) -> list[Microkernel]:
    """Microkernels that tile ``gemm`` with no tail (what a tuner may choose from), best
    first."""
    return select(target, gemm.dtype, gemm.shape, panel=gemm.packed_nr)


def prepare(sch: s_tir.Schedule) -> list[GemmBlock] | None:
    """Inline free producers and find the GEMM blocks; None when ``sch`` has opaque blocks."""
    # Not dlight's normalize_prim_func: it drops unit loops (M = 1) and fuses batch loops,
    # which would hide the GEMM structure the template relies on.
    root = sch.get_sblock("root")
    infos = [get_sblock_info(sch, b) for b in sch.get_child_blocks(root)]
    if any("O" in info.dom_kind() for info in infos):
        return None
    inline_free_producers(sch, infos)
    gemms = [match_gemm(sch, block) for block in reduction_blocks(sch)]
    return [g for g in gemms if g is not None]


def knobs_for(gemm: GemmBlock, target: Target) -> GemmKnobs | None:
    """The heuristic knobs for ``gemm`` on ``target``, or None when no microkernel fits.

    ``K = 1`` (an outer product, memory-bound) is left to the fallback rule.
    """
    if gemm.shape.k < 2:
        return None
    return choose_knobs(gemm.shape, candidate_kernels(gemm, target), cache_sizes(),
                        target_threads(target))


def schedule_gemm(sch: s_tir.Schedule, gemm: GemmBlock, knobs: GemmKnobs):
    """Apply the template to ``gemm`` with ``knobs``; return the loop of one register tile."""
    if knobs.kernel.per_block:
        return schedule_block_gemm(sch, gemm, knobs)
    blocks = tile_gemm(sch, gemm, knobs)
    # Unconditionally: the trace's instructions must not depend on its decisions (a tuner
    # replays it with other block sizes); a parallel loop of extent 1 costs nothing.
    sch.parallel(blocks)
    return finish_gemm(sch, gemm, knobs)


def tile_gemm(sch: s_tir.Schedule, gemm: GemmBlock, knobs: GemmKnobs, sampled: bool = True):
    """The template's loops for ``gemm`` (a vector microkernel) without the thread split:
    return the loop over blocks, serial (the caller parallelises it, or merges it with
    another's first); :func:`finish_gemm` then puts the microkernel in.

    ``sampled``: the block sizes are ``sample_perfect_tile`` decisions a tuner may change; the
    chain template fixes them instead (a draw that gave two layers different row blocks of
    equal count would still merge, reading rows another iteration computes)."""
    kernel = knobs.kernel
    *batch, i, j, k = sch.get_loops(gemm.block)
    m_tiles, n_tiles = gemm.shape.m // kernel.mr, gemm.shape.n // kernel.nr
    io, ii = sch.split(i, [m_tiles, kernel.mr])
    jo, ji = sch.split(j, [n_tiles, kernel.nr])
    m_split = [m_tiles // knobs.m_block, knobs.m_block]
    n_split = [n_tiles // knobs.n_block, knobs.n_block]
    if sampled:
        m_split = sch.sample_perfect_tile(io, n=2, max_innermost_factor=m_tiles,
                                          decision=m_split)
        n_split = sch.sample_perfect_tile(jo, n=2, max_innermost_factor=n_tiles,
                                          decision=n_split)
    m_outer, m_inner = sch.split(io, m_split)
    n_outer, n_inner = sch.split(jo, n_split)
    tiles = (n_inner, m_inner) if knobs.order == "nm" else (m_inner, n_inner)
    if knobs.k_block:
        k_outer, k = sch.split(k, [gemm.shape.k // knobs.k_block, knobs.k_block])
        tiles = (tiles[0], k_outer, tiles[1])
    sch.reorder(*batch, m_outer, n_outer, *tiles, ii, ji, k)
    return sch.fuse(*batch, m_outer, n_outer, preserve_unit_iters=True)


def finish_gemm(sch: s_tir.Schedule, gemm: GemmBlock, knobs: GemmKnobs):
    """After :func:`tile_gemm`: accumulate each register tile in the microkernel, the
    epilogue in the tile's write-back; return the loop of one register tile.

    In two halves for the chain template, which merges the layers' loops in between:
    :func:`attach_gemm_epilogue` then :func:`tensorize_gemm`."""
    attach_gemm_epilogue(sch, gemm, knobs.k_block)
    return tensorize_gemm(sch, gemm, knobs)


def attach_gemm_epilogue(sch: s_tir.Schedule, gemm: GemmBlock, k_block: int = 0) -> None:
    """A register-tile accumulator with the epilogue in its write-back (loops above still
    parallelisable); with ``K`` blocks, an accumulator of the outer tile loop's iteration (a
    column or row of tiles), written back after the last ``K`` block."""
    tile = sch.get_loops(gemm.block)[1 if k_block else 2]
    attach_accumulator(sch, gemm.block, tile)


def tensorize_gemm(sch: s_tir.Schedule, gemm: GemmBlock, knobs: GemmKnobs):
    """Zero the accumulators and put the microkernel in; return the loop holding the
    accumulator and its write-back (the tile loop; with ``K`` blocks, the outer tile loop)."""
    kernel = knobs.kernel
    # The accumulator's loop, the loop it is zeroed before, and the microkernel's loop: in
    # (blocks, tile, k_outer, tiles, ii, ...) with K blocks, (blocks, tiles, tile, ii, ...)
    # without.
    loops = sch.get_loops(gemm.block)
    if knobs.k_block:
        tile, init_at, ii = loops[1], loops[2], loops[4]
    else:
        tile, init_at, ii = loops[2], loops[3], loops[3]
    decompose_accumulator(sch, gemm.block, tile, init_at, kernel.lanes)
    tail = gemm_tail(gemm, kernel, knobs.k_block)
    k = knobs.k_block or gemm.shape.k
    prefetch = prefetches_next(gemm, kernel, k)
    row_tail = gemm_row_tail(gemm, kernel)
    sch.tensorize(ii, tensor_intrin(kernel, k, tail=tail, prefetch=prefetch, row_tail=row_tail))
    if stack_accumulator(kernel, knobs.k_block):
        keep_accumulator_on_stack(sch, tile)
    blocked = f", K blocks of {knobs.k_block}" if knobs.k_block else ""
    if prefetch:
        blocked += ", next panel prefetched"
    if tail is not None:
        blocked += f", last panel {tail.columns} of {kernel.nr} columns"
        if tail.run:
            per = " of one column" if tail.per_column else ""
            blocked += f", transposed ({tail.run} k{per} per vector)"
    if row_tail is not None:
        blocked += f", last row tile {row_tail.rows} of {kernel.mr} rows"
        # Rows of A past gemm.rows are never read: the padding that added them can go.
        sch.annotate(tile, ROWS_READ, f"{gemm.a_name}:{gemm.rows}")
    # Visible in the scheduled TIR (CompiledModel.lowered), for users and tests. The block
    # sizes are left out: they are decisions a tuner may change after this string is written
    # (they show as the loop extents).
    sch.annotate(tile, TEMPLATE_ANNOTATION,
                 f"{kernel.isa} {kernel.mr}x{kernel.nr} microkernel, order {knobs.order}, "
                 f"K={gemm.shape.k}{blocked}")
    return tile


def prefetches_next(gemm: GemmBlock, kernel: Microkernel, k: int) -> bool:
    """Whether ``kernel``'s intrinsic for ``gemm`` over ``k`` prefetches the next ``k`` rows of
    ``B`` (``heuristics.prefetches_weights``): ``B`` packed in ``kernel``'s panels, which lie one
    after the other, so that the rows after a call's are the next panel's (or ``K`` block's)."""
    return (gemm.packed_nr == kernel.nr == kernel.panel_width and supports_prefetch(kernel, k)
            and prefetches_weights(gemm.shape, kernel, cache_sizes()))


def gemm_tail(gemm: GemmBlock, kernel: Microkernel, k_block: int = 0) -> Tail | None:
    """The microkernel's tail for ``gemm`` (module docstring): where the last packed panel
    starts in ``B`` and how many of its columns the consumer keeps; None when it keeps all
    (or ``B`` is not packed in ``kernel``'s panels, or its family has no tail intrinsics).

    Where the panel holds its used columns transposed (``gemm.transposed_run``), the tail
    runs on that copy when ``kernel`` has its vectors and each call's ``K`` (``k_block``, or
    the whole ``K``) starts where the copy's row rotation does (``copy_period``)."""
    panel = kernel.panel_width
    if gemm.columns is None or not supports_tail(kernel) or gemm.packed_nr != kernel.nr \
            or panel != kernel.nr or gemm.shape.n % panel:
        return None
    used = gemm.columns - (gemm.shape.n - panel)
    if not 0 < used < panel:
        return None
    tail = Tail((gemm.shape.n // panel - 1) * gemm.shape.k * panel, used)
    run, per_column = gemm.transposed_run, gemm.transposed_per_column
    period = copy_period(run, panel, spread_of(used) if per_column else 1) if run else 0
    if run and (not k_block or k_block % period == 0):
        transposed = dataclasses.replace(tail, run=run, per_column=per_column)
        if transposed_fits(kernel, transposed):
            return transposed
    return tail


def gemm_row_tail(gemm: GemmBlock, kernel: Microkernel) -> RowTail | None:
    """The microkernel's row tail for ``gemm``: where ``A`` was padded with zero rows to whole
    tiles (``heuristics.padded_rows``) and only the last row tile holds padding, that tile's
    offset in ``A`` and its rows of ``A`` proper; else None. One batch only (the padding of
    a batched ``A`` is inside every batch)."""
    m, k, last = gemm.shape.m, gemm.shape.k, gemm.shape.m - kernel.mr
    if gemm.rows is None or gemm.shape.batch != 1 or m % kernel.mr \
            or gemm.a_shape[-2:] != (m, k):
        return None
    row_tail = RowTail(last * k, gemm.rows - last)
    return row_tail if row_tail_fits(kernel, row_tail) else None


def schedule_block_gemm(sch: s_tir.Schedule, gemm: GemmBlock, knobs: GemmKnobs):
    """The template with the AMX microkernel; return the loop of one block.

    AMX state (the tile configuration) is per thread, so the microkernel covers a whole block:
    parallel over (batch, M blocks, N blocks), one tensorized call per block that configures
    the tiles once and runs all its 32 x 32 register tiles over the whole ``K``, then the
    epilogue over the block's accumulators.
    """
    kernel = knobs.kernel
    block = gemm.block
    *batch, i, j, k = sch.get_loops(block)
    rows, cols = knobs.m_block * kernel.mr, knobs.n_block * kernel.nr
    m_tiles, n_tiles = gemm.shape.m // kernel.mr, gemm.shape.n // kernel.nr
    m_split = sch.sample_perfect_tile(
        i, n=2, max_innermost_factor=gemm.shape.m,
        decision=[m_tiles // knobs.m_block, rows])
    n_split = sch.sample_perfect_tile(
        j, n=2, max_innermost_factor=gemm.shape.n,
        decision=[n_tiles // knobs.n_block, cols])
    io, ii = sch.split(i, m_split)
    jo, ji = sch.split(j, n_split)
    sch.reorder(*batch, io, jo, ii, ji, k)
    blocks = sch.fuse(*batch, io, jo, preserve_unit_iters=True)
    sch.parallel(blocks)
    init = accumulate_in_tile(sch, block, blocks, ii, kernel.lanes, vectorize_init=False)
    # The block intrinsic starts from zero: the init's pass over the accumulators is left out
    # (an intrinsic that writes nothing, microkernels.tiles.zero_block_functions).
    sch.tensorize(sch.get_loops(init)[-2], zero_intrin(kernel, (rows, cols)))
    sch.tensorize(ii, tensor_intrin(kernel, gemm.shape.k, (rows, cols)))
    sch.annotate(blocks, TEMPLATE_ANNOTATION,
                 f"{kernel.isa} {kernel.in_dtype} {kernel.mr}x{kernel.nr} tiles per block, "
                 f"K={gemm.shape.k}")
    return blocks
