"""The GEMM template's knob space: what a tuner may change, and how it moves.

Per GEMM the knobs are the microkernel (any tail-free register tile of the target's kernels,
the :data:`MAX_KERNELS` best by the heuristic's ranking), the block sizes in tiles (divisors of
the tile counts; they also set how many parallel blocks the threads share), the tile loop
order and the ``K`` split (the whole ``K``, or blocks of the heuristic's size where ``K`` has
one). Everything else about the schedule (the microkernel's code, the epilogue placement,
vectorisation) is fixed by the template.
"""

from __future__ import annotations

import random

from ...host import cache_sizes
from ...microkernels import Microkernel
from ..template import adjacent
from .heuristics import GemmKnobs, GemmShape, choose_kernel, divisors, k_block_size, kernel_knobs

ORDERS = ("nm", "mn")

#: How many microkernels per GEMM a search considers (best first by the heuristic's score).
MAX_KERNELS = 4


def ranked_kernels(shape: GemmShape, fitting: list[Microkernel]) -> list[Microkernel]:
    """The :data:`MAX_KERNELS` best of ``fitting`` for ``shape``, best first."""
    fitting, ranked = list(fitting), []
    while fitting and len(ranked) < MAX_KERNELS:
        best = choose_kernel(shape, fitting)
        if best is None:
            break
        ranked.append(best)
        fitting = [k for k in fitting if k != best]
    return ranked


def default_knobs(shape: GemmShape, kernel: Microkernel, threads: int,
                  order: str = "nm") -> GemmKnobs:
    """``kernel`` with the heuristic's blocks (and ``K`` split) for it."""
    return kernel_knobs(shape, kernel, cache_sizes(), threads, order)


def variants(shape: GemmShape, kernels: list[Microkernel], threads: int) -> list[GemmKnobs]:
    """Each ranked kernel in each loop order, with the heuristic's blocks."""
    return [default_knobs(shape, k, threads, order) for k in kernels for order in ORDERS]


def neighbours(shape: GemmShape, knobs: GemmKnobs, kernels: list[Microkernel],
               threads: int) -> list[GemmKnobs]:
    """Moves: a block size to the next smaller or larger divisor (each dimension, then both),
    the other loop order, the other ``K`` split, another microkernel with its heuristic
    blocks."""
    kernel, order, k_block = knobs.kernel, knobs.order, knobs.k_block
    m_moves = adjacent(divisors(shape.m // kernel.mr), knobs.m_block)
    n_moves = adjacent(divisors(shape.n // kernel.nr), knobs.n_block)
    out = [GemmKnobs(kernel, m, knobs.n_block, order, k_block) for m in m_moves]
    out += [GemmKnobs(kernel, knobs.m_block, n, order, k_block) for n in n_moves]
    out += [GemmKnobs(kernel, m, n, order, k_block) for m in m_moves for n in n_moves]
    other = ORDERS[1 - ORDERS.index(order)]
    out.append(GemmKnobs(kernel, knobs.m_block, knobs.n_block, other, k_block))
    out += [GemmKnobs(kernel, knobs.m_block, knobs.n_block, order, split)
            for split in _k_splits(shape, kernel) if split != k_block]
    out += [default_knobs(shape, k, threads, knobs.order) for k in kernels if k != kernel]
    return out


def random_knobs(shape: GemmShape, kernels: list[Microkernel], rng: random.Random) -> GemmKnobs:
    """Knobs drawn uniformly per knob."""
    kernel = rng.choice(kernels)
    return GemmKnobs(kernel, rng.choice(divisors(shape.m // kernel.mr)),
                     rng.choice(divisors(shape.n // kernel.nr)), rng.choice(ORDERS),
                     rng.choice(_k_splits(shape, kernel)))


def size(shape: GemmShape, kernels: list[Microkernel]) -> int:
    """Number of distinct knob sets."""
    return sum(len(divisors(shape.m // k.mr)) * len(divisors(shape.n // k.nr))
               * len(_k_splits(shape, k)) for k in kernels) * len(ORDERS)


def _k_splits(shape: GemmShape, kernel: Microkernel) -> list[int]:
    """The ``k_block`` values of ``kernel`` for ``shape``: 0 (whole ``K``) and the heuristic's
    block size where ``K`` has one."""
    k_block = k_block_size(shape, kernel, cache_sizes())
    return [0, k_block] if k_block else [0]
