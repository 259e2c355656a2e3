"""ONNX's ``Attention`` (opset 23) as the Relax ops ``FuseAttention`` fuses.

TVM 0.27's importer looks converters up by op name only, and its ``Attention`` is the
``com.microsoft`` contrib op (input, packed QKV weights, bias, ``num_heads``): a standard
``Attention`` node would be misread by it. This converter keeps the contrib op's conversion for
nodes that carry ``num_heads`` and converts the standard op::

    Q, K, V: [b, h, s, d], or [b, s, h * d] with q_num_heads / kv_num_heads
    K, V = concat(past, K / V) along the sequence        (past_key, past_value)
    K, V = heads repeated when kv_num_heads < q_num_heads  (grouped-query attention)
    S    = Q @ K^T * scale                    (scale: the attribute or 1 / sqrt(d))
    S    = softcap * tanh(S / softcap)        (softcap; the attention then stays unfused)
    S    = where(keep, S, -inf)               (a bool attn_mask, is_causal, the sliding
                                               window, nonpad_kv_seqlen's valid keys)
    S    = S + attn_mask                      (a float attn_mask)
    Y    = softmax(S) @ V                     ([b, s, h * d] again for 3-d inputs)
    Y    = where(the query sees some key, Y, 0)

as the specification and ONNX's reference have it: ``is_causal`` and the window are aligned to
the end of the cache (query ``i`` sees key ``j <= i + past``), a mask shorter than the keys is
padded with False or -inf, and a query that sees no key gets zeros, not NaN (decided on the
masks; no such step when only a constant mask that leaves every query a key applies).
float16 and bfloat16 inputs are computed in float32 (the fused kernel's type) and the
outputs cast back; ``present_key`` and ``present_value`` keep the inputs' type. The
head split and merge are the ``reshape`` + ``permute_dims`` the fused kernel reads through.
Outputs ``present_key`` / ``present_value`` are the concatenated ``K`` / ``V``;
``qk_matmul_output`` is what ``qk_matmul_output_mode`` names: ``Q @ K^T * scale`` (0), after
the soft cap (1), with the masks' bias (2), the probabilities with the rows of queries that see
no key zeroed (3); the attention then stays unfused (its scores are an output).
``softmax_precision`` double computes the softmax in float64; float, float16 and bfloat16 in
float32 (for the last two more precisely than asked, which the specification's cast to them
would round).
Unsupported, with an error naming the node: dynamic shapes, ``nonpad_kv_seqlen`` with
``past_key``, other ``softmax_precision`` values and input types.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import Attention as _ContribAttention
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError
from .static_dims import static_dims

#: ``softmax_precision`` values (ONNX TensorProto types) and the softmax's dtype for each.
_SOFTMAX_DTYPES = {1: "float32", 10: "float32", 11: "float64", 16: "float32"}
#: Input types computed in float32 (their outputs cast back).
_WIDENED = ("float16", "bfloat16")


def _dims(expr: relax.Expr, what: str, node: str) -> list[int]:
    return static_dims(expr, f"Attention's {what}", node)


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


def _keys_padded(bb, mask: relax.Expr, skv: int, node: str) -> relax.Expr:
    """``mask`` padded to ``skv`` keys (the specification: with False, or -inf)."""
    dims = _dims(mask, "attn_mask", node)
    if dims[-1] == skv:
        return mask
    if dims[-1] > skv:
        raise UnsupportedModelError(f"{node}: attn_mask of shape {dims} has more keys than "
                                    f"the {skv} of K")
    boolean = str(mask.ty.dtype) == "bool"
    fill = np.full((*dims[:-1], skv - dims[-1]), False if boolean else -np.inf,
                   str(mask.ty.dtype))
    return bb.emit(relax.op.concat([mask, relax.const(fill, str(fill.dtype))], axis=-1))


def _position_mask(bb, attr, sq: int, skv: int, past_key, nonpad, node: str):
    """The keys each query may see by position: None (all), a numpy bool ``[sq, skv]``, or
    a bool tensor. ``is_causal`` and the sliding window (``left_window_size``,
    ``right_window_size``) are aligned to the end of the cache: query ``i`` sits at
    ``i + offset``, the offset being ``past_key``'s length. With ``nonpad_kv_seqlen`` (an
    external cache of ``n[b]`` valid keys) only the keys below ``n[b]`` are seen and the
    offset is ``n[b] - sq``: the mask is then a ``[b, 1, sq, skv]`` tensor computed at run
    time."""
    causal = bool(int(attr.get("is_causal", 0)))
    left, right = int(attr.get("left_window_size", -1)), int(attr.get("right_window_size", -1))
    # diff[i, j] = (i + offset) - j: causal keeps diff >= 0, the window -right <= diff <= left.
    rel = np.arange(sq)[:, None] - np.arange(skv)[None, :]
    if nonpad is None:
        offset = _dims(past_key, "past_key", node)[2] if past_key is not None else 0
        diff = rel + offset
        keep = np.ones((sq, skv), bool)
        if causal:
            keep &= diff >= 0
        if left >= 0:
            keep &= diff <= left
        if right >= 0:
            keep &= -diff <= right
        return None if keep.all() else keep
    # n[b] as [b, 1, 1, 1]: diff = rel + n[b] - sq; valid keys j < n[b].
    lengths = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(nonpad, "int64")),
                                       (-1, 1, 1, 1)))
    diff = bb.emit(relax.op.add(relax.const(rel[None, None] - sq, "int64"), lengths))
    keep = bb.emit(relax.op.less(relax.const(np.arange(skv), "int64"), lengths))
    bounds = [(causal, relax.op.greater_equal, 0), (left >= 0, relax.op.less_equal, left),
              (right >= 0, relax.op.greater_equal, -right)]
    for wanted, compare, bound in bounds:
        if wanted:
            within = bb.emit(compare(diff, relax.const(bound, "int64")))
            keep = bb.emit(relax.op.logical_and(keep, within))
    return keep


def _sees_some_key(bb, keep, additive, dtype: str) -> relax.Expr:
    """Whether each query sees some key (a bool ``[.., sq, 1]``), decided on the masks ``keep``
    (bool) and ``additive`` as ONNX's reference does: the rows of queries that see none are
    zeros in the outputs (the softmax would give NaN)."""
    # Whether each key is seen, as 0 or 1 (a max over -inf alone would give TVM's reduction
    # start, the lowest finite float, not -inf).
    seen = keep
    if additive is not None:
        finite = bb.emit(relax.op.greater(additive, relax.const(-np.inf, dtype)))
        seen = finite if seen is None else bb.emit(relax.op.logical_and(seen, finite))
    any_key = bb.emit(relax.op.max(bb.emit(relax.op.astype(seen, "float32")), axis=-1,
                                   keepdims=True))
    return bb.emit(relax.op.greater(any_key, relax.const(0.5, "float32")))


class Attention(OnnxOpConverter):
    """ONNX ``Attention`` (opset 23) and, with ``num_heads``, the ``com.microsoft`` op."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "num_heads" in attr:
            return _ContribAttention._impl_v1(bb, inputs, attr, params)
        custom = attr.get("tvm_custom", {})
        node = f"Attention node {custom.get('name', '')!r}"
        precision = int(attr.get("softmax_precision", 1))
        if precision not in _SOFTMAX_DTYPES:
            raise UnsupportedModelError(f"{node}: softmax_precision {precision} is not one of "
                                        "the specification's (float, float16, double, "
                                        "bfloat16)")
        mode = int(attr.get("qk_matmul_output_mode", 0))
        if mode not in (0, 1, 2, 3):
            raise UnsupportedModelError(f"{node}: qk_matmul_output_mode {mode} is not 0-3")
        outputs = int(custom.get("num_outputs", 1))
        want_qk = outputs > 3
        inputs = list(inputs) + [None] * (7 - len(inputs))
        q_in, k_in, v_in, mask, past_key, past_value, nonpad = inputs[:7]
        if nonpad is not None and past_key is not None:
            raise UnsupportedModelError(f"{node}: nonpad_kv_seqlen cannot be combined with "
                                        "past_key (the ONNX specification)")
        in_dtype = str(q_in.ty.dtype)
        if in_dtype not in ("float32", "float64", *_WIDENED):
            raise UnsupportedModelError(f"{node}: Attention on {in_dtype} inputs is not "
                                        "supported (float16, bfloat16, float32, float64 are)")
        dtype = "float32" if in_dtype in _WIDENED else in_dtype

        def widened(x):
            if x is None or str(x.ty.dtype) == "bool" or str(x.ty.dtype) == dtype:
                return x
            return bb.emit(relax.op.astype(x, dtype))

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
        q, k, v, mask = widened(q), widened(k), widened(v), widened(mask)
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
        scores = bb.emit(relax.op.multiply(scores, relax.const(scale, dtype)))
        qk_output = scores
        softcap = float(attr.get("softcap", 0.0))
        if softcap > 0.0:  # before the masks, so -inf stays -inf (not fused: tanh in between)
            scaled = bb.emit(relax.op.multiply(scores, relax.const(1.0 / softcap, dtype)))
            scores = bb.emit(relax.op.multiply(bb.emit(relax.op.tanh(scaled)),
                                               relax.const(softcap, dtype)))
            qk_output = scores if mode == 1 else qk_output
        if mask is not None:
            mask = _keys_padded(bb, mask, skv, node)
        keep = _position_mask(bb, attr, sq, skv, past_key, nonpad, node)
        # A query may see no key only under a mask given at run time or a position mask
        # that hides every key from some query.
        guarded = mask is not None or nonpad is not None or (
            isinstance(keep, np.ndarray) and not keep.any(axis=-1).all())
        if isinstance(keep, np.ndarray):
            keep = relax.const(keep)
        additive = None
        if mask is not None:
            if str(mask.ty.dtype) == "bool":
                keep = mask if keep is None else bb.emit(relax.op.logical_and(mask, keep))
            else:
                additive = mask
        if keep is not None:
            scores = bb.emit(relax.op.where(keep, scores, relax.const(-np.inf, dtype)))
        if additive is not None:
            scores = bb.emit(relax.op.add(scores, additive))
        if mode == 2:
            qk_output = scores
        softmax_dtype = _SOFTMAX_DTYPES[precision]
        if softmax_dtype != dtype:
            scores = bb.emit(relax.op.astype(scores, softmax_dtype))
        probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
        if softmax_dtype != dtype:
            probs = bb.emit(relax.op.astype(probs, dtype))
        sees = _sees_some_key(bb, keep, additive, dtype) if guarded else None
        if want_qk and mode == 3:
            qk_output = probs if sees is None else bb.emit(
                relax.op.where(sees, probs, relax.const(0.0, dtype)))
        y = bb.emit(relax.op.matmul(probs, v))
        if sees is not None:
            y = bb.emit(relax.op.where(sees, y, relax.const(0.0, dtype)))
        if rank == 3:
            merged = bb.emit(relax.op.permute_dims(y, [0, 2, 1, 3]))
            y = bb.emit(relax.op.reshape(merged, (b, sq, hq * _dims(y, "V", node)[-1])))
        if dtype != in_dtype:
            y = bb.emit(relax.op.astype(y, in_dtype))
            if want_qk:
                qk_output = bb.emit(relax.op.astype(qk_output, in_dtype))
        if outputs == 1:
            return y
        return relax.Tuple([y, *present, qk_output][:outputs])


CONVERTERS = {"Attention": Attention}
