"""``FoldConstantCleanly``: Relax constant folding without the bindings it leaks.

TVM 0.27's ``FoldConstant``, meeting an op whose legalization emits bindings of its own with
arguments that are not all constant (``dynamic_strided_slice``: a ``shape_func`` kernel, a
``tensor_to_shape`` and a ``match_cast``), folds nothing but leaves those bindings in the
function, calling a ``shape_func`` it never adds to the module. ``FuseOps`` then stops on "There
is no definition of shape_func": ONNX ``Slice`` with run-time starts or ends did not compile.
The stock pipeline folds only after legalization and never meets this; ours folds before it
(phase 1, and inside ``ConvToGemm``), so the QDQ and layout rewrites see constants.

This pass runs ``FoldConstant``, then drops the bindings that call a function the module does
not define, with every binding reading only what they bind, provided nothing else reads any of
them and the function stays well formed; otherwise the module is returned as folded.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .relax_rewrite import rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="FoldConstantCleanly")
class FoldConstantCleanly:
    """``relax.transform.FoldConstant`` and the removal of its leaked bindings."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return drop_leaked_bindings(relax.transform.FoldConstant()(mod))


def drop_leaked_bindings(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without the bindings of its Relax functions that call an undefined function
    (and those computed only from them); ``mod`` itself when there are none or when dropping
    them would leave a use behind."""
    defined = set(mod.get_global_vars())
    dead: set = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            dead |= _leaked(func, defined)
    if not dead:
        return mod
    out = rewrite_functions(mod, _Dropper(mod, dead))
    return out if relax.analysis.check_well_formed(out) else mod


def _leaked(func: relax.Function, defined: set) -> set:
    """The variables ``func`` binds to calls of undefined functions or to values read only
    from those; empty when anything else reads one of them."""
    dead: set = set()
    readers = []
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return dead
    for block in body.blocks:
        for binding in block.bindings:
            value = binding.value
            reads = relax.analysis.free_vars(value)
            if (any(gv not in defined for gv in relax.analysis.all_global_vars(value))
                    or any(v in dead for v in reads)):
                dead.add(binding.var)
            else:
                readers.extend(reads)
    readers.extend(relax.analysis.free_vars(body.body))
    return set() if any(v in dead for v in readers) else dead


@relax.expr_functor.mutator
class _Dropper(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dead: set):
        super().__init__(mod)
        self.dead = dead

    def visit_var_binding_(self, binding) -> None:
        if binding.var not in self.dead:
            super().visit_var_binding_(binding)

    def visit_match_cast_(self, binding) -> None:
        if binding.var not in self.dead:
            super().visit_match_cast_(binding)
