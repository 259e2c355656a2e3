"""``DropRowPadding``: a GEMM whose last row tile reads only ``A``'s own rows takes ``A`` as it is.

Where no good register tile divides a GEMM's ``M`` (97 or 257 rows, primes; 197 ViT tokens),
the packing pads ``x`` with zero rows to whole tiles (``heuristics.padded_rows``): a padding
kernel copies ``x`` into a buffer of ``M_padded`` rows before the GEMM. The GEMM template's
last row tile then runs a row tail (``microkernels/tiles.py``: ``RowTail``) that reads only
the rows of ``A`` that exist, and marks its tile loop so (``template.ROWS_READ``). After
scheduling, this pass removes the copy: the GEMM kernel takes ``x`` itself, declared with its
own rows, and sees it through a view of ``M_padded`` rows whose last ones it never reads.

The copy cost more than its bytes: in the model it ran 3-5 times slower than timed alone
(its buffer's lines were held by the other core, which had read them in the GEMM before).

A padding call is removed only when it is a kernel of its own that pads ``x``'s second-last
axis and nothing else (TVM's ``pad``), its output feeds nothing but the GEMM, and every call
of that GEMM kernel in the module takes a padding so removable (the kernel is rewritten once
for all of them).
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from ..schedules.gemm.template import ROWS_READ
from .relax_rewrite import rewrite_functions, static_shape

#: The name TVM's legalization gives a padding kernel (``pad``, ``pad1``, ...): one fused with
#: another op is named after both (``fused_...``) and is kept.
_PAD_KERNEL = re.compile(r"pad\d*")
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@tvm.transform.module_pass(opt_level=0, name="DropRowPadding")
class DropRowPadding:
    """Let GEMM kernels with a row tail take their ``A`` unpadded (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        reads = {gv: found for gv, func in mod.functions.items()
                 if isinstance(func, tirx.PrimFunc) and (found := rows_read(func))}
        if not reads:
            return mod
        calls, eligible = _padded_calls(mod, reads)
        kernels = {gv: param for gv, (param, count) in eligible.items()
                   if count == calls.get(gv, 0) and param is not None}
        if not kernels:
            return mod
        # The kernels are added anew, under their names: their GlobalVars' types change.
        rest = tvm.IRModule({gv: func for gv, func in mod.functions.items() if gv not in kernels},
                            attrs=mod.attrs)
        unpadded = {gv: _unpadded_kernel(mod[gv], param, reads[gv][1])
                    for gv, param in kernels.items()}
        return rewrite_functions(rest, _Unpad(rest, kernels, unpadded),
                                 eliminate_dead_code=True)


def rows_read(func: tirx.PrimFunc) -> tuple[str, int] | None:
    """``(parameter name, rows)`` when ``func`` reads only the first ``rows`` rows of that
    parameter: one tile loop says so (the template's :data:`ROWS_READ`) and no block outside
    it reads the parameter; else None."""
    loops = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda loop: loops.append(loop)
                                         if ROWS_READ in loop.annotations else None)])
    if len(loops) != 1:
        return None
    name, _, rows = str(loops[0].annotations[ROWS_READ]).rpartition(":")
    param = next((p for p in func.params if p.name == name), None)
    if param is None or _readers(func.body, param) != _readers(loops[0].body, param):
        return None
    return name, int(rows)


def _readers(stmt: tirx.Stmt, buffer: tvm.ir.Var) -> int:
    """How many blocks in ``stmt`` read ``buffer`` (or match a region of it)."""
    count = 0

    def on_block(block):
        nonlocal count
        if any(r.source.same_as(buffer) for r in block.reads) or any(
                m.source.source.same_as(buffer) for m in block.match_buffers):
            count += 1

    tvm_ffi.structural_walk(stmt, [(s_tir.stmt.SBlock, on_block)])
    return count


