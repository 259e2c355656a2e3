"""The template's search space: the few knobs the expert GEMM template exposes.

For each GEMM of a fused function the knobs are the microkernel (any tail-free register tile
of the target's family), the block sizes in tiles (divisors of the tile counts; they also set
how many parallel blocks the threads share) and the tile loop order. A configuration is one
:class:`~tvm_hybrid.heuristics.GemmKnobs` per GEMM. Everything else about the schedule (the
microkernel's code, the epilogue placement, vectorisation) is fixed by the template.

:func:`template_space` offers the same space to MetaSchedule as a space generator: one design
space per (microkernel, loop order), whose block sizes are ``sample_perfect_tile`` decisions,
searched by ``MutateTileSize`` only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..heuristics import GemmKnobs, choose_blocks, choose_kernel, divisors
from ..host import cache_sizes
from ..schedules.gemm_analysis import GemmBlock
from ..schedules.gemm_template import apply_template, candidate_kernels, template_gemms
from ..thread_pool import num_threads

#: A configuration: the knobs of each GEMM of a function, in block order.
Config = tuple[GemmKnobs, ...]

ORDERS = ("nm", "mn")

#: How many microkernels per GEMM a search considers (best first by the heuristic's score).
MAX_KERNELS = 4


def config_key(config: Config) -> str:
    """A stable string naming ``config`` (used to skip repeats and in records)."""
    return ";".join(
        f"{k.kernel.name}/{k.m_block}/{k.n_block}/{k.order}" for k in config
    )


class TemplateSpace:
    """The knob space of one fused function the template covers.

    Parameters
    ----------
    func
        The fused PrimFunc (a tuning task).
    target
        The CPU target.
    """

    def __init__(self, func: tirx.PrimFunc, target: Target):
        self.func = func
        self.target = target
        self.gemms: list[GemmBlock] = template_gemms(func, target)
        self.threads = int(target.attrs.get("num-cores", 0)) or num_threads()
        self.caches = cache_sizes()
        self.kernels = [self._ranked_kernels(g) for g in self.gemms]

    def __bool__(self) -> bool:
        return bool(self.gemms)

    @property
    def flops(self) -> float:
        """Floating-point operations of one call (the GEMMs only)."""
        return float(sum(2 * g.shape.batch * g.shape.m * g.shape.n * g.shape.k
                         for g in self.gemms))

    def _ranked_kernels(self, gemm: GemmBlock):
        fitting = candidate_kernels(gemm, self.target)
        ranked = []
        while fitting and len(ranked) < MAX_KERNELS:
            best = choose_kernel(gemm.shape, fitting)
            ranked.append(best)
            fitting = [k for k in fitting if k != best]
        return ranked

    def _default_knobs(self, index: int, kernel, order: str = "nm") -> GemmKnobs:
        m_block, n_block = choose_blocks(self.gemms[index].shape, kernel, self.caches,
                                         self.threads)
        return GemmKnobs(kernel, m_block, n_block, order)

    def heuristic(self) -> Config:
        """The configuration the heuristic picks (what an untuned compile uses)."""
        return tuple(self._default_knobs(i, kernels[0]) for i, kernels in enumerate(self.kernels))

    def neighbours(self, config: Config) -> list[Config]:
        """Configurations one move away from ``config``, nearest moves first.

        Moves: a block size to the next smaller or larger divisor (each GEMM, each dimension,
        then both together), the other loop order, another microkernel with its heuristic
        blocks.
        """
        out: list[Config] = []
        for index, knobs in enumerate(config):
            gemm = self.gemms[index]
            m_sizes = divisors(gemm.shape.m // knobs.kernel.mr)
            n_sizes = divisors(gemm.shape.n // knobs.kernel.nr)
            m_moves = _adjacent(m_sizes, knobs.m_block)
            n_moves = _adjacent(n_sizes, knobs.n_block)
            variants = [GemmKnobs(knobs.kernel, m, knobs.n_block, knobs.order) for m in m_moves]
            variants += [GemmKnobs(knobs.kernel, knobs.m_block, n, knobs.order) for n in n_moves]
            variants += [GemmKnobs(knobs.kernel, m, n, knobs.order)
                         for m in m_moves for n in n_moves]
            other = ORDERS[1 - ORDERS.index(knobs.order)]
            variants.append(GemmKnobs(knobs.kernel, knobs.m_block, knobs.n_block, other))
            variants += [self._default_knobs(index, k, knobs.order)
                         for k in self.kernels[index] if k != knobs.kernel]
            out += [config[:index] + (v,) + config[index + 1:] for v in variants]
        return out

    def random(self, rng: random.Random) -> Config:
        """A configuration drawn uniformly per knob."""
        config = []
        for index, kernels in enumerate(self.kernels):
            kernel = rng.choice(kernels)
            gemm = self.gemms[index]
            config.append(GemmKnobs(kernel,
                                    rng.choice(divisors(gemm.shape.m // kernel.mr)),
                                    rng.choice(divisors(gemm.shape.n // kernel.nr)),
                                    rng.choice(ORDERS)))
        return tuple(config)

    def size(self) -> int:
        """Number of distinct configurations."""
        total = 1
        for index, kernels in enumerate(self.kernels):
            shape = self.gemms[index].shape
            total *= sum(len(divisors(shape.m // k.mr)) * len(divisors(shape.n // k.nr))
                         for k in kernels) * len(ORDERS)
        return total

    def schedule(self, config: Config) -> s_tir.Schedule:
        """The function scheduled by the template with ``config``.

        Raises
        ------
        ValueError
            When the template rejects the configuration.
        """
        applied = apply_template(self.func, self.target, list(config))
        if applied is None:
            raise ValueError(f"the template cannot apply {config_key(config)}")
        return applied[0]


def _adjacent(sizes: Sequence[int], current: int) -> list[int]:
    at = sizes.index(current) if current in sizes else 0
    return [sizes[i] for i in (at - 1, at + 1) if 0 <= i < len(sizes)]


def template_space(target: Target) -> ms.space_generator.ScheduleFn:
    """The template as a MetaSchedule space generator, for MetaSchedule's own search.

    Each task gets one design space per (microkernel, loop order); the heuristic's microkernel
    and order come first, with the heuristic's block sizes as the decisions. Only
    ``MutateTileSize`` mutates them, so the search never leaves the template.
    """

    def design_spaces(sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        func = sch.mod["main"]
        space = TemplateSpace(func, target)
        if not space:
            return [sch]
        heuristic = space.heuristic()
        variants = [heuristic]
        variants += [tuple(space._default_knobs(i, k, order) for i, k in enumerate(kernels))
                     for kernels in zip(*space.kernels) for order in ORDERS]
        out, seen = [], set()
        for config in variants:
            if config_key(config) in seen:
                continue
            seen.add(config_key(config))
            copy = sch.copy()
            copy.seed(sch.fork_seed())
            if apply_template(func, target, list(config), sch=copy) is not None:
                out.append(copy)
        return out or [sch]

    return ms.space_generator.ScheduleFn(
        design_spaces, sch_rules=[], postprocs=[],
        mutator_probs={ms.mutator.MutateTileSize(): 1.0},
    )
