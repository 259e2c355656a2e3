"""One lock for TVM's compiler: imports and compiles in this process run one at a time.

TVM's compiler keeps process-global state: the TE tag scope the ONNX importer and the
legalization of ops enter (two threads importing at once fail with "nested op_tag"), the current
target and pass context, the registries our tensor intrinsics and pipeline write to. Every import
and compile of ``tvm_hybrid`` (and the tuner's) holds :data:`COMPILER_LOCK`, so threads may compile
models concurrently: they are serialised, not corrupted. Running compiled models takes no lock.
"""

from __future__ import annotations

import threading

#: Re-entrant: ``compile`` holds it while the pipeline (which may compile again) runs.
COMPILER_LOCK = threading.RLock()
