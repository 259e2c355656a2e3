"""Is this TIR block a GEMM the expert template covers? (analysis only, no scheduling)

A covered block computes ``C[..., i, j] += A[..., i, k] * B[...]`` either

* in fp32, with ``B`` read plainly, ``B[..., k, j]``, or in the packed layout of
  ``passes/prepack.py``, ``B[j // nr, k, j % nr]``; or
* in int32 from ``u8`` ``A`` and ``s8`` ``B`` (``C += int32(A) * int32(B)``), with ``B`` in the
  VNNI layout of ``passes/integer_gemm.py``, ``B[j // nr, k // 4, j % nr, k % 4]``, or from
  ``s16`` ``A`` and ``B`` with ``B`` packed in pairs, ``B[j // nr, k // 2, j % nr, k % 2]``; or
* in fp32 from bf16 ``A`` and ``B`` (``C += float32(A) * float32(B)``), with ``B`` packed in
  pairs by ``passes/bf16.py``, ``B[j // nr, k // 2, j % nr, k % 2]``.

Leading spatial axes are batch axes; the single reduction axis is ``k``. A prepacked GEMM's
``N`` is padded to whole panels; :func:`used_columns` finds how many its consumer keeps (the
template's tail, ``microkernels/tiles.py``).
"""

from __future__ import annotations

import dataclasses

import tvm.ir.expr as ir_expr
import tvm.ir.prim.expr as prim
import tvm_ffi
from tvm import s_tir, tirx

from ...microkernels.transposed_tail import TRANSPOSED_PER_COLUMN, TRANSPOSED_TAIL
from .heuristics import GemmShape


@dataclasses.dataclass
class GemmBlock:
    """A GEMM block found by :func:`match_gemm`: its loops, shape and ``B`` layout."""

    block: s_tir.schedule.SBlockRV
    shape: GemmShape
    packed_nr: int | None  # the panel width when B is prepacked, else None
    dtype: str  # the dtype of A: "float32", "uint8" (VNNI), "int16" (AVX2 integer) or "bfloat16"
    #: Of the ``N`` columns (packed: padded to whole panels), those the consumer reads when
    #: fewer (:func:`used_columns`); None: all.
    columns: int | None = None
    #: ``k`` per vector of the transposed copy of the used columns the last panel holds
    #: (``microkernels/transposed_tail.py``, from the block's annotation); 0: none.
    transposed_run: int = 0
    #: Whether that copy holds one column per vector (the block's annotation).
    transposed_per_column: bool = False
    #: Of the ``M`` rows (padded to whole tiles: ``heuristics.padded_rows``), those the
    #: consumer reads when fewer (:func:`used_rows`); None: all.
    rows: int | None = None
    #: The name and shape of ``A``'s buffer (a row tail's offset; ``passes/row_padding.py``).
    a_name: str = ""
    a_shape: tuple[int, ...] = ()


