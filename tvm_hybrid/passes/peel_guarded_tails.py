"""``PeelGuardedTails``: a tile's guarded write-back runs in whole vectors outside its last panel.

Where the packed weights pad ``N`` to whole panels and the consumer keeps fewer columns (a
197 x 777 GEMM on 32- or 48-column panels), the tile's write-back and epilogue are guarded by
``column < N``. Unless whole (or half) vectors line up with ``N``
(``schedules/accumulate.py``), that guard depends on the vector lane, and TVM's
``VectorizeLoop`` then scalarises the whole vectorised loop, in every panel, though only the
last panel has padded columns.

This TIR pass, run before TVM's lowering in the ``"hybrid"`` TIR pipeline, marks each such
lane-dependent conjunct of a block predicate ``likely`` (the predicate's other conjuncts, the
rows', stay as they are). :func:`with_loop_partition` runs the lowering with
``s_tir.LoopPartition``'s ``partition_const_loop``, so ``LoopPartition`` splits the loop over
panels where the guard is known: every panel but the last writes whole vectors without it, the
last keeps the guarded scalar loop. Nothing else in a kernel is marked ``likely``, so no other
loop is partitioned. A conjunct that uses a parallel loop's variable is left alone: partitioning
that loop would run its parts one after the other.

Measured on a 2-core Emerald Rapids VM, builds of the old and the new code exported and timed in
one process (outputs identical in every case):

- 197 x 777 x 333 GEMMs, 21 rounds: with a HardSwish epilogue 1.117x (faster in 21 of 21), with
  a Sigmoid 1.016x (LLVM had partly re-vectorised its scalar loop), the plain GEMM 1.017x;
  960 x 240 x 777 with a HardSwish 1.150x;
- models, 9 rounds: ocr_det, ocr_cls, orientation, layout, Inception v1, yolov8n, yolox_captcha,
  captcha_ocr, ShuffleNet and orientation_qdq_int8 0.976-1.008x, within noise (few kernels
  peeled: ocr_det and yolov8n have 9 such guards between them). The 1.03-1.055x first measured for
  six of them came from timing the new build right after the old one in every round (see
  ``bench.comparison.time_interleaved``).
"""

from __future__ import annotations

import tvm
import tvm.ir.expr as ir_expr
import tvm.ir.prim.expr as prim
import tvm_ffi
from tvm import s_tir, tirx

from ..intrinsics import intrinsic_name

#: The ``s_tir.LoopPartition`` option that lets it split loops of constant extent.
_PARTITION_OPTION = "s_tir.LoopPartition"


@tvm.transform.module_pass(opt_level=0, name="PeelGuardedTails")
class PeelGuardedTails:
    """Mark ``likely`` each conjunct of a block predicate that depends on an enclosing
    vectorised loop's variable and on no parallel loop's (run before TVM's lowering, which
    :func:`with_loop_partition` runs)."""

    def transform_module(self, mod: tvm.IRModule,
                         _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions.items():
            if isinstance(func, tirx.PrimFunc):
                peeled = peel_guarded_tails(func)
                if not peeled.same_as(func):
                    updates[gvar] = peeled
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def peel_guarded_tails(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its lane-dependent predicate conjuncts marked ``likely`` (see the module
    docstring); ``func`` itself where it has none."""
    vectorized, parallel = set(), set()

    def on_for(loop: tirx.For) -> None:
        if loop.kind == tirx.ForKind.VECTORIZED:
            vectorized.add(loop.loop_var)
        elif loop.kind == tirx.ForKind.PARALLEL:
            parallel.add(loop.loop_var)

    tvm_ffi.structural_walk(func.body, [(tirx.For, on_for)])
    if not vectorized:
        return func

    def mark(realize: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        predicate = realize.predicate
        if isinstance(predicate, prim.IntImm):
            return realize
        parts = _conjuncts(predicate)
        marked = [tirx.likely(part) if _uses(part, vectorized) and not _uses(part, parallel)
                  and not _is_likely(part) else part for part in parts]
        if all(new.same_as(old) for new, old in zip(marked, parts)):
            return realize
        joined = marked[0]
        for part in marked[1:]:
            joined = tirx.And(joined, part)
        return s_tir.SBlockRealize(list(realize.iter_values), joined, realize.block)

    return tvm_ffi.structural_map(func, [(s_tir.SBlockRealize, mark)])


def with_loop_partition(lower: tvm.transform.Pass) -> tvm.transform.Pass:
    """``lower`` run with ``s_tir.LoopPartition``'s ``partition_const_loop`` on (the current
    pass context's other options and its instruments kept), so it peels the loops
    :class:`PeelGuardedTails` marked."""

    @tvm.transform.module_pass(opt_level=0, name="LowerWithLoopPartition")
    def _lower(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        config = dict(ctx.config)
        options = dict(config.get(_PARTITION_OPTION) or {})
        options["partition_const_loop"] = True
        config[_PARTITION_OPTION] = options
        with tvm.transform.PassContext(opt_level=ctx.opt_level,
                                       required_pass=list(ctx.required_pass),
                                       disabled_pass=list(ctx.disabled_pass), config=config,
                                       instruments=list(ctx.instruments)):
            return lower(mod)

    return _lower


def _conjuncts(expr) -> list:
    return _conjuncts(expr.a) + _conjuncts(expr.b) if isinstance(expr, tirx.And) else [expr]


def _is_likely(expr) -> bool:
    return isinstance(expr, ir_expr.Call) and intrinsic_name(expr) == "likely"


def _uses(expr, variables: set) -> bool:
    found = False

    def on_var(var) -> None:
        nonlocal found
        found |= var in variables

    tvm_ffi.structural_walk(expr, [(tirx.Var, on_var)])
    return found
