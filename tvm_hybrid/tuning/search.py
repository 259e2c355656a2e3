"""Guided neighbourhood search over the template's knobs.

The search starts from the heuristic's configuration (always measured first, so tuning can
only match or improve on an untuned compile), then repeatedly measures the unmeasured
neighbours of the best configurations so far: block sizes one divisor up or down, the other
loop order, other microkernels. When every neighbour of the leaders has been measured it
draws random configurations. This follows the observation that guided neighbourhood moves on
tile factors find good GEMM tilings after measuring a tiny fraction of the space, without a
cost model.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable

from .space import Config, TemplateSpace, config_key

#: How many of the best configurations so far have their neighbours explored.
LEADERS = 3


@dataclasses.dataclass
class Trial:
    """One measured configuration."""

    key: str
    config: Config | None
    seconds: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.seconds)


@dataclasses.dataclass
class SearchState:
    """Everything measured so far for one task (restored from records when resuming)."""

    trials: dict[str, Trial] = dataclasses.field(default_factory=dict)
    heuristic_key: str | None = None

    def best(self) -> Trial | None:
        finite = [t for t in self.trials.values() if t.ok]
        return min(finite, key=lambda t: t.seconds) if finite else None

    @property
    def heuristic(self) -> Trial | None:
        return self.trials.get(self.heuristic_key) if self.heuristic_key else None


def neighbourhood_search(
    space: TemplateSpace,
    measure: Callable[[list[Config]], list[float]],
    budget: int,
    *,
    state: SearchState | None = None,
    batch: int = 4,
    seed: int = 0,
    on_batch: Callable[[SearchState, list[Trial]], None] | None = None,
) -> SearchState:
    """Search ``space`` until ``budget`` configurations are measured (or the space is spent).

    Parameters
    ----------
    space
        The task's knob space.
    measure
        Times a list of configurations (seconds; ``inf`` for a failure).
    budget
        Total configurations to have measured, counting those already in ``state``.
    state
        What earlier (interrupted) runs measured; a new state by default.
    batch
        Configurations measured per round.
    seed
        Seed of the random draws.
    on_batch
        Called after each round with the state and the round's trials (progress, saving).

    Returns
    -------
    SearchState
    """
    state = state or SearchState()
    rng = random.Random(seed + len(state.trials))
    heuristic = space.heuristic()
    state.heuristic_key = config_key(heuristic)
    if state.heuristic_key not in state.trials and budget > 0:
        _run([heuristic], measure, state, on_batch)  # alone: nothing is measured before it
    misses = 0
    while len(state.trials) < budget:
        want = min(batch, budget - len(state.trials))
        picked = _next_configs(space, state, want, rng)
        if not picked:
            misses += 1
            if misses > 3:
                break  # the space is exhausted
            continue
        _run(picked, measure, state, on_batch)
    return state


def _next_configs(space: TemplateSpace, state: SearchState, want: int,
                  rng: random.Random) -> list[Config]:
    leaders = sorted((t for t in state.trials.values() if t.ok and t.config is not None),
                     key=lambda t: t.seconds)[:LEADERS]
    picked: dict[str, Config] = {}
    # Round-robin over the leaders' neighbourhoods, the best leader first.
    pools = [space.neighbours(t.config) for t in leaders]
    while len(picked) < want and any(pools):
        for pool in pools:
            while pool:
                config = pool.pop(0)
                key = config_key(config)
                if key not in state.trials and key not in picked:
                    picked[key] = config
                    break
            if len(picked) >= want:
                break
    for _ in range(50 * want):
        if len(picked) >= want:
            break
        config = space.random(rng)
        key = config_key(config)
        if key not in state.trials and key not in picked:
            picked[key] = config
    return list(picked.values())


def _run(configs: list[Config], measure, state: SearchState, on_batch) -> None:
    seconds = measure(configs)
    trials = [Trial(config_key(c), c, s) for c, s in zip(configs, seconds)]
    for trial in trials:
        state.trials[trial.key] = trial
    if on_batch is not None:
        on_batch(state, trials)


def median(values: list[float]) -> float:
    """Median of repeated timings; ``inf`` when any failed."""
    return math.inf if not values or any(not math.isfinite(v) for v in values) \
        else statistics.median(values)