def match_gemm(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> GemmBlock | None:
    """Describe ``block`` as a :class:`GemmBlock`, or return None if it is not one."""
    stmt = sch.get(block)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    reduce = tirx.IterVar.CommReduce
    if kinds.count(reduce) != 1 or kinds[-1] != reduce or len(kinds) < 3:
        return None
    loops = sch.get_loops(block)
    if len(loops) != len(kinds):
        return None
    extents = []
    for loop in loops:
        extent = sch.get(loop).extent
        if not isinstance(extent, prim.IntImm):
            return None
        extents.append(int(extent.value))
    store = stmt.body
    if not isinstance(store, tirx.BufferStore):
        return None
    out_dtype = str(store.buffer.dtype)
    if out_dtype not in ("float32", "int32"):
        return None
    ivars = [iv.var for iv in stmt.iter_vars]
    *spatial, k = ivars
    i, j = spatial[-2], spatial[-1]
    if len(store.indices) != len(spatial) or not all(
        idx.same_as(v) for idx, v in zip(store.indices, spatial)
    ):
        return None
    value = store.value
    if not isinstance(value, prim.Add) or not _is_load_of(value.a, store.buffer):
        return None
    product = value.b
    if not isinstance(product, prim.Mul):
        return None
    loads = [product.a, product.b]
    widened = all(isinstance(x, prim.Cast) and str(x.ty.dtype) == out_dtype for x in loads)
    if out_dtype == "int32" and not widened:
        return None
    if widened:
        loads = [x.value for x in loads]
    if not all(isinstance(x, ir_expr.TensorLoad) for x in loads):
        return None
    a_load = next((x for x in loads if _ends_with(x.indices, [i, k])), None)
    if a_load is None:
        return None
    b_load = loads[1] if a_load is loads[0] else loads[0]
    batch = 1
    for extent in extents[: len(spatial) - 2]:
        batch *= extent
    m, n, k_len = extents[len(spatial) - 2], extents[len(spatial) - 1], extents[-1]
    if out_dtype == "int32":
        a_dtype, b_dtype = str(a_load.source.dtype), str(b_load.source.dtype)
        group = {("uint8", "int8"): 4, ("int16", "int16"): 2}.get((a_dtype, b_dtype))
        if group is None or k_len % group:
            return None
        packed_nr = _vnni_width(b_load.indices, j, k, group)
        if packed_nr is None:
            return None
        return GemmBlock(block, GemmShape(batch, m, n, k_len, itemsize=4 // group), packed_nr,
                         a_dtype, used_columns(sch, block, n))
    if widened:  # bf16 operands, fp32 accumulation: B packed with K in pairs
        packed_nr = _pair_width(b_load.indices, j, k)
        a_dtype, b_dtype = str(a_load.source.dtype), str(b_load.source.dtype)
        if packed_nr is None or (a_dtype, b_dtype) != ("bfloat16", "bfloat16") or k_len % 2:
            return None
        return GemmBlock(block, GemmShape(batch, m, n, k_len, itemsize=2), packed_nr,
                         "bfloat16", used_columns(sch, block, n))
    packed_nr = _packed_width(b_load.indices, j, k)
    if packed_nr is None and not _ends_with(b_load.indices, [k, j]):
        return None
    columns = used_columns(sch, block, n) if packed_nr is not None else None
    run = int(stmt.annotations.get(TRANSPOSED_TAIL, 0)) if columns is not None else 0
    per_column = bool(run) and bool(int(stmt.annotations.get(TRANSPOSED_PER_COLUMN, 0)))
    rows = used_rows(sch, block, m) if packed_nr is not None else None
    a_shape = tuple(int(d.value) if isinstance(d, prim.IntImm) else -1
                    for d in a_load.source.shape)
    return GemmBlock(block, GemmShape(batch, m, n, k_len), packed_nr, "float32", columns, run,
                     per_column, rows, str(a_load.source.name), a_shape)


def used_columns(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, n: int) -> int | None:
    """How many of the ``n`` columns of ``block``'s output its consumer reads, when fewer and
    provably so; else None.

    A packed GEMM's output has ``N`` padded to whole panels and one consumer, the block that
    slices the padding off (or compensates, for integer GEMMs), reading ``acc[..., j]`` at its
    own last iteration variable, whose extent is the kept ``N``. Anything else (several
    consumers, other indices, an output parameter) keeps all ``n`` columns.
    """
    return _used_extent(sch, block, n, -1)


def used_rows(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, m: int) -> int | None:
    """How many of the ``m`` rows of ``block``'s output its consumer reads, when fewer and
    provably so (``x`` padded with zero rows to whole tiles, ``heuristics.padded_rows``, the
    rows sliced off by the consumer that drops the padded columns); else None. As
    :func:`used_columns`, for the second-last axis."""
    return _used_extent(sch, block, m, -2)


def _used_extent(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, extent: int,
                 axis: int) -> int | None:
    """The extent of ``axis`` of ``block``'s output its single consumer reads, at its own
    iteration variable of that axis (from 0), when smaller than ``extent``; else None."""
    consumers = sch.get_consumers(block)
    if len(consumers) != 1:
        return None
    buffer = sch.get(block).writes[0].source
    # An intermediate is allocated by the root block; anything else is a parameter.
    if not any(b.same_as(buffer) for b in sch.get(sch.get_sblock("root")).alloc_buffers):
        return None
    consumer = sch.get(consumers[0])
    if len(consumer.iter_vars) < -axis:
        return None
    var = consumer.iter_vars[axis]
    loads = []
    tvm_ffi.structural_walk(consumer.body, [(ir_expr.TensorLoad, loads.append)])
    loads = [x for x in loads if x.source.same_as(buffer)]
    if not loads or not all(
            len(x.indices) == len(buffer.shape) and x.indices[axis].same_as(var.var)
            for x in loads):
        return None
    used = var.dom.extent
    if not isinstance(used, prim.IntImm) or not isinstance(var.dom.min, prim.IntImm) \
            or int(var.dom.min.value) != 0:
        return None
    return int(used.value) if int(used.value) < extent else None


def _is_load_of(expr, buffer) -> bool:
    return isinstance(expr, ir_expr.TensorLoad) and expr.source.same_as(buffer)


def _ends_with(indices, variables) -> bool:
    if len(indices) < len(variables):
        return False
    return all(a.same_as(b) for a, b in zip(list(indices)[-len(variables):], variables))


def _vnni_width(indices, j, k, group: int = 4) -> int | None:
    """``nr`` if ``indices`` are ``[j // nr, k // group, j % nr, k % group]``, else None."""
    if len(indices) != 4:
        return None
    nr = _div_mod_pair(indices[0], indices[2], j)
    found = _div_mod_pair(indices[1], indices[3], k)
    return nr if found == group else None


def _pair_width(indices, j, k) -> int | None:
    """``nr`` if ``indices`` are ``[j // nr, k // 2, j % nr, k % 2]`` (bf16 pairs)."""
    return _vnni_width(indices, j, k, group=2)


def _div_mod_pair(outer, inner, var) -> int | None:
    """``d`` if ``outer`` is ``var // d`` and ``inner`` is ``var % d``, else None."""
    if not (isinstance(outer, prim.FloorDiv) and isinstance(inner, prim.FloorMod)):
        return None
    if not (outer.a.same_as(var) and inner.a.same_as(var)):
        return None
    if not (isinstance(outer.b, prim.IntImm) and isinstance(inner.b, prim.IntImm)):
        return None
    return int(outer.b.value) if outer.b.value == inner.b.value else None


def _packed_width(indices, j, k) -> int | None:
    """``nr`` if ``indices`` are ``[j // nr, k, j % nr]``, else None."""
    if len(indices) != 3 or not indices[1].same_as(k):
        return None
    return _div_mod_pair(indices[0], indices[2], j)
