"""The compile cache: a model compiled once is loaded, not recompiled, by later processes.

``compile(model, cache_dir=DIR)`` (``--cache-dir``, or ``TVM_HYBRID_CACHE_DIR``) keys an entry by
everything that changes the compiled code: the model's bytes, the input shapes, the target (its
JSON, hence CPU and cores, and the CPU features LLVM derives), the precision and pipeline, the
GEMM chain mode (``TVM_HYBRID_GEMM_CHAINS``), the tuning records' bytes, and the versions of
tvm_hybrid, TVM, tvm_ffi and LLVM. An entry is an exported model (``artifact.py``: library,
checksummed sidecar with the kernel descriptions):

* a hit loads it (checked like any exported model) in well under a second;
* a miss compiles, exports into a temporary directory inside ``DIR`` and renames it into place,
  so readers never see a half-written entry and concurrent processes are safe (the first rename
  wins; the others use it);
* a damaged entry (truncated, modified) fails the load checks and is recompiled, never run;
* the cache is bounded (``max_bytes``, default 2 GiB): after a write the least recently used
  entries are removed.

Relax ``IRModule`` inputs are not cached (their bytes are not a stable key); without a C++
compiler to export with, the cache is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx

from .errors import ModelLoadError, TargetError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 2 << 30
CACHE_VARIABLE = "TVM_HYBRID_CACHE_DIR"
_LIBRARY = "model.so"


def cache_key(model_bytes: bytes, target, input_shapes, precision: str, pipeline: str,
              records: str | os.PathLike | None) -> str:
    """The entry name for these compile inputs (a SHA-256, hex)."""
    import tvm
    import tvm_ffi
    from tvm.target import codegen

    from . import __version__
    from .host import target_features, target_to_dict
    from .passes.gemm_chain import chain_mode

    digest = hashlib.sha256(model_bytes)
    facts = {
        "target": target_to_dict(target),
        "features": sorted(target_features(target)),
        "input_shapes": {k: list(v) for k, v in sorted((input_shapes or {}).items())},
        "precision": precision,
        "pipeline": pipeline,
        "gemm_chains": chain_mode(),
        "versions": [__version__, tvm.__version__, tvm_ffi.__version__,
                     int(codegen.llvm_version_major())],
        "records": _records_digest(records),
    }
    digest.update(json.dumps(facts, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _records_digest(records) -> str | None:
    if records is None:
        return None
    path = Path(records)
    digest = hashlib.sha256()
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    for item in files:
        if item.is_file():
            digest.update(item.name.encode())
            digest.update(item.read_bytes())
    return digest.hexdigest()


def model_bytes(model) -> bytes | None:
    """The bytes an ONNX model is keyed by, or None for inputs the cache does not take."""
    if isinstance(model, bytes):
        return model
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString(deterministic=True)
    if isinstance(model, (str, os.PathLike)) and Path(model).is_file():
        return Path(model).read_bytes()
    return None


def cached_compile(compile_fn, cache_dir, key: str, max_bytes: int):
    """Load the entry ``key`` of ``cache_dir``, or compile with ``compile_fn()`` and store it."""
    from .compiled_model import load

    root = Path(cache_dir)
    entry = root / key
    library = entry / _LIBRARY
    if library.is_file():
        try:
            model_out = load(library)
        except (ModelLoadError, TargetError) as err:
            logger.warning("compile cache: entry %s is unusable (%s); recompiling", key[:12], err)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            os.utime(entry)  # recently used
            return model_out
    compiled = compile_fn()
    if not any(shutil.which(c) for c in ("g++", "gcc", "clang++", "clang", "c++", "cc")):
        logger.warning("compile cache skipped: exporting needs a C/C++ compiler on PATH")
        return compiled
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        compiled.export(staging / _LIBRARY)
        try:
            os.rename(staging, entry)
        except OSError:  # another process stored the same entry first: keep theirs
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _evict(root, max_bytes, keep=entry)
    return compiled


def _evict(root: Path, max_bytes: int, keep: Path) -> None:
    """Remove least recently used entries until the cache holds at most ``max_bytes``."""
    entries = []
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-") or not entry.is_dir():
            if entry.name.startswith(".tmp-") and time.time() - entry.stat().st_mtime > 3600:
                shutil.rmtree(entry, ignore_errors=True)  # left by a killed process
            continue
        size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
        entries.append((entry.stat().st_mtime, size, entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries):
        if total <= max_bytes:
            break
        if entry == keep:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
