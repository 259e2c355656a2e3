"""ONNX's ``RotaryEmbedding`` (opset 23), which TVM 0.27's importer lacks.

Rotary position embeddings as ONNX's reference computes them, on static shapes::

    x: [b, h, s, d] (rank 4), or [b, s, h * d] with num_heads (rank 3)
    cos, sin = cos_cache[position_ids], sin_cache[position_ids]   ([b, s, r / 2]; without
               position_ids the caches are that already)
    x1, x2 = the first r channels in halves, or the even and odd ones (interleaved)
    out    = (cos * x1 - sin * x2, sin * x1 + cos * x2) in x1's and x2's places; channels from
             r = rotary_embedding_dim (the whole head when 0) on are kept as they are

Rank-4 inputs are rotated in their own layout (the caches broadcast over the heads), rank-3
ones through a ``[b, s, h, d]`` view. Position ids index the caches with ``take``, whose
indices ``passes.CheckIndices`` checks at run time.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError
from .static_dims import static_dims


def _static(expr: relax.Expr, what: str, node: str) -> list[int]:
    return static_dims(expr, f"RotaryEmbedding's {what}", node)


def _channels(bb, x: relax.Expr, start: int, end: int, step: int = 1) -> relax.Expr:
    return bb.emit(relax.op.strided_slice(x, [x.ty.ndim - 1], [start], [end], [step]))


class RotaryEmbedding(OnnxOpConverter):
    """ONNX ``RotaryEmbedding`` (module docstring)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        node = f"RotaryEmbedding node {attr.get('tvm_custom', {}).get('name', '')!r}"
        x, cos, sin = inputs[0], inputs[1], inputs[2]
        positions = inputs[3] if len(inputs) > 3 else None
        dims = _static(x, "the input", node)
        interleaved = bool(int(attr.get("interleaved", 0)))
        if len(dims) == 3:
            heads = int(attr.get("num_heads", 0))
            if not heads or dims[2] % heads:
                raise UnsupportedModelError(f"{node}: a rank-3 input of shape {dims} needs "
                                            "num_heads dividing its last dimension")
            view = bb.emit(relax.op.reshape(x, (dims[0], dims[1], heads, dims[2] // heads)))
        elif len(dims) == 4:
            view = x
        else:
            raise UnsupportedModelError(f"{node}: the input has rank {len(dims)}; 3 or 4 "
                                        "expected")
        view_dims = _static(view, "the input", node)
        head = view_dims[-1]
        rotary = int(attr.get("rotary_embedding_dim", 0)) or head
        if rotary % 2 or rotary > head:
            raise UnsupportedModelError(f"{node}: rotary_embedding_dim {rotary} must be even "
                                        f"and at most the head size {head}")
        if positions is not None:
            cos = bb.emit(relax.op.take(cos, positions, axis=0))
            sin = bb.emit(relax.op.take(sin, positions, axis=0))
        for cache, name in ((cos, "cos_cache"), (sin, "sin_cache")):
            last = _static(cache, name, node)[-1]
            if last != rotary // 2:
                raise UnsupportedModelError(f"{node}: {name}'s last dimension is {last}, not "
                                            f"rotary_embedding_dim / 2 = {rotary // 2}")
        # [b, s, r/2] broadcast over the heads: axis 1 of [b, h, s, d], axis 2 of [b, s, h, d].
        axis = 1 if len(dims) == 4 else 2
        cos = bb.emit(relax.op.expand_dims(cos, axis))
        sin = bb.emit(relax.op.expand_dims(sin, axis))
        if interleaved:
            x1, x2 = _channels(bb, view, 0, rotary, 2), _channels(bb, view, 1, rotary, 2)
        else:
            x1 = _channels(bb, view, 0, rotary // 2)
            x2 = _channels(bb, view, rotary // 2, rotary)
        real = bb.emit(relax.op.subtract(bb.emit(relax.op.multiply(cos, x1)),
                                         bb.emit(relax.op.multiply(sin, x2))))
        imag = bb.emit(relax.op.add(bb.emit(relax.op.multiply(sin, x1)),
                                    bb.emit(relax.op.multiply(cos, x2))))
        if interleaved:
            pairs = bb.emit(relax.op.stack([real, imag], axis=-1))
            rotated = bb.emit(relax.op.reshape(pairs, (*view_dims[:-1], rotary)))
        else:
            rotated = bb.emit(relax.op.concat([real, imag], axis=-1))
        if rotary < head:
            rotated = bb.emit(relax.op.concat([rotated, _channels(bb, view, rotary, head)],
                                              axis=-1))
        return relax.op.reshape(rotated, dims) if len(dims) == 3 else rotated


CONVERTERS = {"RotaryEmbedding": RotaryEmbedding}
