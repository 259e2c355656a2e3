"""The direct convolution template: a batch-reduce GEMM over the taps, no im2col buffer.

For the stride-1 NHWC convolution of ``passes/conv_gemm.py`` (``direct_conv``)::

    Y[b, y, x, o] += Xp[b, y + ky * dh, x + kx * dw, c] * W[o // nr, ky, kx, c, o % nr]

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
import logging

from tvm import s_tir, tirx
from tvm.ir.prim.expr import IntImm
from tvm.s_tir.dlight.analysis import get_sblock_info
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ..heuristics import divisors
from ..host import cache_sizes
from ..microkernels import Microkernel, microkernels_for, tensor_intrin
from .gemm_template import TEMPLATE_ANNOTATION, accumulate_in_tile
from .parallel_vectorize import inline_free_producers, schedule_blocks
from .rule_failures import template_failed

logger = logging.getLogger(__name__)

#: The name of the convolution's compute (and so of its TIR block), set by ``direct_conv``.
DIRECT_CONV_BLOCK = "direct_conv"
#: Smallest ``mr`` worth the direct form (narrower tiles load ``W`` too often per FMA).
MIN_MR = 4


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """A direct convolution: ``rows`` output rows (batch x height) of ``width`` pixels,
    ``channels`` output channels (padded to panels), ``taps`` taps of ``depth`` channels."""

    rows: int
    width: int
    channels: int
    taps: int
    depth: int
    panel: int


@dataclasses.dataclass(frozen=True)
class ConvKnobs:
    """The template's knobs: microkernel and pixel block (in tiles of ``mr``)."""

    kernel: Microkernel
    x_block: int


def choose_conv_kernel(kernels: list[Microkernel], width: int, panel: int) -> Microkernel | None:
    """The microkernel for rows of ``width`` pixels and weight panels of ``panel`` columns:
    the most accumulators among those whose ``mr`` divides ``width`` (at least
    :data:`MIN_MR`), or None."""
    fitting = [k for k in kernels if k.nr == panel and k.mr >= MIN_MR and width % k.mr == 0]
    if not fitting:
        return None
    return max(fitting, key=lambda k: (k.mr * k.nr, k.mr))


def conv_knobs(shape: ConvShape, target: Target) -> ConvKnobs | None:
    """The heuristic knobs for ``shape`` on ``target`` (None when no microkernel fits)."""
    kernel = choose_conv_kernel(microkernels_for(target, "float32"), shape.width, shape.panel)
    if kernel is None:
        return None
    tiles = shape.width // kernel.mr
    budget = cache_sizes().l1d // 2
    fitting = [d for d in divisors(tiles) if d * kernel.mr * kernel.nr * 4 <= budget]
    return ConvKnobs(kernel, max(fitting) if fitting else 1)


class ConvTemplate(ScheduleRule):
    """Schedule functions holding a direct convolution with the template (heuristic knobs)."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        if not microkernels_for(target, "float32"):
            return None
        sch = s_tir.Schedule(func)
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
        knobs = conv_knobs(shape, target) if shape is not None else None
        if knobs is None:
            return None
        done = {sch.get(block).name_hint}
        try:
            tile = schedule_conv(sch, block, shape, knobs)
            done.update(sch.get(b).name_hint for b in sch.get_child_blocks(tile))
            schedule_blocks(sch, target, done)
        except s_tir.ScheduleError as err:
            template_failed("direct convolution template", func,
                            f"{shape} with {knobs.kernel.name}", err)
            return None
        return sch


def conv_shape(sch: s_tir.Schedule, block) -> ConvShape | None:
    """The :class:`ConvShape` of a ``direct_conv`` block, or None if it is not one."""
    stmt = sch.get(block)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    spatial, reduce = tirx.IterVar.DataPar, tirx.IterVar.CommReduce
    if kinds != [spatial] * 4 + [reduce] * 3:
        return None
    extents = []
    for iv in stmt.iter_vars:
        if not isinstance(iv.dom.extent, IntImm):
            return None
        extents.append(int(iv.dom.extent))
    weights = [r.source for r in stmt.reads if len(r.source.shape) == 5]
    if len(weights) != 1 or str(stmt.body.buffer.dtype) != "float32":
        return None
    batch, height, width, channels, kh, kw, depth = extents
    return ConvShape(batch * height, width, channels, kh * kw, depth,
                     int(weights[0].shape[-1]))


def schedule_conv(sch: s_tir.Schedule, block, shape: ConvShape, knobs: ConvKnobs):
    """Apply the template to ``block``; return the loop of one pixel block."""
    kernel = knobs.kernel
    b, y, x, o, ky, kx, c = sch.get_loops(block)
    x_outer, x_tiles, x_inner = sch.split(
        x, [shape.width // (knobs.x_block * kernel.mr), knobs.x_block, kernel.mr])
    o_outer, o_inner = sch.split(o, [shape.channels // kernel.nr, kernel.nr])
    sch.reorder(b, y, o_outer, x_outer, ky, kx, x_tiles, x_inner, o_inner, c)
    blocks = sch.fuse(b, y, o_outer, preserve_unit_iters=True)
    sch.parallel(blocks)
    accumulate_in_tile(sch, block, x_outer, ky)
    sch.tensorize(x_inner, tensor_intrin(kernel, shape.depth))
    sch.annotate(x_outer, TEMPLATE_ANNOTATION,
                 f"{kernel.isa} {kernel.mr}x{kernel.nr} microkernel, direct convolution, "
                 f"{shape.taps} taps of K={shape.depth}")
    return x_outer
