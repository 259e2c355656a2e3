"""``ConvToGemm``: fp32 convolutions with constant weights onto the GEMM engine (im2col).

``conv2d(x[N, C, H, W], W[O, C, KH, KW])`` (NCHW, one group) is the GEMM

    Y[(n, oh, ow), o] = sum_{(c, kh, kw)} X_col[(n, oh, ow), (c, kh, kw)] * W_mat[(c, kh, kw), o]

with ``X_col`` gathered from ``x`` (zero outside the padding; a plain transpose for a 1x1,
stride-1, unpadded convolution) and ``W_mat = W.reshape(O, -1).T`` a constant, which
``PrepackConstantWeights`` packs for the microkernel like any GEMM weight. The result is
transposed back to NCHW in a kernel that the following bias and activation fuse into.

TVM's own conv2d lowering runs at about 1% of the FMA peak on the fallback schedule; this puts
dense convolutions on the template. Grouped and depthwise convolutions (no reduction across
channels worth a GEMM) keep their own path.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.target import Target

from .relax_rewrite import constant_value, is_op, is_static_tensor, rewrite_functions

IM2COL = "hybrid_im2col"


def im2col(x: te.Tensor, kernel: tuple[int, int], strides: tuple[int, int],
           padding: tuple[int, int, int, int], dilation: tuple[int, int],
           out_hw: tuple[int, int]) -> te.Tensor:
    """``x[N, C, H, W]`` to ``X_col[N * OH * OW, C * KH * KW]`` (zero in the padding)."""
    n, c, h, w = (int(d) for d in x.shape)
    kh, kw = kernel
    oh, ow = out_hw
    top, left = padding[0], padding[1]

    def value(row, col):
        b, rest = row // (oh * ow), row % (oh * ow)
        y, xo = rest // ow, rest % ow
        ch, k = col // (kh * kw), col % (kh * kw)
        iy = y * strides[0] + (k // kw) * dilation[0] - top
        ix = xo * strides[1] + (k % kw) * dilation[1] - left
        inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        return tirx.if_then_else(inside, x[b, ch, tirx.max(tirx.min(iy, h - 1), 0),
                                           tirx.max(tirx.min(ix, w - 1), 0)],
                                 tirx.const(0.0, x.dtype))

    return te.compute((n * oh * ow, c * kh * kw), value, name="im2col")


@tvm.transform.module_pass(opt_level=0, name="ConvToGemm")
class ConvToGemm:
    """Rewrite fp32 ``conv2d`` with a constant weight and one group to im2col + GEMM."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod), eliminate_dead_code=True)


def _pair(values) -> tuple[int, int]:
    values = [int(v) for v in values]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.nn.conv2d"):
            return call
        rewritten = self._rewrite(call)
        return call if rewritten is None else rewritten

    def _rewrite(self, call: relax.Call) -> relax.Expr | None:
        attrs = call.attrs
        if (int(attrs.groups) != 1 or str(attrs.data_layout) != "NCHW"
                or str(attrs.kernel_layout) != "OIHW"
                or str(attrs.out_layout) not in ("NCHW", "")):
            return None
        x, weight = call.args
        if not is_static_tensor(x.ty, ("float32",), min_ndim=4):
            return None
        w = constant_value(self, weight)
        if w is None or w.dtype != np.float32 or w.ndim != 4:
            return None
        out_ty = call.ty
        if not is_static_tensor(out_ty, ("float32",), min_ndim=4):
            return None
        n, c, h, wd = (int(d) for d in x.ty.shape.values)
        o, _, kh, kw = w.shape
        oh, ow = (int(d) for d in out_ty.shape.values[2:])
        strides, dilation = _pair(attrs.strides), _pair(attrs.dilation)
        pads = [int(p) for p in attrs.padding]
        padding = (pads[0], pads[1], pads[2], pads[3]) if len(pads) == 4 else \
            (pads[0], pads[1], pads[0], pads[1])
        k = c * kh * kw
        bb = self.builder_
        if (kh, kw) == (1, 1) and strides == (1, 1) and not any(padding) and (oh, ow) == (h, wd):
            nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
            cols = bb.emit(relax.op.reshape(nhwc, (n * h * wd, c)))
        else:
            cols = bb.emit(bb.call_te(im2col, x, (kh, kw), strides, padding, dilation,
                                      (oh, ow), primfunc_name_hint=IM2COL))
        w_mat = relax.const(np.ascontiguousarray(w.reshape(o, k).T))
        y = bb.emit(relax.op.matmul(cols, w_mat))
        y = bb.emit(relax.op.reshape(y, (n, oh, ow, o)))
        return relax.op.permute_dims(y, [0, 3, 1, 2])
