"""The direct convolution template: a batch-reduce GEMM over the taps, no im2col buffer.

For the NHWC convolution of ``passes/conv_gemm.py`` (``direct_conv``)::

    Y[b, y, x, o] += Xp[b, y * sh + ky * dh, x + kx * dw, c] * W[o // nr, ky, kx, c, o % nr]

(a column stride ``sw`` over 1 reads ``Xs[b, y * sh + ky * dh, kx * dw % sw,
x + kx * dw // sw, c]``, the padded input dealt into ``sw`` phases: ``conv_computes.phase_split``)

(``Xp`` the padded input, ``W`` prepacked in panels of ``nr`` output channels), the rows of
``mr`` consecutive output pixels read ``mr`` consecutive input pixels, ``C`` channels each: for
one tap they are an ``mr x C`` matrix with leading dimension ``C`` inside ``Xp`` itself, which
the GEMM microkernel reads in place. The loop nest (the paper's batch-reduce GEMM)::

    parallel for (b, y, n_panel):                  # one output row, one panel of nr channels
      for x_block:                                 # the block's accumulators stay in L1
        acc[x_block, nr] = 0
        for (ky, kx):                              # each tap's C x nr weights stay in L1
          for x_tile in x_block:
            acc[x_tile] += Xp[rows of x_tile, tap] @ W[panel, tap]   # microkernel, K = C
        Y[x_block, panel] = epilogue(acc)          # bias, activation, residual...

Compared with im2col, nothing ``KH * KW`` times the input's size is written and read back.
The knobs are the microkernel (its ``mr`` must divide the row's width, ``nr`` the packing's
panel width) and the pixel block; the heuristic keeps the block's accumulators within half
of L1.
"""

from __future__ import annotations

import dataclasses
import random

from tvm import s_tir, tirx
from tvm.ir.prim.expr import IntImm
from tvm.s_tir.dlight.analysis import get_sblock_info
from tvm.target import Target

from ..host import cache_sizes
from ..microkernels import Microkernel, microkernel_by_name, microkernels_for, tensor_intrin
from .accumulate import accumulate_in_tile
from .gemm.heuristics import divisors, padded_throughput
from .gemm.template import TEMPLATE_ANNOTATION
from .parallel_vectorize import inline_free_producers
from .template import Template, adjacent

#: The name of the convolution's compute (and so of its TIR block), set by ``direct_conv``.
DIRECT_CONV_BLOCK = "direct_conv"
#: Smallest ``mr`` worth the direct form (narrower tiles load ``W`` too often per FMA).
MIN_MR = 4


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """A direct convolution: ``rows`` output rows (batch x height) of ``width`` pixels,
    ``channels`` output channels (padded to panels), ``taps`` taps of ``depth`` channels;
    each of ``groups`` groups (a grouped convolution) has its own ``channels`` and ``depth``."""

    rows: int
    width: int
    channels: int
    taps: int
    depth: int
    panel: int
    groups: int = 1


@dataclasses.dataclass(frozen=True)
class ConvKnobs:
    """The template's knobs: microkernel and pixel block (in tiles of ``mr``)."""

    kernel: Microkernel
    x_block: int

    @property
    def key(self) -> str:
        return f"{self.kernel.name}/{self.x_block}"

    def describe(self) -> str:
        k = self.kernel
        return f"{k.isa} {k.mr}x{k.nr} microkernel, pixel blocks of {self.x_block * k.mr}"

    def as_dict(self) -> dict:
        return {"template": ConvTemplate.name, "kernel": self.kernel.name,
                "x_block": self.x_block}


@dataclasses.dataclass(frozen=True)
class ConvWorkload:
    """The ``direct_conv`` block of a function and its shape."""

    block: s_tir.schedule.SBlockRV
    shape: ConvShape


def conv_kernels(kernels: list[Microkernel], width: int, panel: int) -> list[Microkernel]:
    """The microkernels for rows of ``width`` pixels and weight panels of ``panel`` columns,
    best first: those whose ``mr`` divides ``width`` (at least :data:`MIN_MR`), the most
    accumulators first."""
    fitting = [k for k in kernels if k.nr == panel and k.mr >= MIN_MR and width % k.mr == 0]
    return sorted(fitting, key=lambda k: (k.mr * k.nr, k.mr), reverse=True)


