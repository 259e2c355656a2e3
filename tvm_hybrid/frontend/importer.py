"""Import a model (ONNX file, ``onnx.ModelProto`` or Relax ``IRModule``) into Relax.

Weights stay in the graph as constants (``keep_params_in_input=False``) so that graph passes can
fold and prepack them at compile time. Every way an import can fail becomes a
:class:`~tvm_hybrid.errors.ModelLoadError` or :class:`~tvm_hybrid.errors.UnsupportedModelError`
naming the file, op or node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import tvm
from tvm import relax

from ..attribution import name_bindings, node_labels, record_nodes
from ..errors import ModelLoadError, UnsupportedModelError, first_line
from .converters import added_converters, convert_map
from .fold import fold_constants
from .qlinear import decompose_qlinear


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, shape (``None`` or a string for a dynamic dimension) and dtype of one input."""

    name: str
    shape: tuple
    dtype: str


@dataclasses.dataclass
class ImportedModel:
    """A model in Relax form plus the signature users call it with."""

    mod: tvm.IRModule
    inputs: list[TensorSpec]
    source: str
    #: ``OpType 'name'`` of each ONNX node, indexed as ``main``'s bindings are named
    #: (``attribution.py``); empty for Relax modules.
    node_labels: list[str] = dataclasses.field(default_factory=list)


def load_onnx(model: str | os.PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Read an ONNX model, raising :class:`ModelLoadError` with the file name on failure."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        try:
            return onnx.load_from_string(model)
        except Exception as err:  # protobuf raises DecodeError and friends
            raise ModelLoadError(f"the given bytes are not an ONNX model: {err}") from None
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        proto = onnx.load(str(path))
    except Exception as err:
        raise ModelLoadError(
            f"{path} is not a valid ONNX model ({type(err).__name__}: {err})"
        ) from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"{path} is not a valid ONNX model: its graph is empty")
    return proto


def import_model(
    model: str | os.PathLike | bytes | onnx.ModelProto | tvm.IRModule,
    *,
    input_shapes: dict[str, tuple] | None = None,
) -> ImportedModel:
    """Translate ``model`` into a Relax module whose ``main`` takes the model's inputs.

    Parameters
    ----------
    model
        An ONNX file path, serialized bytes, an ``onnx.ModelProto``, or a Relax ``IRModule``
        with a ``main`` function.
    input_shapes
        Static shapes for ONNX inputs with dynamic dimensions, by input name.

    Returns
    -------
    ImportedModel
    """
    if isinstance(model, tvm.IRModule):
        return _from_relax(model)
    source = str(model) if isinstance(model, (str, os.PathLike)) else "<onnx model>"
    proto = load_onnx(model)
    _check_versions(proto, source)
    if proto.functions:  # model-local functions: inline them, TVM's importer does not
        proto = onnx.inliner.inline_local_functions(proto)
    proto = decompose_qlinear(proto)
    inputs = onnx_inputs(proto, input_shapes or {})
    shape_dict = {spec.name: spec.shape for spec in inputs if is_static(spec.shape)}
    proto, _ = fold_constants(proto, shape_dict)
    _check_ops_supported(proto, source)
    from tvm.relax.frontend.onnx import from_onnx

    printed = io.StringIO()  # the importer prints "Error converting operator X" on failure
    records: list = []
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed), \
                record_nodes(records), added_converters():
            warnings.simplefilter("ignore")
            mod = from_onnx(proto, shape_dict=shape_dict or None, keep_params_in_input=False)
    except Exception as err:
        if isinstance(err, (tvm.error.OpNotImplemented, UnsupportedModelError)):
            # A converter's own refusal (ours name the node and what is missing): as it is.
            message = f"{source}: {first_line(err)}"
        else:
            found = re.search(r"Error converting operator (\w+)", printed.getvalue())
            where = f" at a {found.group(1)} node" if found else ""
            message = (f"{source}: TVM's ONNX importer failed{where} ({type(err).__name__}: "
                       f"{first_line(err)})")
        _release_quietly(err)
        raise UnsupportedModelError(message) from None
    return ImportedModel(mod=name_bindings(mod, records), inputs=inputs, source=source,
                         node_labels=node_labels(records, proto.graph))


