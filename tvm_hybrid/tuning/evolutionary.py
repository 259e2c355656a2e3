"""MetaSchedule's own search (evolutionary, with a cost model), inside or outside the template.

Two uses:

* ``search="evolutionary"``: the template is MetaSchedule's space generator
  (:func:`~tvm_hybrid.tuning.space.template_space`); ``EvolutionarySearch`` samples and mutates
  only its tile-size decisions, and a cost model (``"random"``, or ``"xgb"`` with the optional
  ``xgboost`` package) ranks the candidates.
* ``others="metaschedule"``: kernels no template covers (softmax, layer norm, ...) are searched
  with MetaSchedule's stock rules.

Either way the schedule an untuned compile would use (the heuristic's, or the fallback rule's)
is measured first by tvm_hybrid and committed to the database, where the evolutionary search
picks its seeds; the final choice is never slower than it in these measurements.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..errors import TVMHybridError
from .search import Trial, median

BASELINE = "baseline"


def metaschedule_search(task, entry, measurer, target: Target, baseline: s_tir.Schedule | None,
                        baseline_key: str, space_generator, work_dir, cost_model: str,
                        seed: int, advance) -> None:
    """Tune ``task`` with MetaSchedule's evolutionary search; results go to ``entry``.

    Parameters
    ----------
    task
        The task (``task.mod``, ``task.name``, ``task.budget``).
    entry
        Its records (search state, best record), updated in place.
    measurer
        Times the baseline.
    target
        The target.
    baseline
        The schedule an untuned compile uses (measured first), or None (stock lowering).
    baseline_key
        Name of the baseline in the search state.
    space_generator
        The MetaSchedule space generator (the template's, or ``"post-order-apply"``).
    work_dir
        MetaSchedule's log directory.
    cost_model
        ``"random"`` or ``"xgb"``.
    seed
        Random seed.
    advance
        Called with the number of trials after each measured batch (progress).
    """
    if cost_model == "xgb":
        try:
            import xgboost  # noqa: F401
        except ImportError:
            raise TVMHybridError("cost model 'xgb' needs the xgboost package "
                                 "(pip install xgboost-cpu), or use cost_model='random'"
                                 ) from None
    args_info = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
    entry.state.heuristic_key = baseline_key
    database = ms.database.MemoryDatabase()
    workload = database.commit_workload(task.mod)
    if baseline is not None and baseline_key not in entry.state.trials:
        seconds = median(measurer.measure([baseline.mod], args_info)[0])
        entry.state.trials[baseline_key] = Trial(baseline_key, None, seconds)
        advance(1)
    base = entry.state.trials.get(baseline_key)
    if baseline is not None and base is not None and base.ok:
        database.commit_tuning_record(ms.database.TuningRecord(
            baseline.trace, workload, [base.seconds], target, args_info))
    if entry.best is not None:
        database.commit_tuning_record(ms.database.TuningRecord(
            entry.best.trace, workload, entry.best.run_secs, target, args_info))
    remaining = task.budget - len(entry.state.trials)
    if remaining > 0:
        _run(task, target, space_generator, database, remaining, Path(work_dir), cost_model,
             seed, advance)
    seen = {str(baseline.trace)} if baseline is not None else set()
    for record in database.get_all_tuning_records():
        text = str(record.trace)
        if text in seen:
            continue
        seen.add(text)
        runs = [float(s) for s in record.run_secs] if record.run_secs else []
        key = "trace:" + hashlib.sha1(text.encode()).hexdigest()[:16]
        entry.state.trials.setdefault(key, Trial(key, None, median(runs) if runs else math.inf))
    top = database.get_top_k(workload, 1)
    if not top:
        return
    seconds = median([float(s) for s in top[0].run_secs])
    if baseline is not None and base is not None and base.ok and not seconds < base.seconds:
        entry.best = ms.database.TuningRecord(baseline.trace, entry.workload, [base.seconds],
                                              target, args_info)
        entry.confirmed = baseline_key
    else:
        entry.best = ms.database.TuningRecord(top[0].trace, entry.workload, top[0].run_secs,
                                              target, args_info)


def _run(task, target, space_generator, database, trials, work_dir: Path, cost_model, seed,
         advance) -> None:
    @derived_object
    class _Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, candidates, builder_results, runner_results):
            advance(len(candidates))

    context = ms.TuneContext(
        mod=task.mod, target=target, space_generator=space_generator,
        search_strategy=ms.search_strategy.EvolutionarySearch(population_size=64,
                                                              init_min_unmeasured=16),
        task_name=task.name, rand_state=seed, num_threads="physical",
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    ms.tune_tasks(
        tasks=[context], task_weights=[1.0], work_dir=str(work_dir),
        max_trials_global=trials, max_trials_per_task=trials,
        num_trials_per_iter=min(trials, 8), database=database, cost_model=cost_model,
        measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                           _Progress()],
        task_scheduler="round-robin",
    )
