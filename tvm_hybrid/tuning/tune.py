"""``tvm_hybrid.tune``: search the expert templates' knobs of a model's kernels.

The model goes through the hybrid pipeline up to TIR scheduling; every fused kernel the GEMM
template covers becomes a task whose space is the template's knobs (``space.py``). Each task
measures the heuristic's configuration first, then searches (``search.py``) with its share of
the trials; the best schedule of every task goes to one records file, written after every round
so that an interrupted run resumes. ``tvm_hybrid.compile(..., tuning_records=FILE)`` applies it.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..compile_lock import COMPILER_LOCK
from ..errors import CompileError, TuningRecordsError, TVMHybridError, first_line
from ..frontend import import_model
from ..host import make_target
from ..pipeline import prepare_passes
from ..schedules.template import is_scheduled
from .attention import attention_workloads, tune_attention
from .measure import Measurer, RPCSettings
from .records import RecordsFile, TaskRecords, load_records, new_records, workload_key
from .search import SearchState, Trial, median, neighbourhood_search
from .space import TemplateSpace, config_key, template_space

logger = logging.getLogger(__name__)

SEARCHES = ("neighbourhood", "evolutionary")
RECORDS_NAME = "records.json"

#: The search's winner must beat the heuristic by this fraction in the confirmation runs.
CONFIRM_MARGIN = 0.01
#: Interleaved re-measurements of (heuristic, winner) in the confirmation.
CONFIRM_ROUNDS = 3


OTHERS = ("skip", "metaschedule")


class Task:
    """One kernel to tune: its workload module, the template's space (None for a kernel no
    template covers), its trial budget."""

    def __init__(self, extracted: ms.ExtractedTask, space: TemplateSpace | None):
        self.name = extracted.task_name
        self.weight = int(extracted.weight)
        self.mod = extracted.dispatched[0]
        self.key = workload_key(self.mod)
        self.space = space
        self.budget = 1

    @property
    def templated(self) -> bool:
        return self.space is not None

    @property
    def cost(self) -> float:
        return self.space.flops * self.weight if self.space is not None else 0.0


def extract_tasks(model, target: Target, *, input_shapes=None, params=None,
                  others: bool = False, precision: str = "fp32") -> list[Task]:
    """The kernels of ``model`` to tune, after the hybrid pipeline's fusion phases.

    Those the GEMM template covers come first; with ``others``, the remaining kernels follow
    (without a template space).
    """
    from ..compiler import _bind_params

    with COMPILER_LOCK:
        return _extract_tasks(model, target, input_shapes, params, others, precision,
                              _bind_params)[0]


def _extract_tasks(model, target, input_shapes, params, others, precision, bind_params):
    """``(tasks, attention workloads)`` of ``model`` after the fusion phases."""
    imported = import_model(model, input_shapes=input_shapes)
    mod = bind_params(imported.mod, params) if params else imported.mod
    try:
        with warnings.catch_warnings(), target:
            warnings.simplefilter("ignore")
            prepared = tvm.transform.Sequential(prepare_passes(target, precision))(mod)
            extracted = ms.relax_integration.extract_tasks(prepared, target)
    except TVMHybridError:
        raise
    except Exception as err:
        raise CompileError(f"TVM failed to prepare {imported.source} for tuning: "
                           f"{first_line(err)}") from err
    tasks, rest = [], []
    for item in extracted:
        if is_scheduled(item.dispatched[0]["main"]):
            continue  # generated scheduled (fused attention): searched by tune_attention
        space = TemplateSpace(item.dispatched[0]["main"], target)
        if space:
            tasks.append(Task(item, space))
        else:
            rest.append(Task(item, None))
    return tasks + (rest if others else []), attention_workloads(prepared)


def split_budget(tasks: list[Task], trials: int) -> None:
    """Give every task its heuristic trial, and the rest in proportion to its FLOPs.

    Kernels without a template (no FLOP estimate) count as the average templated kernel.
    """
    for task in tasks:
        task.budget = 1
    spare = max(0, trials - len(tasks))
    templated = [t.cost for t in tasks if t.templated]
    average = sum(templated) / len(templated) if templated else 1.0
    costs = [t.cost if t.templated else average for t in tasks]
    total = sum(costs) or 1.0
    shares = [spare * c / total for c in costs]
    for task, share in zip(tasks, shares):
        task.budget += int(share)
    leftover = spare - sum(int(s) for s in shares)
    by_fraction = sorted(range(len(tasks)), key=lambda i: shares[i] - int(shares[i]),
                         reverse=True)
    for index in by_fraction[:leftover]:
        tasks[index].budget += 1
    for task in tasks:
        if task.templated:
            task.budget = min(task.budget, task.space.size())


def tune(
    model: str | os.PathLike | bytes | onnx.ModelProto | tvm.IRModule,
    target="host",
    *,
    trials: int = 64,
    work_dir: str | os.PathLike = "tvm_hybrid_tuning",
    output: str | os.PathLike | None = None,
    input_shapes: dict[str, tuple] | None = None,
    params: dict[str, np.ndarray] | None = None,
    search: str = "neighbourhood",
    cost_model: str = "random",
    others: str = "skip",
    rpc: RPCSettings | None = None,
    batch: int = 4,
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    precision: str = "fp32",
) -> Path:
    """Tune the template knobs of ``model``'s kernels; return the path of the records file.

    The GEMM and convolution templates' kernels are searched by schedule (traces in the
    records); each fused attention workload by its knob sets (``tuning/attention.py``).

    Parameters
    ----------
    model
        What :func:`tvm_hybrid.compile` accepts: an ONNX path, bytes, ``onnx.ModelProto`` or
        Relax ``IRModule``.
    target
        The target to tune for (``"host"`` by default); records only apply to that target.
    trials
        Configurations to measure in total, over all tasks. Every task measures the
        heuristic's configuration first; the rest are shared in proportion to FLOPs.
    work_dir
        Directory for the records file (and MetaSchedule's logs with ``search="evolutionary"``).
    output
        Path of the records file; ``WORK_DIR/records.json`` by default.
    input_shapes, params
        As for :func:`tvm_hybrid.compile`.
    search
        ``"neighbourhood"`` (default): guided moves from the heuristic over the knobs.
        ``"evolutionary"``: MetaSchedule's evolutionary search with a cost model, over the same
        space (the template as a space generator, only tile sizes mutated).
    cost_model
        MetaSchedule cost model for ``search="evolutionary"``: ``"random"`` or ``"xgb"`` (needs
        the ``xgboost`` package).
    others
        Kernels no template covers: ``"skip"`` (default; they keep the fallback rule's
        schedule) or ``"metaschedule"`` (searched with MetaSchedule's stock rules, seeded with
        the fallback schedule, which is kept unless beaten).
    rpc
        Measure on the machines behind this RPC tracker instead of locally (neighbourhood
        search).
    batch
        Configurations built and measured per round.
    seed
        Seed of the random choices.
    resume
        Continue from the records already in ``output`` (same target) instead of starting over.
    progress
        Show a progress bar (tasks, trials, best so far) on stderr.
    precision
        The precision mode the records are for (as for :func:`tvm_hybrid.compile`).

    Returns
    -------
    pathlib.Path
        The records file, for ``tvm_hybrid.compile(..., tuning_records=path)``.
    """
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    if others not in OTHERS:
        raise ValueError(f"others must be one of {OTHERS}, got {others!r}")
    if rpc is not None and (search != "neighbourhood" or others != "skip"):
        raise ValueError("rpc measurement is supported with search='neighbourhood' and "
                         "others='skip'")
    tgt = make_target(target)
    from ..compiler import check_precision

    check_precision(precision, tgt)
    work_dir = Path(work_dir)
    path = Path(output) if output is not None else work_dir / RECORDS_NAME
    source = str(model) if isinstance(model, (str, os.PathLike)) else "<model>"
    from ..compiler import _bind_params

    with COMPILER_LOCK:
        tasks, attention = _extract_tasks(model, tgt, input_shapes, params,
                                          others == "metaschedule", precision, _bind_params)
    records = _start_records(path, tgt, source, resume)
    if not tasks and not attention:
        logger.warning("%s: no kernel is covered by a template; nothing to tune", source)
        return records.save(path)
    # Attention workloads get their share of the trials by FLOPs, at most their knob sets.
    attention_budget = _attention_budget(tasks, attention, trials, tgt)
    split_budget(tasks, max(len(tasks), trials - sum(attention_budget.values())))
    measurer = Measurer(tgt, rpc=rpc)
    total = sum(t.budget for t in tasks) + sum(attention_budget.values())
    done = sum(min(len(records.tasks[t.key].state.trials), t.budget)
               for t in tasks if t.key in records.tasks)
    bar = _progress(total, done, progress)
    try:
        for shape in attention:
            bar.set_description(f"attention {shape.batch}x{shape.heads}x{shape.q_len}")
            records.attention[shape.key] = tune_attention(
                shape, tgt, measurer, attention_budget[shape.key],
                records.attention.get(shape.key), bar.update)
            records.save(path)
        for index, task in enumerate(tasks, 1):
            kind = search if task.templated else "metaschedule"
            entry = records.tasks.get(task.key) or TaskRecords(
                task.name, task.weight, ms.database.Workload(task.mod), search=kind)
            records.tasks[task.key] = entry
            bar.set_description(f"task {index}/{len(tasks)} {task.name[:40]}")
            started = time.perf_counter()
            if task.templated and search == "neighbourhood":
                _neighbourhood(task, entry, measurer, tgt, records, path, bar, batch, seed)
            else:
                _metaschedule(task, entry, measurer, tgt, work_dir / "metaschedule",
                              cost_model, seed, lambda n, e=entry: _advance(bar, e, n))
            entry.wall_s += time.perf_counter() - started
            records.save(path)
    finally:
        bar.close()
    return path


def _attention_budget(tasks: list[Task], attention: list, trials: int,
                      target: Target) -> dict[str, int]:
    """Trials per attention workload: its share of ``trials`` by FLOPs among all tasks, at
    least 4, at most its number of knob sets."""
    from ..schedules.attention import variants

    flops = sum(t.cost for t in tasks) + sum(s.flops for s in attention) or 1.0
    return {s.key: min(len(variants(target, s)), max(4, round(trials * s.flops / flops)))
            for s in attention}


def _metaschedule(task: Task, entry: TaskRecords, measurer: Measurer, target: Target,
                  work_dir: Path, cost_model: str, seed: int, advance) -> None:
    from ..schedules import ParallelVectorize
    from .evolutionary import BASELINE, metaschedule_search

    func = task.mod["main"]
    if task.templated:
        heuristic = task.space.heuristic()
        baseline, key = task.space.schedule(heuristic), config_key(heuristic)
        space = template_space(target)
    else:
        baseline, key = ParallelVectorize().apply(func, target, False), BASELINE
        space = "post-order-apply"
    metaschedule_search(task, entry, measurer, target, baseline, key, space, work_dir,
                        cost_model, seed, advance)


def _start_records(path: Path, target: Target, source: str, resume: bool) -> RecordsFile:
    if resume and path.is_file():
        records = load_records(path)
        records.check_target(target, path)
        return records
    if path.exists() and not path.is_file():
        raise TuningRecordsError(f"{path} exists and is not a file")
    return new_records(target, source)


def _neighbourhood(task: Task, entry: TaskRecords, measurer: Measurer, target: Target,
                   records: RecordsFile, path: Path, bar, batch: int, seed: int) -> None:
    args_info = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
    batch_schedules: dict[str, s_tir.Schedule] = {}  # the last round's, by configuration key

    def measure(configs):
        batch_schedules.clear()
        for config in configs:
            try:
                batch_schedules[config_key(config)] = task.space.schedule(config)
            except ValueError:
                pass
        keys = list(batch_schedules)
        runs = measurer.measure([batch_schedules[k].mod for k in keys], args_info) if keys \
            else []
        seconds = dict(zip(keys, (median(r) for r in runs)))
        return [seconds.get(config_key(c), math.inf) for c in configs]

    def on_batch(state: SearchState, trials: list[Trial]) -> None:
        best = state.best()
        if best is not None and best.key in batch_schedules:  # a new best in this round
            entry.best = ms.database.TuningRecord(batch_schedules[best.key].trace,
                                                  entry.workload, [best.seconds], target,
                                                  args_info)
        _advance(bar, entry, len(trials))
        records.save(path)

    neighbourhood_search(task.space, measure, task.budget, state=entry.state, batch=batch,
                         seed=seed, on_batch=on_batch)
    _confirm(task, entry, measurer, target, args_info)
    if entry.best is None and entry.state.best() is not None:
        # Resumed with the search already complete but no trace kept: rebuild the best one.
        best = entry.state.best()
        sch = task.space.schedule(best.config)
        entry.best = ms.database.TuningRecord(sch.trace, entry.workload, [best.seconds], target,
                                              args_info)


def _confirm(task: Task, entry: TaskRecords, measurer: Measurer, target: Target,
             args_info) -> None:
    """Keep the heuristic unless the best beats it again in a fresh, interleaved measurement.

    Single measurements on a busy machine are noisy; a winner by noise would make the tuned
    model slower than the untuned one. Both are timed alternately, several times, and the
    search's winner stays only if its median is at least ``CONFIRM_MARGIN`` faster.
    """
    best, heuristic = entry.state.best(), entry.state.heuristic
    if best is None or heuristic is None or best.key == heuristic.key or best.config is None:
        return
    pair = [task.space.schedule(heuristic.config), task.space.schedule(best.config)]
    runs = measurer.measure([s.mod for s in pair], args_info, rounds=CONFIRM_ROUNDS)
    again = [median(r) for r in runs]
    if not again[1] < again[0] * (1 - CONFIRM_MARGIN):
        logger.info("%s: %s did not beat the heuristic again (%.4f vs %.4f ms); keeping it",
                    task.name, best.key, again[1] * 1e3, again[0] * 1e3)
        entry.best = ms.database.TuningRecord(pair[0].trace, entry.workload, [again[0]], target,
                                              args_info)
        entry.confirmed = heuristic.key
    else:
        entry.best = ms.database.TuningRecord(pair[1].trace, entry.workload, [again[1]], target,
                                              args_info)
        entry.confirmed = best.key


def _advance(bar, entry: TaskRecords, count: int) -> None:
    bar.update(count)
    best, heuristic = entry.state.best(), entry.state.heuristic
    if best is not None:
        postfix = {"best": f"{best.seconds * 1e3:.3f} ms"}
        if heuristic is not None and heuristic.ok:
            postfix["vs heuristic"] = f"{heuristic.seconds / best.seconds:.2f}x"
        bar.set_postfix(postfix, refresh=False)


def _progress(total: int, done: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit="trial", disable=not enabled, dynamic_ncols=True)
