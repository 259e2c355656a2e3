"""``ConvToGemm``: fp32 convolutions with constant weights onto the GEMM engine.

Convolutions first move to NHWC activations and OHWI weights (TVM's ``ConvertLayout``, which
carries the layout through elementwise ops and puts one layout change at each end of a conv
chain). Then ``conv2d(x[N, H, W, C], W[O, KH, KW, C])`` with one group is the GEMM

    Y[(n, oh, ow), o] = sum_{(kh, kw, c)} X_col[(n, oh, ow), (kh, kw, c)] * W_mat[(kh, kw, c), o]

with ``X_col`` gathered from ``x`` (zero outside the padding; ``x`` itself, reshaped, for a
1x1, stride-1, unpadded convolution) and ``W_mat = W.reshape(O, -1).T`` a constant, which
``PrepackConstantWeights`` packs for the microkernel like any GEMM weight. ``Y`` reshaped is
the NHWC output, so the bias and activation after it fuse as the GEMM's epilogue.

A convolution whose output rows a microkernel tiles skips ``X_col`` (``KH * KW`` times the
input over the strides' product, written and read back): :func:`direct_conv` on the
zero-padded input, which ``schedules/conv_template.py`` schedules as a batch-reduce GEMM over
the taps with the weights packed here (:func:`pack_conv_weight`). A column stride over 1 reads
the padded input dealt into phases (:func:`phase_split`, one copy of the input, as the padding
of a stride-1 convolution): one tap's pixels of an output row are then consecutive, as the
microkernel reads them (stride-2 3x3 convolutions ran 1.02-1.05x faster in YOLOv8n, YOLOX and
ZFNet than through im2col on a 2-core Emerald Rapids). With ``precision="bf16"`` strided
convolutions keep im2col, whose GEMM computes in bf16. So do convolutions of large weights
on few pixels whose GEMM reads each block of the weights once for all the output's rows
(:func:`_gemm_reads_weights_once`: ResNet's last stage), which the direct template does not.

TVM's own conv2d lowering runs at about 1% of the FMA peak on the fallback schedule; this puts
dense convolutions on the template. A depthwise convolution (no reduction across channels
worth a GEMM) becomes :func:`depthwise_conv`, an injective kernel vectorised along the NHWC
channels. A grouped convolution (ShuffleNet's, AlexNet's) of stride 1 is one
:func:`grouped_direct_conv` kernel, the direct template with a group axis, its output
``[N, OH, OW, G, Og]`` the NHWC output reshaped (no slices per group, no concatenation; the
BatchNorm after it folds into its weights, the bias, activation and residual add join its
kernel); other grouped convolutions are a dense convolution per group, and those of many
small groups keep TVM's lowering.

A transposed convolution (NCHW, one group) is the GEMM of every input pixel by
``W[C, (KH, KW, O)]`` followed by :func:`col2im`, which sums the taps landing on each output
pixel (without overlap, ``KH == stride``, a pure rearrangement).
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from ..errors import first_line
from ..host import cache_sizes
from ..microkernels import microkernels_for
from ..schedules.conv_template import conv_panel
from ..schedules.gemm.heuristics import GemmShape, k_split_blocks, select, target_threads
from .conv_computes import (
    COL2IM,
    DEPTHWISE,
    DIRECT_CONV,
    IM2COL,
    OUT_ELEMWISE_FUSABLE,
    PHASE_SPLIT,
    col2im,
    depthwise_conv,
    direct_conv,
    grouped_direct_conv,
    im2col,
    pack_conv_weight,
    pack_grouped_conv_weight,
    phase_split,
)
from .conv_layout import (
    CancelPermutes,
    ChannelShuffleNHWC,
    Conv1dAs2d,
    ElementwiseQuantize,
    LayoutFriendly,
    fp32_operands,
)
from .fold_constant import drop_leaked_bindings
from .integer_conv import IntegerConvToFloat
from .integer_gemm import integer_conv_gemm
from .relax_rewrite import (
    TargetMutator,
    is_op,
    rewrite_by_op,
    rewrite_functions,
)

#: Transposed and depthwise convolutions with more taps than this keep TVM's lowering (their
#: kernels unroll the taps).
_MAX_TAPS = 25
#: Grouped (not depthwise) convolutions become one dense convolution per group when there are
#: at most this many groups of at least this many input and output channels each; others keep
#: TVM's lowering (a GEMM per group of a few channels would be mostly overhead).
_MAX_GROUPS = 16
_MIN_GROUP_CHANNELS = 4
#: The most pixels a grouped 1x1 convolution's row (all its pixels) is padded by for a tile.
MAX_PIXEL_PADDING = 3
_NHWC = ("NHWC", "OHWI", "NHWC")
_NCHW = ("NCHW", "OIHW", "NCHW")
#: Fewer input channels than this per tap keep im2col (the microkernel's K would be too short),
#: except :func:`_shallow_direct` ones.
_MIN_DIRECT_DEPTH = 8
_SHALLOW_DEPTH = 3
_SHALLOW_TAPS = 9


def _shallow_direct(channels: int, taps: int, im2col_bytes: int) -> bool:
    """Whether a convolution of fewer than :data:`_MIN_DIRECT_DEPTH` input channels (an RGB
    stem) runs direct: at least :data:`_SHALLOW_DEPTH` channels, at most :data:`_SHALLOW_TAPS`
    taps, and an im2col buffer that would not stay in a core's L2.

    The direct kernel then saves writing and reading that buffer, though its microkernel
    multiplies only ``channels`` deep per tap between the accumulators' loads and stores.
    Measured on a 2-core Emerald Rapids (2 MiB L2), 3 channels, 3x3 taps, against im2col and
    its GEMM: stride 2 to 8-32 channels on 640 x 640 (11 MiB of im2col) 1.16-1.29x faster with
    AVX-512 and 1.23-2.63x with AVX2, the phase split included; stride 1 on 320 x 320 1.49x
    and 1.43x; on 192-224 pixels (1-1.4 MiB) 0.85-0.91x, and OCR's 48 x 192 classifier 0.93-0.98x.
    One channel lost (0.66-0.84x), and so did ResNet's 7x7 stem on 224 x 224 (0.76-0.81x,
    7.4 MiB: 49 taps of one multiply-add each), though on 448 x 448 it won (1.18x)."""
    return (_SHALLOW_DEPTH <= channels and taps <= _SHALLOW_TAPS
            and im2col_bytes > cache_sizes().l2)


def _gemm_reads_weights_once(target: Target, rows: int, cols: int, depth: int) -> bool:
    """Whether a convolution (``rows`` output pixels, ``cols`` output channels, ``depth`` =
    taps x input channels) runs on im2col and a GEMM rather than on the direct template: where
    the GEMM heuristic's rule 3 applies (:func:`~..schedules.gemm.heuristics.k_split_blocks`:
    weights of several L2s, too few rows per whole-``K`` block of half an L2 to cover the
    output, one block of all the rows with ``K`` blocks) and the im2col buffer stays in a
    core's L2. The GEMM then multiplies each ``K`` block of the weights with every row tile
    while it is in L1; the direct kernel, with no ``K`` blocks, streams the weights for its
    first row tile at that tile's pace and waits on memory.

    Same process on a 2-core Emerald Rapids (2 MiB L2), outputs identical: ResNet-50's last
    stage (512 channels of 3x3 taps on 7 x 7 pixels, 9.4 MB of weights, 0.9 MB of im2col)
    1.05-1.06x on the whole model (9 of 9 rounds) with the GEMM in ``K`` blocks of 256 (it
    later ran over the whole ``K`` where the im2col fits L2, and the model 1.022x faster in
    ``K`` blocks again, 9 of 11 rounds: ``heuristics.k_block_size``); VGG-19's 14 x 14
    ones (3.6 MB of im2col) lost (0.95x) and keep the direct kernel."""
    if rows * depth * 4 > cache_sizes().l2:
        return False
    shape = GemmShape(1, rows, cols, depth)
    kernels = select(target, "float32", shape, packing=True)
    if not kernels:
        return False
    kernel = kernels[0]
    padded = GemmShape(1, rows, -(-cols // kernel.nr) * kernel.nr, depth)
    return k_split_blocks(padded, kernel, cache_sizes(), target_threads(target)) is not None


#: What ``ConvertLayout`` is asked for; transposed convolutions stay NCHW (the only layout
#: TVM legalizes for them).
_LAYOUTS = {"relax.nn.conv2d": ["NHWC", "OHWI"],
            "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}

logger = logging.getLogger(__name__)




def grouped_panel(target: Target, width: int, per_group: int,
                  strides: tuple[int, int]) -> int | None:
    """The panel width of a grouped convolution on one :func:`grouped_direct_conv` kernel (its
    output rows ``width`` pixels, ``per_group`` output channels a group), or None where it
    keeps a dense convolution per group: strides other than 1, no microkernel tiling the rows
    (``conv_template.conv_panel``), or less than half the padded panels' columns useful (8
    channels a group on 32-wide panels would compute four times the work)."""
    if tuple(strides) != (1, 1):
        return None
    nr = conv_panel(microkernels_for(target, "float32"), width, per_group)
    if nr is None or per_group * 2 < -(-per_group // nr) * nr:
        return None
    return nr


@tvm.transform.module_pass(opt_level=0, name="ConvToGemm")
class ConvToGemm:
    """Rewrite fp32 ``conv2d`` with a constant weight and one group to im2col + GEMM (or the
    direct template).

    Parameters
    ----------
    target
        The target whose microkernels the rewrite picks for.
    precision
        ``"bf16"`` keeps strided convolutions on im2col, whose GEMM then computes in bf16
        (``PrepackConstantWeights``); the direct template is fp32.
    """

    def __init__(self, target: Target, precision: str = "fp32"):
        self.target = target
        self.strided_direct = precision != "bf16"

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # NHWC activations, OHWI weights: a 1x1 convolution's input is already the GEMM's
        # left operand, im2col copies whole channel vectors, the GEMM's output is the next
        # layer's input, and the layout changes stay at the ends of conv chains.
        # (TVM's pass cannot carry a layout through every op; then each convolution changes
        # layout on its own, below.) A 1-D convolution is first a 2-D one of height 1, and
        # ``clip`` (no layout rule in TVM: a transpose each side) is maximum and minimum.
        mod = rewrite_functions(mod, Conv1dAs2d(mod))
        # (Canonicalized: a dropout's output, now an alias of its input, would be a binding
        # TVM's layout pass has no rule for: a layout change each side.)
        mod = rewrite_functions(mod, LayoutFriendly(mod), eliminate_dead_code=True)
        mod = relax.transform.CanonicalizeBindings()(
            rewrite_functions(mod, ElementwiseQuantize(mod)))
        try:
            mod = relax.transform.ConvertLayout(_LAYOUTS)(mod)
        except Exception as err:  # noqa: BLE001 - TVM raises its C++ check failures
            logger.debug("ConvertLayout failed (%s); NHWC per convolution", first_line(err))
        mod = drop_leaked_bindings(relax.transform.FoldConstant()(mod))
        mod = rewrite_functions(mod, CancelPermutes(mod), eliminate_dead_code=True)
        mod = rewrite_functions(mod, ChannelShuffleNHWC(mod), eliminate_dead_code=True)
        mod = rewrite_functions(mod, self._rewriter(mod), eliminate_dead_code=True)
        if _has_integer_conv(mod):
            # An integer convolution IntegerConvToFloat left for the integer GEMM that the
            # rewrite could not take after all (a form the layout change made): the fp32
            # engine where that is exact, as for any integer convolution, not TVM's int32 loop.
            logger.debug("integer convolutions left after ConvToGemm; to fp32 where exact")
            mod = IntegerConvToFloat()(mod)
            mod = rewrite_functions(mod, self._rewriter(mod), eliminate_dead_code=True)
        return mod

    def _rewriter(self, mod: tvm.IRModule):
        return _Rewriter(mod, self.target, self.strided_direct)


def _has_integer_conv(mod: tvm.IRModule) -> bool:
    found = []

    def visit(expr):
        if is_op(expr, "relax.nn.conv2d") and str(expr.ty.dtype) == "int32":
            found.append(expr)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return bool(found)


def _four(padding) -> tuple[int, int, int, int]:
    """A conv2d's padding as ``(top, left, bottom, right)``."""
    pads = [int(p) for p in padding]
    return (pads[0], pads[1], pads[2], pads[3]) if len(pads) == 4 else \
        (pads[0], pads[1], pads[0], pads[1])


