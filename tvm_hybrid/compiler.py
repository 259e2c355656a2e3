"""``tvm_hybrid.compile``: import a model, run the hybrid (or stock) pipeline, build it."""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from .artifact import embed_metadata
from .compile_cache import (
    CACHE_VARIABLE,
    DEFAULT_MAX_BYTES,
    cache_key,
    cached_compile,
    model_bytes,
)
from .compile_lock import COMPILER_LOCK
from .compiled_model import CompiledModel
from .errors import (
    CompileError,
    OptionError,
    TargetError,
    TemplateError,
    TuningRecordsError,
    UnsupportedModelError,
    first_line,
)
from .frontend import import_model, load_onnx
from .frontend.importer import is_static, onnx_inputs
from .frontend.value_inputs import value_inputs, with_values
from .host import make_target, target_to_dict
from .kernel_info import KernelRecorder
from .microkernels import best_vector_family
from .passes.gemm_chain import chain_mode
from .pipeline import PRECISIONS, hybrid_pipeline
from .schedules.attention import tuned_knobs
from .specializing_model import DEFAULT_MAX_SPECIALIZATIONS, SpecializingModel

PIPELINES = ("hybrid", "stock")
DYNAMIC_MODES = ("specialize", "symbolic")

logger = logging.getLogger(__name__)


def compile(  # noqa: A001 - the public name mirrors tvm.compile
    model: str | os.PathLike | bytes | onnx.ModelProto | tvm.IRModule,
    target="host",
    *,
    params: dict[str, np.ndarray] | None = None,
    tuning_records: str | os.PathLike | None = None,
    input_shapes: dict[str, tuple] | None = None,
    pipeline: str = "hybrid",
    precision: str = "fp32",
    cache_dir: str | os.PathLike | None = None,
    cache_max_bytes: int = DEFAULT_MAX_BYTES,
    dynamic: str = "specialize",
    max_specializations: int = DEFAULT_MAX_SPECIALIZATIONS,
) -> CompiledModel | SpecializingModel:
    """Compile a model for an x86 CPU.

    Parameters
    ----------
    model
        An ONNX file path, serialized ONNX bytes, an ``onnx.ModelProto``, or a Relax
        ``IRModule`` with a ``main`` function.
    target
        ``"host"`` (default: this CPU, all physical cores), ``"llvm"``, a target dict/JSON such
        as ``{"kind": "llvm", "mcpu": "skylake-avx512"}``, or a ``tvm.target.Target``.
    params
        Values for parameters of a Relax ``main`` to bind as constants (weights), by name.
    tuning_records
        A records file written by :func:`tvm_hybrid.tune` (``tvm-hybrid tune``), or a
        MetaSchedule work directory (``database_workload.json`` and
        ``database_tuning_record.json``); the best schedules are applied without search. Records
        made for another target raise :class:`TuningRecordsError`.
    input_shapes
        Static shapes for ONNX inputs with dynamic dimensions, by input name.
    pipeline
        ``"hybrid"`` (default) or ``"stock"`` (TVM's default pipeline, for comparison).
    cache_dir
        A directory to keep compiled models in (``compile_cache.py``; default: the
        ``TVM_HYBRID_CACHE_DIR`` environment variable, else no cache). A later compile of the
        same ONNX model, shapes, target, precision, records and versions loads the stored one.
    cache_max_bytes
        The cache's size bound (least recently used entries go first).
    dynamic
        For ONNX inputs with dynamic dimensions that ``input_shapes`` does not fix:
        ``"specialize"`` (default) returns a :class:`~tvm_hybrid.specializing_model.
        SpecializingModel` that compiles the model for each new combination of input shapes on
        first use (static-compile speed; the first call at a new size pays one compile, a cache
        hit with ``cache_dir``); ``"symbolic"`` compiles one binary for all sizes, whose kernels
        run on TVM's generic lowering (much slower). ``"specialize"`` also covers inputs whose
        values TVM needs at compile time (a reduction's axes, ``TopK``'s ``k``,
        ``NonMaxSuppression``'s limits given as graph inputs: :mod:`tvm_hybrid.frontend.
        value_inputs`): one compile per combination of their values.
    max_specializations
        With ``dynamic="specialize"``: how many shapes' compiled models to keep in memory.
    precision
        ``"fp32"`` (default) or ``"bf16"``: GEMMs with constant weights compute in bf16 with
        fp32 accumulation (like OpenVINO's inference precision hint); inputs and outputs stay
        fp32. With AVX512-BF16 the products use ``vdpbf16ps``; on other AVX2/AVX-512 CPUs the
        bf16 weights (half the memory of fp32) are widened to fp32 in the microkernel and the
        bf16 compute is emulated (logged once per compile), with the same results.

    Returns
    -------
    CompiledModel or SpecializingModel
    """
    if pipeline not in PIPELINES:
        raise OptionError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if dynamic not in DYNAMIC_MODES:
        raise OptionError(f"dynamic must be one of {DYNAMIC_MODES}, got {dynamic!r}")
    tgt = make_target(target)
    check_precision(precision, tgt)
    chain_mode()  # a bad TVM_HYBRID_GEMM_CHAINS is the user's error, said before compiling
    if dynamic == "specialize" and not isinstance(model, tvm.IRModule) and not params:
        proto = load_onnx(model)
        declared = onnx_inputs(proto, input_shapes or {})
        by_value = value_inputs(proto)
        if by_value or not all(is_static(spec.shape) for spec in declared):
            source = str(model) if isinstance(model, (str, os.PathLike)) else "<onnx model>"

            def compile_for(shapes: dict[str, tuple], values: dict) -> CompiledModel:
                return compile(with_values(proto, values) if values else proto, tgt,
                               tuning_records=tuning_records, input_shapes=shapes,
                               pipeline=pipeline, precision=precision, cache_dir=cache_dir,
                               cache_max_bytes=cache_max_bytes, dynamic="symbolic")

            return SpecializingModel(compile_for, declared, tgt, source, max_specializations,
                                     value_inputs=by_value)
        model = proto
    cache_dir = cache_dir if cache_dir is not None else os.environ.get(CACHE_VARIABLE) or None
    key_bytes = model_bytes(model) if cache_dir and not params else None

    def build() -> CompiledModel:
        with COMPILER_LOCK:
            try:
                return _compile(model, tgt, params, tuning_records, input_shapes, pipeline,
                                precision)
            except UnsupportedModelError as err:
                by_value = [] if isinstance(model, tvm.IRModule) else value_inputs(
                    load_onnx(model))
                if not by_value:
                    raise
                raise UnsupportedModelError(
                    f"{err} (the model takes {by_value} as inputs, operands TVM needs at "
                    "compile time: one binary cannot serve all their values; "
                    "tvm_hybrid.compile with dynamic='specialize', the default, compiles per "
                    "value, or make them initializers to export)") from None

    if key_bytes is None:
        return build()
    key = cache_key(key_bytes, tgt, input_shapes, precision, pipeline, tuning_records)
    return cached_compile(build, cache_dir, key, cache_max_bytes)


