"""Models with dynamic input dimensions, compiled once per input shape on first use.

A model exported with a symbolic batch or sequence length compiled as is runs every kernel on
TVM's generic lowering for unknown sizes (85-90x slower than a static compile on the real-model
zoo). Real services call one model with a handful of sizes, so tvm_hybrid specializes instead:
:func:`tvm_hybrid.compile` of such a model returns a :class:`SpecializingModel`, which on the
first call with a new combination of input shapes compiles the model for exactly those shapes
(the same templates and microkernels as a static compile, so the same speed), keeps the most
recent ``max_specializations`` of them in memory and, with a compile cache, on disk. The first
call at a new size pays one compile (seconds; a cache hit takes a fraction of a second).
``compile(..., dynamic="symbolic")`` keeps the old one-binary behaviour.

Inputs whose values TVM needs at compile time (:mod:`tvm_hybrid.frontend.value_inputs`: a
reduction's axes, ``TopK``'s ``k``, ``NonMaxSuppression``'s limits given as graph inputs) are
specialized the same way, on their values: each new combination of values (with the shapes)
compiles the model with those values as constants.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from .compiled_model import CompiledModel
from .errors import InputError, OptionError, first_line
from .frontend import TensorSpec
from .frontend.value_inputs import MAX_ELEMENTS, value_key

logger = logging.getLogger(__name__)

#: Specializations kept in memory by default (least recently used go first).
DEFAULT_MAX_SPECIALIZATIONS = 8

#: The input shapes, then the value inputs' values (``value_key``).
ShapeKey = tuple[tuple, ...]


class SpecializingModel:
    """A compiled model whose inputs have dynamic dimensions, or whose values TVM needs at
    compile time (see the module docstring).

    Call it like a :class:`~tvm_hybrid.compiled_model.CompiledModel`; ``specialize`` compiles
    ahead for known sizes (and values); ``specializations`` lists the shapes compiled so far.
    ``compile_for(shapes, values)`` compiles one specialization: ``shapes`` of the inputs that
    are not ``value_inputs``, ``values`` of those that are.
    """

    def __init__(self, compile_for: Callable[[dict[str, tuple], dict], CompiledModel],
                 inputs: list[TensorSpec], target, source: str,
                 max_specializations: int = DEFAULT_MAX_SPECIALIZATIONS,
                 value_inputs: list[str] = ()):
        if max_specializations < 1:
            raise OptionError(f"max_specializations must be >= 1, got {max_specializations}")
        self._compile_for = compile_for
        self.inputs = list(inputs)
        self.value_inputs = list(value_inputs)
        self.target = target
        self.source = source
        self.max_specializations = max_specializations
        self._models: collections.OrderedDict[ShapeKey, CompiledModel] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    # --- running -----------------------------------------------------------------------------

    def __call__(self, *arrays, **named):
        feeds = self._bind(arrays, named)
        return self._model_for(feeds)(**self._data(feeds))

    def benchmark(self, *arrays, **named) -> dict:
        """:meth:`CompiledModel.benchmark` of the specialization for these inputs."""
        options = {k: named.pop(k) for k in ("repeat", "min_repeat_ms") if k in named}
        feeds = self._bind(arrays, named)
        return self._model_for(feeds).benchmark(**self._data(feeds), **options)

    def profile(self, *arrays, **named):
        """:meth:`CompiledModel.profile` of the specialization for these inputs."""
        options = {k: named.pop(k) for k in ("repeat",) if k in named}
        feeds = self._bind(arrays, named)
        return self._model_for(feeds).profile(**self._data(feeds), **options)

    def specialize(self, values: dict | None = None, /, **shapes: tuple) -> CompiledModel:
        """The model compiled for these input shapes (by input name) and the values of its
        value inputs (``values``, by name: each of them is needed), compiling it now if new.
        The compiled model takes the other inputs."""
        unknown = sorted(set(shapes) - {spec.name for spec in self.inputs})
        if unknown:
            raise OptionError(f"{self.source} has no inputs {unknown}")
        values = {n: np.asarray(v) for n, v in (values or {}).items()}
        wrong = sorted(set(values) ^ set(self.value_inputs))
        if wrong:
            raise OptionError(f"specialize needs the values of exactly {self.value_inputs}, "
                              f"the inputs of {self.source} TVM needs at compile time; "
                              f"got {sorted(values)}")
        key = []
        for spec in self.inputs:
            if spec.name in values:
                continue
            if spec.name not in shapes:
                if not _is_static(spec.shape):
                    raise OptionError(f"specialize needs a shape for input {spec.name!r} "
                                      f"({_show(spec.shape)})")
                key.append(tuple(spec.shape))
                continue
            shape = tuple(int(d) for d in shapes[spec.name])
            _check_shape(spec, shape)
            key.append(shape)
        return self._get(tuple(key), self._checked_values(values))

    @property
    def specializations(self) -> list[dict[str, tuple]]:
        """The input shapes compiled and kept (value inputs: their values, as lists), least
        recently used first."""
        with self._lock:
            keys = list(self._models)
        names = [s.name for s in self.inputs if s.name not in self.value_inputs]
        out = []
        for key in keys:
            entry = dict(zip(names, key))
            for name, (dtype, shape, data) in zip(self.value_inputs, key[len(names):]):
                entry[name] = np.frombuffer(data, dtype).reshape(shape).tolist()
            out.append(entry)
        return out

    # --- what needs one shape ------------------------------------------------------------------

    def _one_shape_only(self, what: str):
        if self.value_inputs:
            raise OptionError(
                f"{what} needs one compiled model, and {self.source} is compiled per value of "
                f"its inputs {self.value_inputs} (operands TVM needs at compile time); take "
                "one specialization's model with .specialize({NAME: VALUE, ...}, NAME=SHAPE)")
        dims = ", ".join(f"{s.name}: {_show(s.shape)}" for s in self.inputs)
        raise OptionError(
            f"{what} needs static input shapes, and {self.source} has dynamic dimensions "
            f"({dims}); compile with input_shapes=..., or take one shape's model with "
            ".specialize(NAME=SHAPE)")

    def export(self, path):
        self._one_shape_only("export")

    def kernel_names(self):
        self._one_shape_only("kernel_names")

    def inspect_source(self, fmt: str = "asm"):
        self._one_shape_only("inspect_source")

    @property
    def kernels(self):
        self._one_shape_only("kernels")

    # --- internals -----------------------------------------------------------------------------

    def _bind(self, arrays: tuple, named: dict) -> dict[str, np.ndarray]:
        names = [spec.name for spec in self.inputs]
        if len(arrays) > len(names):
            raise InputError(f"{self.source} takes {len(names)} inputs, got {len(arrays)}")
        feeds = dict(zip(names, arrays))
        for name, value in named.items():
            if name not in names:
                raise InputError(f"{self.source} has no input {name!r}; inputs: {names}")
            if name in feeds:
                raise InputError(f"input {name!r} given twice")
            feeds[name] = value
        missing = [n for n in names if n not in feeds]
        if missing:
            raise InputError(f"missing inputs {missing} of {self.source}")
        return {spec.name: np.asarray(feeds[spec.name]) for spec in self.inputs}

    def _data(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` less the value inputs (constants of the specialization)."""
        return {n: a for n, a in feeds.items() if n not in self.value_inputs}

    def _checked_values(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        specs = {spec.name: spec for spec in self.inputs}
        for name in self.value_inputs:
            _check_shape(specs[name], tuple(values[name].shape))
            if values[name].size > MAX_ELEMENTS:
                raise InputError(
                    f"input {name!r} of {self.source} is an operand TVM needs at compile time "
                    f"(axes, pads, k, limits: compiled once per value), and has "
                    f"{values[name].size} elements; at most {MAX_ELEMENTS} are supported")
        # In the declared type (a Python list of ints is int64; the model may say int32).
        return {name: values[name].astype(specs[name].dtype, copy=False)
                for name in self.value_inputs}

    def _model_for(self, feeds: dict[str, np.ndarray]) -> CompiledModel:
        key = []
        for spec in self.inputs:
            if spec.name in self.value_inputs:
                continue
            shape = tuple(int(d) for d in feeds[spec.name].shape)
            _check_shape(spec, shape)
            key.append(shape)
        return self._get(tuple(key), self._checked_values(feeds))

    def _get(self, shape_key: tuple, values: dict[str, np.ndarray]) -> CompiledModel:
        key = (*shape_key, *(value_key(values[n]) for n in self.value_inputs))
        with self._lock:
            model = self._models.get(key)
            if model is not None:
                self._models.move_to_end(key)
                return model
            names = [s.name for s in self.inputs if s.name not in self.value_inputs]
            shapes = dict(zip(names, shape_key))
            start = time.perf_counter()
            shown = [f"{n}: {_show(s)}" for n, s in shapes.items()]
            shown += [f"{n} = {v.tolist()}" for n, v in values.items()]
            try:
                model = self._compile_for(shapes, values)
            except Exception as err:
                if not values:
                    raise
                # A value the model cannot take (k past the axis, an axis past the rank):
                # the caller's input, said as such.
                raise InputError(f"{self.source} cannot run with "
                                 f"{', '.join(shown[len(shapes):])}: {first_line(err)}") from err
            logger.info("compiled %s for inputs %s in %.1f s (%d of at most %d kept)",
                        self.source, ", ".join(shown), time.perf_counter() - start,
                        len(self._models) + 1, self.max_specializations)
            self._models[key] = model
            while len(self._models) > self.max_specializations:
                self._models.popitem(last=False)
            return model


def _check_shape(spec: TensorSpec, shape: tuple) -> None:
    if len(shape) != len(spec.shape):
        raise InputError(f"input {spec.name!r} must have rank {len(spec.shape)} "
                         f"({_show(spec.shape)}), got shape {_show(shape)}")
    for declared, got in zip(spec.shape, shape):
        if isinstance(declared, (int, np.integer)) and declared > 0 and declared != got:
            raise InputError(f"input {spec.name!r} must have shape {_show(spec.shape)}, got "
                             f"{_show(shape)}")


def _is_static(shape: tuple) -> bool:
    return all(isinstance(d, (int, np.integer)) and d > 0 for d in shape)


def _show(shape: tuple) -> str:
    return "x".join(str(d) if d is not None else "?" for d in shape) or "scalar"
