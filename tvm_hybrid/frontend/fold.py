"""Fold shape arithmetic and small constant subgraphs of an ONNX graph before import.

Exporters build reshape targets and anchor grids from the input's run-time shape:
``Reshape(x, Cast(Concat(Slice(Shape(x)))))``, ``Range(0, Gather(Shape(x), 3))``. TVM's importer
rejects a computed reshape target ("Reshape requires the input new shape to be Shape") and turns
``Range`` of a computed bound into fresh symbolic sizes that later passes cannot handle. Once the
input shapes are known, all of it is constant: ONNX shape inference gives every ``Shape`` its
value, and onnx's reference evaluator computes each node whose inputs are then all known.

``Constant`` nodes become initializers. Only small results are folded
(:data:`MAX_FOLDED_ELEMENTS`): shape subgraphs, index tensors and
scalars. Large constant expressions of weights stay for TVM's own ``FoldConstant``, and
``DequantizeLinear`` is never folded, so that the int8 passes still see it applied to an
integer weight. ``QuantizeLinear`` of a constant, of any size, is folded: that is the integer
weight. ONNX Runtime's quantizer writes one in front of each weight a model keeps in
``Constant`` nodes (Paddle exports), and left in the graph, TVM's ``FoldConstant`` made those
weights fp32 again (ocr_cls in QOperator format ran no int8 kernel).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.shape_inference
from onnx.reference import ReferenceEvaluator

logger = logging.getLogger(__name__)

#: The largest tensor (in elements) that a folded node may produce.
MAX_FOLDED_ELEMENTS = 1 << 16

#: Ops whose value must stay in the graph: dequantization (the int8 passes match it),
#: randomness, control flow and sequences (handled by the importer, or not foldable node by node).
_NEVER_FOLD = frozenset({
    "DequantizeLinear", "DynamicQuantizeLinear", "RandomNormal",
    "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "If",
    "Loop", "Scan", "SequenceConstruct", "SequenceAt", "SequenceInsert", "SplitToSequence",
    "ConcatFromSequence", "SequenceEmpty", "SequenceErase", "SequenceLength", "Optional",
    "OptionalGetElement", "OptionalHasElement",
})
#: Ops folded whatever their size: a ``Constant`` becomes an initializer of the same bytes, a
#: ``QuantizeLinear`` of constants the integer weight (a quarter of its float input's).
_ANY_SIZE = frozenset({"Constant", "QuantizeLinear"})


@dataclasses.dataclass
class FoldReport:
    """What :func:`fold_constants` did: how many nodes it replaced by constants."""

    folded: int = 0
    shapes: int = 0


def fold_constants(proto: onnx.ModelProto, input_shapes: dict[str, tuple]) -> tuple[
        onnx.ModelProto, FoldReport]:
    """Fix the graph inputs' shapes and fold every node whose value is then known and small.

    Parameters
    ----------
    proto
        The model (not modified).
    input_shapes
        A static shape for each graph input whose dimensions are all known, by name; inputs not
        named keep their dimensions as declared.

    Returns
    -------
    (onnx.ModelProto, FoldReport)
        A new model whose folded nodes became initializers, and what was folded.
    """
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    for value in graph.input:
        if value.name in input_shapes:
            _set_shape(value, input_shapes[value.name])
    report = FoldReport()
    # A folded reshape target gives shape inference the shapes after it: fold again until
    # nothing more is known (a few rounds on real exports).
    for _ in range(_MAX_ROUNDS):
        before = report.folded
        _fold_round(model, report)
        if report.folded == before:
            break
    if report.folded:
        logger.debug("folded %d ONNX nodes (%d Shape) before import", report.folded,
                     report.shapes)
    return model, report


_MAX_ROUNDS = 8


def _fold_round(model: onnx.ModelProto, report: FoldReport) -> None:
    _fold_graph(model.graph, {}, _inferred_shapes(model), list(model.opset_import), report)


def _fold_graph(graph: onnx.GraphProto, outer: dict[str, np.ndarray], shapes: dict,
                opsets, report: FoldReport) -> None:
    """Fold the nodes of ``graph`` (and of its subgraphs, which see the values around them)."""
    known = dict(outer)  # name -> value: an array, or an initializer read when first needed
    known.update((init.name, init) for init in graph.initializer)
    kept: list[onnx.NodeProto] = []
    folded = 0
    for node in graph.node:
        if node.op_type == "If" and node.input[0] in known:
            # A condition known at compile time (PyTorch's squeeze-if-size-1 pattern): the
            # taken branch's nodes replace the If, read by Identity nodes under its outputs.
            branch = _taken_branch(node, bool(_array(known, node.input[0]).reshape(-1)[0]))
            graph.initializer.extend(branch.initializer)
            kept.extend(branch.node)
            kept.extend(onnx.helper.make_node("Identity", [inner.name], [outer])
                        for inner, outer in zip(branch.output, node.output) if outer)
            folded += 1
            continue
        values = _node_value(node, known, shapes, opsets)
        if values is None:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    _fold_graph(attr.g, known, shapes, opsets, report)
            kept.append(node)
            continue
        folded += 1
        report.shapes += node.op_type == "Shape"
        for name, value in zip(node.output, values):
            if name:
                known[name] = value
                graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    if folded:
        report.folded += folded
        del graph.node[:]
        graph.node.extend(kept)
        _keep_constant_outputs(graph, known)
        _drop_unused_initializers(graph)


def _array(known: dict, name: str) -> np.ndarray:
    """``known[name]`` as an array (an initializer is converted once, on first use: most
    weights are never an input of a foldable node)."""
    value = known[name]
    if isinstance(value, onnx.TensorProto):
        value = known[name] = onnx.numpy_helper.to_array(value)
    return value


def _taken_branch(node: onnx.NodeProto, condition: bool) -> onnx.GraphProto:
    wanted = "then_branch" if condition else "else_branch"
    return next(attr.g for attr in node.attribute if attr.name == wanted)


def _set_shape(value: onnx.ValueInfoProto, shape: tuple) -> None:
    dims = value.type.tensor_type.shape.dim
    if len(dims) != len(shape):
        return  # the importer reports the rank mismatch with the input's name
    for dim, size in zip(dims, shape):
        dim.Clear()
        dim.dim_value = int(size)


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Static shapes ONNX shape inference finds, by value name (empty when it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as err:  # custom ops, inconsistent exports: fold what needs no shapes
        logger.debug("ONNX shape inference failed (%s); folding constants only", err)
        return {}
    shapes: dict[str, tuple] = {}
    _collect_shapes(inferred.graph, shapes)
    return shapes


def _collect_shapes(graph: onnx.GraphProto, shapes: dict[str, tuple]) -> None:
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _collect_shapes(attr.g, shapes)


def _node_value(node, known, shapes, opsets) -> list[np.ndarray] | None:
    """The outputs of ``node`` when they are known and small, else ``None``."""
    if node.op_type in _NEVER_FOLD or node.domain not in ("", "ai.onnx"):
        return None
    if any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for attr in node.attribute):
        return None
    if node.op_type in ("Shape", "Size"):
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", None)
        return [np.array(shape[start:end], dtype=np.int64)]
    inputs = [name for name in node.input if name]
    if not all(name in known for name in inputs):
        return None
    try:
        values = _evaluate(node, known, opsets)
    except Exception as err:  # the importer meets the node later and names it if it fails
        logger.debug("not folding %s %r: %s", node.op_type, node.name, err)
        return None
    if node.op_type not in _ANY_SIZE and any(v.size > MAX_FOLDED_ELEMENTS for v in values):
        return None
    return values


def _evaluate(node: onnx.NodeProto, known: dict[str, np.ndarray], opsets) -> list[np.ndarray]:
    inputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)
              for name in node.input if name]
    outputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)
               for name in node.output if name]
    graph = onnx.helper.make_graph([node], "fold", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=opsets)
    feeds = {v.name: _array(known, v.name) for v in inputs}
    results = ReferenceEvaluator(model).run(None, feeds)
    if not all(isinstance(r, (np.ndarray, np.generic)) for r in results):
        raise TypeError("a sequence, map or optional value")  # only tensors become constants
    return [np.asarray(r) for r in results]


def _keep_constant_outputs(graph: onnx.GraphProto, known: dict[str, np.ndarray]) -> None:
    """A graph output that became an initializer is produced by a ``Constant`` node again
    (an output must be a node's or an input's)."""
    produced = {out for node in graph.node for out in node.output}
    for value in graph.output:
        if value.name not in produced and value.name in known:
            tensor = onnx.numpy_helper.from_array(_array(known, value.name),
                                                  value.name + "_folded")
            graph.node.append(onnx.helper.make_node(
                "Constant", [], [value.name], value=tensor))


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input}
    used |= _subgraph_inputs(graph)
    used |= {value.name for value in graph.output}
    used |= {value.name for value in graph.input}  # old exports list weights as inputs too
    kept = [init for init in graph.initializer if init.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names that nodes inside subgraphs (``If`` branches, loop bodies) read."""
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                names |= {name for inner in sub.node for name in inner.input}
                names |= _subgraph_inputs(sub)
    return names
