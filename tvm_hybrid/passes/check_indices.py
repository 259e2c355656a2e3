"""``CheckIndices``: gathers and scatters check their run-time indices in the compiled code.

TVM lowers ``take``, ``gather_elements``, ``gather_nd``, ``scatter_elements`` and ``scatter_nd``
with no bounds check (stock TVM too): an index outside the data (a bad token id, say) reads or
writes arbitrary memory, returning garbage or killing the process. ONNX Runtime rejects such
indices. This pass puts a small kernel in front of every such op whose indices are not constant:
it maps negative indices to ``index + extent`` (ONNX semantics, replacing the importer's own
``where(i < 0, i + extent, i)``) and asserts ``-extent <= index < extent``, so a bad index stops
the model with an error before the op reads anything. ``CompiledModel`` turns that error into an
:class:`~tvm_hybrid.errors.InputError` naming the ONNX op, the input and the values found.

The check reads each index once (``O(indices)``, next to the op's own work); data with dynamic
extents keeps the importer's form unchecked.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.script import tirx as T

from .relax_rewrite import bound_value, is_op, rewrite_functions, static_shape

#: Marker at the start of the kernel's error message (``CompiledModel`` looks for it).
INDEX_ERROR = "tvm_hybrid.index_out_of_range"

#: Relax op -> the ONNX op it imports.
_ONNX_NAMES = {
    "relax.take": "Gather",
    "relax.gather_elements": "GatherElements",
    "relax.gather_nd": "GatherND",
    "relax.scatter_elements": "ScatterElements",
    "relax.scatter_nd": "ScatterND",
}


@tvm.transform.module_pass(opt_level=0, name="CheckIndices")
class CheckIndices:
    """Bounds-check the run-time indices of gathers and scatters (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod), eliminate_dead_code=True)


def _extents(call: relax.Call, data_shape: tuple, index_shape: tuple) -> list[int] | None:
    """Extent of the data axis each index addresses (one per coordinate for the ND ops)."""
    name = call.op.name
    if name == "relax.take":
        axis = call.attrs.axis
        return [math.prod(data_shape)] if axis is None else [data_shape[int(axis)]]
    if name in ("relax.gather_elements", "relax.scatter_elements"):
        return [data_shape[int(call.attrs.axis)]]
    if not index_shape:
        return None
    start = int(call.attrs.batch_dims) if name == "relax.gather_nd" else 0
    return list(data_shape[start:start + index_shape[-1]])


def check_function(count: int, dtype: str, extents: list[int], negative: bool, message: str):
    """A PrimFunc checking ``count`` indices (coordinate ``i % len(extents)`` addresses an axis
    of ``extents[i % len]``) and writing them with negatives mapped to ``index + extent``."""
    coords = len(extents)

    def extent(i):
        value = T.Cast(dtype, extents[-1])
        for j in range(coords - 2, -1, -1):
            value = T.Select(i % coords == j, T.Cast(dtype, extents[j]), value)
        return value

    low = -1 if negative else 0

    @T.prim_func(private=True, s_tir=True)
    def check(ids: T.Buffer((count,), dtype), out: T.Buffer((count,), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        with T.sblock("root"):
            T.reads(ids[0:count])
            T.writes(out[0:count])
            for i in range(count):
                assert ids[i] >= extent(i) * T.Cast(dtype, low) and ids[i] < extent(i), message
                out[i] = T.Select(ids[i] < T.Cast(dtype, 0), ids[i] + extent(i), ids[i])

    return check


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.params: set = set()

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.params = set(func.params)
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not isinstance(call.op, tvm.ir.Op) or call.op.name not in _ONNX_NAMES:
            return call
        data, indices = call.args[0], call.args[1]
        if isinstance(bound_value(self, indices), tvm.ir.GenericConst):
            return call
        index_shape, data_shape = static_shape(indices), static_shape(data)
        if index_shape is None or data_shape is None:
            return call
        extents = _extents(call, data_shape, index_shape)
        if not extents:
            return call
        original, negative = self._before_normalisation(indices)
        # ONNX allows negative indices; the importer normalises them for all but this one.
        negative = negative or call.op.name == "relax.scatter_elements"
        dtype = str(original.ty.dtype)
        negative = negative and not dtype.startswith("uint")
        count = math.prod(index_shape)
        who = f"input {original.name!r}" if original in self.params else "computed indices"
        bounds = (f"[-{extents[0]}, {extents[0]})" if negative else f"[0, {extents[0]})") \
            if len(extents) == 1 else f"the data shape {tuple(extents)}"
        message = (f"{INDEX_ERROR}: {_ONNX_NAMES[call.op.name]} on {who}: an index is outside "
                   f"{bounds}")
        func = check_function(count, dtype, extents, negative, message)
        gvar = self.builder_.add_func(func, "hybrid_check_indices")
        flat = self.builder_.emit(relax.op.reshape(original, [count]))
        checked = self.builder_.emit(
            relax.call_tir(gvar, [flat], relax.TensorType((count,), dtype)))
        checked = self.builder_.emit(relax.op.reshape(checked, list(index_shape)))
        return relax.Call(call.op, [data, checked, *call.args[2:]], call.attrs)

    def _before_normalisation(self, indices: relax.Expr) -> tuple[relax.Expr, bool]:
        """``(i, True)`` when ``indices`` is the importer's ``where(i < 0, i + extent, i)``."""
        node = bound_value(self, indices)
        if is_op(node, "relax.where"):
            cond, added = (bound_value(self, a) for a in node.args[:2])
            raw = node.args[2]
            if is_op(cond, "relax.less") and cond.args[0].same_as(raw) and \
                    is_op(added, "relax.add") and added.args[0].same_as(raw):
                return raw, True
        return indices, False
