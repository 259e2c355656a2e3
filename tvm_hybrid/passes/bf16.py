"""``PrepackBF16``: GEMMs with constant weights to the AVX512-BF16 microkernel.

Two cases, both computed by ``vdpbf16ps`` (bf16 products, fp32 accumulation):

* bf16 models: ``matmul(x_bf16, W_bf16)`` with a constant ``W``;
* the opt-in ``precision="bf16"`` mode for fp32 models (like OpenVINO's inference precision
  hint): ``matmul(x_fp32, W_fp32)`` with a constant ``W`` rounds ``W`` to bf16 at compile time
  and ``x`` to bf16 at run time (round to nearest even); inputs and outputs stay fp32.

``W`` is stored packed for the microkernel, ``W_packed[N_pad / nr, K / 2, nr, 2]`` (``K`` in
pairs, zero-padded to even; ``N`` zero-padded and sliced off inside the kernel). Rounding both
operands to bf16 (8 significant bits) gives a relative error of about ``2**-8`` per product;
the sums are exact fp32, so a GEMM's error relative to its output scale is typically
``1e-3``-``1e-2``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax, te
from tvm.target import Target

from ..heuristics import panel_width
from ..microkernels import microkernels_for
from .prepack import pack_weight_grouped
from .relax_rewrite import bound_value, is_static_tensor, rewrite_functions

BF16_PACKED_MATMUL = "hybrid_bf16_packed_matmul"


def pack_weight_bf16(weight: np.ndarray, nr: int) -> np.ndarray:
    """``W[K, N]`` to bf16 ``W_packed[ceil(N / nr), ceil(K / 2), nr, 2]`` (zero-padded)."""
    return pack_weight_grouped(weight, nr, 2, ml_dtypes.bfloat16)


def bf16_packed_matmul(x: te.Tensor, packed: te.Tensor, n: int, out_dtype: str) -> te.Tensor:
    """``x[..., M, K] (bf16) @ W (bf16, packed in pairs)``, accumulated in fp32."""
    panels, pairs, nr, _ = (int(d) for d in packed.shape)
    batch = tuple(x.shape[:-1])
    k = te.reduce_axis((0, pairs * 2), name="k")
    acc = te.compute(
        (*batch, panels * nr),
        lambda *idx: te.sum(
            x[(*idx[:-1], k)].astype("float32")
            * packed[idx[-1] // nr, k // 2, idx[-1] % nr, k % 2].astype("float32"),
            axis=k,
        ),
        name="bf16_packed_matmul",
    )
    if panels * nr == n and out_dtype == "float32":
        return acc
    return te.compute((*batch, n), lambda *idx: acc[idx].astype(out_dtype), name="unpad")


@tvm.transform.module_pass(opt_level=0, name="PrepackBF16")
class PrepackBF16:
    """Rewrite GEMMs with constant weights to the bf16 microkernel (see the module docstring).

    Parameters
    ----------
    target
        The target; nothing changes unless it has AVX512-BF16.
    convert_fp32
        Also take fp32 GEMMs (the ``precision="bf16"`` mode).
    """

    def __init__(self, target: Target, convert_fp32: bool = False):
        self.target = target
        self.convert_fp32 = convert_fp32

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not microkernels_for(self.target, "bfloat16"):
            return mod
        return rewrite_functions(mod, _Rewriter(mod, self.target, self.convert_fp32))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target, convert_fp32: bool):
        super().__init__(mod)
        self.target = target
        self.dtypes = ("bfloat16", "float32") if convert_fp32 else ("bfloat16",)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul"):
            return call
        x, weight = call.args
        weight = bound_value(self, weight)
        if not isinstance(weight, tvm.ir.GenericConst):
            return call
        w_ty, x_ty = weight.ty, x.ty
        dtype = str(w_ty.dtype)
        if dtype not in self.dtypes or w_ty.ndim != 2 or not is_static_tensor(x_ty, (dtype,)):
            return call
        array = weight.value.numpy()
        k, n = array.shape
        nr = panel_width(self.target, "bfloat16", int(x_ty.shape.values[-2]), n, k + k % 2)
        if nr is None:
            return call
        if dtype == "float32":
            x = self.builder_.emit(relax.op.astype(x, "bfloat16"))
        if k % 2:
            x = self.builder_.emit(relax.op.nn.pad(x, [0, 0] * (x_ty.ndim - 1) + [0, 1]))
        out_dtype = str(call.ty.dtype)
        packed = relax.const(pack_weight_bf16(array, nr))
        return self.builder_.call_te(bf16_packed_matmul, x, packed, int(n), out_dtype,
                                     primfunc_name_hint=BF16_PACKED_MATMUL)
