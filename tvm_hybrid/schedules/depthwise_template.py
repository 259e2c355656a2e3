"""The depthwise convolution template: register blocks of pixels by a vector of channels.

For the NHWC depthwise convolution of ``passes/conv_gemm.py`` (``conv_computes.depthwise_conv``:
``Y[b, y, x, c] = sum_{ky, kx} Xp[b, y * sh + ky * dh, x * sw + kx * dw, c] * W[ky, kx, c]``,
an injective block with its taps unrolled; ``Xp`` is ``X`` zero-padded, read in the taps by
clamped loads and selects) and the elementwise epilogue fused after it (bias, folded
BatchNorm, HardSwish, a residual add, a quantization)::

    parallel for (b, y_block rows, c_vector):      # output rows, one vector of channels
      for x_block:                                 # x_block pixels of each row
        acc[y_block, x_block, lanes] = taps        # on the stack: register accumulators
        Y[y_block, x_block, c_vector] = epilogue(acc)

Within a block the pixels share input columns (``x_block + kw - 1`` loads per row of taps
instead of ``x_block * kw``), its rows share input rows (``y_block + kh - 1`` rows of taps
instead of ``y_block * kh``) and each tap's weight vector is loaded once per block; along a
row the block walks ``kh + y_block - 1`` input rows of one vector of channels (a few KiB, in
L1), and the weights of that vector stay in L1 across the row. The fallback rule instead
inlined the convolution into the epilogue, so that an epilogue reading it twice (HardSwish's
``x * clip(x + 3, 0, 6)``) held all taps twice in its expression, and swept every channel of
a pixel before the next pixel, loading each weight once per pixel.

Knobs: ``lanes`` (the channel vector: the target's fp32 vector, its half or quarter, or twice
it; :func:`channel_lanes`), ``x_block`` (pixels per block, a divisor of the row's width) and
``y_block`` (output rows per block, a divisor of the map's height up to :data:`MAX_Y_BLOCK`;
tuning records without it take one row). Heuristic: the first vector :func:`channel_lanes`
allows (the widest fp32 vector that divides the channels; 16 lanes at least for a u8 output);
the largest block of at most :data:`X_BLOCK` pixels dividing the width, or the whole row when
it is at most :data:`WHOLE_ROW` and nothing larger than 1 divides it (7x7 maps). Measured on
the Zen 4 (2 cores, ocr_rec's depthwise kernels with their HardSwish epilogues): 5x5 taps on
240 channels, 12 x 80 pixels, 0.240 -> 0.081 ms (zmm; 2 pixels 0.090, 8 pixels 0.082) and
0.217 -> 0.105 ms with the AVX2 code (2 pixels 0.120); 3x3 taps on 64 channels at 24 x 160,
0.044 -> 0.027 ms. Rows (:func:`default_y_block`): 2 where the height is even and that leaves
every thread four tasks. On a 2-core Zen 4, kernels with their epilogues, same process,
against one row: 3x3 taps 1.10-1.41x (64 channels, 24 x 160), 1.14-1.17x (96, 56 x 56), 1.07x
(128, 28 x 28), 1.12x at stride 2, with the AVX2 code 1.38x, 1.42x and 1.23x (32, 112 x 112);
5x5 taps on 240 channels at 12 x 80 1.14-1.18x (AVX2 code 1.43x). 4 rows lost on 3x3 taps
(0.84-0.93x), and on 5x5 taps were no faster than 2 (zmm 1.04-1.12x, a 1 KiB accumulator in
the workspace pool; AVX2 code 1.43x); 2 x 2 pixels where 2 x 4 are taken were within noise of
them. In models (same process, outputs identical) the depthwise kernels of layout's profile
took 6.37 -> 5.34 ms (AVX2 code 10.38 -> 8.41 ms), ocr_rec's 0.88 -> 0.70 ms; whole calls
(11 rounds) layout 1.015x, ocr_rec 1.013x, orientation 1.024x, ocr_cls 1.034x (faster in 10 of
11), with the AVX2 code layout 0.990x and ocr_rec 1.034x (9 rounds): these kernels are a tenth
of layout's time and under a tenth of the others', within the VM's noise.

The accumulator is a stack buffer, not a ``"local"`` one: TVM's ``LowerTVMBuiltin`` keeps only
``"global"`` allocations under 1 KiB on the stack and allocates any ``"local"`` buffer from the
workspace pool (``TVMBackendAllocWorkspace`` and a free, once per parallel task), so the
accumulator also went through memory. On the 2-core Emerald Rapids VM (kernels with the NCHW
transposes around them, 15 interleaved rounds): 1.16-1.19x faster on 3x3 and 5x5 maps of 256-512
channels, 1.08-1.16x on 7x7 to 28x28 maps, 1.02-1.06x on maps of 12 rows or more; with the AVX2
code 1.35x, 1.27x, 1.08x, 1.11x and 1.04x on 3x3x512, 7x7x544, 14x14x272, 28x28x136 and
12x80x240. Outputs are identical.
"""

