"""The Template protocol: what an expert template offers the schedule rules and the tuner.

A template covers some blocks of a fused PrimFunc (its *workloads*: one GEMM, one direct
convolution...) and schedules each with a few knobs (microkernel, block sizes, loop order).
It says:

* ``match``: the workloads it covers in a function, in block order (after preparing the
  schedule, e.g. inlining producers), or None;
* ``heuristic``: the knobs an untuned compile uses for a workload (None: leave it to the
  fallback), and ``fits``: whether given knobs (a tuner's, a record's) can be applied;
* ``schedule``: apply knobs to one workload, returning the loop under which everything the
  template scheduled lives;
* the space a tuner searches: ``variants`` (one per structural choice, heuristic first),
  ``neighbours``, ``random``, ``size``; knobs round-trip through ``as_dict`` and
  ``knobs_from_dict`` (records) and name themselves with ``key``.

:class:`Template` is also the dlight ``ScheduleRule`` that applies the heuristic knobs, and
:func:`apply_template` applies any knobs; the tuner (``tuning/space.py``) needs nothing else, so
a new template is tunable without touching the tuner. Templates decline silently and fail
loudly (``rule_failures.py``).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Any, Protocol

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .parallel_vectorize import schedule_blocks
from .rule_failures import NotApplicable, template_failed


class Knobs(Protocol):
    """One workload's knobs (a frozen dataclass in practice)."""

    @property
    def key(self) -> str:
        """A stable string naming the knobs (tuning records, repeats)."""

    def describe(self) -> str:
        """The knobs in a user's words."""

    def as_dict(self) -> dict:
        """A JSON-able form with a ``"template"`` entry; ``knobs_from_dict`` reverses it."""


class Template(ScheduleRule, abc.ABC):
    """An expert template (module docstring); as a schedule rule it applies the heuristic."""

    #: Short name, stored in tuning records with the knobs.
    name: str = ""
    #: How failures name it: "the GEMM template failed on ...".
    title: str = ""

    def available(self, target: Target) -> bool:
        """Whether ``target`` has what the template needs at all (a quick check)."""
        return True

    @abc.abstractmethod
    def match(self, sch: s_tir.Schedule, target: Target) -> list | None:
        """Prepare ``sch`` and return the workloads it covers, in block order (or None).

        A workload has a ``block`` (the block the template schedules) and a ``shape``.
        """

    @abc.abstractmethod
    def heuristic(self, workload, target: Target) -> Knobs | None:
        """The untuned knobs for ``workload``, or None to leave it to the fallback."""

    @abc.abstractmethod
    def fits(self, workload, knobs: Knobs, target: Target) -> bool:
        """Whether ``knobs`` can be applied to ``workload`` on ``target``."""

    @abc.abstractmethod
    def schedule(self, sch: s_tir.Schedule, workload, knobs: Knobs):
        """Apply ``knobs``; return the loop holding every block the template scheduled."""

    @abc.abstractmethod
    def flops(self, workload) -> float:
        """Arithmetic operations of one call (the tuner's weight for the workload)."""

    @abc.abstractmethod
    def variants(self, workload, target: Target) -> list[Knobs]:
        """One knob set per structural choice (kernel, order), heuristic numbers, best first."""

    @abc.abstractmethod
    def neighbours(self, workload, knobs: Knobs, target: Target) -> list[Knobs]:
        """Knob sets one move away from ``knobs``, nearest moves first."""

    @abc.abstractmethod
    def random(self, workload, target: Target, rng: random.Random) -> Knobs:
        """A knob set drawn uniformly per knob."""

    @abc.abstractmethod
    def size(self, workload, target: Target) -> int:
        """How many distinct knob sets ``workload`` has."""

    @abc.abstractmethod
    def knobs_from_dict(self, data: dict) -> Knobs:
        """The knobs ``as_dict`` wrote (KeyError for an unknown microkernel)."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        applied = apply_template(self, func, target)
        return applied[0] if applied is not None else None

    def workloads(self, func: tirx.PrimFunc, target: Target) -> list:
        """The workloads of ``func`` the template schedules (those with heuristic knobs)."""
        if not isinstance(func, tirx.PrimFunc):
            return []
        return [w for w, _ in _matched(self, func, target, s_tir.Schedule(func))]


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` came scheduled (a generated kernel: fused attention, index checks);
    templates and tuners leave it alone."""
    return bool((func.attrs or {}).get("tirx.is_scheduled", False))


