"""``ElementAlignedArguments``: kernels take tensor arguments at any element-aligned address.

TVM's packed calling convention marks every tensor argument as 64-byte aligned
(``storage_alignment`` of its data pointer, from ``Buffer.data_alignment``), so LLVM may emit loads
and stores that assume it. numpy aligns large arrays to 16 bytes only, so a model call had to copy
such inputs into aligned staging tensors (``transfer.py``): three 12.6 MB attention inputs, two of
them 16-byte aligned, spent ~3.5 ms of an ~11.7 ms call copying. This TIR pass, run after
``MakePackedAPI``, lowers the alignment the kernels assume of their tensor arguments to their
element size, so any C-contiguous numpy array is passed zero-copy.

On x86 this costs nothing when the data is aligned after all: with AVX the vector loads and
stores LLVM emits for an unaligned pointer (``vmovups``, or a memory operand of the arithmetic
instruction) run as fast as the aligned forms on aligned data. Measured on a 2-core Emerald
Rapids VM, fp32 attention b32 s128: 7.9 ms with 64-byte-aligned inputs before and after the
pass, 8.2 ms with 16-byte-aligned inputs after it.

The pass runs in the ``"hybrid"`` TIR pipeline (:func:`tvm_hybrid.pipeline.tir_pipeline`), which
:func:`tvm_hybrid.compile` builds with; its models record that they take element-aligned inputs
(``CompiledModel.element_aligned``).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

#: The attribute ``MakePackedAPI`` puts on each tensor argument's data pointer.
_ALIGNMENT_KEY = "storage_alignment"


def element_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (1 for sub-byte types such as bool)."""
    return max(1, tvm.DataType(dtype).bits * tvm.DataType(dtype).lanes // 8)


@tvm.transform.module_pass(opt_level=0, name="ElementAlignedArguments")
class ElementAlignedArguments:
    """Lower the alignment every packed-API kernel assumes of its tensor arguments to their
    element size (run after ``MakePackedAPI``)."""

    def transform_module(self, mod: tvm.IRModule,
                         _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions.items():
            if isinstance(func, tirx.PrimFunc):
                updates[gvar] = tvm_ffi.structural_map(func, [(tirx.AttrStmt, _element_aligned)])
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _element_aligned(stmt: tirx.AttrStmt) -> tirx.AttrStmt:
    if stmt.attr_key != _ALIGNMENT_KEY or not isinstance(stmt.node, tvm.ir.expr.Var):
        return stmt
    align = element_bytes(str(stmt.node.dtype))
    if int(stmt.value) <= align:
        return stmt
    return tirx.AttrStmt(stmt.node, stmt.attr_key, tirx.IntImm("int32", align), stmt.body,
                         stmt.span)
