"""Exported models that carry their own metadata and are checked before they are loaded.

An exported model is a shared library (``model.so``) plus a JSON sidecar (``model.so.json``).
Loading a library runs code (``dlopen``), and running it on a CPU without the ISA it was built
for dies with SIGILL; a truncated file dies with SIGBUS. So:

* compiling embeds the model's metadata (format, target, inputs) in the module itself: a Relax
  function ``tvm_hybrid_metadata`` returning it as bytes between :data:`MARKER` and
  :data:`END`, which appear verbatim in the library's serialized executable;
* exporting writes the sidecar with the same metadata plus the library's SHA-256 and size;
* :func:`read_checked` verifies, before anything is loaded: the file is an x86-64 ELF shared
  object, its size and SHA-256 match the sidecar, its embedded metadata exists and agrees with
  the sidecar. The target that decides whether this CPU may run the code is the embedded one,
  so editing the sidecar cannot make a library for another CPU run here.

Every failure is a :class:`~tvm_hybrid.errors.ModelLoadError` naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .errors import ModelLoadError

FORMAT = "tvm_hybrid/2"
MARKER = b"TVM_HYBRID_METADATA:"
END = b":END_TVM_HYBRID_METADATA"
METADATA_FUNCTION = "tvm_hybrid_metadata"


def embed_metadata(mod: tvm.IRModule, metadata: dict) -> tvm.IRModule:
    """``mod`` plus a Relax function returning ``metadata`` (JSON) as a uint8 tensor."""
    payload = MARKER + json.dumps(metadata, sort_keys=True).encode() + END
    builder = relax.BlockBuilder(mod)
    with builder.function(METADATA_FUNCTION, []):
        builder.emit_func_output(relax.const(np.frombuffer(payload, np.uint8), "uint8"))
    return builder.get()


def file_digest(path: Path) -> str:
    """SHA-256 of the file at ``path`` (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_path(path: Path) -> Path:
    return Path(str(path) + ".json")


def write_sidecar(path: Path, metadata: dict) -> None:
    """The sidecar of the library at ``path``: ``metadata`` plus its size and SHA-256."""
    record = dict(metadata, bytes=path.stat().st_size, sha256=file_digest(path))
    sidecar_path(path).write_text(json.dumps(record, indent=1))


def read_checked(path: str | Path) -> dict:
    """The metadata of the exported library at ``path``, after every check of the module
    docstring; raises :class:`ModelLoadError` naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"compiled model not found: {path}")
    meta_path = sidecar_path(path)
    if not meta_path.is_file():
        raise ModelLoadError(f"{meta_path} is missing: it records the model's inputs, target "
                             "and checksum")
    try:
        sidecar = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelLoadError(f"{meta_path} is not JSON ({err})") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        raise ModelLoadError(f"{meta_path} is not tvm_hybrid model metadata (format "
                             f"{sidecar.get('format') if isinstance(sidecar, dict) else None!r}"
                             f", expected {FORMAT!r}; re-export the model)")
    data = path.read_bytes()
    _check_elf(path, data)
    if len(data) != sidecar.get("bytes") or hashlib.sha256(data).hexdigest() != \
            sidecar.get("sha256"):
        raise ModelLoadError(f"{path} does not match its checksum in {meta_path.name} "
                             f"({len(data)} bytes, {sidecar.get('bytes')} recorded): the file "
                             "is truncated, modified or not the exported model")
    start = data.find(MARKER)
    stop = data.find(END, start + len(MARKER)) if start >= 0 else -1
    if start < 0 or stop < 0:
        raise ModelLoadError(f"{path} holds no tvm_hybrid metadata: not a model exported by "
                             "tvm_hybrid")
    try:
        embedded = json.loads(data[start + len(MARKER):stop])
    except ValueError as err:
        raise ModelLoadError(f"{path}: its embedded metadata is damaged ({err})") from None
    for key in ("target", "inputs"):
        if sidecar.get(key) != embedded.get(key):
            raise ModelLoadError(f"{meta_path.name} does not match {path.name}: its {key!r} "
                                 "differs from the one compiled into the library")
    # Descriptive only (the profile report's kernel table), so taken from the sidecar.
    embedded["kernels"] = sidecar.get("kernels") if isinstance(sidecar.get("kernels"), list) \
        else []
    return embedded


def _check_elf(path: Path, data: bytes) -> None:
    """An x86-64 little-endian ELF shared object, or ModelLoadError."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise ModelLoadError(f"{path} is not a shared library (no ELF header)")
    elf_class, endian = data[4], data[5]
    e_type = int.from_bytes(data[16:18], "little")
    machine = int.from_bytes(data[18:20], "little")
    if elf_class != 2 or endian != 1 or machine != 0x3E or e_type != 3:
        raise ModelLoadError(f"{path} is an ELF file but not an x86-64 shared library")
