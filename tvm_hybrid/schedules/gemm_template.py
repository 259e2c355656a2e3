"""The expert GEMM template: one schedule function whose knobs are MetaSchedule decisions.

For a block ``C[b..., M, N] += A[b..., M, K] * B[K, N]`` (``B`` plain or prepacked), the loop
nest is::

    parallel for (b..., m_block, n_block):        # blocks spread over the cores
      for n_tile in n_block:                      # one K x nr panel of B stays hot
        for m_tile in m_block:                    # A block stays in L2
          acc[mr, nr] = 0
          acc += A[m_tile, :] @ B[:, n_tile]      # tensorized microkernel, whole K
          C[m_tile, n_tile] = epilogue(acc)       # bias, activation, residual... while hot

The block sizes are ``sample_perfect_tile`` decisions (the heuristic's values are passed as the
decisions, so a tuner can search exactly these knobs); the microkernel comes from
``microkernels.py``. The elementwise consumers FuseOps put in the same function (the fusion
group's epilogue) are inlined into the tile's write-back, or computed at the tile (the paper's
"anchor") when they cannot be inlined, e.g. the slice that drops the packing's padded columns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_sblock_info
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ..heuristics import GemmKnobs, choose_knobs, select
from ..host import cache_sizes, target_features
from ..microkernels import Microkernel, has_gemm_kernels, tensor_intrin
from ..thread_pool import num_threads
from .gemm_analysis import GemmBlock, match_gemm
from .parallel_vectorize import inline_free_producers, schedule_blocks
from .rule_failures import template_failed

logger = logging.getLogger(__name__)

#: Loop annotation naming the microkernel and blocks the template chose.
TEMPLATE_ANNOTATION = "hybrid.gemm_template"


class GemmTemplate(ScheduleRule):
    """Schedule functions holding a GEMM with the expert template (heuristic knobs)."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        applied = apply_template(func, target)
        return applied[0] if applied is not None else None


def apply_template(
    func: tirx.PrimFunc,
    target: Target,
    knobs: Sequence[GemmKnobs] | None = None,
    *,
    sch: s_tir.Schedule | None = None,
) -> tuple[s_tir.Schedule, list[GemmKnobs]] | None:
    """Schedule ``func`` with the template, or return None when the template does not apply.

    Parameters
    ----------
    func
        A fused PrimFunc (one GEMM plus its producers and epilogue, typically).
    target
        The CPU target; its ISA picks the microkernel family.
    knobs
        One :class:`GemmKnobs` per GEMM block, in block order (what a tuner searches). None
        uses the heuristic's knobs (:func:`knobs_for`).
    sch
        A schedule of ``func`` to apply the template to (MetaSchedule passes its own, so that
        the trace is recorded there). A new one by default.

    Returns
    -------
    (s_tir.Schedule, list[GemmKnobs]) or None
        The scheduled function and the knobs used for each GEMM.
    """
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    if not has_gemm_kernels(target):
        return None
    sch = sch if sch is not None else s_tir.Schedule(func)
    gemms = _prepare(sch)
    if gemms is None:
        return None
    chosen: list[tuple[GemmBlock, GemmKnobs]] = []
    for index, gemm in enumerate(gemms):
        picked = knobs_for(gemm, target) if knobs is None else knobs[index]
        if picked is None:
            continue
        if not set(picked.kernel.features) <= target_features(target):
            # Never lower a microkernel the target lacks (AMX on a non-AMX CPU aborts LLVM):
            # knobs from elsewhere (records, a caller) are declined here.
            logger.warning("microkernel %s needs %s, which the target lacks; declined",
                           picked.kernel.name, "/".join(picked.kernel.features))
            return None
        if not knobs_fit(gemm, picked):
            return None
        chosen.append((gemm, picked))
    if not chosen:
        return None
    try:
        done: set[str] = set()
        for gemm, picked in chosen:
            done.add(sch.get(gemm.block).name_hint)
            tile_loop = schedule_gemm(sch, gemm, picked)
            done.update(sch.get(b).name_hint for b in sch.get_child_blocks(tile_loop))
        schedule_blocks(sch, target, done)
    except s_tir.ScheduleError as err:
        template_failed("GEMM template", func,
                        "; ".join(f"{g.shape} with {k.describe()}" for g, k in chosen), err)
        return None
    return sch, [k for _, k in chosen]


def knobs_fit(gemm: GemmBlock, knobs: GemmKnobs) -> bool:
    """Whether ``knobs`` tile ``gemm`` exactly (what the template can apply)."""
    kernel, shape = knobs.kernel, gemm.shape
    if gemm.packed_nr is not None and kernel.panel_width != gemm.packed_nr:
        return False
    if shape.k % kernel.k_granule:
        return False
    return (shape.m % (kernel.mr * knobs.m_block) == 0
            and shape.n % (kernel.nr * knobs.n_block) == 0)


def template_gemms(func: tirx.PrimFunc, target: Target) -> list[GemmBlock]:
    """The GEMMs of ``func`` the template schedules (each with its shape), in block order.

    Empty when the template does not apply to ``func``.
    """
    if apply_template(func, target) is None:
        return []
    gemms = _prepare(s_tir.Schedule(func)) or []
    return [g for g in gemms if knobs_for(g, target) is not None]


def candidate_kernels(gemm: GemmBlock, target: Target) -> list[Microkernel]:
    """Microkernels that tile ``gemm`` with no tail (what a tuner may choose from), best
    first."""
    return select(target, gemm.dtype, gemm.shape, panel=gemm.packed_nr)