def conv_panel(kernels: list[Microkernel], width: int, channels: int,
               narrow: bool = False) -> int | None:
    """The panel width to pack a direct convolution's weights with (``channels`` output
    channels padded to whole panels), or None when no kernel tiles ``width``: the one of the
    kernel with the most throughput on the useful channels (``heuristics.padded_throughput``:
    32 channels take 16-wide panels, not 24-wide ones computing 48). Tiles of two vectors or
    more: a one-vector tile broadcasts once per FMA (im2col and a GEMM tile do better); with
    ``narrow`` (a dense convolution's) also one-vector tiles where the channels fit one
    vector, as im2col's GEMM would take too, where a two-vector tile would compute 32 columns
    for 16 (a 3-channel stem, 3x3 stride 2 to 16 channels on 640 x 640: 1.26x faster than
    im2col and its GEMM with AVX-512, to 8 channels 2.63x with AVX2, on a 2-core Emerald
    Rapids). ``whole_panels`` tiles only where the channels fill their panels."""
    fitting = [k for k in kernels
               if k.mr >= MIN_MR and width % k.mr == 0
               and (k.nr >= 2 * k.lanes or (narrow and channels <= k.lanes))
               and k.takes_columns(channels)]
    if not fitting:
        return None
    best = max(fitting, key=lambda k: (padded_throughput(k, channels), k.mr * k.nr, k.mr))
    return best.nr


def choose_conv_kernel(kernels: list[Microkernel], width: int, panel: int) -> Microkernel | None:
    """The best of :func:`conv_kernels`, or None."""
    ranked = conv_kernels(kernels, width, panel)
    return ranked[0] if ranked else None


def _default_knobs(shape: ConvShape, kernel: Microkernel) -> ConvKnobs:
    """``kernel`` with the largest pixel block whose accumulators fit half of L1."""
    tiles = shape.width // kernel.mr
    budget = cache_sizes().l1d // 2
    fitting = [d for d in divisors(tiles) if d * kernel.mr * kernel.nr * 4 <= budget]
    return ConvKnobs(kernel, max(fitting) if fitting else 1)


def conv_knobs(shape: ConvShape, target: Target) -> ConvKnobs | None:
    """The heuristic knobs for ``shape`` on ``target`` (None when no microkernel fits)."""
    kernel = choose_conv_kernel(_fp32_kernels(target), shape.width, shape.panel)
    return None if kernel is None else _default_knobs(shape, kernel)


def _fp32_kernels(target: Target) -> list[Microkernel]:
    return microkernels_for(target, "float32")