from __future__ import annotations

import dataclasses
import random

import tvm
import tvm.ir.expr as ir_expr
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.prim.expr import IntImm
from tvm.s_tir.dlight.analysis import get_sblock_info
from tvm.target import Target

from ..passes.conv_computes import DEPTHWISE_BLOCK
from .gemm.heuristics import divisors, target_threads
from .gemm.template import TEMPLATE_ANNOTATION
from .parallel_vectorize import vector_lanes
from .rule_failures import NotApplicable
from .template import Template, adjacent

#: The largest pixel block the heuristic picks (4: the best or within noise of it in the
#: measurements of the module docstring, on zmm and on AVX2).
X_BLOCK = 4
#: Rows at most this wide with no divisor in ``2..X_BLOCK`` are one block (7 pixels, 5).
WHOLE_ROW = 8
#: The largest pixel block the tuner tries.
MAX_X_BLOCK = 16
#: The most output rows a register block spans (the tuner's range).
MAX_Y_BLOCK = 4
#: The heuristic's row block.
Y_BLOCK = 2


@dataclasses.dataclass(frozen=True)
class DepthwiseShape:
    """A depthwise convolution: ``rows`` output rows (batch x ``height``) of ``width``
    pixels, ``channels`` channels, ``taps`` taps per output; the function's output has
    ``out_bytes`` per element (1: a quantized epilogue). ``height`` bounds the row blocks
    (1: one row a block)."""

    rows: int
    width: int
    channels: int
    taps: int
    out_bytes: int = 4
    height: int = 1

    @property
    def flops(self) -> float:
        """Arithmetic operations of one call: a multiply and an add per tap."""
        return float(2 * self.rows * self.width * self.channels * self.taps)


@dataclasses.dataclass(frozen=True)
class DepthwiseKnobs:
    """The template's knobs: channels per vector, pixels per row of a register block and
    its rows."""

    lanes: int
    x_block: int
    y_block: int = 1

    @property
    def key(self) -> str:
        return f"{self.lanes}/{self.x_block}" + (f"/{self.y_block}" if self.y_block > 1 else "")

    def describe(self) -> str:
        pixels = f"{self.y_block} rows x {self.x_block}" if self.y_block > 1 else self.x_block
        return f"{pixels} pixels x {self.lanes} channels per register block"

    def as_dict(self) -> dict:
        return {"template": DepthwiseTemplate.name, "lanes": self.lanes,
                "x_block": self.x_block, "y_block": self.y_block}


@dataclasses.dataclass(frozen=True)
class DepthwiseWorkload:
    """The function's output block (the epilogue's, or the convolution's without one), the
    convolution's block, and the shape."""

    block: s_tir.schedule.SBlockRV
    conv: s_tir.schedule.SBlockRV
    shape: DepthwiseShape


