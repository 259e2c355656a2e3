"""A compiled model: call it on numpy arrays, time it, export it, read its generated code."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from .errors import CompileError, InputError, ModelLoadError
from .frontend import TensorSpec
from .host import check_runnable_here, target_to_dict

_SOURCE_FORMATS = {"asm": "s", "s": "s", "ll": "ll", "llvm": "ll", "tir": "tir"}


class CompiledModel:
    """A model compiled by :func:`tvm_hybrid.compile` (or loaded by :func:`tvm_hybrid.load`).

    Parameters
    ----------
    executable
        The Relax VM executable (or a runtime module loaded from an exported ``.so``).
    target
        The target it was compiled for.
    inputs
        The model's inputs, in call order.
    lowered
        The IRModule after the Relax pipeline (the TIR kernels), when compiled in this process.
    """

    def __init__(self, executable, target: Target, inputs: list[TensorSpec], lowered=None):
        self.executable = executable
        self.target = target
        self.inputs = list(inputs)
        self.lowered = lowered
        self._vm = None

    # --- running -------------------------------------------------------------------------

    @property
    def vm(self) -> relax.VirtualMachine:
        """The Relax VM, created on first use (after checking this CPU can run the code)."""
        if self._vm is None:
            check_runnable_here(self.target)
            self._vm = relax.VirtualMachine(self.executable, tvm.cpu())
        return self._vm

    def __call__(self, *arrays, **named):
        """Run the model.

        Parameters
        ----------
        *arrays, **named
            One array per model input, positionally in :attr:`inputs` order or by input name.

        Returns
        -------
        numpy.ndarray or tuple of numpy.ndarray
            One array for a single-output model, else a tuple.
        """
        args = self._to_device(self._bind(arrays, named))
        return _to_numpy(self.vm["main"](*args))

    def benchmark(self, *arrays, repeat: int = 30, min_repeat_ms: int = 50, **named) -> dict:
        """Time the model on the given inputs.

        Each of ``repeat`` measurements runs the model enough times to take at least
        ``min_repeat_ms`` and reports the mean of those runs.

        Returns
        -------
        dict
            ``median_ms``, ``mean_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``std_ms`` and
            ``repeat``.
        """
        args = self._to_device(self._bind(arrays, named))
        timer = self.vm.time_evaluator(
            "main", tvm.cpu(), repeat=repeat, number=1, min_repeat_ms=int(min_repeat_ms)
        )
        return summarize_times(np.array(timer(*args).results) * 1e3)

    def _bind(self, arrays: tuple, named: dict) -> list[np.ndarray]:
        if arrays and named:
            raise InputError("pass inputs either positionally or by name, not both")
        if named:
            unknown = set(named) - {spec.name for spec in self.inputs}
            if unknown:
                raise InputError(
                    f"unknown input(s) {sorted(unknown)}; the model's inputs are "
                    f"{[spec.name for spec in self.inputs]}"
                )
            missing = [spec.name for spec in self.inputs if spec.name not in named]
            if missing:
                raise InputError(f"missing input(s) {missing}")
            arrays = tuple(named[spec.name] for spec in self.inputs)
        if len(arrays) != len(self.inputs):
            raise InputError(
                f"the model takes {len(self.inputs)} input(s) "
                f"{[spec.name for spec in self.inputs]}, got {len(arrays)}"
            )
        return [_check_input(spec, np.asarray(a)) for spec, a in zip(self.inputs, arrays)]

    @staticmethod
    def _to_device(arrays: list[np.ndarray]) -> list:
        return [tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu()) for a in arrays]

    # --- code and export -----------------------------------------------------------------

    def inspect_source(self, fmt: str = "asm") -> str:
        """The generated code: ``"asm"`` (x86 assembly), ``"ll"`` (LLVM IR) or ``"tir"``."""
        kind = _SOURCE_FORMATS.get(fmt)
        if kind is None:
            raise ValueError(f"unknown source format {fmt!r}; use one of asm, ll, tir")
        if kind == "tir":
            if self.lowered is None:
                raise CompileError("TIR is only kept for models compiled in this process")
            funcs = [
                f"# {gv.name_hint}\n{func.script()}"
                for gv, func in self.lowered.functions_items()
                if isinstance(func, tvm.tirx.PrimFunc)
            ]
            return "\n\n".join(funcs)
        root = getattr(self.executable, "mod", self.executable)
        libs = [m for m in (root, *root.imports) if m.kind == "llvm"]
        return "\n".join(lib.inspect_source(kind) for lib in libs)

    def kernel_names(self) -> list[str]:
        """Names of the TIR kernels (one per fused group) the model runs."""
        if self.lowered is None:
            raise CompileError("kernel names are only kept for models compiled in this process")
        return sorted(
            gv.name_hint
            for gv, func in self.lowered.functions_items()
            if isinstance(func, tvm.tirx.PrimFunc)
        )

    def export(self, path: str | os.PathLike) -> Path:
        """Write the model to a shared library ``path`` (plus ``path + '.json'`` metadata).

        Needs a C++ compiler (g++ or clang) on ``PATH`` to link the library.
        """
        path = Path(path)
        if not any(shutil.which(c) for c in ("g++", "gcc", "clang++", "clang", "c++", "cc")):
            raise CompileError(
                "exporting a .so needs a C/C++ compiler (g++ or clang) on PATH to link it"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.executable.export_library(str(path))
        except Exception as err:
            raise CompileError(f"could not export {path}: {err}") from None
        meta = {
            "format": "tvm_hybrid/1",
            "target": target_to_dict(self.target),
            "inputs": [
                {"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in self.inputs
            ],
        }
        Path(str(path) + ".json").write_text(json.dumps(meta, indent=1))
        return path


def load(path: str | os.PathLike) -> CompiledModel:
    """Load a model written by :meth:`CompiledModel.export`."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"compiled model not found: {path}")
    meta_path = Path(str(path) + ".json")
    if not meta_path.is_file():
        raise ModelLoadError(f"{meta_path} is missing: it records the model's inputs and target")
    try:
        meta = json.loads(meta_path.read_text())
        target = Target(meta["target"])
        inputs = [TensorSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in meta["inputs"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{meta_path} is not tvm_hybrid model metadata ({err})") from None
    check_runnable_here(target)
    try:
        lib = tvm.runtime.load_module(str(path))
    except Exception as err:
        raise ModelLoadError(f"{path} is not a loadable TVM module ({err})") from None
    return CompiledModel(lib, target, inputs)


def summarize_times(times_ms) -> dict:
    """Median, mean, spread and percentiles of a list of run times in milliseconds."""
    times = np.asarray(times_ms, dtype="float64")
    return {
        "median_ms": float(np.median(times)),
        "mean_ms": float(times.mean()),
        "p10_ms": float(np.percentile(times, 10)),
        "p90_ms": float(np.percentile(times, 90)),
        "min_ms": float(times.min()),
        "std_ms": float(times.std()),
        "repeat": int(times.size),
    }


def _check_input(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    if str(array.dtype) != spec.dtype:
        raise InputError(
            f"input {spec.name!r} must have dtype {spec.dtype}, got {array.dtype}"
        )
    if len(array.shape) != len(spec.shape) or any(
        isinstance(want, int) and want != got for want, got in zip(spec.shape, array.shape)
    ):
        raise InputError(
            f"input {spec.name!r} must have shape {_show_shape(spec.shape)}, got "
            f"{tuple(array.shape)}"
        )
    return array


def _show_shape(shape: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _to_numpy(value):
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)) or type(value).__name__ in ("Array", "Tuple"):
        return tuple(_to_numpy(v) for v in value)
    return value
