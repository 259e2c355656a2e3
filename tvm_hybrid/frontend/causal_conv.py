"""ONNX ``CausalConvWithState`` (opset 27: Gated DeltaNet, Mamba), which TVM's importer lacks.

A depthwise causal convolution over a carried state, as the specification and ONNX's
reference have it::

    padded        = concat(past_state or zeros[B, C, k - 1], input)   along the length
    output        = conv1d(padded, weight[C, 1, k], bias, groups = C)  (no padding)
    output        = output * sigmoid(output)                          (activation silu/swish)
    present_state = padded[:, :, -(k - 1):]                            (the last k - 1 steps)

float16 and bfloat16 are computed in float32 and cast back.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError
from .static_dims import static_dims


class CausalConvWithState(OnnxOpConverter):
    """ONNX ``CausalConvWithState`` (module docstring)."""

    @classmethod
    def _impl_v27(cls, bb, inputs, attr, params):
        node = f"CausalConvWithState node {attr.get('tvm_custom', {}).get('name', '')!r}"
        inputs = list(inputs) + [None] * (4 - len(inputs))
        x, weight, bias, past = inputs[:4]
        activation = attr.get("activation", b"none")
        activation = activation.decode() if isinstance(activation, bytes) else str(activation)
        if activation not in ("none", "silu", "swish"):
            raise UnsupportedModelError(f"{node}: activation {activation!r} is not one of none, "
                                        "silu, swish")
        batch, channels, _ = static_dims(x, "input", node)
        k = static_dims(weight, "weight", node)[2]
        dtype = str(x.ty.dtype)
        compute = "float32" if dtype in ("float16", "bfloat16") else dtype

        def typed(value):
            return bb.emit(relax.op.astype(value, compute)) if dtype != compute else value

        if past is None:
            past = relax.const(np.zeros((batch, channels, k - 1), dtype if dtype != "bfloat16"
                                        else "float32"))
            past = bb.emit(relax.op.astype(past, dtype)) if dtype == "bfloat16" else past
        padded = bb.emit(relax.op.concat([past, x], axis=2))
        out = bb.emit(relax.op.nn.conv1d(typed(padded), typed(weight), groups=channels))
        if bias is not None:
            out = bb.emit(relax.op.add(out, relax.op.reshape(typed(bias), (1, channels, 1))))
        if activation != "none":
            out = bb.emit(relax.op.multiply(out, relax.op.sigmoid(out)))
        if dtype != compute:
            out = bb.emit(relax.op.astype(out, dtype))
        length = static_dims(padded, "padded input", node)[2]
        present = bb.emit(relax.op.strided_slice(padded, [2], [length - (k - 1)], [length]))
        return relax.Tuple([out, present])


CONVERTERS = {"CausalConvWithState": CausalConvWithState}