def _padding_source(value: relax.Expr) -> relax.Expr | None:
    """``x`` when ``value`` calls a kernel of its own padding ``x``'s second-last axis only."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR):
        return None
    callee, args = value.args[0], value.args[1]
    if not isinstance(callee, tvm.ir.GlobalVar) or not _PAD_KERNEL.fullmatch(callee.name_hint) \
            or len(args.fields) != 1:
        return None
    x = args.fields[0]
    before, after = static_shape(x), static_shape(value)
    if before is None or after is None or len(before) < 2 or len(before) != len(after) \
            or before[:-2] != after[:-2] or before[-1] != after[-1] or before[-2] >= after[-2]:
        return None
    if str(x.ty.dtype) != str(value.ty.dtype):
        return None
    return x


def _padded_calls(mod: tvm.IRModule, reads: dict):
    """Per GEMM kernel of ``reads``: how many calls it has in the module, and ``(argument
    index, calls that can drop their padding)``, the index None when calls disagree on it."""
    calls: dict = {}
    eligible: dict = {}
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        uses: dict = {}
        for value in [*bindings.values(), func.body.body]:
            for var in relax.analysis.free_vars(value):
                uses[var] = uses.get(var, 0) + 1
        for value in bindings.values():
            if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR) \
                    or value.args[0] not in reads:
                continue
            gv = value.args[0]
            calls[gv] = calls.get(gv, 0) + 1
            param = _droppable(mod, gv, value.args[1].fields, reads[gv], bindings, uses)
            if param is None:
                continue
            known, count = eligible.get(gv, (param, 0))
            eligible[gv] = (known if known == param else None, count + 1)
    return calls, eligible


def _droppable(mod, gv, args, read, bindings, uses) -> int | None:
    """The index of the argument of this call of ``gv`` whose padding can go, or None."""
    name, rows = read
    params = mod[gv].params
    for index, arg in enumerate(args):
        if index >= len(params) or params[index].name != name:
            continue
        x = _padding_source(bindings.get(arg)) if isinstance(arg, relax.Var) else None
        if x is None or uses.get(arg, 0) != 1 or static_shape(x)[-2] != rows:
            return None
        return index
    return None


def _unpadded_kernel(func: tirx.PrimFunc, index: int, rows: int) -> tirx.PrimFunc:
    """``func`` taking parameter ``index`` with ``rows`` rows, seen inside through a view of
    its former shape (whose rows past ``rows`` the kernel does not read)."""
    padded = func.params[index]
    ty = padded.ty
    shape = [*ty.shape[:-2], tirx.IntImm(str(ty.shape[-2].ty.dtype), rows), ty.shape[-1]]
    own = tvm.ir.Var(padded.name, tirx.buffer.BufferType(
        ty.dtype, ty.storage_scope, shape, ty.strides, ty.elem_offset, ty.data_alignment,
        ty.offset_factor, ty.layout, ty.allocated_addr))
    realize = func.body
    root = realize.block
    body = tirx.SeqStmt([tirx.DeclBuffer(padded, data=own.data), root.body])
    block = s_tir.stmt.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body,
                              root.init, root.alloc_buffers, root.match_buffers,
                              root.annotations)
    params = [own if i == index else p for i, p in enumerate(func.params)]
    return tirx.PrimFunc(params, s_tir.stmt.SBlockRealize(
        realize.iter_values, realize.predicate, block), func.ret_type, func.attrs)


@relax.expr_functor.mutator
class _Unpad(relax.PyExprMutator):
    """Calls of the rewritten kernels take the padding's input instead of its output."""

    def __init__(self, mod: tvm.IRModule, kernels: dict, unpadded: dict):
        super().__init__(mod)
        self.kernels = kernels
        self.renamed = {gv: self.builder_.add_func(func, gv.name_hint)
                        for gv, func in unpadded.items()}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not call.op.same_as(_CALL_TIR) or call.args[0] not in self.kernels:
            return call
        index = self.kernels[call.args[0]]
        args = list(call.args[1].fields)
        x = _padding_source(self.lookup_binding(args[index]))
        if x is None:
            raise ValueError(f"{call.args[0].name_hint}: argument {index} is not a padding")
        args[index] = self.visit_expr(x)
        return relax.Call(call.op, [self.renamed[call.args[0]], relax.Tuple(args), *call.args[2:]],
                          call.attrs, call.ty_args)
