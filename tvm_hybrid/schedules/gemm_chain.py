"""The GEMM chain template: an MLP's layers in one parallel loop over row blocks.

For a function holding ``L`` GEMM layers where layer ``l + 1`` reads layer ``l``'s output
(after its epilogue) as its ``A`` (what ``passes/gemm_chain.py`` makes), the loop nest is::

    parallel for row_block in M / rows:          # one row block per thread (or a few)
      for layer in 1..L:                         # all layers of the block, in order
        for n_tile in N_layer:                   # B panels of the layer stream from L2
          for m_tile in row_block:
            acc[mr, nr] = A_layer[m_tile, :] @ B_layer[:, n_tile]   # microkernel, whole K
            out_layer[m_tile, n_tile] = epilogue(acc)

Each layer is the GEMM template's loop nest (``gemm/template.py``: same microkernels, same
epilogue in the tile's write-back) with one block of ``rows`` rows and every column; the
layers' loops over row blocks are then merged into one parallel loop. A block's layer
``l + 1`` reads only the rows its layer ``l`` wrote, so the merge is exact; the intermediate
rows stay in the core's L1/L2 and the threads never join between layers.

The knob is ``rows`` (a multiple of every layer's ``mr`` dividing ``M``); the microkernel of
each layer is the GEMM heuristic's best whose ``mr`` divides ``rows``.
"""

from __future__ import annotations

import dataclasses
import random

from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_sblock_info
from tvm.target import Target

from ..host import cache_sizes, target_features
from ..microkernels import Microkernel, has_gemm_kernels, microkernel_by_name
from .accumulate import is_reduction, reduction_blocks
from .gemm.analysis import GemmBlock, match_gemm
from .gemm.heuristics import (
    GemmKnobs,
    GemmShape,
    divisors,
    select,
    target_threads,
    tile_throughput,
)
from .gemm.template import attach_gemm_epilogue, candidate_kernels, tensorize_gemm, tile_gemm
from .parallel_vectorize import inline_free_producers
from .template import Template, adjacent

#: The cost model keeps a chain's layers apart where a row block's tile has less than this
#: share of the throughput of the tile the whole ``M`` takes (:func:`thin_tiles`): ResNet-50's
#: 14x14 stage (196 rows, 2 threads) chained its 3x3 and 1x1 convolutions in 14-row blocks on
#: AVX2's 2x24 tile at 76% of peak, where the per-layer kernels run 4x24 at 96%
#: (``heuristics.tile_throughput``: 0.9 vs 1.71).
THIN_TILES = 0.75
#: Loop annotation of the merged loop: the chain's layers and rows per block.
CHAIN_ANNOTATION = "hybrid.gemm_chain"


@dataclasses.dataclass(frozen=True)
class ChainShape:
    """``layers`` GEMMs of ``m`` rows: each layer's ``(n, k, panel)`` (``n`` and ``k`` as
    packed, ``panel`` the packed weights' width) and the dtype of its ``A`` (``"float32"``,
    ``"uint8"`` or ``"int16"``)."""

    m: int
    layers: tuple[tuple[int, int, int], ...]
    dtypes: tuple[str, ...]


@dataclasses.dataclass
class GemmChain:
    """The chain found in a function: its GEMM blocks in order (the last is ``block``)."""

    gemms: list[GemmBlock]
    shape: ChainShape

    @property
    def block(self):
        return self.gemms[-1].block


