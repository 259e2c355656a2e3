"""``PrepackConstantWeights``: constant GEMM weights to the microkernel's layout, at compile time.

``matmul(x, W)`` with a constant ``W[K, N]`` (transposed weights arrive here already folded into
constants by phase 1's FoldConstant, so ``Gemm(transB=1)`` and ``linear`` are covered) becomes a
call to a packed GEMM reading ``W_packed[N_pad / nr, K, nr]``: for each block of ``nr`` output
columns, the ``K x nr`` panel the microkernel streams, contiguous (``nr`` is the panel width of
the microkernel the heuristic picks for the GEMM's ``M``, ``heuristics.panel_width``). ``N`` is
zero-padded to a
multiple of ``nr`` and the padded columns are dropped by a slice inside the same kernel, so every
tile is full. The packed array is computed here with numpy and embedded as the new constant:
nothing is repacked at run time, no ``transform_params`` call is needed, and the compiled model
takes exactly the ONNX model's inputs.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.ir.prim.expr import IntImm
from tvm.target import Target

from ..heuristics import panel_width
from .relax_rewrite import rewrite_functions

PACKED_MATMUL = "hybrid_packed_matmul"


def pack_weight(weight: np.ndarray, nr: int) -> np.ndarray:
    """``W[K, N]`` to ``W_packed[ceil(N / nr), K, nr]`` (zero-padded columns)."""
    k, n = weight.shape
    n_pad = -(-n // nr) * nr
    padded = np.zeros((k, n_pad), weight.dtype)
    padded[:, :n] = weight
    return np.ascontiguousarray(padded.reshape(k, n_pad // nr, nr).transpose(1, 0, 2))


def pack_weight_grouped(weight: np.ndarray, nr: int, group: int, dtype) -> np.ndarray:
    """``W[K, N]`` to ``W_packed[ceil(N / nr), ceil(K / group), nr, group]`` in ``dtype``.

    The layout of microkernels that consume ``group`` consecutive ``k`` per 32-bit lane (VNNI
    int8: 4, bf16: 2). ``K`` and ``N`` are zero-padded.
    """
    k, n = weight.shape
    k_pad, n_pad = -(-k // group) * group, -(-n // nr) * nr
    padded = np.zeros((k_pad, n_pad), dtype)
    padded[:k, :n] = weight.astype(dtype)
    return np.ascontiguousarray(
        padded.reshape(k_pad // group, group, n_pad // nr, nr).transpose(2, 0, 3, 1))


def packed_matmul(x: te.Tensor, packed: te.Tensor, n: int) -> te.Tensor:
    """``x[..., M, K] @ W`` with ``W`` given packed; the output has ``n`` columns."""
    panels, k_len, nr = (int(d) for d in packed.shape)
    batch = tuple(x.shape[:-1])
    k = te.reduce_axis((0, k_len), name="k")
    out = te.compute(
        (*batch, panels * nr),
        lambda *idx: te.sum(x[(*idx[:-1], k)] * packed[idx[-1] // nr, k, idx[-1] % nr], axis=k),
        name="packed_matmul",
    )
    if panels * nr == n:
        return out
    return te.compute((*batch, n), lambda *idx: out[idx], name="unpad")


@tvm.transform.module_pass(opt_level=0, name="PrepackConstantWeights")
class PrepackConstantWeights:
    """Rewrite ``matmul(x, constant W)`` to a packed GEMM on a constant packed at compile time."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod, self.target))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target):
        super().__init__(mod)
        self.target = target

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul"):
            return call
        x, weight = call.args
        if not _is_packable(x, weight):
            return call
        array = weight.value.numpy()
        k, n = (int(d) for d in array.shape)
        nr = panel_width(self.target, "float32", int(x.ty.shape.values[-2]), n, k)
        if nr is None:
            return call
        packed = relax.const(pack_weight(array, nr))
        return self.builder_.call_te(packed_matmul, x, packed, n, primfunc_name_hint=PACKED_MATMUL)


def _is_packable(x: relax.Expr, weight: relax.Expr) -> bool:
    if not isinstance(weight, tvm.ir.GenericConst):
        return False
    w_ty, x_ty = weight.ty, x.ty
    if str(w_ty.dtype) != "float32" or w_ty.ndim != 2:
        return False
    if not isinstance(x_ty, relax.TensorType) or str(x_ty.dtype) != "float32":
        return False
    if x_ty.shape is None or x_ty.ndim < 2:
        return False
    return all(isinstance(d, IntImm) for d in x_ty.shape.values)