def _prepare(sch: s_tir.Schedule) -> list[GemmBlock] | None:
    """Inline free producers and find the GEMM blocks; None when ``sch`` has opaque blocks."""
    # Not dlight's normalize_prim_func: it drops unit loops (M = 1) and fuses batch loops,
    # which would hide the GEMM structure the template relies on.
    root = sch.get_sblock("root")
    infos = [get_sblock_info(sch, b) for b in sch.get_child_blocks(root)]
    if any("O" in info.dom_kind() for info in infos):
        return None
    inline_free_producers(sch, infos)
    gemms = [match_gemm(sch, block) for block in _reduction_blocks(sch)]
    return [g for g in gemms if g is not None]


def knobs_for(gemm: GemmBlock, target: Target) -> GemmKnobs | None:
    """The heuristic knobs for ``gemm`` on ``target``, or None when no microkernel fits.

    ``K = 1`` (an outer product, memory-bound) is left to the fallback rule.
    """
    if gemm.shape.k < 2:
        return None
    kernels = candidate_kernels(gemm, target)
    cores = int(target.attrs.get("num-cores", 0)) or num_threads()
    return choose_knobs(gemm.shape, kernels, cache_sizes(), cores)


def schedule_gemm(sch: s_tir.Schedule, gemm: GemmBlock, knobs: GemmKnobs):
    """Apply the template to ``gemm`` with ``knobs``; return the loop of one register tile."""
    if knobs.kernel.per_block:
        return schedule_block_gemm(sch, gemm, knobs)
    kernel = knobs.kernel
    block = gemm.block
    *batch, i, j, k = sch.get_loops(block)
    m_tiles, n_tiles = gemm.shape.m // kernel.mr, gemm.shape.n // kernel.nr
    io, ii = sch.split(i, [m_tiles, kernel.mr])
    jo, ji = sch.split(j, [n_tiles, kernel.nr])
    m_split = sch.sample_perfect_tile(
        io, n=2, max_innermost_factor=m_tiles, decision=[m_tiles // knobs.m_block, knobs.m_block]
    )
    n_split = sch.sample_perfect_tile(
        jo, n=2, max_innermost_factor=n_tiles, decision=[n_tiles // knobs.n_block, knobs.n_block]
    )
    m_outer, m_inner = sch.split(io, m_split)
    n_outer, n_inner = sch.split(jo, n_split)
    tiles = (n_inner, m_inner) if knobs.order == "nm" else (m_inner, n_inner)
    sch.reorder(*batch, m_outer, n_outer, *tiles, ii, ji, k)
    blocks = sch.fuse(*batch, m_outer, n_outer, preserve_unit_iters=True)
    # Unconditionally: the trace's instructions must not depend on its decisions (a tuner
    # replays it with other block sizes); a parallel loop of extent 1 costs nothing.
    sch.parallel(blocks)

    tile = tiles[1]
    accumulate_in_tile(sch, block, tile, ii)
    sch.tensorize(ii, tensor_intrin(kernel, gemm.shape.k))
    # Visible in the scheduled TIR (CompiledModel.lowered), for users and tests. The block
    # sizes are left out: they are decisions a tuner may change after this string is written
    # (they show as the loop extents).
    sch.annotate(tile, TEMPLATE_ANNOTATION,
                 f"{kernel.isa} {kernel.mr}x{kernel.nr} microkernel, order {knobs.order}, "
                 f"K={gemm.shape.k}")
    return tile


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
    accumulate_in_tile(sch, block, blocks, ii)
    sch.tensorize(ii, tensor_intrin(kernel, gemm.shape.k, (rows, cols)))
    sch.annotate(blocks, TEMPLATE_ANNOTATION,
                 f"{kernel.isa} {kernel.in_dtype} {kernel.mr}x{kernel.nr} tiles per block, "
                 f"K={gemm.shape.k}")
    return blocks


def accumulate_in_tile(sch: s_tir.Schedule, block, tile_loop, init_at) -> None:
    """Accumulate ``block`` in a local buffer per ``tile_loop`` iteration, zeroed before the
    loop ``init_at``, with the elementwise chain after it in the tile's write-back; the init,
    write-back and epilogue blocks vectorised (the update is left to the microkernel)."""
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, tile_loop, preserve_unit_loops=True)
    _attach_epilogue(sch, acc, tile_loop)
    sch.decompose_reduction(block, init_at)
    update = sch.get(block).name_hint
    for child in sch.get_child_blocks(tile_loop):
        if sch.get(child).name_hint != update:
            _vectorize_innermost(sch, child)


def _attach_epilogue(sch: s_tir.Schedule, producer, tile_loop) -> None:
    """Bring the elementwise chain after ``producer`` into the tile: inline, else compute-at."""
    while True:
        consumers = sch.get_consumers(producer)
        if len(consumers) != 1:
            return
        consumer = consumers[0]
        try:
            sch.reverse_compute_inline(consumer)
            continue
        except s_tir.ScheduleError:
            pass
        if _is_reduction(sch, consumer):
            return
        try:
            sch.reverse_compute_at(consumer, tile_loop, preserve_unit_loops=True)
        except s_tir.ScheduleError:
            return
        producer = consumer


def _vectorize_innermost(sch: s_tir.Schedule, block) -> None:
    loops = sch.get_loops(block)
    try:
        sch.vectorize(loops[-1])
    except s_tir.ScheduleError:
        pass


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _reduction_blocks(sch: s_tir.Schedule) -> list:
    root = sch.get_sblock("root")
    return [b for b in sch.get_child_blocks(root) if _is_reduction(sch, b)]
