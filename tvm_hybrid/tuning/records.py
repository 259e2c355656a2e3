"""The tuning-records file: what ``tvm-hybrid tune`` writes and ``compile`` applies.

One JSON file holds, for one target, every tuned task: its MetaSchedule workload (the fused
PrimFunc), the best schedule found (a MetaSchedule ``TuningRecord``: the template's trace with
its decisions) and every configuration measured, so that an interrupted run resumes where it
stopped. Compiling with the file replays each best trace through MetaSchedule's
``ApplyDatabase``; nothing is measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..errors import TuningRecordsError, first_line
from ..host import names_narrow_vectors, target_to_dict
from ..microkernels import ensure_tensor_intrin
from ..microkernels.registry import INTRIN_PREFIX
from .attention import AttentionRecord
from .search import SearchState, Trial
from .space import knobs_from_dict

FORMAT = "tvm_hybrid.tuning_records"
VERSION = 1


def target_identity(target: Target) -> dict:
    """The parts of a target a schedule depends on: CPU, ISA features, cores, triple (not the
    vector width LLVM's vectorizers prefer, :func:`~tvm_hybrid.host.wide_vectors`: records made
    before that was set still apply)."""
    spec = target_to_dict(target)
    attrs = [a for a in spec.get("mattr") or [] if not names_narrow_vectors(a)]
    return {
        "mcpu": spec.get("mcpu"),
        "mattr": sorted(str(a) for a in attrs),
        "num-cores": spec.get("num-cores"),
        "mtriple": spec.get("mtriple"),
    }


@dataclasses.dataclass
class TaskRecords:
    """Tuning results of one task (one fused kernel)."""

    name: str
    weight: int
    workload: ms.database.Workload
    state: SearchState = dataclasses.field(default_factory=SearchState)
    best: ms.database.TuningRecord | None = None
    search: str = "neighbourhood"
    wall_s: float = 0.0
    #: The configuration kept after the confirmation runs (the heuristic's when the search's
    #: winner did not beat it again).
    confirmed: str | None = None

    @property
    def key(self) -> str:
        return workload_key(self.workload.mod)

    def summary(self) -> dict:
        best, heuristic = self.state.best(), self.state.heuristic
        return {
            "name": self.name,
            "trials": len(self.state.trials),
            "heuristic_ms": heuristic.seconds * 1e3 if heuristic and heuristic.ok else None,
            "best_ms": best.seconds * 1e3 if best else None,
            "best": best.key if best else None,
            "kept": self.confirmed or (best.key if best else None),
            "kept_ms": (float(min(self.best.run_secs)) * 1e3
                        if self.best is not None and self.best.run_secs else None),
        }


def workload_key(mod: tvm.IRModule) -> str:
    """The structural hash MetaSchedule identifies a workload by, as a string."""
    return str(tvm_ffi.structural_hash(mod))


@dataclasses.dataclass
class RecordsFile:
    """All tuned tasks of one model for one target."""

    target: dict
    tasks: dict[str, TaskRecords] = dataclasses.field(default_factory=dict)
    model: str = ""
    #: Fused attention workloads (``tuning/attention.py``), by workload key.
    attention: dict[str, AttentionRecord] = dataclasses.field(default_factory=dict)

    def attention_knobs(self) -> dict[str, dict]:
        """The kept knobs of every tuned attention workload, by workload key."""
        return {k: r.kept for k, r in self.attention.items() if r.kept is not None}

    def check_target(self, target: Target, source: str | os.PathLike) -> None:
        """Raise :class:`TuningRecordsError` unless these records were made for ``target``."""
        wanted = target_identity(target)
        made = self.target.get("identity", {})
        if made != wanted:
            diff = ", ".join(f"{k}: tuned for {made.get(k)!r}, compiling for {wanted[k]!r}"
                             for k in wanted if made.get(k) != wanted[k])
            raise TuningRecordsError(
                f"{source} was tuned for another target ({diff}); tune again for this target "
                "or compile with the target the records were made for"
            )

    def database(self) -> ms.database.Database:
        """A MetaSchedule database holding the best schedule of every task."""
        database = ms.database.MemoryDatabase()
        for task in self.tasks.values():
            if task.best is None:
                continue
            workload = database.commit_workload(task.workload.mod)
            database.commit_tuning_record(ms.database.TuningRecord(
                task.best.trace, workload, task.best.run_secs, task.best.target,
                task.best.args_info))
        return database

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file atomically (a crash never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": FORMAT,
            "version": VERSION,
            "tvm": tvm.__version__,
            "model": self.model,
            "target": self.target,
            "tasks": [_task_json(t) for t in self.tasks.values()],
            "attention": [r.as_json() for r in self.attention.values()],
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=1)
        os.replace(tmp, path)
        return path


def new_records(target: Target, model: str) -> RecordsFile:
    """Empty records for ``target``."""
    return RecordsFile(target={"target": target_to_dict(target),
                               "identity": target_identity(target)}, model=model)


def load_records(path: str | os.PathLike) -> RecordsFile:
    """Read a records file written by :meth:`RecordsFile.save`.

    Raises
    ------
    TuningRecordsError
        When the file is missing, not JSON, or not a tvm_hybrid records file.
    """
    path = Path(path)
    if not path.is_file():
        raise TuningRecordsError(f"tuning records not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TuningRecordsError(f"{path}: not a JSON tuning-records file ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TuningRecordsError(
            f"{path}: not a tvm_hybrid tuning-records file (no \"format\": \"{FORMAT}\"); "
            "a MetaSchedule work directory can be passed as a directory instead"
        )
    if data.get("version") != VERSION:
        raise TuningRecordsError(f"{path}: records version {data.get('version')} is not "
                                 f"supported (this tvm_hybrid reads version {VERSION})")
    records = RecordsFile(target=data.get("target", {}), model=data.get("model", ""))
    try:
        for item in data["tasks"]:
            task = _task_from_json(item)
            records.tasks[task.key] = task
        for item in data.get("attention", []):
            record = AttentionRecord.from_json(item)
            records.attention[record.key] = record
    except TuningRecordsError:
        raise
    except Exception as err:  # noqa: BLE001 - TVM's JSON readers raise several kinds
        raise TuningRecordsError(f"{path}: unreadable tuning records ({first_line(err)})") \
            from None
    return records


def _task_json(task: TaskRecords) -> dict:
    return {
        "name": task.name,
        "weight": task.weight,
        "search": task.search,
        "wall_s": round(task.wall_s, 3),
        "summary": task.summary(),
        "workload": task.workload.as_json(),
        "best": task.best.as_json() if task.best is not None else None,
        "heuristic": task.state.heuristic_key,
        "confirmed": task.confirmed,
        "measured": [
            {"key": t.key,
             "knobs": [k.as_dict() for k in t.config] if t.config is not None else None,
             "seconds": t.seconds if t.ok else None}
            for t in task.state.trials.values()
        ],
    }


def register_intrinsics_named(text: str) -> list[str]:
    """Register each of our tensor intrinsics that ``text`` (a trace's JSON) names: the
    microkernels' (``microkernels.registry.INTRIN_NAME``) and the per-block kernels' zeroing
    intrinsic (``ZERO_INTRIN_NAME``). Returns the names registered."""
    return [name for name in dict.fromkeys(re.findall(INTRIN_PREFIX + r"\w+", text))
            if ensure_tensor_intrin(name)]


def _task_from_json(item: dict) -> TaskRecords:
    workload = ms.database.Workload.from_json(item["workload"])
    best = None
    if item.get("best") is not None:
        # Reading a trace checks its tensor intrinsics exist: register ours first.
        register_intrinsics_named(json.dumps(item["best"]))
        best = ms.database.TuningRecord.from_json(item["best"], workload)
    state = SearchState(heuristic_key=item.get("heuristic"))
    for trial in item.get("measured", []):
        try:
            config = tuple(knobs_from_dict(k) for k in trial["knobs"]) if trial["knobs"] \
                else None
        except KeyError:
            config = None
        seconds = trial["seconds"] if trial["seconds"] is not None else math.inf
        state.trials[trial["key"]] = Trial(trial["key"], config, float(seconds))
    return TaskRecords(item["name"], int(item.get("weight", 1)), workload, state, best,
                       item.get("search", "neighbourhood"), float(item.get("wall_s", 0.0)),
                       item.get("confirmed"))