def _release_quietly(err: BaseException) -> None:
    """Free what the failed import left (held by ``err``'s traceback) with the C++ stderr
    silenced: TVM's block builder warns ("destroyed with remaining blocks") when freed after a
    failure, a stray line around our one-line error."""
    import gc

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            err.__traceback__ = None
            gc.collect()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_DEFAULT_DOMAINS = ("", "ai.onnx")


def _check_versions(proto: onnx.ModelProto, source: str) -> None:
    """The IR version and the default domain's opset must be ones onnx (and the importer)
    know; a newer model would be imported with the wrong semantics."""
    if proto.ir_version > onnx.IR_VERSION:
        raise ModelLoadError(
            f"{source}: ONNX IR version {proto.ir_version} is newer than this onnx "
            f"({onnx.__version__}) supports (up to {onnx.IR_VERSION})")
    newest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in _DEFAULT_DOMAINS and opset.version > newest:
            raise ModelLoadError(
                f"{source}: the model needs opset {opset.version} of the ONNX operators; this "
                f"onnx ({onnx.__version__}) and TVM's importer know up to opset {newest}")


def _check_ops_supported(proto: onnx.ModelProto, source: str) -> None:
    known = set(convert_map()) | {"If", "Constant"}
    standard = {schema.name for schema in onnx.defs.get_all_schemas() if schema.domain == ""}
    missing: dict[str, str] = {}

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            name = node.name or node.output[0]
            if node.domain not in _DEFAULT_DOMAINS:
                # TVM's importer looks ops up by name only: a custom-domain "Relu" would be
                # compiled as ONNX's. Only the contrib ops it implements (com.microsoft's,
                # whose names ONNX does not use) are taken.
                if not (node.domain == "com.microsoft" and node.op_type in known
                        and node.op_type not in standard):
                    missing.setdefault(f"{node.op_type} of domain {node.domain!r}", name)
            elif node.op_type not in known:
                missing.setdefault(node.op_type, name)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)

    walk(proto.graph)
    if missing:
        listed = ", ".join(f"{op} (node {name!r})" for op, name in sorted(missing.items()))
        raise UnsupportedModelError(f"{source}: TVM cannot import these ONNX operators: {listed}")


def onnx_inputs(proto: onnx.ModelProto, overrides: dict[str, tuple]) -> list[TensorSpec]:
    """The graph inputs that are not initializers, with ``overrides`` applied."""
    initializers = {init.name for init in proto.graph.initializer}
    unknown = set(overrides) - {i.name for i in proto.graph.input}
    if unknown:
        raise ModelLoadError(
            f"input_shapes names inputs the model does not have: {sorted(unknown)}"
        )
    specs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dtype = str(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        )
        if value.name in overrides:
            shape = tuple(int(d) for d in overrides[value.name])
        specs.append(TensorSpec(value.name, shape, dtype))
    return specs


def _from_relax(mod: tvm.IRModule) -> ImportedModel:
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelLoadError("the Relax IRModule has no 'main' function")
    main = mod["main"]
    if not isinstance(main, relax.Function):
        raise ModelLoadError("'main' of the IRModule is not a Relax function")
    count = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else None
    params = list(main.params)[:count] if count is not None else list(main.params)
    specs = []
    for param in params:
        ty = param.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise ModelLoadError(f"input {param.name!r} of 'main' is not a tensor of known rank")
        dims = ty.shape.values if hasattr(ty.shape, "values") else ()
        shape = tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in dims)
        specs.append(TensorSpec(param.name, shape, str(ty.dtype)))
    return ImportedModel(mod=mod, inputs=specs, source="<relax module>")


def is_static(shape: tuple) -> bool:
    """Whether every dimension of ``shape`` is a known positive size."""
    return all(isinstance(d, (int, np.integer)) and d > 0 for d in shape)


