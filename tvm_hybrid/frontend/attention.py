"""ONNX's ``Attention`` (opset 23) as the Relax ops ``FuseAttention`` fuses.

TVM 0.27's importer looks converters up by op name only, and its ``Attention`` is the
``com.microsoft`` contrib op (input, packed QKV weights, bias, ``num_heads``): a standard
``Attention`` node would be misread by it. This converter keeps the contrib op's conversion for
nodes that carry ``num_heads`` and converts the standard op::

    Q, K, V: [b, h, s, d], or [b, s, h * d] with q_num_heads / kv_num_heads
    K, V = concat(past, K / V) along the sequence        (past_key, past_value)
    K, V = heads repeated when kv_num_heads < q_num_heads  (grouped-query attention)
    S    = Q @ K^T * scale                    (scale: the attribute or 1 / sqrt(d))
    S    = where(keep, S, -inf)               (a bool attn_mask and/or is_causal)
    S    = S + attn_mask                      (a float attn_mask)
    Y    = softmax(S) @ V                     ([b, s, h * d] again for 3-d inputs)

so the head split and merge are the ``reshape`` + ``permute_dims`` the fused kernel reads
through. Outputs ``present_key`` / ``present_value`` are the concatenated ``K`` / ``V``.
Unsupported, with an error naming the node: ``softcap``, the ``qk_matmul_output`` output,
``softmax_precision`` other than float, dynamic shapes.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import Attention as _ContribAttention
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError

#: ONNX TensorProto FLOAT: the one ``softmax_precision`` the conversion honours (fp32).
_FLOAT = 1


def _dims(expr: relax.Expr, what: str, node: str) -> list[int]:
    shape = expr.ty.shape
    dims = list(shape.values) if shape is not None and hasattr(shape, "values") else None
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        raise UnsupportedModelError(f"{node}: Attention needs a static shape for {what} (got "
                                    f"{dims}); pass input_shapes to compile")
    return [int(d) for d in dims]


def _heads_first(bb, x: relax.Expr, heads: int | None, what: str, node: str) -> relax.Expr:
    """``[b, h, s, d]`` of a 4-d input, or of a 3-d ``[b, s, h * d]`` split into ``heads``."""
    dims = _dims(x, what, node)
    if len(dims) == 4:
        return x
    if len(dims) != 3 or not heads or dims[2] % heads:
        raise UnsupportedModelError(f"{node}: Attention's {what} of shape {dims} needs rank 4, "
                                    f"or rank 3 with a head count dividing {dims[-1:]}")
    b, s, hidden = dims
    split = bb.emit(relax.op.reshape(x, (b, s, heads, hidden // heads)))
    return bb.emit(relax.op.permute_dims(split, [0, 2, 1, 3]))


class Attention(OnnxOpConverter):
    """ONNX ``Attention`` (opset 23) and, with ``num_heads``, the ``com.microsoft`` op."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "num_heads" in attr:
            return _ContribAttention._impl_v1(bb, inputs, attr, params)
        custom = attr.get("tvm_custom", {})
        node = f"Attention node {custom.get('name', '')!r}"
        if float(attr.get("softcap", 0.0)) != 0.0:
            raise UnsupportedModelError(f"{node}: softcap is not supported")
        if int(attr.get("softmax_precision", _FLOAT)) != _FLOAT:
            raise UnsupportedModelError(f"{node}: softmax_precision other than float is not "
                                        "supported")
        outputs = int(custom.get("num_outputs", 1))
        if outputs > 3:
            raise UnsupportedModelError(f"{node}: the qk_matmul_output output is not supported")
        inputs = list(inputs) + [None] * (6 - len(inputs))
        q_in, k_in, v_in, mask, past_key, past_value = inputs[:6]
        rank = len(_dims(q_in, "Q", node))
        q_heads, kv_heads = attr.get("q_num_heads"), attr.get("kv_num_heads")
        q = _heads_first(bb, q_in, q_heads, "Q", node)
        k = _heads_first(bb, k_in, kv_heads, "K", node)
        v = _heads_first(bb, v_in, kv_heads, "V", node)
        if past_key is not None:
            k = bb.emit(relax.op.concat([past_key, k], axis=2))
        if past_value is not None:
            v = bb.emit(relax.op.concat([past_value, v], axis=2))
        present = [k, v]
        b, hq, sq, d = _dims(q, "Q", node)
        _, hkv, skv, _ = _dims(k, "K", node)
        if hq != hkv:
            if hkv == 0 or hq % hkv:
                raise UnsupportedModelError(f"{node}: {hq} query heads cannot share {hkv} "
                                            "key/value heads")
            k = bb.emit(relax.op.repeat(k, hq // hkv, axis=1))
            v = bb.emit(relax.op.repeat(v, hq // hkv, axis=1))
        scale = float(attr["scale"]) if "scale" in attr else 1.0 / math.sqrt(d)
        scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
        scores = bb.emit(relax.op.multiply(scores, relax.const(scale, "float32")))
        keep = None
        if int(attr.get("is_causal", 0)):
            # Upper-left aligned: query i sees keys 0..i.
            keep = relax.const(np.tril(np.ones((sq, skv), bool)))
        additive = None
        if mask is not None:
            if str(mask.ty.dtype) == "bool":
                keep = mask if keep is None else bb.emit(relax.op.logical_and(mask, keep))
            else:
                additive = mask
        if keep is not None:
            scores = bb.emit(relax.op.where(keep, scores,
                                            relax.const(-np.inf, "float32")))
        if additive is not None:
            scores = bb.emit(relax.op.add(scores, additive))
        probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
        y = bb.emit(relax.op.matmul(probs, v))
        if rank == 3:
            merged = bb.emit(relax.op.permute_dims(y, [0, 2, 1, 3]))
            y = bb.emit(relax.op.reshape(merged, (b, sq, hq * _dims(y, "V", node)[-1])))
        if outputs == 1:
            return y
        return relax.Tuple([y, *present][:outputs])


CONVERTERS = {"Attention": Attention}
