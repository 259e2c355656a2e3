"""A compiled model: call it on numpy arrays, time it, export it, read its generated code."""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from . import memory_guard
from .artifact import read_checked, write_sidecar
from .errors import CompileError, InputError, ModelLoadError, OptionError, first_line
from .frontend import TensorSpec
from .host import check_runnable_here
from .passes.check_indices import INDEX_ERROR
from .transfer import fresh_outputs, to_device, to_numpy

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
    kernel_source, kernels
        What :attr:`kernels` is derived from (``compile``), or the kernels themselves
        (``load``, from the sidecar).
    checked
        Whether this CPU is already known to run the code.
    element_aligned
        Whether its kernels take inputs at any element-aligned address (the ``"hybrid"`` TIR
        pipeline's), so numpy arrays pass zero-copy; else inputs not 64-byte aligned are copied.
    """

    def __init__(self, executable, target: Target, inputs: list[TensorSpec], lowered=None, *,
                 kernel_source=None, kernels: dict | None = None, checked: bool = False,
                 element_aligned: bool = False):
        self.executable = executable
        self.target = target
        self.inputs = list(inputs)
        self.lowered = lowered
        self._local = threading.local()
        self._checked = checked  # check_runnable_here already passed (load() does it)
        self._kernel_source = kernel_source  # (KernelRecorder, node labels), from compile()
        self._kernels = kernels
        self._fresh = False  # not analysed yet
        self._exact = [_exact_signature(spec) for spec in self.inputs]
        self.element_aligned = element_aligned

    # --- running -------------------------------------------------------------------------

    @property
    def vm(self) -> relax.VirtualMachine:
        """This thread's Relax VM, created on first use (after checking this CPU can run the
        code).

        A VM holds per-call state (its registers), so each thread calling the model gets its
        own; they share the executable and its constants, so a model is safe to call from any
        number of threads at once.
        """
        vm = getattr(self._local, "vm", None)
        if vm is None:
            if not self._checked:  # once per model, not per thread
                check_runnable_here(self.target)
                too_big = memory_guard.excess(
                    self.lowered["main"] if self.lowered is not None else None, self.inputs)
                if too_big:  # an overcommitting host would kill the process (memory_guard.py)
                    raise InputError(too_big)
                self._checked = True
            vm = self._local.vm = relax.VirtualMachine(self.executable, tvm.cpu())
        return vm

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
        bound = self._bind(arrays, named)
        args = self._to_device(bound)
        try:
            return to_numpy(self._main()(*args), self._fresh_outputs())
        except Exception as err:
            error = self._run_error(err, bound)
            if error is err:
                raise
            raise error from err

    def _main(self):
        """This thread's VM's ``main`` (looked up once per thread)."""
        main = getattr(self._local, "main", None)
        if main is None:
            main = self._local.main = self.vm["main"]
        return main

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
        if repeat < 1:
            raise OptionError(f"repeat must be at least 1, got {repeat}")
        bound = self._bind(arrays, named)
        args = self._to_device(bound)
        timer = self.vm.time_evaluator(
            "main", tvm.cpu(), repeat=repeat, number=1, min_repeat_ms=int(min_repeat_ms)
        )
        try:
            results = timer(*args).results
        except Exception as err:
            error = self._run_error(err, bound)
            if error is err:
                raise
            raise error from err
        return summarize_times(np.array(results) * 1e3)

    def _run_error(self, err: Exception, arrays: list[np.ndarray]) -> Exception:
        """The error to raise for ``err`` from running the model on ``arrays``.

        A failed index check (``passes/check_indices.py``) becomes an :class:`InputError` with
        the range of the offending input's values; memory exhaustion a :class:`InputError`
        saying so; anything else is returned unchanged.
        """
        if isinstance(err, InputError):  # already says what is wrong (memory_guard.py)
            return err
        text = str(err)
        if INDEX_ERROR in text:
            detail = text[text.index(INDEX_ERROR) + len(INDEX_ERROR) + 2:].splitlines()[0]
            found = re.search(r"input '([^']+)'", detail)
            names = {spec.name: a for spec, a in zip(self.inputs, arrays)}
            if found and found.group(1) in names and names[found.group(1)].size:
                values = names[found.group(1)]
                detail += f"; it holds values from {values.min()} to {values.max()}"
            return InputError(f"index out of range: {detail}")
        if "bad_alloc" in text or "out of memory" in text.lower():
            sizes = ", ".join(f"{s.name} {tuple(a.shape)}" for s, a in zip(self.inputs, arrays))
            return InputError(f"out of memory running the model on inputs {sizes}: reduce the "
                              "batch or sequence size")
        return err

    def _bind(self, arrays: tuple, named: dict) -> list[np.ndarray]:
        if named and not arrays and len(named) == len(self.inputs) and all(
                spec.name in named for spec in self.inputs):
            arrays, named = tuple(named[spec.name] for spec in self.inputs), {}
        if not named and len(arrays) == len(self._exact) and all(
                type(a) is np.ndarray and exact is not None and a.dtype == exact[0]
                and a.shape == exact[1] for a, exact in zip(arrays, self._exact)):
            return list(arrays)  # positional arrays of the static signature: nothing to check
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

    def _fresh_outputs(self) -> tuple[bool, ...] | None:
        """Which outputs can be returned as views (``transfer.fresh_outputs``); None (copy
        all) for loaded models, whose Relax code is not kept."""
        if self._fresh is False:
            self._fresh = fresh_outputs(self.lowered["main"]) if self.lowered is not None \
                else None
        return self._fresh

    def _to_device(self, arrays: list[np.ndarray]) -> list:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = {}
        return to_device(arrays, staging, self.element_aligned)

    # --- code and export -----------------------------------------------------------------

    def inspect_source(self, fmt: str = "asm") -> str:
        """The generated code: ``"asm"`` (x86 assembly), ``"ll"`` (LLVM IR) or ``"tir"``."""
        kind = _SOURCE_FORMATS.get(fmt)
        if kind is None:
            raise OptionError(f"unknown source format {fmt!r}; use one of asm, ll, tir")
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

    @property
    def kernels(self) -> dict:
        """``{kernel name: KernelInfo}``: each kernel's ONNX nodes, schedule (template,
        fallback or stock) and why, FLOPs (``kernel_info.py``). Loaded models have it from
        their sidecar."""
        if self._kernels is None:
            from .kernel_info import describe_kernels

            if self.lowered is None:
                return {}
            recorder, labels = self._kernel_source or (None, [])
            self._kernels = describe_kernels(self.lowered, recorder, labels, self.target)
        return self._kernels

    def profile(self, *arrays, repeat: int = 10, **named):
        """Per-kernel profile of one run on these inputs (``profile.py``).

        Returns
        -------
        ProfileReport
            A table per kernel (nodes, schedule, calls, time, share, GFLOP/s and % of peak)
            and a summary; ``str()`` prints it, ``to_html(path)`` writes a bar chart.
        """
        from .profile import profile_model

        return profile_model(self, self._bind(arrays, named), repeat=repeat)

    def kernel_names(self) -> list[str]:
        """Names of the TIR kernels (one per fused group) the model runs."""
        if self.lowered is None:
            if self._kernels:
                return sorted(self._kernels)
            raise CompileError("kernel names are only kept for models compiled in this process")
        from .kernel_info import called_kernels

        return sorted(gv.name_hint for gv, _ in called_kernels(self.lowered))

    def export(self, path: str | os.PathLike) -> Path:
        """Write the model to a shared library ``path`` (plus ``path + '.json'`` metadata with
        its target, inputs and checksum; the library embeds the same metadata).

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
            raise CompileError(f"could not export {path}: {err}") from err
        from .compiler import model_metadata

        metadata = model_metadata(self.target, self.inputs, self.element_aligned)
        metadata["kernels"] = [info.as_dict() for info in self.kernels.values()]
        write_sidecar(path, metadata)
        return path