def _compile(model, tgt, params, tuning_records, input_shapes, pipeline, precision):
    imported = import_model(model, input_shapes=input_shapes)
    mod = imported.mod
    if params:
        mod = _bind_params(mod, params)
        bound = set(params)
        imported.inputs = [spec for spec in imported.inputs if spec.name not in bound]
    database, attention = (_load_records(tuning_records, tgt) if tuning_records is not None
                           else (None, {}))
    element_aligned = pipeline == "hybrid"  # the hybrid TIR pipeline's kernels (pipeline.py)
    mod = embed_metadata(mod, model_metadata(tgt, imported.inputs, element_aligned))
    recorder = KernelRecorder()
    relax_pipeline = (hybrid_pipeline(tgt, precision, recorder) if pipeline == "hybrid"
                      else relax.get_pipeline("default"))
    passes = _PassTracker()
    try:
        with warnings.catch_warnings(), tgt, _with_instrument(passes):
            warnings.simplefilter("ignore")
            with tuned_knobs(attention):
                if database is not None:
                    with database:
                        lowered = relax_pipeline(mod)
                else:
                    lowered = relax_pipeline(mod)
            passes.stack = ["code generation"]
            executable = tvm.compile(lowered, target=tgt, relax_pipeline=None,
                                     tir_pipeline="hybrid" if element_aligned else "default")
    except TemplateError:
        raise
    except Exception as err:
        raise CompileError(f"TVM failed to compile {imported.source}"
                           f"{passes.where()}{_nodes_named(err, imported.node_labels)}: "
                           f"{first_line(err)}") from err
    return CompiledModel(executable, tgt, imported.inputs, lowered=lowered,
                         kernel_source=(recorder, imported.node_labels),
                         element_aligned=element_aligned)


