"""Fallback schedule: parallel outer loops, vectorised contiguous inner loops.

Every fused TIR function that no expert template claims goes through this rule, so that nothing
runs single-threaded and scalar, as stock TVM 0.27 does on CPU. Per function:

1. Inline blocks whose recomputation is free: injective producers into injective consumers, and
   pure data movement without transposition (padding, casts, copies) into reductions. Anything
   costlier feeding a reduction (GELU before a matmul, say) stays materialised, so it is computed
   once rather than once per reduction step.
2. GEMM-like reductions (the innermost output axis is contiguous in one operand and not reduced)
   get an ``MR x NR`` register tile accumulated in a local buffer across the whole reduction;
   the elementwise epilogue (bias, activation) is inlined into the tile's write-back.
3. Every other block: spatial loops outermost, enough leading ones fused for a parallel loop,
   the rest serial inside it; the innermost loop vectorised when it is the contiguous axis of
   the written buffer and of every buffer read (one no vector width divides is split: its
   whole vectors vectorised, the few elements left scalar); row reductions run ``lanes``
   partial results, vectorised, or unrolled where no vector divides the row. A
   transposing copy (a read whose contiguous axis is not the written one: NCHW to NHWC, a
   channel shuffle) would vectorise to per-lane gathers instead: its innermost loop is
   unrolled in chunks for LLVM's SLP vectoriser.

A function the rule cannot handle (opaque blocks, a schedule error) is returned as ``None`` and
takes TVM's stock lowering.
"""

from __future__ import annotations

import logging

import tvm
import tvm.ir.expr as ir_expr
import tvm.ir.prim.expr as prim
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, get_sblock_info, normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.sym import Analyzer, detect_linear_equation
from tvm.target import Target

from ..errors import first_line
from ..intrinsics import SELECTS, intrinsic_name
from ..microkernels import vector_bits
from .rule_failures import NotApplicable, function_name, rule_failed

logger = logging.getLogger(__name__)

# Below this many iterations a parallel launch costs more than it saves.
_MIN_PARALLEL_WORK = 1 << 14
# Register-tile rows tried for GEMM-like blocks, best first; the first one dividing M is used.
_TILE_ROWS = (6, 4, 3, 2, 1)
# Innermost elements a transposing copy unrolls per step (at least one vector of its type).
_UNROLL_CHUNK = 16
# Spatial blocks fuse leading loops until they give this many parallel iterations.
_PARALLEL_GRAIN = 256


