"""ONNX ``LinearAttention`` (opset 27: Gated DeltaNet and other linear-attention layers), which
TVM's importer lacks, as its recurrence unrolled over the (static) tokens.

Per token ``t``, with the state ``S[b, h, d_k, d_v]`` of each key/value head (``past_state``
or zeros), as the specification and ONNX's reference have it::

    S = S * exp(g_t)                            gated, gated_delta (g: per head or per d_k)
    v = beta_t * (v_t - S^T k_t)                delta, gated_delta
    S = S + k_t (x) v                           (outer product)
    o_t = scale * q_t^T S                       each query head reads its key/value head's S

in float32 (16-bit inputs are cast, the outputs cast back). The output is ``[B, T, H_q * d_v]``
and ``present_state`` the last state. The steps are unrolled, so a prefill of more than
:data:`MAX_STEPS` tokens is refused naming the node (decoding, one token a call, is the
common case).
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError
from .static_dims import static_dims

#: The most tokens one node's recurrence is unrolled over.
MAX_STEPS = 128
_RULES = ("linear", "gated", "delta", "gated_delta")


class LinearAttention(OnnxOpConverter):
    """ONNX ``LinearAttention`` (module docstring)."""

    @classmethod
    def _impl_v27(cls, bb, inputs, attr, params):
        node = f"LinearAttention node {attr.get('tvm_custom', {}).get('name', '')!r}"
        inputs = list(inputs) + [None] * (6 - len(inputs))
        query, key, value, past, decay, beta = inputs[:6]
        rule = attr.get("update_rule", b"gated_delta")
        rule = rule.decode() if isinstance(rule, bytes) else str(rule)
        hq, hkv = int(attr.get("q_num_heads", 0)), int(attr.get("kv_num_heads", 0))
        if rule not in _RULES or hq <= 0 or hkv <= 0 or hq % hkv:
            raise UnsupportedModelError(f"{node}: update_rule {rule!r} with {hq} query and "
                                        f"{hkv} key/value heads is not supported")
        gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
        if gated != (decay is not None) or delta != (beta is not None):
            raise UnsupportedModelError(f"{node}: update_rule {rule!r} needs "
                                        f"{'decay ' if gated else ''}{'beta' if delta else ''}"
                                        " and no other of the two")
        b, steps, q_width = static_dims(query, "query", node)
        d_k, d_v = q_width // hq, static_dims(value, "value", node)[2] // hkv
        if steps > MAX_STEPS:
            raise UnsupportedModelError(f"{node}: {steps} tokens; the recurrence is unrolled "
                                        f"for at most {MAX_STEPS} (decode, or prefill in chunks)")
        dtype = str(query.ty.dtype)
        scale = float(attr.get("scale", 0.0)) or 1.0 / math.sqrt(d_k)

        def f32(x):
            return bb.emit(relax.op.astype(x, "float32")) if str(x.ty.dtype) != "float32" else x

        def heads(x, count, width):  # [B, T, H * D] -> [B, H, T, D]
            split = bb.emit(relax.op.reshape(f32(x), (b, steps, count, width)))
            return bb.emit(relax.op.permute_dims(split, [0, 2, 1, 3]))

        def step(x, t):  # [B, H, T, D] -> [B, H, D] at token t
            return bb.emit(relax.op.squeeze(relax.op.strided_slice(x, [2], [t], [t + 1]), [2]))

        q, k, v = heads(query, hq, d_k), heads(key, hkv, d_k), heads(value, hkv, d_v)
        if gated:
            width = static_dims(decay, "decay", node)[2]
            g = heads(decay, hkv, width // hkv)  # [B, H, T, 1 or d_k]
        if delta:
            beta_heads = static_dims(beta, "beta", node)[2]
            bt = heads(beta, beta_heads, 1)  # [B, H or 1, T, 1]
        state = f32(past) if past is not None else relax.const(
            np.zeros((b, hkv, d_k, d_v), "float32"))
        outputs = []
        for t in range(steps):
            k_t, v_t = step(k, t), step(v, t)
            if gated:
                state = bb.emit(relax.op.multiply(
                    state, relax.op.expand_dims(relax.op.exp(step(g, t)), 3)))
            if delta:
                read = bb.emit(relax.op.squeeze(relax.op.matmul(
                    relax.op.expand_dims(k_t, 2), state), [2]))  # S^T k: [B, H, d_v]
                v_t = bb.emit(relax.op.multiply(step(bt, t), relax.op.subtract(v_t, read)))
            state = bb.emit(relax.op.add(state, relax.op.multiply(
                relax.op.expand_dims(k_t, 3), relax.op.expand_dims(v_t, 2))))
            shared = state if hq == hkv else bb.emit(relax.op.repeat(state, hq // hkv, axis=1))
            read_out = relax.op.matmul(relax.op.expand_dims(step(q, t), 2), shared)
            outputs.append(bb.emit(relax.op.multiply(read_out, relax.const(scale, "float32"))))
        out = bb.emit(relax.op.concat(outputs, axis=2))  # [B, H_q, T, d_v]
        out = bb.emit(relax.op.reshape(relax.op.permute_dims(out, [0, 2, 1, 3]),
                                       (b, steps, hq * d_v)))
        state_dtype = str(past.ty.dtype) if past is not None else dtype
        if dtype != "float32":
            out = bb.emit(relax.op.astype(out, dtype))
        if state_dtype != "float32":
            state = bb.emit(relax.op.astype(state, state_dtype))
        return relax.Tuple([out, state])


CONVERTERS = {"LinearAttention": LinearAttention}
