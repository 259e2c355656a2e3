"""``IntegerGemmToVNNI``: integer matmuls with constant 8-bit weights to the u8 x s8 VNNI GEMM.

TVM imports ONNX ``MatMulInteger`` (and the integer core of quantized graphs) as an int32
``matmul(astype(x, int32) - x_zp, W32)``, where phase 1 has already folded the weight side,
``W32 = int32(W) - w_zp``, into a constant. When every value of ``W32`` fits in ``s8``, that is
rewritten to a GEMM on 8-bit operands the VNNI microkernel computes exactly:

    y[i, j] = sum_k (x[i, k] - zp) * W32[k, j]
            = sum_k xu[i, k] * W32[k, j] - zp_u * colsum(W32)[j]

``xu`` is ``x`` itself for ``u8`` activations, or ``x + 128`` (as ``u8``) for ``s8`` activations
with ``zp_u = zp + 128``: VNNI multiplies unsigned by signed bytes. The compensation
``zp_u * colsum(W32)`` is a constant computed here with numpy; ``W32`` is stored packed for the
microkernel, ``W_packed[N_pad / nr, K / 4, nr, 4]`` (``K`` in groups of 4, ``N`` zero-padded),
and the padded columns are sliced off inside the kernel. The result is bit-exact.

Shapes the microkernel cannot take (``K % 4 != 0``), weights outside ``s8`` and non-constant
operands keep TVM's int32 matmul.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.ir.prim.expr import IntImm
from tvm.target import Target

from ..microkernels import microkernels_for, panel_for

INT8_PACKED_MATMUL = "hybrid_int8_packed_matmul"


def pack_weight_vnni(weight: np.ndarray, nr: int) -> np.ndarray:
    """``W[K, N]`` (s8 values) to ``W_packed[ceil(N / nr), K / 4, nr, 4]`` as ``int8``."""
    k, n = weight.shape
    if k % 4:
        raise ValueError(f"VNNI packing needs K % 4 == 0, got K = {k}")
    n_pad = -(-n // nr) * nr
    padded = np.zeros((k, n_pad), np.int8)
    padded[:, :n] = weight
    return np.ascontiguousarray(padded.reshape(k // 4, 4, n_pad // nr, nr).transpose(2, 0, 3, 1))


def int8_packed_matmul(x: te.Tensor, packed: te.Tensor, compensation: te.Tensor,
                       n: int) -> te.Tensor:
    """``x[..., M, K] (u8) @ W (s8, VNNI-packed) - compensation[N]``, in int32."""
    panels, groups, nr, _ = (int(d) for d in packed.shape)
    batch = tuple(x.shape[:-1])
    k = te.reduce_axis((0, groups * 4), name="k")
    acc = te.compute(
        (*batch, panels * nr),
        lambda *idx: te.sum(
            x[(*idx[:-1], k)].astype("int32")
            * packed[idx[-1] // nr, k // 4, idx[-1] % nr, k % 4].astype("int32"),
            axis=k,
        ),
        name="int8_packed_matmul",
    )
    return te.compute((*batch, n), lambda *idx: acc[idx] - compensation[idx[-1]],
                      name="compensate")


@tvm.transform.module_pass(opt_level=0, name="IntegerGemmToVNNI")
class IntegerGemmToVNNI:
    """Rewrite int32 matmuls of 8-bit data with constant 8-bit weights to the VNNI GEMM."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not microkernels_for(self.target, "uint8"):
            return mod
        rewriter = _Rewriter(mod, self.target)
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target):
        super().__init__(mod)
        self.target = target

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul"):
            return call
        lhs, weight = call.args
        matched = self._match(lhs, weight)
        if matched is None:
            return call
        x, zero_point, w32 = matched
        nr = panel_for(self.target, "uint8", int(x.ty.shape.values[-2]), *w32.shape[::-1])
        if nr is None:
            return call
        if str(x.ty.dtype) == "int8":  # VNNI takes unsigned A: shift by 128
            shifted = relax.op.add(relax.op.astype(x, "int32"), relax.const(128, "int32"))
            x = self.builder_.emit(relax.op.astype(shifted, "uint8"))
            zero_point += 128
        columns = w32.astype(np.int64).sum(axis=0)
        compensation = zero_point * columns
        if np.abs(compensation).max(initial=0) >= 2**31:
            return call
        packed = relax.const(pack_weight_vnni(w32.astype(np.int8), nr))
        comp = relax.const(compensation.astype(np.int32))
        return self.builder_.call_te(int8_packed_matmul, x, packed, comp, int(w32.shape[1]),
                                     primfunc_name_hint=INT8_PACKED_MATMUL)

    def _match(self, lhs: relax.Expr, weight: relax.Expr):
        """``(x, zero_point, W32)`` when the matmul is an 8-bit GEMM we can take, else None."""
        w32 = self._constant(weight)
        if w32 is None or w32.dtype != np.int32 or w32.ndim != 2:
            return None
        if w32.shape[0] % 4 or w32.min(initial=0) < -128 or w32.max(initial=0) > 127:
            return None
        zero_point = 0
        expr = self._bound(lhs)
        if _is_op(expr, "relax.subtract"):
            zp = self._constant(expr.args[1])
            if zp is None or zp.ndim != 0:
                return None
            zero_point = int(zp)
            expr = self._bound(expr.args[0])
        if not _is_op(expr, "relax.astype") or str(expr.ty.dtype) != "int32":
            return None
        x = expr.args[0]
        x_ty = x.ty
        if not isinstance(x_ty, relax.TensorType) or str(x_ty.dtype) not in ("uint8", "int8"):
            return None
        if x_ty.shape is None or x_ty.ndim < 2:
            return None
        if not all(isinstance(d, IntImm) for d in x_ty.shape.values):
            return None
        if int(x_ty.shape.values[-1]) != w32.shape[0]:
            return None
        return x, zero_point, w32

    def _constant(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of ``expr`` if it is a constant, or casts/sums/differences of constants.

        (FoldConstant leaves ``astype(const)`` and ``const - astype(const)`` of the zero points
        unfolded.)
        """
        expr = self._bound(expr)
        if isinstance(expr, tvm.ir.GenericConst):
            return expr.value.numpy()
        if _is_op(expr, "relax.astype"):
            value = self._constant(expr.args[0])
            return None if value is None else value.astype(str(expr.ty.dtype))
        for name, combine in (("relax.subtract", np.subtract), ("relax.add", np.add)):
            if _is_op(expr, name):
                a, b = (self._constant(arg) for arg in expr.args)
                if a is None or b is None:
                    return None
                exact = combine(a.astype(np.int64), b.astype(np.int64))
                result = exact.astype(str(expr.ty.dtype))
                return result if np.array_equal(result, exact) else None
        return None

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if value is None:
                return expr
            expr = value
        return expr


def _is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
        expr.op.name == name