@tvm.ir.instrument.pass_instrument
class _PassTracker:
    """Which pass is running: after a failure, ``stack`` holds the chain of passes it was in
    (``run_after_pass`` is not called for the failing ones)."""

    def __init__(self):
        self.stack: list[str] = []

    def run_before_pass(self, _mod, info):
        self.stack.append(info.name)

    def run_after_pass(self, _mod, _info):
        if self.stack:
            self.stack.pop()

    def where(self) -> str:
        return f" in pass {self.stack[-1]}" if self.stack else ""


def _with_instrument(instrument) -> tvm.transform.PassContext:
    """The current pass context (its options kept) with ``instrument`` added."""
    current = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(
        opt_level=current.opt_level, required_pass=list(current.required_pass),
        disabled_pass=list(current.disabled_pass), config=dict(current.config),
        instruments=[*current.instruments, instrument])


def _nodes_named(err: Exception, labels: list[str]) -> str:
    """``(ONNX node Conv 'x')`` for the bindings the error text mentions (named
    ``node<index>_`` at import, ``attribution.py``)."""
    found = []
    for index in re.findall(r"\bnode(\d+)_", str(err)):
        i = int(index)
        if i < len(labels) and labels[i] not in found:
            found.append(labels[i])
    return f" (ONNX node {', '.join(found[:3])})" if found else ""


def model_metadata(target: tvm.target.Target, inputs, element_aligned: bool) -> dict:
    """What an exported model records about itself (``artifact.py``); ``element_aligned``: its
    kernels take inputs at any element-aligned address (``passes/element_aligned_arguments.py``).
    """
    from .artifact import FORMAT

    return {"format": FORMAT, "target": target_to_dict(target),
            "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype}
                       for s in inputs],
            "element_aligned_inputs": element_aligned}


def check_precision(precision: str, target: tvm.target.Target) -> None:
    """Raise unless ``precision`` is known and ``target`` can compute in it."""
    if precision not in PRECISIONS:
        raise OptionError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "bf16":
        return
    family = best_vector_family(target, "bfloat16")
    if family is None:
        raise TargetError(
            f"precision='bf16' needs AVX2 or AVX-512, which target mcpu="
            f"{target.attrs.get('mcpu')!s} lacks; use precision='fp32'"
        )
    if family.note:
        logger.warning("note: mcpu=%s has %s", target.attrs.get("mcpu"), family.note)


def _bind_params(mod: tvm.IRModule, params: dict[str, np.ndarray]) -> tvm.IRModule:
    names = {p.name for p in mod["main"].params}
    unknown = sorted(set(params) - names)
    if unknown:
        raise CompileError(f"params names no parameter of 'main': {unknown}")
    values = {k: tvm.runtime.tensor(np.asarray(v)) for k, v in params.items()}
    mod = relax.transform.BindParams("main", values)(mod)
    main = mod["main"]
    if main.attrs and "num_input" in main.attrs:
        kept = len(main.params)
        mod["main"] = main.with_attr("num_input", min(int(main.attrs["num_input"]), kept))
    return mod


def _load_records(path: str | os.PathLike,
                  target: tvm.target.Target) -> tuple[ms.database.Database, dict]:
    """A database of the records at ``path`` (a ``tvm-hybrid tune`` file or a MetaSchedule
    work directory) and the tuned attention knobs by workload. Raises
    :class:`TuningRecordsError` when they were made for another target.
    """
    from .tuning.records import load_records, register_intrinsics_named, target_identity

    source = Path(path)
    if source.is_file():
        records = load_records(source)
        records.check_target(target, source)
        return records.database(), records.attention_knobs()
    if not source.is_dir():
        raise TuningRecordsError(
            f"tuning records not found: {source} (expected a file written by tvm-hybrid tune "
            "or a MetaSchedule work directory)"
        )
    workloads = source / "database_workload.json"
    records = source / "database_tuning_record.json"
    if not workloads.is_file() or not records.is_file():
        raise TuningRecordsError(
            f"{source} holds no MetaSchedule database (database_workload.json and "
            "database_tuning_record.json)"
        )
    try:
        # Reading a trace checks its tensor intrinsics exist: register ours first.
        register_intrinsics_named(records.read_text(errors="replace"))
        database = ms.database.JSONDatabase(str(workloads), str(records), allow_missing=False)
        made = [r.target for r in database.get_all_tuning_records() if r.target is not None]
    except Exception as err:
        raise TuningRecordsError(f"{source}: unreadable tuning records ({err})") from None
    wanted = target_identity(target)
    for other in made:
        if target_identity(other) != wanted:
            raise TuningRecordsError(
                f"{source} was tuned for another target ({other}); compiling for {target}"
            )
    return database, {}
