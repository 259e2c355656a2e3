"""``LRN`` (local response normalization across channels) as one NHWC kernel.

TVM 0.27 imports ``LRN`` as seven ops: the squares, an ``avg_pool3d`` over the channels of an
``expand_dims``-ed NCDHW view, a scale, a shift, ``power`` and a division. ``ConvertLayout``
carries none of the pooling's view through NHWC, so each LRN (GoogLeNet, AlexNet, ZFNet) ran as
a strided channel pooling, a transpose each side, and a scalar ``powf`` per element: 2.8 ms of
a 19 ms Inception v1 on 2 cores. Here a 4-D float32 ``LRN`` is
``permute(lrn_nhwc(permute(x, to NHWC)), to NCHW)``: once the convolutions around it are NHWC
the permutes cancel (``passes/conv_layout.CancelPermutes``), and :func:`lrn_nhwc` computes
each pixel's channel window in one pass, vectorised along the channels, with ``d ** -beta``
as square roots for the exporters' ``beta`` of 0.75 (0.5 and 1 likewise; others ``pow``).
Other float types (float16, bfloat16, float64: TVM's conversion fails on them) run it in float32
and are cast back; other inputs keep TVM's conversion.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.frontend.onnx.onnx_frontend import LocalResponseNormalization as _StockLRN
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter
from tvm.script import tirx as T

from ..passes.relax_rewrite import static_shape

#: The kernel's name (its PrimFunc's name hint).
LRN_KERNEL = "hybrid_lrn"


def lrn_nhwc(shape: tuple[int, int, int, int], size: int, alpha: float, beta: float,
             bias: float) -> tirx.PrimFunc:
    """``y = x / (bias + alpha / size * sum(x[c'] ** 2 for c' in the window of c)) ** beta``
    on NHWC ``x`` (ONNX's window: ``(size - 1) // 2`` channels below, the rest above, clipped
    to the channels), parallel over pixels, the channels without clipping vectorised. Needs at
    least ``size`` channels and a window of two or more (``size`` 1 has no clipped channels
    for the edge loop)."""
    n, h, w, c = shape
    lo = (size - 1) // 2
    hi = size - 1 - lo
    scale = alpha / size
    inner = c - lo - hi
    edges = [ch for ch in range(c) if ch < lo or ch >= c - hi]

    def normalized(xv, total):
        d = T.float32(bias) + T.float32(scale) * total
        if beta == 0.75:
            root = T.sqrt(d)
            return xv / (root * T.sqrt(root))
        if beta == 0.5:
            return xv / T.sqrt(d)
        if beta == 1.0:
            return xv / d
        return xv * T.pow(d, T.float32(-beta))

    def window(x, b, yy, xx, ch, clipped):
        total = T.float32(0)
        for k in range(size):
            src = ch + k - lo
            value = x[b, yy, xx, src] * x[b, yy, xx, src]
            total = total + (T.if_then_else(tirx.all(src >= 0, src < c), value, T.float32(0))
                             if clipped else value)
        return total

    @T.prim_func(private=True, s_tir=True)
    def func(x: T.Buffer((n, h, w, c), "float32"), y: T.Buffer((n, h, w, c), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):
            T.reads(x[0:n, 0:h, 0:w, 0:c])
            T.writes(y[0:n, 0:h, 0:w, 0:c])
            for p in T.parallel(n * h * w):
                for i in T.vectorized(inner):
                    y[p // (h * w), p // w % h, p % w, i + lo] = normalized(
                        x[p // (h * w), p // w % h, p % w, i + lo],
                        window(x, p // (h * w), p // w % h, p % w, i + lo, False))
                for e in T.serial(len(edges)):
                    y[p // (h * w), p // w % h, p % w, _edge(edges, e)] = normalized(
                        x[p // (h * w), p // w % h, p % w, _edge(edges, e)],
                        window(x, p // (h * w), p // w % h, p % w, _edge(edges, e), True))

    return func


def _edge(edges: list[int], e):
    """The ``e``-th clipped channel: the first ``lo`` channels, then the last ``hi``."""
    out = edges[-1]
    for i in range(len(edges) - 2, -1, -1):
        out = T.if_then_else(e == i, edges[i], out)
    return out


#: Input types the kernel computes (float16, bfloat16 and float64 in float32, cast back).
_FLOATS = ("float32", "float16", "bfloat16", "float64")


class LRN(OnnxOpConverter):
    """ONNX ``LRN`` on a static 4-D float input as :func:`lrn_nhwc` between permutes."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        shape = static_shape(x)
        size = int(attr["size"])
        dtype = str(x.ty.dtype)
        if shape is None or len(shape) != 4 or dtype not in _FLOATS \
                or shape[1] < size or size < 2:
            return _StockLRN._impl_v13(bb, inputs, attr, params)
        if dtype != "float32":  # TVM's LRN fails on other types (float32 constants)
            x = bb.emit(relax.op.astype(x, "float32"))
        n, c, h, w = shape
        func = lrn_nhwc((n, h, w, c), size, float(attr.get("alpha", 1e-4)),
                        float(attr.get("beta", 0.75)), float(attr.get("bias", 1.0)))
        nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
        y = bb.emit(relax.call_tir(bb.add_func(func, LRN_KERNEL), [nhwc],
                                   relax.TensorType((n, h, w, c), "float32")))
        y = relax.op.permute_dims(y, [0, 3, 1, 2])
        return y if dtype == "float32" else relax.op.astype(bb.emit(y), dtype)


CONVERTERS = {"LRN": LRN}
