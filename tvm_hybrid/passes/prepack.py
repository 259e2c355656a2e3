"""``PrepackConstantWeights``: GEMMs with constant weights to the packed GEMM, at compile time.

``matmul(x, W)`` with a constant ``W[K, N]`` (transposed weights arrive here already folded into
constants by phase 1's FoldConstant, so ``Gemm(transB=1)`` and ``linear`` are covered) becomes a
packed GEMM (``packed_gemm.py``): the weights are packed with numpy in the layout of the kernel
chosen for the GEMM and embedded as the new constant, ``N`` zero-padded to whole panels and
sliced off inside the same kernel. Nothing is repacked at run time, no ``transform_params`` call
is needed, and the compiled model takes exactly the ONNX model's inputs.

fp32 weights take the fp32 kernels; bf16 weights (bf16 models), and fp32 weights in the
``precision="bf16"`` mode, take the bf16 front-end (``bf16.py``). Integer GEMMs have their own
front-end (``integer_gemm.py``), which runs first.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.target import Target

from .bf16 import emit_bf16_gemm
from .conv_computes import IM2COL, IM2COL_ARGS, im2col_padding_rows
from .packed_gemm import emit_packed_gemm
from .relax_rewrite import bound_value, is_op, is_static_tensor, rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="PrepackConstantWeights")
class PrepackConstantWeights:
    """Rewrite ``matmul(x, constant W)`` to a packed GEMM on a constant packed at compile time.

    Parameters
    ----------
    target
        The CPU target: its kernels decide the layout.
    bf16
        The ``precision="bf16"`` mode: fp32 GEMMs compute in bf16 too.
    """

    def __init__(self, target: Target, bf16: bool = False):
        self.target = target
        self.bf16 = bf16

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod, self.target, self.bf16),
                                 eliminate_dead_code=True)


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target, bf16: bool):
        super().__init__(mod)
        self.target = target
        self.bf16 = bf16

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.matmul"):
            return call
        x, weight = call.args
        weight = bound_value(self, weight)
        if not isinstance(weight, tvm.ir.GenericConst) or weight.ty.ndim != 2:
            return call
        dtype = str(weight.ty.dtype)
        if dtype not in ("float32", "bfloat16") or not is_static_tensor(x.ty, (dtype,)):
            return call
        array = weight.value.numpy()
        # An im2col's output (a hand-written kernel) gets padded rows only from the im2col
        # itself (emit_packed_gemm); other kernels' outputs keep their rows.
        producer = bound_value(self, x)
        pad_rows = not is_op(producer, "relax.call_tir")
        row_padder = None if pad_rows else self._im2col_padder(producer)
        if dtype == "bfloat16" or self.bf16:
            gemm = emit_bf16_gemm(self.builder_, self.target, x, array, str(call.ty.dtype),
                                  pad_rows)
            if gemm is not None or dtype == "bfloat16":
                return call if gemm is None else gemm
        gemm = emit_packed_gemm(self.builder_, self.target, x, array, weight_dtype="float32",
                                acc_dtype="float32", out_dtype="float32", pad_rows=pad_rows,
                                row_padder=row_padder)
        return call if gemm is None else gemm

    def _im2col_padder(self, producer: relax.Call) -> Callable[[int], relax.Expr] | None:
        """The function emitting ``producer``, an :func:`~.conv_computes.im2col` call, again
        with zero rows appended.

        Returns
        -------
        ``emit_packed_gemm``'s ``row_padder`` (number of rows -> the padded call), or None
        when ``producer`` is not a call of an im2col that can be re-emitted.
        """
        gvar, args = producer.args[0], producer.args[1]
        func = self.builder_.get()[gvar]
        if IM2COL_ARGS not in (func.attrs or {}):
            return None
        rows, cols = (int(d) for d in producer.ty.shape.values)
        dtype = str(producer.ty.dtype)

        def pad(extra_rows: int) -> relax.Expr:
            padded = self.builder_.add_func(im2col_padding_rows(func, extra_rows), IM2COL)
            return self.builder_.emit(relax.call_tir(padded, args, relax.TensorType(
                (rows + extra_rows, cols), dtype)))

        return pad
