"""tvm_hybrid: fast x86 CPU inference for Apache TVM without hours of tuning.

Graph passes, expert templates and microkernels in the oneDNN Graph Compiler's hybrid style.

>>> import tvm_hybrid
>>> model = tvm_hybrid.compile("model.onnx")          # target="host"
>>> y = model(x)                                      # numpy in, numpy out
>>> records = tvm_hybrid.tune("model.onnx", trials=64)  # optional: search the template knobs
>>> model = tvm_hybrid.compile("model.onnx", tuning_records=records)

or, inside existing TVM code, ``tvm.compile(mod, target, relax_pipeline="hybrid")``.
"""

from __future__ import annotations

from .thread_pool import configure_defaults

# Before anything starts TVM's thread pool: all physical cores, no pinning of the caller.
configure_defaults()

from .compiled_model import CompiledModel, load  # noqa: E402
from .compiler import compile  # noqa: E402
from .errors import (  # noqa: E402
    CompileError,
    InputError,
    ModelLoadError,
    OptionError,
    TargetError,
    TuningRecordsError,
    TVMHybridError,
    UnsupportedModelError,
)
from .host import describe_host, make_target  # noqa: E402
from .pipeline import hybrid_pipeline, register  # noqa: E402
from .specializing_model import SpecializingModel  # noqa: E402
from .thread_pool import num_threads, set_num_threads  # noqa: E402
from .tuning import tune  # noqa: E402

register()

__version__ = "0.1.0"

__all__ = [
    "CompiledModel",
    "CompileError",
    "InputError",
    "ModelLoadError",
    "OptionError",
    "SpecializingModel",
    "TargetError",
    "TuningRecordsError",
    "TVMHybridError",
    "UnsupportedModelError",
    "compile",
    "describe_host",
    "hybrid_pipeline",
    "load",
    "make_target",
    "num_threads",
    "set_num_threads",
    "tune",
]