def vector_lanes(target: Target, dtype: str) -> int:
    """Elements of ``dtype`` in one vector register of ``target`` (zmm, ymm or xmm)."""
    return max(1, vector_bits(target) // tvm.DataType(dtype).bits)


class ParallelVectorize(ScheduleRule):
    """Schedule any CPU PrimFunc with parallel, vectorised, register-tiled loops."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        try:
            if not _schedule(sch, target):
                return None
        except (s_tir.ScheduleError, NotApplicable) as err:
            if logger.isEnabledFor(logging.DEBUG):  # naming an unnamed function costs a schedule
                logger.debug("ParallelVectorize left %s to stock lowering: %s",
                             function_name(func), first_line(err))
            return None
        except tvm.error.InternalError as err:  # a TVM check a schedule primitive trips on
            rule_failed(func, err)
            return None
        return sch


def _schedule(sch: s_tir.Schedule, target: Target) -> bool:
    infos = normalize_prim_func(sch)
    if infos is None or any("O" in info.dom_kind() for info in infos):
        return False
    inline_free_producers(sch, infos)
    # A block without loops (a 0-d result: ReduceMean's division over the whole tensor) beside
    # a loop nest made TVM's rfactor on that nest fail an internal check; a unit loop each
    # gives the root the shape rfactor expects.
    root = sch.get_sblock("root")
    for block in sch.get_child_blocks(root):
        if not sch.get_loops(block):
            sch.add_unit_loop(block)
    schedule_blocks(sch, target, set())
    return True


def schedule_blocks(sch: s_tir.Schedule, target: Target, done: set[str]) -> None:
    """Schedule every top-level block whose name is not in ``done`` (steps 2 and 3)."""
    root = sch.get_sblock("root")
    while True:
        pending = [b for b in sch.get_child_blocks(root) if sch.get(b).name_hint not in done]
        if not pending:
            return
        block = pending[0]
        done.add(sch.get(block).name_hint)
        writes = sch.get(block).writes
        if not sch.get_loops(block) or not writes:
            continue  # (no writes: the wrapper of a partitioned loop, _vectorize_most)
        info = get_sblock_info(sch, block)
        if not writes[0].region and not info.is_reduction():
            continue  # one scalar (a 0-d result), nothing to spread
        if not info.is_reduction():
            _schedule_spatial(sch, block, target)
            continue
        tile_loop = _tile_gemm_like(sch, block, info, target)
        if tile_loop is None:
            done.update(_schedule_row_reduction(sch, block, info))
        else:  # the init and write-back blocks the tiling created are scheduled already
            done.update(sch.get(b).name_hint for b in sch.get_child_blocks(tile_loop))


# --- 1. inlining ---------------------------------------------------------------------------


def inline_free_producers(sch: s_tir.Schedule, infos: list[SBlockInfo]) -> None:
    changed = True
    while changed:
        changed = False
        for info in list(infos):
            block = info.block_rv
            if info.is_reduction() or _is_output(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if not consumers:
                continue
            into_reduction = any(get_sblock_info(sch, c).is_reduction() for c in consumers)
            if into_reduction and not _is_plain_data_movement(sch.get(block)):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                continue
            infos.remove(info)
            changed = True


def _is_output(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    # Intermediates are allocated by the root block; anything else written is a parameter.
    internal = list(sch.get(sch.get_sblock("root")).alloc_buffers)
    return any(
        not any(region.source.same_as(buf) for buf in internal) for region in sch.get(block).writes
    )


def _is_plain_data_movement(block) -> bool:
    """A block whose value is a load (maybe cast or padded) with indices in iteration order.

    Such a producer costs nothing to recompute inside a reduction and keeps the consumer's
    access pattern, unlike a transpose or arithmetic.
    """
    store = block.body
    if not isinstance(store, tirx.BufferStore):
        return False
    order = [iv.var for iv in block.iter_vars]
    ok = True

    def on_load(node) -> None:
        nonlocal ok
        seen = [n for index in node.indices for n, v in enumerate(order) if index.same_as(v)]
        ok &= seen == sorted(seen)

    def on_call(node) -> None:
        nonlocal ok
        ok &= intrinsic_name(node) in SELECTS

    def on_arith(_node) -> None:
        # arithmetic on values is work; on indices it is a reshape we do not want to inline
        nonlocal ok
        ok = False

    arith = (prim.Mul, prim.Div, prim.FloorDiv, prim.Mod, prim.FloorMod)
    tvm_ffi.structural_walk(
        store.value, [(ir_expr.TensorLoad, on_load), (ir_expr.Call, on_call), (arith, on_arith)]
    )
    return ok


# --- 2. GEMM-like reductions -----------------------------------------------------------------


def _tile_gemm_like(sch, block, info: SBlockInfo, target: Target):
    """Register-tile a GEMM-like block; return its outer tile loop, or None if it does not fit."""
    kinds = info.dom_kind()
    if kinds != "S" * kinds.count("S") + "R" * kinds.count("R") or kinds.count("S") < 2:
        return None
    stmt = sch.get(block)
    out = stmt.writes[0].source
    spatial = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    j_var = spatial[-1]
    reduced = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    # The output's innermost index is the last spatial var, and one operand walks it
    # contiguously along the reduction (``B[k, j]``). An operand constant over the reduction
    # (a row mean in a variance, ``sum_k (x[i, j, k] - mean[i, j])^2``) does not make a GEMM:
    # tiled, the reduction's real operand would be gathered across rows, a lane at a time.
    if not _last_index_is(stmt.body, out, j_var):
        return None
    if not any(
        not r.source.same_as(out) and _region_last_is(r, j_var) and _uses_any(r, reduced)
        for r in stmt.reads
    ):
        return None
    loops = sch.get_loops(block)
    extents = [_const_extent(sch, lp) for lp in loops]
    n_spatial = kinds.count("S")
    m_ext, n_ext = extents[n_spatial - 2], extents[n_spatial - 1]
    lanes = vector_lanes(target, out.dtype)
    if m_ext is None or n_ext is None or n_ext % lanes:
        return None
    nr = 2 * lanes if n_ext % (2 * lanes) == 0 else lanes
    mr = next(r for r in _TILE_ROWS if m_ext % r == 0)

    outer = loops[: n_spatial - 2]
    i_loop, j_loop = loops[n_spatial - 2], loops[n_spatial - 1]
    reduce_loops = loops[n_spatial:]
    io, ii = sch.split(i_loop, [None, mr])
    jo, ji = sch.split(j_loop, [None, nr])
    sch.reorder(*outer, io, jo, *reduce_loops, ii, ji)
    tile_loop = sch.fuse(*outer, io, jo)
    work = _product(extents)
    if work is not None and work >= _MIN_PARALLEL_WORK:
        sch.parallel(tile_loop)

    acc = sch.cache_write(block, 0, "global")
    sch.reverse_compute_at(acc, tile_loop, preserve_unit_loops=True)
    _inline_epilogue(sch, acc)
    sch.unroll(ii)
    sch.vectorize(ji)
    init = sch.decompose_reduction(block, reduce_loops[0])
    sch.vectorize(sch.get_loops(init)[-1])
    write_back = sch.get_loops(_write_back_block(sch, tile_loop))
    sch.vectorize(write_back[-1])
    return tile_loop


def _inline_epilogue(sch, write_back) -> None:
    """Fold elementwise consumers of the accumulator's write-back into it (bias, activation)."""
    while True:
        consumers = sch.get_consumers(write_back)
        if len(consumers) != 1 or not _reads_each_element_once(
            sch.get(consumers[0]), sch.get(write_back).writes[0].source
        ):
            return
        try:
            sch.reverse_compute_inline(consumers[0])
        except s_tir.ScheduleError:
            return


def _reads_each_element_once(consumer, buffer) -> bool:
    """True when ``consumer`` reads ``buffer`` once per element: one point, indexed by distinct
    block variables (or constants), with every block variable of extent > 1 among them.

    Reverse inlining needs this. A broadcasting consumer (softmax's ``exp(x - max)`` over the
    reduced axis) reads each element many times; TVM 0.27's ``reverse_compute_inline`` stops
    on it with an internal error instead of a ScheduleError.
    """
    regions = [r for r in consumer.reads if r.source.same_as(buffer)]
    if len(regions) != 1 or not all(_is_one(rng.extent) for rng in regions[0].region):
        return False
    starts = [rng.min for rng in regions[0].region]
    if not all(isinstance(v, (tirx.Var, prim.IntImm)) for v in starts):
        return False
    for iv in consumer.iter_vars:
        uses = sum(v.same_as(iv.var) for v in starts)
        if uses > 1 or (uses == 0 and not _is_one(iv.dom.extent)):
            return False
    return True


def _write_back_block(sch, tile_loop):
    blocks = sch.get_child_blocks(tile_loop)
    return blocks[-1]


def _last_index_is(store, buffer, var) -> bool:
    if not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(buffer):
        return False
    return store.indices[-1].same_as(var)


def _region_last_is(region, var) -> bool:
    last = region.region[-1]
    return last.min.same_as(var) and _is_one(last.extent)


def _uses_any(region, variables) -> bool:
    """Whether any index of ``region`` depends on one of ``variables``."""
    return any(used.same_as(v) for rng in region.region
               for used in tirx.analysis.undefined_vars(rng.min) for v in variables)


def _is_one(expr) -> bool:
    return isinstance(expr, prim.IntImm) and expr.value == 1


# --- 3. everything else ----------------------------------------------------------------------


def _schedule_row_reduction(sch, block, info: SBlockInfo, lanes: int = 16) -> list[str]:
    """Parallel over rows, vectorised partial reductions; returns the names of new blocks.

    Where the input's innermost axes are the reduced ones (a row reduction, or a whole-tensor
    min/max as ``DynamicQuantizeLinear`` computes), they fuse into one loop whose partial
    results run in vector lanes. Where the innermost axis is kept (a mean over the pixels of
    an NHWC tensor, a pooling) the reduction loops go outside it and it is vectorised, on
    the widest of ``lanes``, a half or a quarter of them that divides it. ShuffleNet's max
    pooling over 24 channels had been left scalar, its index rebuilt from one counter for
    every output; with 8 lanes (and its padding read in place, step 1) it took 0.080 ms
    instead of 0.174, its average poolings 0.028 and 0.016 instead of 0.061 and 0.040 (2-core
    Zen 4, ``tvm-hybrid profile``); the model ran 1.078x faster (same process, 11 rounds,
    10 faster), YOLOX's padded 5x5 to 13x13 poolings 0.080, 0.045 and 0.015 ms instead of
    0.128, 0.066 and 0.017. Other models (Inception v1 and v2, ResNet-50, SqueezeNet,
    DenseNet-121, ocr_det, YOLOv8n, layout) were within 1.5% either way.
    """
    kinds = info.dom_kind()
    loops = sch.get_loops(block)
    spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
    reduce = [lp for lp, k in zip(loops, kinds) if k == "R"]
    if not spatial:
        return []
    worth = _worth_parallel(sch, loops)  # before fuse: fusing invalidates the loop handles
    innermost = _innermost_read_vars(sch.get(block), kinds)
    kept = _const_extent(sch, spatial[-1])
    width = _vector_width(kept, lanes)
    if innermost == "S" and width is not None:
        return _schedule_column_reduction(sch, block, spatial, reduce, width, worth)
    sch.reorder(*spatial, *reduce)
    fused = sch.fuse(*spatial)
    if worth:
        sch.parallel(fused)
    if innermost == "R" and len(reduce) > 1:
        reduce = [sch.fuse(*reduce)]
    extent = _const_extent(sch, reduce[-1]) if len(reduce) == 1 else None
    if extent is not None and extent % lanes == 0 and extent >= 2 * lanes:
        return _vectorize_reduction(sch, block, lanes)
    if extent is not None and extent >= 4 * lanes:
        return _unroll_reduction(sch, block, extent, lanes)
    return []


def _innermost_read_vars(stmt, kinds: str) -> str | None:
    """``"R"`` when the input's innermost indices are exactly the reduction's iteration
    variables in order, ``"S"`` when its last index is the last spatial one, else None."""
    ivars = [iv.var for iv in stmt.iter_vars]
    reduced = [v for v, k in zip(ivars, kinds) if k == "R"]
    spatial = [v for v, k in zip(ivars, kinds) if k == "S"]
    out = stmt.writes[0].source
    reads = [r for r in stmt.reads if not r.source.same_as(out)]
    if len(reads) != 1:
        return None
    mins = [rng.min for rng in reads[0].region]
    extents = [rng.extent for rng in reads[0].region]
    if not all(isinstance(e, prim.IntImm) and int(e.value) == 1 for e in extents):
        return None
    tail = mins[-len(reduced):] if reduced else []
    if reduced and len(tail) == len(reduced) and all(a.same_as(b) for a, b in zip(tail, reduced)):
        return "R"
    if spatial and mins and mins[-1].same_as(spatial[-1]):
        return "S"
    return None


def _schedule_column_reduction(sch, block, spatial, reduce, lanes: int, worth: bool) -> list[str]:
    """Reduction loops outside the contiguous last spatial axis (a multiple of ``lanes``),
    which is vectorised."""
    outer, inner = sch.split(spatial[-1], [None, lanes])
    sch.reorder(*spatial[:-1], outer, *reduce, inner)
    fused = sch.fuse(*spatial[:-1], outer)
    if worth:
        sch.parallel(fused)
    init = sch.decompose_reduction(block, reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])
    # TVM refuses to vectorize a loop under the reduction loops of a block that is not
    # "complete"; the unrolled contiguous lanes LLVM's SLP vectoriser packs into vectors.
    sch.unroll(sch.get_loops(block)[-1])
    return [sch.get(init).name_hint, sch.get(block).name_hint]  # decomposing renamed it


