"""Graph inputs whose values TVM's importer needs at compile time.

TVM 0.27's ONNX importer converts some operands only when they are constants: a reduction's
``axes``, ``Pad``'s pads, ``TopK``'s ``k``, ``OneHot``'s depth and values, ``Resize``'s scales,
sizes and region, ``CumSum``'s axis, ``Split``'s sizes, ``NonMaxSuppression``'s limits,
``MaxUnpool``'s output shape, ``Upsample``'s scales, ``DFT``'s length and axis, ``STFT``'s
frame step and length; window functions and ``MelWeightMatrix`` are folded to constants when
their sizes are. A model that takes such an operand as a graph input (a detector's
``max_output_boxes_per_class`` or score threshold, a ``k`` chosen by the caller) cannot be
compiled ahead of its first call. :func:`value_inputs` names those inputs;
:class:`~tvm_hybrid.specializing_model.SpecializingModel` then compiles the model once per
combination of their values (as it does per input shape), with :func:`with_values` making them
initializers. Each distinct value costs a compile, so such inputs should take few values: an
axis, a limit, a threshold.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

_REDUCTIONS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
               "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")
#: Operand positions TVM's importer needs as constants, by op type (default domain).
VALUE_OPERANDS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(_REDUCTIONS, (1,)),
    "CumSum": (1,),
    "CumProd": (1,),
    "CenterCropPad": (1,),
    "AffineGrid": (1,),
    "DFT": (1, 2),
    "STFT": (1, 3),
    "MaxUnpool": (2,),
    "NonMaxSuppression": (2, 3, 4),
    "OneHot": (1, 2),
    "Pad": (1, 2, 3),
    "Resize": (1, 2, 3),
    "Split": (1,),
    "SplitToSequence": (1,),
    "TopK": (1,),
    **dict.fromkeys(("BlackmanWindow", "HammingWindow", "HannWindow"), (0,)),
    "MelWeightMatrix": (0, 1, 2, 3, 4),
    "Upsample": (1,),
}
#: The most elements a value input may have (operands such as axes and pads are short).
MAX_ELEMENTS = 64


def _nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of the subgraphs of its nodes (``If``, ``Loop``, ``Scan``)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _nodes(sub)


def value_inputs(proto: onnx.ModelProto) -> list[str]:
    """The graph inputs (not initializers) some node reads as an operand TVM needs constant
    (:data:`VALUE_OPERANDS`), in the graph's input order."""
    initializers = {init.name for init in proto.graph.initializer}
    inputs = [v.name for v in proto.graph.input if v.name not in initializers]
    wanted = set()
    for node in _nodes(proto.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        for position in VALUE_OPERANDS.get(node.op_type, ()):
            if position < len(node.input) and node.input[position]:
                wanted.add(node.input[position])
    return [name for name in inputs if name in wanted]


def value_key(value: np.ndarray) -> tuple:
    """A hashable key of ``value`` (dtype, shape and bytes)."""
    return (str(value.dtype), tuple(value.shape), value.tobytes())


def with_values(proto: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``proto`` whose inputs ``values`` names are initializers of those values."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    kept = [v for v in out.graph.input if v.name not in values]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    for name, value in values.items():
        out.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return out
