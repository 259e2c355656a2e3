"""The runtimes a user would pick instead of tvm_hybrid, behind one interface.

Each runner compiles (or loads) an ONNX model and returns a callable taking the model's inputs
as a name -> array dict and returning its outputs as a list of arrays. ``hybrid`` and ``tvm``
(stock TVM's default pipeline) are always available; ``onnxruntime`` and ``openvino`` when
installed (``pip install tvm_hybrid[bench]``). ``hybrid_bf16`` is hybrid's ``precision="bf16"``
mode; ``openvino`` runs with an fp32 inference-precision hint, ``openvino_default`` with
OpenVINO's own default (bf16 on CPUs with AVX512-BF16 or AMX).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable

import numpy as np
import onnx

from ..thread_pool import physical_cores

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]

PEERS = ("hybrid", "tvm", "onnxruntime", "openvino", "hybrid_bf16", "openvino_default")
_MODULES = {"onnxruntime": "onnxruntime", "openvino": "openvino",
            "openvino_default": "openvino"}


def available(name: str) -> bool:
    """Whether the peer ``name`` can run here."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    module = _MODULES.get(name)
    return module is None or importlib.util.find_spec(module) is not None


def make_runner(name: str, model: onnx.ModelProto, target="host") -> Runner:
    """Compile ``model`` with the peer ``name`` and return a callable running it."""
    if name in ("hybrid", "tvm", "hybrid_bf16"):
        from ..compiler import compile as hybrid_compile

        compiled = hybrid_compile(model, target, pipeline="stock" if name == "tvm" else "hybrid",
                                  precision="bf16" if name == "hybrid_bf16" else "fp32")
        names = [spec.name for spec in compiled.inputs]

        def run_tvm(feeds):
            out = compiled(*[feeds[n] for n in names])
            return list(out) if isinstance(out, tuple) else [out]

        return run_tvm
    if name == "onnxruntime":
        return _onnxruntime(model)
    if name == "openvino":
        return _openvino(model)
    if name == "openvino_default":
        return _openvino(model, precision=None)
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


def _onnxruntime(model: onnx.ModelProto) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = physical_cores()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Idle ORT threads otherwise spin for a while after each run and, timed interleaved with
    # other runtimes on few cores, steal those cores from whichever runtime runs next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return lambda feeds: session.run(None, feeds)


def _openvino(model: onnx.ModelProto, precision: str | None = "f32") -> Runner:
    import openvino as ov

    core = ov.Core()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save(model, path)
        ov_model = core.read_model(path)
    config = {"INFERENCE_NUM_THREADS": physical_cores(), "PERFORMANCE_HINT": "LATENCY"}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = core.compile_model(ov_model, "CPU", config)
    request = compiled.create_infer_request()
    outputs = compiled.outputs

    def run(feeds):
        result = request.infer(feeds)
        return [np.asarray(result[o]) for o in outputs]

    return run