def _pair(values) -> tuple[int, int]:
    values = [int(v) for v in values]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


@relax.expr_functor.mutator
class _Rewriter(TargetMutator):

    def __init__(self, mod: tvm.IRModule, target: Target, strided_direct: bool = True):
        super().__init__(mod, target)
        self.strided_direct = strided_direct

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        return rewrite_by_op(call, {"relax.nn.conv2d": self._rewrite,
                                    "relax.nn.conv2d_transpose": self._rewrite_transposed})

    def _depthwise(self, x: relax.Expr, w: np.ndarray, out_hw: tuple[int, int],
                   attrs) -> relax.Expr:
        """The NHWC depthwise convolution (one filter per channel) of ``x`` by the OHWI
        constant ``w`` as :func:`depthwise_conv`."""
        # The padding is read in the taps (clamped loads, zeros selected), not written by a
        # kernel of its own: after a GEMM (a 1x1 convolution) that kernel was a copy of the
        # whole input through memory (layout's 33 padding kernels: 5.0 ms of a 34 ms profile
        # on a 2-core Emerald Rapids VM; the model ran 1.06x faster without them).
        taps = relax.const(np.ascontiguousarray(w[..., 0].transpose(1, 2, 0)))  # [KH, KW, C]
        conv = self.builder_.call_te(
            depthwise_conv, x, taps, _pair(attrs.strides), _pair(attrs.dilation), out_hw,
            _four(attrs.padding), primfunc_name_hint=DEPTHWISE)
        return self._not_inlined_into(conv)

    def _grouped(self, x: relax.Expr, w: np.ndarray, out_shape: list[int], groups: int,
                 attrs) -> relax.Expr:
        """The NHWC convolution of ``x`` in ``groups`` groups: one
        :func:`grouped_direct_conv` kernel for all groups where :func:`grouped_panel` allows
        (no slices, no concatenation); else one dense convolution per group (:meth:`_gemm`:
        im2col, direct or 1x1 GEMM) on its slice of the channels, the outputs concatenated."""
        o, kh, kw, per_group = w.shape
        outs = o // groups
        bb = self.builder_
        out_hw, width = tuple(out_shape[1:3]), out_shape[2]
        padding = _four(attrs.padding)
        nr = grouped_panel(self.target, out_shape[2], outs, _pair(attrs.strides))
        if nr is None and (kh, kw) == (1, 1) and not any(padding):
            # A 1x1 convolution's pixels as one row: AVX2's tiles (4, 6 rows) divide
            # ShuffleNet's 196 pixels of 14x14, not its 14-pixel rows; its 49 pixels of 7x7
            # are padded to 50 for 5-row tiles (the kernel keeps the first 49).
            pixels = out_shape[1] * out_shape[2]
            for row in range(pixels, pixels + MAX_PIXEL_PADDING + 1):
                nr = grouped_panel(self.target, row, outs, _pair(attrs.strides))
                if nr is not None:
                    x = bb.emit(relax.op.reshape(x, [out_shape[0], 1, pixels, -1]))
                    out_hw, width, padding = (1, row), pixels, (0, 0, 0, row - pixels)
                    break
        if nr is not None:
            x = self._padded(x, padding)
            packed = relax.const(pack_grouped_conv_weight(w, groups, nr))
            y = bb.emit(self._not_inlined_into(bb.call_te(
                grouped_direct_conv, x, packed, _pair(attrs.dilation), out_hw,
                outs, width, primfunc_name_hint=DIRECT_CONV)))
            return relax.op.reshape(y, out_shape)
        parts = []
        for g in range(groups):
            part = bb.emit(relax.op.strided_slice(x, axes=[3], begin=[g * per_group],
                                                  end=[(g + 1) * per_group]))
            y = self._gemm(part, w[g * outs:(g + 1) * outs], [*out_shape[:3], outs], attrs)
            parts.append(bb.emit(y))
        return relax.op.concat(parts, axis=3)

    def _padded(self, x: relax.Expr, padding: tuple[int, int, int, int]) -> relax.Expr:
        """NHWC ``x`` zero-padded by ``(top, left, bottom, right)`` (``x`` itself if none)."""
        top, left, bottom, right = padding
        if not any(padding):
            return x
        return self.builder_.emit(relax.op.nn.pad(x, [0, 0, top, bottom, left, right, 0, 0]))

    def _not_inlined_into(self, call: relax.Call) -> relax.Call:
        """Mark ``call``'s PrimFunc fusable like a convolution: the ops after it may join its
        kernel, the ops before it do not (inlined, they would be recomputed for every tap)."""
        gvar = call.args[0]
        func = self.builder_.get()[gvar]
        self.builder_.update_func(gvar, func.with_attr("op_pattern", OUT_ELEMWISE_FUSABLE))
        return call

    def _rewrite_transposed(self, call: relax.Call) -> relax.Expr | None:
        """``conv2d_transpose`` (NCHW, IOHW, one group) as a GEMM of every input pixel by
        ``W[C, (KH, KW, O)]``, then :func:`col2im`."""
        attrs = call.attrs
        if (int(attrs.groups) != 1 or str(attrs.data_layout) != "NCHW"
                or str(attrs.kernel_layout) != "IOHW"
                or str(attrs.out_layout) not in ("NCHW", "")):
            return None
        operands = fp32_operands(self, call, ndim=4)
        if operands is None:
            return None
        x, w = operands
        n, c, h, wd = (int(d) for d in x.ty.shape.values)
        _, o, kh, kw = w.shape
        if kh * kw > _MAX_TAPS:
            return None
        oh, ow = (int(d) for d in call.ty.shape.values[2:])
        pads = [int(p) for p in attrs.padding]
        bb = self.builder_
        nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
        rows = bb.emit(relax.op.reshape(nhwc, (n * h * wd, c)))
        w_mat = relax.const(np.ascontiguousarray(w.transpose(0, 2, 3, 1).reshape(c, kh * kw * o)))
        cols = bb.emit(relax.op.matmul(rows, w_mat))
        return bb.call_te(col2im, cols, n, (h, wd), (kh, kw), o, _pair(attrs.strides),
                          (pads[0], pads[1]), _pair(attrs.dilation), (oh, ow),
                          primfunc_name_hint=COL2IM)

    def _rewrite(self, call: relax.Call) -> relax.Expr | None:
        attrs = call.attrs
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout),
                   str(attrs.out_layout) or str(attrs.data_layout))
        if layouts not in (_NHWC, _NCHW):
            return None
        if str(call.ty.dtype) == "int32":
            return self._integer(call)
        operands = fp32_operands(self, call, ndim=4)
        if operands is None:
            return None
        x, w = operands
        if layouts == _NCHW:
            w = w.transpose(0, 2, 3, 1)  # OIHW -> OHWI
        groups = int(attrs.groups)
        o, kh, kw, per_group = w.shape
        depthwise = groups > 1 and per_group == 1 and o == groups
        if (depthwise and kh * kw > _MAX_TAPS) or (groups > 1 and not depthwise and (
                groups > _MAX_GROUPS or min(per_group, o // groups) < _MIN_GROUP_CHANNELS)):
            return None  # TVM's lowering
        bb = self.builder_
        out_shape = [int(d) for d in call.ty.shape.values]
        if layouts == _NCHW:  # to NHWC and back around the kernels
            x = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
            out_shape = [out_shape[0], out_shape[2], out_shape[3], out_shape[1]]
        if groups == 1:
            y = self._gemm(x, w, out_shape, attrs)
        elif depthwise:
            y = self._depthwise(x, w, tuple(out_shape[1:3]), attrs)
        else:
            y = self._grouped(x, w, out_shape, groups, attrs)
        if layouts == _NCHW:
            y = relax.op.permute_dims(bb.emit(y), [0, 3, 1, 2])
        return y

    def _integer(self, call: relax.Call) -> relax.Expr | None:
        """An int32 convolution of 8-bit data the integer GEMM takes
        (:func:`~tvm_hybrid.passes.integer_gemm.integer_conv_gemm`) as the int32 matmul
        ``(astype(X8, int32) - zp) @ W32`` of its NHWC pixels (1x1) or of their im2col
        (padded with the zero point), which ``IntegerGemmToVNNI`` puts on the integer
        microkernels."""
        conv = integer_conv_gemm(self, call, self.target)
        if conv is None:
            return None
        bb = self.builder_
        x8 = conv.x8
        if conv.permutation is not None:
            x8 = bb.emit(relax.op.permute_dims(x8, conv.permutation))
        if conv.layout == "NCHW":
            x8 = bb.emit(relax.op.permute_dims(x8, [0, 2, 3, 1]))
        n, h, wd, c = (int(d) for d in x8.ty.shape.values)
        out = [int(d) for d in call.ty.shape.values]
        oh, ow = out[1:3] if conv.layout == "NHWC" else out[2:]
        k, o = conv.w32.shape
        if conv.pointwise:
            rows = bb.emit(relax.op.reshape(x8, (n * h * wd, c)))
        else:
            attrs = call.attrs
            w_shape = [int(d) for d in call.args[1].ty.shape.values]
            kh, kw = w_shape[2:] if conv.layout == "NCHW" else w_shape[1:3]
            func = im2col((n, h, wd, c), (kh, kw), _pair(attrs.strides), _four(attrs.padding),
                          _pair(attrs.dilation), (oh, ow), dtype=str(x8.ty.dtype),
                          fill=conv.zero_point, extra_columns=conv.extra_columns)
            rows = bb.emit(relax.call_tir(bb.add_func(func, IM2COL), [x8], relax.TensorType(
                (n * oh * ow, k), str(x8.ty.dtype))))
        cols = relax.op.astype(rows, "int32")
        if conv.zp_expr is not None:
            cols = relax.op.subtract(bb.emit(cols), conv.zp_expr)
        y = bb.emit(relax.op.matmul(bb.emit(cols), relax.const(conv.w32.astype(np.int32)),
                                    out_dtype="int32"))
        y = relax.op.reshape(y, (n, oh, ow, o))
        return relax.op.permute_dims(bb.emit(y), [0, 3, 1, 2]) if conv.layout == "NCHW" else y

    def _gemm(self, x: relax.Expr, w: np.ndarray, out_shape: list[int], attrs) -> relax.Expr:
        """The NHWC convolution of ``x`` by the OHWI constant ``w`` as im2col + GEMM."""
        n, h, wd, c = (int(d) for d in x.ty.shape.values)
        o, kh, kw, _ = w.shape
        oh, ow = out_shape[1:3]
        strides, dilation = _pair(attrs.strides), _pair(attrs.dilation)
        padding = _four(attrs.padding)
        k = c * kh * kw
        bb = self.builder_
        direct = self._direct(x, w, (oh, ow), strides, padding, dilation)
        if direct is not None:
            return direct
        if (kh, kw) == (1, 1) and strides == (1, 1) and not any(padding) and (oh, ow) == (h, wd):
            cols = bb.emit(relax.op.reshape(x, (n * h * wd, c)))
        else:
            func = im2col((n, h, wd, c), (kh, kw), strides, padding, dilation, (oh, ow))
            cols = bb.emit(relax.call_tir(bb.add_func(func, IM2COL), [x], relax.TensorType(
                (n * oh * ow, k), "float32")))
        w_mat = relax.const(np.ascontiguousarray(w.reshape(o, k).T))
        y = bb.emit(relax.op.matmul(cols, w_mat))
        return relax.op.reshape(y, (n, oh, ow, o))

    def _direct(self, x: relax.Expr, w: np.ndarray, out_hw: tuple[int, int],
                strides: tuple[int, int], padding: tuple[int, int, int, int],
                dilation: tuple[int, int]) -> relax.Expr | None:
        """The convolution as :func:`direct_conv` on the zero-padded input (phase-split for a
        column stride over 1: :func:`phase_split`), when a microkernel tiles the output rows
        (else None: im2col)."""
        o, kh, kw, c = w.shape
        pixels, depth = int(x.ty.shape[0]) * out_hw[0] * out_hw[1], kh * kw * c
        deep_enough = c >= _MIN_DIRECT_DEPTH or _shallow_direct(c, kh * kw, pixels * depth * 4)
        if kh * kw == 1 or not deep_enough or (strides != (1, 1) and not self.strided_direct):
            return None
        if _gemm_reads_weights_once(self.target, pixels, o, depth):
            return None
        nr = conv_panel(microkernels_for(self.target, "float32"), out_hw[1], o, narrow=True)
        if nr is None:
            return None
        bb = self.builder_
        if strides[1] > 1:
            x = bb.emit(bb.call_te(phase_split, x, padding, strides[1],
                                   primfunc_name_hint=PHASE_SPLIT))
        else:
            x = self._padded(x, padding)
        packed = relax.const(pack_conv_weight(w, nr))
        return self._not_inlined_into(bb.call_te(
            direct_conv, x, packed, dilation, out_hw, o, strides,
            primfunc_name_hint=DIRECT_CONV))
