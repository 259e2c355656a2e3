"""The ONNX (and Relax) front end: read a model, fold its shape arithmetic, import it.

- :mod:`.importer`: :func:`import_model`, the entry point, and its checks;
- :mod:`.fold`: shape inference and folding of shape and small constant subgraphs, and of
  ``QuantizeLinear`` of constant weights (before import);
- :mod:`.qlinear`: ``QLinearMatMul`` and ``QLinearConv`` rewritten to QDQ form (before import).
"""

from .importer import ImportedModel, TensorSpec, import_model, load_onnx

__all__ = ["ImportedModel", "TensorSpec", "import_model", "load_onnx"]