class ConvTemplate(Template):
    """Schedule functions holding a direct convolution with the template (heuristic knobs)."""

    name = "direct_conv"
    title = "direct convolution template"

    def available(self, target: Target) -> bool:
        return bool(_fp32_kernels(target))

    def match(self, sch: s_tir.Schedule, target: Target) -> list[ConvWorkload] | None:
        root = sch.get_sblock("root")
        convs = [b for b in sch.get_child_blocks(root)
                 if sch.get(b).name_hint.startswith(DIRECT_CONV_BLOCK)]
        if len(convs) != 1:
            return None
        infos = [get_sblock_info(sch, b) for b in sch.get_child_blocks(root)]
        if any("O" in info.dom_kind() for info in infos):
            return None
        inline_free_producers(sch, infos)
        block = sch.get_sblock(sch.get(convs[0]).name_hint)
        shape = conv_shape(sch, block)
        return None if shape is None else [ConvWorkload(block, shape)]

    def heuristic(self, workload: ConvWorkload, target: Target) -> ConvKnobs | None:
        return conv_knobs(workload.shape, target)

    def fits(self, workload: ConvWorkload, knobs: ConvKnobs, target: Target) -> bool:
        kernel, shape = knobs.kernel, workload.shape
        return (kernel in _fp32_kernels(target) and kernel.nr == shape.panel
                and shape.width % (kernel.mr * knobs.x_block) == 0)

    def schedule(self, sch: s_tir.Schedule, workload: ConvWorkload, knobs: ConvKnobs):
        return schedule_conv(sch, workload.block, workload.shape, knobs)

    def flops(self, workload: ConvWorkload) -> float:
        s = workload.shape
        return float(2 * s.rows * s.width * s.groups * s.channels * s.taps * s.depth)

    def variants(self, workload: ConvWorkload, target: Target) -> list[ConvKnobs]:
        return [_default_knobs(workload.shape, k) for k in self._kernels(workload, target)]

    def neighbours(self, workload: ConvWorkload, knobs: ConvKnobs,
                   target: Target) -> list[ConvKnobs]:
        sizes = divisors(workload.shape.width // knobs.kernel.mr)
        out = [ConvKnobs(knobs.kernel, b) for b in adjacent(sizes, knobs.x_block)]
        return out + [_default_knobs(workload.shape, k) for k in self._kernels(workload, target)
                      if k != knobs.kernel]

    def random(self, workload: ConvWorkload, target: Target, rng: random.Random) -> ConvKnobs:
        kernel = rng.choice(self._kernels(workload, target))
        return ConvKnobs(kernel, rng.choice(divisors(workload.shape.width // kernel.mr)))

    def size(self, workload: ConvWorkload, target: Target) -> int:
        return sum(len(divisors(workload.shape.width // k.mr))
                   for k in self._kernels(workload, target))

    def knobs_from_dict(self, data: dict) -> ConvKnobs:
        return ConvKnobs(microkernel_by_name(data["kernel"]), int(data["x_block"]))

    @staticmethod
    def _kernels(workload: ConvWorkload, target: Target) -> list[Microkernel]:
        return conv_kernels(_fp32_kernels(target), workload.shape.width, workload.shape.panel)


def conv_shape(sch: s_tir.Schedule, block) -> ConvShape | None:
    """The :class:`ConvShape` of a ``direct_conv`` block (``[b, y, x, o]``, or
    ``[b, y, x, g, o]`` grouped, then ``[ky, kx, c]``), or None if it is not one."""
    stmt = sch.get(block)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    spatial, reduce = tirx.IterVar.DataPar, tirx.IterVar.CommReduce
    grouped = kinds == [spatial] * 5 + [reduce] * 3
    if kinds != [spatial] * 4 + [reduce] * 3 and not grouped:
        return None
    extents = []
    for iv in stmt.iter_vars:
        if not isinstance(iv.dom.extent, IntImm):
            return None
        extents.append(int(iv.dom.extent))
    # The first read is the input (4-d, or 5-d phase-split), the weights come after it.
    weights = [r.source for r in stmt.reads[1:] if len(r.source.shape) == (6 if grouped else 5)]
    if len(weights) != 1 or str(stmt.body.buffer.dtype) != "float32":
        return None
    if grouped:
        batch, height, width, groups, channels, kh, kw, depth = extents
    else:
        (batch, height, width, channels, kh, kw, depth), groups = extents, 1
    return ConvShape(batch * height, width, channels, kh * kw, depth,
                     int(weights[0].shape[-1]), groups)


def schedule_conv(sch: s_tir.Schedule, block, shape: ConvShape, knobs: ConvKnobs):
    """Apply the template to ``block``; return the loop of one pixel block."""
    kernel = knobs.kernel
    loops = sch.get_loops(block)
    (b, y, x), group, (o, ky, kx, c) = loops[:3], loops[3:-4], loops[-4:]
    x_outer, x_tiles, x_inner = sch.split(
        x, [shape.width // (knobs.x_block * kernel.mr), knobs.x_block, kernel.mr])
    o_outer, o_inner = sch.split(o, [shape.channels // kernel.nr, kernel.nr])
    sch.reorder(b, y, *group, o_outer, x_outer, ky, kx, x_tiles, x_inner, o_inner, c)
    blocks = sch.fuse(b, y, *group, o_outer, preserve_unit_iters=True)
    sch.parallel(blocks)
    accumulate_in_tile(sch, block, x_outer, ky, kernel.lanes)
    if group:
        # The tile's accumulators as [b, y, g, x, o]: an mr x nr tile is then a plain 2-D
        # region under unit dimensions, which the microkernel's C matches.
        sch.transform_layout(block, ("write", 0), lambda b, y, x, g, o: (b, y, g, x, o))
    sch.tensorize(x_inner, tensor_intrin(kernel, shape.depth))
    sch.annotate(x_outer, TEMPLATE_ANNOTATION,
                 f"{kernel.isa} {kernel.mr}x{kernel.nr} microkernel, direct convolution, "
                 + (f"{shape.groups} groups, " if shape.groups > 1 else "")
                 + f"{shape.taps} taps of K={shape.depth}")
    return x_outer
