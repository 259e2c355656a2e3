"""A tuning task's search space: the knobs of the template that covers the task's function.

Whichever expert template covers a fused function (``schedules.TEMPLATES``: the GEMM template,
the direct convolution template...), its :class:`~tvm_hybrid.schedules.template.Template`
protocol gives the space: one knob set per workload it schedules (a *configuration*), the
heuristic's configuration, the moves a search makes, random draws, the space's size. Nothing
here depends on which template it is.

:func:`template_space` offers the same space to MetaSchedule as a space generator: one design
space per structural variant (microkernel, loop order), whose block sizes are
``sample_perfect_tile`` decisions, searched by ``MutateTileSize`` only.
"""

from __future__ import annotations

import random

from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..schedules import TEMPLATES, apply_template, covering_template
from ..schedules.template import Knobs
from ..schedules.template import knobs_from_dict as _knobs_from_dict

#: A configuration: the knobs of each workload of a function, in block order.
Config = tuple[Knobs, ...]


def config_key(config: Config) -> str:
    """A stable string naming ``config`` (used to skip repeats and in records)."""
    return ";".join(k.key for k in config)


def knobs_from_dict(data: dict) -> Knobs:
    """The knobs a record holds, read by the template it names (KeyError if unknown)."""
    return _knobs_from_dict(TEMPLATES, data)


class TemplateSpace:
    """The knob space of one fused function a template covers.

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
        covered = covering_template(func, target)
        self.template, self.workloads = covered if covered else (None, [])

    def __bool__(self) -> bool:
        return bool(self.workloads)

    @property
    def flops(self) -> float:
        """Arithmetic operations of one call (the templated workloads only)."""
        return sum(self.template.flops(w) for w in self.workloads) if self else 0.0

    def heuristic(self) -> Config:
        """The configuration the heuristic picks (what an untuned compile uses)."""
        return tuple(self.template.heuristic(w, self.target) for w in self.workloads)

    def variants(self) -> list[Config]:
        """The heuristic's configuration, then one per structural variant (the i-th variant
        of every workload together)."""
        per_workload = [self.template.variants(w, self.target) for w in self.workloads]
        return [self.heuristic(), *zip(*per_workload)]

    def neighbours(self, config: Config) -> list[Config]:
        """Configurations one move away from ``config`` (one workload's knobs changed),
        nearest moves first."""
        out: list[Config] = []
        for index, knobs in enumerate(config):
            moves = self.template.neighbours(self.workloads[index], knobs, self.target)
            out += [config[:index] + (move,) + config[index + 1:] for move in moves]
        return out

    def random(self, rng: random.Random) -> Config:
        """A configuration drawn uniformly per knob."""
        return tuple(self.template.random(w, self.target, rng) for w in self.workloads)

    def size(self) -> int:
        """Number of distinct configurations."""
        total = 1
        for workload in self.workloads:
            total *= self.template.size(workload, self.target)
        return total

    def schedule(self, config: Config) -> s_tir.Schedule:
        """The function scheduled by the template with ``config``.

        Raises
        ------
        ValueError
            When the template rejects the configuration.
        """
        applied = apply_template(self.template, self.func, self.target, list(config))
        if applied is None:
            raise ValueError(f"the {self.template.title} cannot apply {config_key(config)}")
        return applied[0]


def template_space(target: Target) -> ms.space_generator.ScheduleFn:
    """The templates as a MetaSchedule space generator, for MetaSchedule's own search.

    Each task gets one design space per structural variant (:meth:`TemplateSpace.variants`),
    the heuristic's first, with the heuristic's block sizes as the decisions. Only
    ``MutateTileSize`` mutates them, so the search never leaves the template.
    """

    def design_spaces(sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        func = sch.mod["main"]
        space = TemplateSpace(func, target)
        if not space:
            return [sch]
        out, seen = [], set()
        for config in space.variants():
            if config_key(config) in seen:
                continue
            seen.add(config_key(config))
            copy = sch.copy()
            copy.seed(sch.fork_seed())
            if apply_template(space.template, func, target, list(config), sch=copy) is not None:
                out.append(copy)
        return out or [sch]

    return ms.space_generator.ScheduleFn(
        design_spaces, sch_rules=[], postprocs=[],
        mutator_probs={ms.mutator.MutateTileSize(): 1.0},
    )
