"""Accumulating a tile in registers and its epilogue in the tile's write-back: the step every
microkernel template shares (GEMM, per-block AMX, direct convolution)."""

from __future__ import annotations

import tvm.ir.expr as ir_expr
import tvm.ir.prim.expr as prim
import tvm_ffi
from tvm import s_tir, tirx

from ..intrinsics import SELECTS, intrinsic_name


def accumulate_in_tile(sch: s_tir.Schedule, block, tile_loop, init_at,
                       lanes: int | None = None, vectorize_init: bool = True):
    """Accumulate ``block`` in a local buffer per ``tile_loop`` iteration, zeroed before the
    loop ``init_at``, with the elementwise chain after it in the tile's write-back; the init,
    write-back and epilogue blocks vectorised (the update is left to the microkernel).

    ``lanes`` (the microkernel's accumulator lanes): a write-back guarded by a predicate (the
    columns of the weights' padded last panel, sliced off) is vectorised in chunks of
    ``lanes`` columns where the kept columns are a whole number of vectors, so the guard
    holds for whole vectors; a guard on single lanes makes TVM scalarise the whole epilogue
    (a HardSwish epilogue then cost a quarter of a 960x240x240 GEMM's time), except where
    ``passes/peel_guarded_tails.py`` peels the last panel off (the guard's loop not parallel).

    Returns the init block (left as loops where not ``vectorize_init``: a per-block kernel's
    is tensorized instead)."""
    attach_accumulator(sch, block, tile_loop)
    return decompose_accumulator(sch, block, tile_loop, init_at, lanes, vectorize_init)


def attach_accumulator(sch: s_tir.Schedule, block, tile_loop) -> None:
    """The first half of :func:`accumulate_in_tile`: the local accumulator and the epilogue
    in the tile (the reduction not yet split into init and update, so the loops above can
    still be parallelised)."""
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, tile_loop, preserve_unit_loops=True)
    _attach_epilogue(sch, acc, tile_loop)


def decompose_accumulator(sch: s_tir.Schedule, block, tile_loop, init_at,
                          lanes: int | None = None, vectorize_init: bool = True):
    """The second half of :func:`accumulate_in_tile`: zero the accumulator before
    ``init_at``; vectorise the init, write-back and epilogue blocks. Returns the init
    block."""
    init = sch.decompose_reduction(block, init_at)
    update = sch.get(block).name_hint
    skip = {update} if vectorize_init else {update, sch.get(init).name_hint}
    guarded = _predicated_blocks(sch) if lanes else set()
    for child in sch.get_child_blocks(tile_loop):
        stmt = sch.get(child)
        if stmt.name_hint in skip:
            continue
        chunk = None
        if stmt.name_hint in guarded and len(stmt.writes) == 1:
            # The guard keeps the first ``width`` columns of the written buffer: whole vectors
            # where ``lanes`` divides ``width``, else half vectors where those do and the
            # epilogue calls no function (exp, erf, ...): with 8 columns a chunk on a 16-lane
            # kernel, a Sigmoid or SiLU ran 3-5x slower than under TVM's scalar guard, a
            # HardSwish 2.3-3.1x faster (192x200x32, 288x40x16 on a Zen 4; ocr_cls 1.38x).
            width = stmt.writes[0].source.shape[-1]
            if isinstance(width, prim.IntImm) and int(width.value) % lanes == 0:
                chunk = lanes
            elif isinstance(width, prim.IntImm) and lanes >= 16 \
                    and int(width.value) % (lanes // 2) == 0 and not _calls_functions(stmt):
                chunk = lanes // 2
        _vectorize_innermost(sch, child, chunk)
    return init



def keep_accumulator_on_stack(sch: s_tir.Schedule, tile_loop) -> bool:
    """Make the ``"local"`` accumulator written under ``tile_loop`` a ``"global"`` buffer (after
    the microkernel is tensorized: its intrinsics declare ``"local"``), which TVM puts on the
    stack when under ``microkernels.kernel.STACK_BYTES``; the caller checks the size. Returns
    whether one was found.

    From the pool, each parallel task pays an allocation and a free: nothing for a block of
    many tiles, but a GEMM of 197 one-row blocks (``heuristics.choose_blocks``) spent half its
    time there (197x7x333 13.3 us with them, 7.0 us on the stack)."""
    for child in sch.get_child_blocks(tile_loop):
        writes = sch.get(child).writes
        if writes and writes[0].source.scope() == "local":
            sch.set_scope(child, 0, "global")
            return True
    return False


def _calls_functions(stmt) -> bool:
    """Whether the block ``stmt`` calls a function other than a select (exp, erf, ...)."""
    found = False

    def on_call(node) -> None:
        nonlocal found
        found |= intrinsic_name(node) not in SELECTS

    tvm_ffi.structural_walk(stmt.body, [(ir_expr.Call, on_call)])
    return found


def _predicated_blocks(sch: s_tir.Schedule) -> set[str]:
    """Names of the blocks of ``sch`` whose realisation has a predicate (``T.where``)."""
    names: set[str] = set()

    def on_realize(node) -> None:
        predicate = node.predicate
        if not (isinstance(predicate, prim.IntImm) and int(predicate.value) == 1):
            names.add(node.block.name_hint)

    func = sch.mod[sch.func_working_on] if sch.func_working_on is not None else sch.mod["main"]
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlockRealize, on_realize)])
    return names


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
        if is_reduction(sch, consumer):
            return
        try:
            sch.reverse_compute_at(consumer, tile_loop, preserve_unit_loops=True)
        except s_tir.ScheduleError:
            return
        producer = consumer


def _vectorize_innermost(sch: s_tir.Schedule, block, lanes: int | None = None) -> None:
    """Vectorise the innermost loop of ``block``, in chunks of ``lanes`` when given and the
    loop holds several."""
    loop = sch.get_loops(block)[-1]
    extent = sch.get(loop).extent
    if lanes and isinstance(extent, prim.IntImm) and int(extent.value) > lanes \
            and int(extent.value) % lanes == 0:
        _, loop = sch.split(loop, [None, lanes])
    try:
        sch.vectorize(loop)
    except s_tir.ScheduleError:
        pass


def is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def reduction_blocks(sch: s_tir.Schedule) -> list:
    root = sch.get_sblock("root")
    return [b for b in sch.get_child_blocks(root) if is_reduction(sch, b)]