@dataclasses.dataclass(frozen=True)
class ChainKnobs:
    """Rows per block and each layer's microkernel."""

    rows: int
    kernels: tuple[Microkernel, ...]

    @property
    def key(self) -> str:
        return f"{self.rows}/" + "/".join(k.name for k in self.kernels)

    def describe(self) -> str:
        tiles = ", ".join(f"{k.isa} {k.mr}x{k.nr}" for k in self.kernels)
        return f"blocks of {self.rows} rows, microkernels {tiles}"

    def as_dict(self) -> dict:
        return {"template": "gemm_chain", "rows": self.rows,
                "kernels": [k.name for k in self.kernels]}

    def layer_knobs(self, gemm: GemmBlock, kernel: Microkernel) -> GemmKnobs:
        """The GEMM template's knobs of one layer: one block of ``rows`` rows, every column."""
        return GemmKnobs(kernel, self.rows // kernel.mr, gemm.shape.n // kernel.nr, "nm")


class GemmChainTemplate(Template):
    """Schedule a chain of GEMM layers in one parallel loop (module docstring)."""

    name = "gemm_chain"
    title = "GEMM chain template"

    def available(self, target: Target) -> bool:
        return has_gemm_kernels(target)

    def match(self, sch: s_tir.Schedule, target: Target) -> list[GemmChain] | None:
        gemms = prepare_chain(sch)
        if not gemms or len(gemms) < 2:
            return None
        chain = match_chain(sch, gemms)
        return [chain] if chain is not None else None

    def heuristic(self, workload: GemmChain, target: Target) -> ChainKnobs | None:
        options = self.variants(workload, target)
        return options[0] if options else None

    def fits(self, workload: GemmChain, knobs: ChainKnobs, target: Target) -> bool:
        if len(knobs.kernels) != len(workload.gemms) or workload.shape.m % knobs.rows:
            return False
        for gemm, kernel in zip(workload.gemms, knobs.kernels):
            if not set(kernel.features) <= target_features(target) or kernel.per_block:
                return False
            if kernel not in candidate_kernels(gemm, target) or knobs.rows % kernel.mr:
                return False
        return True

    def schedule(self, sch: s_tir.Schedule, workload: GemmChain, knobs: ChainKnobs):
        layers = [(gemm, knobs.layer_knobs(gemm, kernel))
                  for gemm, kernel in zip(workload.gemms, knobs.kernels)]
        loops = [tile_gemm(sch, gemm, layer, sampled=False) for gemm, layer in layers]
        # Each layer's epilogue into its tiles first: the merged loop takes the last
        # layer's place, after the earlier layers' epilogue blocks.
        for gemm, _ in layers:
            attach_gemm_epilogue(sch, gemm)
        _check_attached(sch, workload.gemms, loops)
        merged = sch.merge(*loops)
        sch.parallel(merged)
        for gemm, layer in layers:
            tensorize_gemm(sch, gemm, layer)
        sch.annotate(merged, CHAIN_ANNOTATION, f"{len(layers)} layers, {knobs.rows} rows a block")
        return merged

    def flops(self, workload: GemmChain) -> float:
        m = workload.shape.m
        return float(sum(2 * m * n * k for n, k, _ in workload.shape.layers))

    def variants(self, workload: GemmChain, target: Target) -> list[ChainKnobs]:
        return chain_variants(workload.shape, target)

    def neighbours(self, workload: GemmChain, knobs: ChainKnobs,
                   target: Target) -> list[ChainKnobs]:
        by_rows = {k.rows: k for k in self.variants(workload, target)}
        return [by_rows[rows] for rows in adjacent(sorted(by_rows), knobs.rows)]

    def random(self, workload: GemmChain, target: Target, rng: random.Random) -> ChainKnobs:
        return rng.choice(self.variants(workload, target))

    def size(self, workload: GemmChain, target: Target) -> int:
        return len(self.variants(workload, target))

    def knobs_from_dict(self, data: dict) -> ChainKnobs:
        return ChainKnobs(int(data["rows"]),
                          tuple(microkernel_by_name(n) for n in data["kernels"]))


def chain_variants(shape: ChainShape, target: Target) -> list[ChainKnobs]:
    """The knobs a chain of ``shape`` can take on ``target``, the heuristic's first (empty:
    the template would decline it, so no chain should be formed)."""
    threads = target_threads(target)
    out = []
    for rows in row_choices(shape, threads):
        kernels = []
        for (n, k, panel), dtype in zip(shape.layers, shape.dtypes):
            ranked = select(target, dtype, GemmShape(1, shape.m, n, k), panel=panel)
            fitting = [kern for kern in ranked if rows % kern.mr == 0]
            # A layer the GEMM template would put on per-block tiles (AMX) stays on its own.
            if not fitting or ranked[0].per_block or fitting[0].per_block:
                break
            kernels.append(fitting[0])
        else:
            out.append(ChainKnobs(rows, tuple(kernels)))
    return out


def thin_tiles(shape: ChainShape, knobs: ChainKnobs, target: Target) -> bool:
    """Whether a layer of the chain ``knobs`` runs on a tile with less than
    :data:`THIN_TILES` of the throughput of the tile its per-layer kernel would take (all
    ``M`` rows): the cost model then keeps the layers apart."""
    for (n, k, panel), dtype, kernel in zip(shape.layers, shape.dtypes, knobs.kernels):
        ranked = select(target, dtype, GemmShape(1, shape.m, n, k), panel=panel)
        if ranked and tile_throughput(kernel) < THIN_TILES * tile_throughput(ranked[0]):
            return True
    return False


def row_choices(shape: ChainShape, threads: int) -> list[int]:
    """Rows per block, the heuristic's first: the row blocks split evenly over the threads
    (as few blocks as that allows), each block's widest ``A`` within a quarter of L2."""
    budget = cache_sizes().l2 // 4
    widest = max(k for _, k, _ in shape.layers)
    out = []
    for rows in sorted(divisors(shape.m), reverse=True):
        blocks = shape.m // rows
        if blocks < threads or blocks % threads or rows * widest * 4 > budget:
            continue
        out.append(rows)
    return out


def prepare_chain(sch: s_tir.Schedule) -> list[GemmBlock] | None:
    """Inline the free producers of the first reduction, and each layer's elementwise
    epilogue into one block (HardSwish, SiLU, GELU read the layer's output twice), but never
    into the next layer (it would be recomputed in that layer's ``K`` loop); the GEMM blocks
    found, or None when ``sch`` has opaque blocks."""
    root = sch.get_sblock("root")
    infos = [get_sblock_info(sch, b) for b in sch.get_child_blocks(root)]
    if any("O" in info.dom_kind() for info in infos):
        return None
    first = next((n for n, info in enumerate(infos) if info.is_reduction()), None)
    if first is None:
        return None
    inline_free_producers(sch, infos[:first])
    _inline_epilogues(sch)
    gemms = [match_gemm(sch, block) for block in reduction_blocks(sch)]
    return None if any(g is None for g in gemms) else gemms


def _inline_epilogues(sch: s_tir.Schedule) -> None:
    """Inline every intermediate elementwise block none of whose consumers is a reduction."""
    root = sch.get_sblock("root")
    internal = list(sch.get(root).alloc_buffers)
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(root):
            if is_reduction(sch, block):
                continue
            writes = sch.get(block).writes
            if not all(any(w.source.same_as(b) for b in internal) for w in writes):
                continue  # writes a parameter: the function's output
            consumers = sch.get_consumers(block)
            if not consumers or any(is_reduction(sch, c) for c in consumers):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                continue
            changed = True
            break


def _check_attached(sch: s_tir.Schedule, gemms: list[GemmBlock], loops: list) -> None:
    """Every block between two layers must be under the earlier layer's loop before the loops
    merge (the merged loop takes the last layer's place: a block left outside it would run
    before the rows it reads exist)."""
    for gemm, nxt, loop in zip(gemms, gemms[1:], loops):
        for block in _path(sch, gemm.block, nxt.block):
            outer = sch.get_loops(block)
            if not outer or not sch.get(outer[0]).same_as(sch.get(loop)):
                raise s_tir.ScheduleError(
                    f"block {sch.get(block).name_hint} between two layers stayed outside the "
                    "first layer's tiles")


def match_chain(sch: s_tir.Schedule, gemms: list[GemmBlock]) -> GemmChain | None:
    """``gemms`` as a chain of 2-D packed fp32 or integer layers of one ``M``, each reading the
    previous one's output (through elementwise blocks only), else None."""
    if any(g.shape.batch != 1 or g.packed_nr is None
           or g.dtype not in ("float32", "uint8", "int16") for g in gemms):
        return None
    m = gemms[0].shape.m
    if any(g.shape.m != m for g in gemms):
        return None
    for before, after in zip(gemms, gemms[1:]):
        if not _feeds(sch, before.block, after.block):
            return None
    shape = ChainShape(m, tuple((g.shape.n, g.shape.k, g.packed_nr) for g in gemms),
                       tuple(g.dtype for g in gemms))
    return GemmChain(gemms, shape)


def _feeds(sch: s_tir.Schedule, producer, consumer) -> bool:
    """Whether ``consumer`` reads what ``producer`` computes through a chain of single-consumer
    non-reduction blocks."""
    return _path(sch, producer, consumer) is not None


def _path(sch: s_tir.Schedule, producer, consumer) -> list | None:
    """The blocks from ``producer`` (excluded) to ``consumer`` (excluded) when they are a
    chain of single-consumer non-reduction blocks, else None."""
    block, path = producer, []
    for _ in range(16):
        consumers = sch.get_consumers(block)
        if len(consumers) != 1:
            return None
        nxt = consumers[0]
        if sch.get(nxt).same_as(sch.get(consumer)):
            return path
        if is_reduction(sch, nxt):
            return None
        path.append(nxt)
        block = nxt
    return None
