"""What the graph rewrites share: run a mutator over a module, look through bindings.

Each pass of this package is a ``relax.PyExprMutator`` that matches calls and replaces them;
these helpers keep the plumbing in one place.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm


def rewrite_functions(mod: tvm.IRModule, mutator: relax.PyExprMutator, *,
                      eliminate_dead_code: bool = False) -> tvm.IRModule:
    """``mod`` with every Relax function visited by ``mutator``.

    With ``eliminate_dead_code``, bindings the rewrite left unused (the ops it replaced) are
    removed.
    """
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    out = mutator.builder_.get()
    return relax.transform.DeadCodeElimination()(out) if eliminate_dead_code else out


def single_use_vars(func: relax.Function) -> set[relax.Var]:
    """The variables of ``func`` that exactly one binding reads (and the output does not)."""
    counts: dict[relax.Var, int] = {}
    body = func.body
    values = [binding.value for block in body.blocks for binding in block.bindings]
    for value in [*values, body.body]:
        for var in relax.analysis.free_vars(value):
            counts[var] = counts.get(var, 0) + 1
    outputs = set(relax.analysis.free_vars(body.body))
    return {var for var, n in counts.items() if n == 1 and var not in outputs}


def rewrite_by_op(call: relax.Call, rewrites: dict) -> relax.Expr:
    """``call`` rewritten by the function ``rewrites`` holds for its op, or ``call`` itself
    when there is none or it returns None (the call is not one it takes)."""
    rewrite = rewrites.get(call.op.name) if isinstance(call.op, tvm.ir.Op) else None
    rewritten = rewrite(call) if rewrite is not None else None
    return call if rewritten is None else rewritten


def bound_value(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.Expr:
    """The expression ``expr`` stands for, following variable bindings."""
    while isinstance(expr, relax.Var):
        value = mutator.lookup_binding(expr)
        if value is None:
            return expr
        expr = value
    return expr


def is_op(expr: relax.Expr, name: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator ``name``."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
        expr.op.name == name


def is_static_tensor(ty, dtypes: tuple[str, ...], min_ndim: int = 2) -> bool:
    """Whether ``ty`` is a tensor type of one of ``dtypes`` with a known, static shape."""
    return (isinstance(ty, relax.TensorType) and str(ty.dtype) in dtypes
            and ty.shape is not None and ty.ndim >= min_ndim
            and all(isinstance(d, IntImm) for d in ty.shape.values))


def static_shape(expr_or_ty) -> tuple[int, ...] | None:
    """The static shape of a tensor expression (or of its type), else None."""
    ty = getattr(expr_or_ty, "ty", expr_or_ty)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = getattr(ty.shape, "values", None)
    if dims is None or not all(isinstance(d, IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def constant_value(mutator: relax.PyExprMutator, expr: relax.Expr) -> np.ndarray | None:
    """The numpy value of ``expr`` if it is a constant, a cast of one, or an integer sum or
    difference of such.

    (FoldConstant leaves ``astype(const)`` and ``const - astype(const)`` of zero points
    unfolded.) None otherwise, or when an integer result would not fit its dtype.
    """
    expr = bound_value(mutator, expr)
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    if is_op(expr, "relax.astype"):
        value = constant_value(mutator, expr.args[0])
        return None if value is None else value.astype(str(expr.ty.dtype))
    integer = isinstance(expr, relax.Call) and "int" in str(getattr(expr.ty, "dtype", ""))
    for name, combine in (("relax.subtract", np.subtract), ("relax.add", np.add)):
        if integer and is_op(expr, name):
            a, b = (constant_value(mutator, arg) for arg in expr.args)
            if a is None or b is None:
                return None
            exact = combine(a.astype(np.int64), b.astype(np.int64))
            result = exact.astype(str(expr.ty.dtype))
            return result if np.array_equal(result, exact) else None
    return None


class TargetMutator(relax.PyExprMutator):
    """A rewrite for one target: the mutators of the passes that depend on the CPU's kernels
    derive from it (and are decorated with ``relax.expr_functor.mutator`` themselves)."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.target = target


class TargetPass:
    """Base of the module passes that run one :class:`TargetMutator` over every Relax function
    when the target has the kernels the rewrite targets.

    A subclass (decorated with ``tvm.transform.module_pass``) sets ``mutator`` (the mutator
    class) and ``needs`` (``target -> bool``).
    """

    mutator: type
    needs = staticmethod(lambda target: True)

    def __init__(self, target: tvm.target.Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.needs(self.target):
            return mod
        return rewrite_functions(mod, self.mutator(mod, self.target), eliminate_dead_code=True)