def _vectorize_reduction(sch, block, lanes: int) -> list[str]:
    """``lanes`` partial results per row (rfactor), so the reduction runs on vector registers.

    A scalar reduction over a row is one long dependency chain of adds (or max), bound by
    their latency; ``lanes`` independent partial sums in one vector register remove it.
    """
    try:
        out_dims = len(sch.get(block).writes[0].region)
        *_, reduce = sch.get_loops(block)
        _, inner = sch.split(reduce, [None, lanes])
        partial = sch.rfactor(inner, factor_axis=out_dims)  # lanes innermost: vector stores
        *_, lane = sch.get_loops(partial)
        sch.vectorize(lane)
        return [sch.get(partial).name_hint]
    except s_tir.ScheduleError as err:
        logger.debug("reduction left scalar: %s", err)
        return []


def _unroll_reduction(sch, block, extent: int, lanes: int) -> list[str]:
    """:func:`_vectorize_reduction` for a row no vector divides (6625 classes): ``lanes``
    partial results over the whole vectors of the row, unrolled (LLVM keeps the ``lanes``
    independent chains in flight; TVM does not vectorise a loop under the reduction of a
    partitioned block), the last elements on their own."""
    try:
        out_dims = len(sch.get(block).writes[0].region)
        *_, reduce = sch.get_loops(block)
        outer, inner = sch.split(reduce, [None, lanes])
        partial = sch.rfactor(inner, factor_axis=out_dims)
        *_, outer, _ = sch.get_loops(partial)
        init = sch.decompose_reduction(partial, outer)
        update = sch.get(partial).name_hint
        main, _rest = sch.loop_partition(outer, [extent // lanes, None])
        *_, lane = sch.get_loops(sch.get_child_blocks(main)[0])
        sch.unroll(lane)
        return [sch.get(init).name_hint, update]
    except s_tir.ScheduleError as err:
        logger.debug("reduction left scalar: %s", err)
        return []


def _schedule_spatial(sch, block, target: Target) -> None:
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    out = stmt.writes[0].source
    inner = loops[-1]
    inner_ext = _const_extent(sch, inner)
    lanes = vector_lanes(target, out.dtype)
    last = stmt.iter_vars[-1].var
    if inner_ext is not None and not (_last_index_is(stmt.body, out, last)
                                      and _reads_follow(stmt, last)):
        _schedule_transposing(sch, block, loops, inner_ext, max(_UNROLL_CHUNK, lanes))
        return
    worth = _worth_parallel(sch, loops)
    vec = None
    if inner_ext is not None:
        width = _vector_width(inner_ext, lanes)
        if width is None and inner_ext >= 2 * lanes and \
                (_product([_const_extent(sch, lp) for lp in loops[:-1]]) or 0) >= 2:
            _vectorize_most(sch, loops, inner_ext, lanes, worth)
            return
        if width is not None:
            rest, vec = sch.split(inner, [None, width])
            loops = [*loops[:-1], rest]
    _parallel_leading(sch, loops, worth)
    if vec is not None:
        sch.vectorize(vec)


def _vector_width(extent: int | None, lanes: int) -> int | None:
    """The widest of ``lanes``, a half or a quarter of them (over one lane) that divides
    ``extent``; None for none, or an unknown extent."""
    return next((w for w in (lanes, lanes // 2, lanes // 4) if w > 1 and extent
                 and extent % w == 0), None)


def _vectorize_most(sch, loops, inner_ext: int, lanes: int, worth: bool) -> None:
    """An innermost loop no vector width divides (a softmax over 6625 classes): split in two
    loops, the whole vectors vectorised and the few elements left scalar; the loops outside
    parallel. (Vectorising with a guard on the last vector made TVM scalarise every lane: a
    40 x 6625 softmax's exponentials ran 5x slower than 40 x 6624's.)"""
    _parallel_leading(sch, loops[:-1], worth)
    main, _rest = sch.loop_partition(loops[-1], [inner_ext - inner_ext % lanes, None])
    _, vec = sch.split(main, [None, lanes])
    sch.vectorize(vec)


def _reads_follow(block, var) -> bool:
    """Whether every load in ``block``'s value walks memory with stride 1 or 0 as ``var``
    advances: vector loads, not gathers, when ``var`` is vectorised. The row-major address
    is simplified within the block's iteration domain (a reshape's ``c // 32`` is 0 for
    ``c`` below 32)."""
    analyzer = Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    ok = True

    def on_load(node) -> None:
        nonlocal ok
        address = None  # row-major: a reshape's (c // 68) * 68 + c % 68 is c
        for index, extent in zip(node.indices, node.source.shape):
            address = index if address is None else address * extent + index
        if address is None:  # a scalar
            return
        linear = list(detect_linear_equation(analyzer.simplify(address), [var]))
        ok &= bool(linear) and isinstance(linear[0], prim.IntImm) and linear[0].value in (0, 1)

    store = block.body
    if not isinstance(store, tirx.BufferStore):
        return False
    tvm_ffi.structural_walk(store.value, [(ir_expr.TensorLoad, on_load)])
    return ok


def _schedule_transposing(sch, block, loops, inner_ext: int, chunk: int) -> None:
    """Innermost loop unrolled in chunks of up to ``chunk`` elements (one chunk if it is
    shorter); leading loops fused to at least :data:`_PARALLEL_GRAIN` parallel iterations.

    A vectorised transposing read gathers lane by lane; unrolled, LLVM packs contiguous loads
    and stores into vectors and shuffles between them (ShuffleNet's channel shuffles ran 3-5x
    faster, NCHW to NHWC 8x, on a Zen 3).
    """
    worth = _worth_parallel(sch, loops)
    step = next((d for d in range(min(chunk, inner_ext), 1, -1) if inner_ext % d == 0), 1)
    if inner_ext <= chunk:
        outer, unrolled = loops[:-1], loops[-1]
    elif step >= 4:
        rest, unrolled = sch.split(loops[-1], [None, step])
        outer = [*loops[:-1], rest]
    else:
        outer, unrolled = loops, None
    _parallel_leading(sch, outer, worth)
    if unrolled is not None:
        sch.unroll(unrolled)


def _parallel_leading(sch, loops, worth: bool) -> None:
    """The leading ``loops`` fused until they give :data:`_PARALLEL_GRAIN` iterations (a loop
    of unknown extent counts as one), and parallel if ``worth`` it; the loops after them stay
    serial inside.

    Fusing every loop would rebuild each index from one counter by division and modulo in
    the innermost loop: a max pooling and a depthwise convolution of ShuffleNet ran 1.7-1.9x
    faster on a Zen 3 with only their leading loops fused.
    """
    count, extent = 0, 1
    while count < len(loops) and extent < _PARALLEL_GRAIN:
        extent *= _const_extent(sch, loops[count]) or 1  # a dynamic batch may be 1
        count += 1
    if count and worth:
        sch.parallel(sch.fuse(*loops[:count]) if count > 1 else loops[0])


def _worth_parallel(sch, loops) -> bool:
    work = _product([_const_extent(sch, lp) for lp in loops])
    return work is None or work >= _MIN_PARALLEL_WORK


def _const_extent(sch, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent.value) if isinstance(extent, prim.IntImm) else None


def _product(values) -> int | None:
    total = 1
    for value in values:
        if value is None:
            return None
        total *= value
    return total