def load(path: str | os.PathLike) -> CompiledModel:
    """Load a model written by :meth:`CompiledModel.export`.

    The library is checked before it is loaded (``artifact.py``): an x86-64 shared object whose
    size and SHA-256 match the sidecar and whose embedded target this CPU can run. Anything
    else raises :class:`ModelLoadError` (or :class:`TargetError` for another CPU's code).
    """
    path = Path(path)
    meta = read_checked(path)
    try:
        target = Target(meta["target"])
        inputs = [TensorSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in meta["inputs"]]
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ModelLoadError(f"{path}: its metadata names no valid target and inputs "
                             f"({err})") from None
    check_runnable_here(target)
    try:
        lib = tvm.runtime.load_module(str(path))
        relax.VirtualMachine(lib, tvm.cpu())  # a Relax executable, not some other TVM module
    except Exception as err:
        raise ModelLoadError(f"{path} is not a loadable tvm_hybrid model "
                             f"({first_line(err)})") from err
    from .kernel_info import KernelInfo

    try:
        kernels = {k["name"]: KernelInfo(**k) for k in meta.get("kernels", [])}
    except (TypeError, KeyError):
        kernels = {}  # descriptive only: a sidecar without it still loads
    return CompiledModel(lib, target, inputs, kernels=kernels, checked=True,
                         element_aligned=meta.get("element_aligned_inputs") is True)


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


def _exact_signature(spec: TensorSpec) -> tuple[np.dtype, tuple[int, ...]] | None:
    """``(dtype, shape)`` an input array matches exactly when ``spec`` is fully static (None
    for dynamic dimensions or dtypes numpy lacks)."""
    if not all(isinstance(d, int) for d in spec.shape):
        return None
    try:
        return np.dtype(spec.dtype), tuple(spec.shape)
    except TypeError:
        return None


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
