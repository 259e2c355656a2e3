"""``Sum``, ``Max``, ``Min`` and ``Mean`` of several tensors as chains of binary Relax ops.

TVM 0.27 imports them as ``broadcast_to`` of every input, ``stack`` and a reduction over the new
axis: a rank-(r+1) copy of all inputs that layout conversion cannot carry (``ConvertLayout``
fails on the stacked tensor, so a model with a ``Sum`` residual, ResNet's or ShuffleNet's, kept
every convolution in NCHW), and a kernel of its own. Folded pairwise they are the elementwise
ops the epilogue patterns and layout rules know; the order of the additions is the stack's
(first input first), so the values are the same. All-constant inputs keep TVM's conversion
(folded at import).
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter


def _variadic(stock: type[OnnxOpConverter], binary, mean: bool = False) -> type:
    class Variadic(OnnxOpConverter):
        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            if all(isinstance(x, tvm.ir.GenericConst) for x in inputs) or len(inputs) < 2:
                return stock._impl_v1(bb, inputs, attr, params)
            out = functools.reduce(lambda a, b: bb.normalize(binary(a, b)), inputs)
            if mean:
                out = relax.op.divide(out, relax.const(len(inputs), str(out.ty.dtype)))
            return out

    Variadic.__name__ = stock.__name__
    Variadic.__doc__ = f"ONNX ``{stock.__name__}`` as a chain of binary ops."
    return Variadic


CONVERTERS = {
    "Sum": _variadic(onnx_frontend.Sum, relax.op.add),
    "Max": _variadic(onnx_frontend.Max, relax.op.maximum),
    "Min": _variadic(onnx_frontend.Min, relax.op.minimum),
    "Mean": _variadic(onnx_frontend.Mean, relax.op.add, mean=True),
}
