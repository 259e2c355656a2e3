"""tvm_hybrid as an ONNX backend (``onnx.backend.base.Backend``).

This lets onnx's own conformance runner, ``onnx.backend.test.BackendTest``, drive tvm_hybrid
over the test data that ships with the onnx package::

    import onnx.backend.test
    from tvm_hybrid.onnx_backend import HybridBackend
    globals().update(onnx.backend.test.BackendTest(HybridBackend, __name__).test_cases)

:class:`StockTVMBackend` runs TVM's default pipeline instead, as the baseline.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .compiled_model import CompiledModel
from .compiler import compile as hybrid_compile


class HybridBackendRep(BackendRep):
    """A compiled model, run the way ONNX backends are: a list of inputs in, a list out."""

    def __init__(self, compiled: CompiledModel, sequence_output: bool = False):
        self.compiled = compiled
        #: whether the model's one output is a sequence (returned as one list of arrays)
        self.sequence_output = sequence_output

    def run(self, inputs, **kwargs):  # noqa: ARG002 - the Backend API passes extra kwargs
        if isinstance(inputs, dict):
            arrays = [inputs[spec.name] for spec in self.compiled.inputs]
        elif isinstance(inputs, (list, tuple)):
            arrays = list(inputs)[: len(self.compiled.inputs)]
        else:
            arrays = [inputs]
        outputs = self.compiled(*[np.asarray(a) for a in arrays])
        outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
        return [outputs] if self.sequence_output else outputs


class HybridBackend(Backend):
    """ONNX backend compiling with the hybrid pipeline for this CPU."""

    pipeline = "hybrid"

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs) -> HybridBackendRep:
        if not cls.supports_device(device):
            raise ValueError(f"{cls.__name__} runs on CPU only, not {device!r}")
        outputs = model.graph.output
        sequence = len(outputs) == 1 and outputs[0].type.HasField("sequence_type")
        return HybridBackendRep(hybrid_compile(model, "host", pipeline=cls.pipeline), sequence)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs, device: str = "CPU", **kwargs):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper().startswith("CPU")


class StockTVMBackend(HybridBackend):
    """ONNX backend compiling with TVM's stock default pipeline (the baseline)."""

    pipeline = "stock"


prepare = HybridBackend.prepare
run_model = HybridBackend.run_model
supports_device = HybridBackend.supports_device