def channel_lanes(target: Target, channels: int, out_bytes: int = 4) -> list[int]:
    """The channel vectors ``channels`` allows on ``target``, the heuristic's first: the fp32
    vector, its half and quarter, then twice it, those dividing ``channels`` and writing at
    least 16 bytes of an output of ``out_bytes`` per element (at least 4 lanes). A u8 output
    (a quantized epilogue) of 8 lanes, 8 bytes, made LLVM convert lane by lane: with the AVX2
    code two of orientation_qdq_int8's kernels, timed on their own, ran 1.37x and 1.45x slower
    than the fallback's, and on 16 lanes (two ymm) 1.31x and 1.24x faster."""
    widest = vector_lanes(target, "float32")
    least = max(4, 16 // out_bytes)
    return [n for n in (widest, widest // 2, widest // 4, 2 * widest)
            if n >= least and channels % n == 0]


def _lanes(shape: DepthwiseShape, target: Target) -> list[int]:
    return channel_lanes(target, shape.channels, shape.out_bytes)


def block_sizes(width: int) -> list[int]:
    """The pixel blocks a row of ``width`` allows (its divisors up to :data:`MAX_X_BLOCK`)."""
    return [d for d in divisors(width) if d <= MAX_X_BLOCK]


def row_blocks(height: int) -> list[int]:
    """The row blocks a map of ``height`` rows allows (its divisors up to :data:`MAX_Y_BLOCK`)."""
    return [d for d in divisors(height) if d <= MAX_Y_BLOCK]


def default_x_block(width: int) -> int:
    """The heuristic's pixel block (module docstring)."""
    best = max(d for d in divisors(width) if d <= X_BLOCK)
    return width if best == 1 and width <= WHOLE_ROW else best


def default_y_block(shape: DepthwiseShape, lanes: int, threads: int) -> int:
    """The heuristic's row block: the largest divisor of the height up to :data:`Y_BLOCK`
    that leaves every thread four tasks (module docstring)."""
    tasks = shape.rows * (shape.channels // lanes)
    return max(y for y in row_blocks(shape.height)
               if y == 1 or (y <= Y_BLOCK and tasks // y >= 4 * threads))


def depthwise_knobs(shape: DepthwiseShape, target: Target) -> DepthwiseKnobs | None:
    """The heuristic knobs of ``shape`` on ``target``, or None (no vector divides the
    channels: the fallback rule takes it)."""
    lanes = _lanes(shape, target)
    if not lanes:
        return None
    return DepthwiseKnobs(lanes[0], default_x_block(shape.width),
                          default_y_block(shape, lanes[0], target_threads(target)))


class DepthwiseTemplate(Template):
    """Schedule functions holding a depthwise convolution (heuristic knobs)."""

    name = "depthwise"
    title = "depthwise convolution template"

    def available(self, target: Target) -> bool:
        return vector_lanes(target, "float32") >= 4

    def match(self, sch: s_tir.Schedule, target: Target) -> list[DepthwiseWorkload] | None:
        root = sch.get_sblock("root")
        blocks = sch.get_child_blocks(root)
        convs = [b for b in blocks if sch.get(b).name_hint.startswith(DEPTHWISE_BLOCK)]
        if len(convs) != 1:
            return None
        for info in (get_sblock_info(sch, b) for b in blocks):
            if "O" in info.dom_kind() or info.is_reduction():
                return None
        conv_name = sch.get(convs[0]).name_hint
        # Everything but the convolution and the output inlines: producers (padding, a
        # dequantization) into the taps, the epilogue chain into the output's block.
        for block in blocks[:-1]:
            if sch.get(block).name_hint != conv_name:
                try:
                    sch.compute_inline(block)
                except s_tir.ScheduleError as err:
                    raise NotApplicable(f"a block does not inline: {err}") from err
        blocks = sch.get_child_blocks(root)
        conv = sch.get_sblock(conv_name)
        if len(blocks) > 2 or not sch.get(blocks[0]).same_as(sch.get(conv)):
            return None
        shape = depthwise_shape(sch, conv)
        if shape is None or (len(blocks) == 2 and not _reads_in_place(sch, conv, blocks[1])):
            return None
        out_bytes = tvm.DataType(str(sch.get(blocks[-1]).writes[0].source.dtype)).bits // 8
        shape = dataclasses.replace(shape, out_bytes=max(1, out_bytes))
        return [DepthwiseWorkload(blocks[-1], conv, shape)]

    def heuristic(self, workload: DepthwiseWorkload, target: Target) -> DepthwiseKnobs | None:
        return depthwise_knobs(workload.shape, target)

    def fits(self, workload: DepthwiseWorkload, knobs: DepthwiseKnobs, target: Target) -> bool:
        shape = workload.shape
        return (knobs.lanes in _lanes(shape, target)
                and shape.width % knobs.x_block == 0
                and knobs.y_block in row_blocks(shape.height))

    def schedule(self, sch: s_tir.Schedule, workload: DepthwiseWorkload,
                 knobs: DepthwiseKnobs):
        return schedule_depthwise(sch, workload, knobs)

    def flops(self, workload: DepthwiseWorkload) -> float:
        return workload.shape.flops

    def variants(self, workload: DepthwiseWorkload, target: Target) -> list[DepthwiseKnobs]:
        shape = workload.shape
        x_block = default_x_block(shape.width)
        out = [self.heuristic(workload, target)]
        out += [DepthwiseKnobs(n, x_block, y) for n in _lanes(shape, target)
                for y in row_blocks(shape.height)]
        return list(dict.fromkeys(out))

    def neighbours(self, workload: DepthwiseWorkload, knobs: DepthwiseKnobs,
                   target: Target) -> list[DepthwiseKnobs]:
        shape = workload.shape
        out = [dataclasses.replace(knobs, x_block=b)
               for b in adjacent(block_sizes(shape.width), knobs.x_block)]
        out += [dataclasses.replace(knobs, y_block=y)
                for y in adjacent(row_blocks(shape.height), knobs.y_block)]
        return out + [dataclasses.replace(knobs, lanes=n) for n in _lanes(shape, target)
                      if n != knobs.lanes]

    def random(self, workload: DepthwiseWorkload, target: Target,
               rng: random.Random) -> DepthwiseKnobs:
        shape = workload.shape
        return DepthwiseKnobs(rng.choice(_lanes(shape, target)),
                              rng.choice(block_sizes(shape.width)),
                              rng.choice(row_blocks(shape.height)))

    def size(self, workload: DepthwiseWorkload, target: Target) -> int:
        shape = workload.shape
        return (len(_lanes(shape, target)) * len(block_sizes(shape.width))
                * len(row_blocks(shape.height)))

    def knobs_from_dict(self, data: dict) -> DepthwiseKnobs:
        # Records from before the row block have none: one row.
        return DepthwiseKnobs(int(data["lanes"]), int(data["x_block"]),
                              int(data.get("y_block", 1)))


def depthwise_shape(sch: s_tir.Schedule, block) -> DepthwiseShape | None:
    """The :class:`DepthwiseShape` of a ``depthwise`` block (``[b, y, x, c]``, fp32, weights
    ``[kh, kw, c]``), or None if it is not one."""
    stmt = sch.get(block)
    if (len(stmt.iter_vars) != 4
            or any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars)
            or not all(isinstance(iv.dom.extent, IntImm) for iv in stmt.iter_vars)
            or str(stmt.body.buffer.dtype) != "float32"):
        return None
    batch, height, width, channels = (int(iv.dom.extent) for iv in stmt.iter_vars)
    weights = [r.source for r in stmt.reads if len(r.source.shape) == 3]
    if len(weights) != 1 or not all(isinstance(d, IntImm) for d in weights[0].shape):
        return None
    kh, kw, depth = (int(d) for d in weights[0].shape)
    if depth != channels:
        return None
    return DepthwiseShape(batch * height, width, channels, kh * kw, height=height)


def _reads_in_place(sch: s_tir.Schedule, conv, out) -> bool:
    """Whether ``out`` has the convolution's four loops and reads its value only at its own
    ``[b, y, x, c]`` (an elementwise epilogue, no transposition or reshape)."""
    stmt, produced = sch.get(out), sch.get(conv).writes[0].source
    extents = [iv.dom.extent for iv in sch.get(conv).iter_vars]
    if len(stmt.iter_vars) != 4 or any(
            iv.iter_type != tirx.IterVar.DataPar or not isinstance(iv.dom.extent, IntImm)
            or int(iv.dom.extent) != int(e) for iv, e in zip(stmt.iter_vars, extents)):
        return False
    order = [iv.var for iv in stmt.iter_vars]
    ok = True

    def on_load(node) -> None:
        nonlocal ok
        if node.source.same_as(produced):
            ok &= len(node.indices) == 4 and all(
                i.same_as(v) for i, v in zip(node.indices, order))

    tvm_ffi.structural_walk(stmt.body, [(ir_expr.TensorLoad, on_load)])
    return ok


def schedule_depthwise(sch: s_tir.Schedule, workload: DepthwiseWorkload, knobs: DepthwiseKnobs):
    """Apply the template; return the parallel loop, which holds both blocks."""
    out, conv, shape = workload.block, workload.conv, workload.shape
    b, y, x, c = sch.get_loops(out)
    y_outer, y_inner = sch.split(y, [shape.height // knobs.y_block, knobs.y_block])
    x_outer, x_inner = sch.split(x, [shape.width // knobs.x_block, knobs.x_block])
    c_outer, c_inner = sch.split(c, [shape.channels // knobs.lanes, knobs.lanes])
    sch.reorder(b, y_outer, c_outer, x_outer, y_inner, x_inner, c_inner)
    rows = sch.fuse(b, y_outer, c_outer, preserve_unit_iters=True)
    sch.parallel(rows)
    sch.unroll(y_inner)
    sch.unroll(x_inner)
    sch.vectorize(c_inner)
    if not sch.get(out).same_as(sch.get(conv)):
        sch.compute_at(conv, x_outer, preserve_unit_loops=True)
        # The accumulator, x_block x lanes floats, stays "global": TVM puts a "global"
        # buffer under 1 KiB on the stack, where LLVM keeps it in registers, but takes a
        # "local" one from the runtime's workspace pool once per parallel task (measured in
        # the module docstring).
        sch.set_scope(conv, 0, "global")
        *_, conv_y, conv_x, conv_c = sch.get_loops(conv)
        sch.unroll(conv_y)
        sch.unroll(conv_x)
        sch.vectorize(conv_c)
    sch.annotate(rows, TEMPLATE_ANNOTATION,
                 f"depthwise convolution, {knobs.describe()}, {shape.taps} taps")
    return rows