def has_blocks(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` has the ``root`` block that everything legalized from a TE compute
    has. A scan TOPI writes as one opaque block of plain loops (``cumsum_generic``: ONNX
    ``CumSum``) has none, and no template, nor their block lookups, can take it."""
    body = func.body
    return isinstance(body, s_tir.stmt.SBlockRealize) and body.block.name_hint == "root"


def _matched(template: Template, func, target: Target, sch: s_tir.Schedule) -> list[tuple]:
    """``(workload, heuristic knobs)`` for each workload ``template`` covers in ``func``
    (``sch`` prepared by its ``match``); empty when it takes none."""
    if not (isinstance(func, tirx.PrimFunc) and target.kind.name == "llvm"
            and template.available(target)) or is_scheduled(func) or not has_blocks(func):
        return []
    try:
        found = template.match(sch, target) or []
    except NotApplicable:
        return []
    pairs = [(w, template.heuristic(w, target)) for w in found]
    return [(w, k) for w, k in pairs if k is not None]


def apply_template(template: Template, func: tirx.PrimFunc, target: Target,
                   knobs: Sequence[Knobs] | None = None, *,
                   sch: s_tir.Schedule | None = None) -> tuple[s_tir.Schedule, list] | None:
    """Schedule ``func`` with ``template``, or return None when it does not apply.

    Parameters
    ----------
    template
        The template.
    func
        A fused PrimFunc.
    target
        The CPU target.
    knobs
        One knob set per workload the template schedules (:meth:`Template.workloads`), in
        block order (what a tuner searches); None uses the heuristic's. Knobs that do not fit
        are declined (None).
    sch
        A schedule of ``func`` to work in (MetaSchedule passes its own, to record the trace).

    Returns
    -------
    (s_tir.Schedule, list) or None
        The scheduled function and the knobs used for each workload.
    """
    if not isinstance(func, tirx.PrimFunc):
        return None
    sch = sch if sch is not None else s_tir.Schedule(func)
    matched = _matched(template, func, target, sch)
    if not matched:
        return None
    if knobs is None:
        knobs = [k for _, k in matched]
    if len(knobs) != len(matched):
        return None
    chosen = [(w, k) for (w, _), k in zip(matched, knobs)]
    if not all(template.fits(w, k, target) for w, k in chosen):
        return None
    try:
        done: set[str] = set()
        for workload, picked in chosen:
            done.add(sch.get(workload.block).name_hint)
            loop = template.schedule(sch, workload, picked)
            done.update(sch.get(b).name_hint for b in sch.get_child_blocks(loop))
        schedule_blocks(sch, target, done)
    except s_tir.ScheduleError as err:
        template_failed(template.title, func,
                        "; ".join(f"{w.shape} with {k.describe()}" for w, k in chosen), err)
        return None
    return sch, [k for _, k in chosen]


def knobs_from_dict(templates: Sequence[Template], data: dict[str, Any]) -> Knobs:
    """The knobs ``data`` describes, read by the template it names (``"gemm"`` if none: the
    records of earlier versions).

    Raises
    ------
    KeyError
        When the template or the microkernel named is unknown.
    """
    name = data.get("template", "gemm")
    for template in templates:
        if template.name == name:
            return template.knobs_from_dict(data)
    raise KeyError(f"unknown template {name!r}")


def adjacent(sizes: Sequence[int], current: int) -> list[int]:
    """The values next to ``current`` in the ascending ``sizes`` (a block size's moves)."""
    at = sizes.index(current) if current in sizes else 0
    return [sizes[i] for i in (at - 1, at + 1) if 0 <= i < len(sizes)]
