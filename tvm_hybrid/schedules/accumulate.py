"""Accumulating a tile in registers and its epilogue in the tile's write-back: the step every
microkernel template shares (GEMM, per-block AMX, direct convolution)."""

from __future__ import annotations

from tvm import s_tir, tirx


def accumulate_in_tile(sch: s_tir.Schedule, block, tile_loop, init_at) -> None:
    """Accumulate ``block`` in a local buffer per ``tile_loop`` iteration, zeroed before the
    loop ``init_at``, with the elementwise chain after it in the tile's write-back; the init,
    write-back and epilogue blocks vectorised (the update is left to the microkernel)."""
    attach_accumulator(sch, block, tile_loop)
    decompose_accumulator(sch, block, tile_loop, init_at)


def attach_accumulator(sch: s_tir.Schedule, block, tile_loop) -> None:
    """The first half of :func:`accumulate_in_tile`: the local accumulator and the epilogue
    in the tile (the reduction not yet split into init and update, so the loops above can
    still be parallelised)."""
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, tile_loop, preserve_unit_loops=True)
    _attach_epilogue(sch, acc, tile_loop)


def decompose_accumulator(sch: s_tir.Schedule, block, tile_loop, init_at) -> None:
    """The second half of :func:`accumulate_in_tile`: zero the accumulator before
    ``init_at``; vectorise the init, write-back and epilogue blocks."""
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
        if is_reduction(sch, consumer):
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


def is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def reduction_blocks(sch: s_tir.Schedule) -> list:
    root = sch.get_sblock("root")
    return [b for b in sch.get_child_blocks(root) if is_reduction(sch, b)]
