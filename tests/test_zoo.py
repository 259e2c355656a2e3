"""The real-model zoo (``tvm_hybrid/testing/zoo.py``): third-party ONNX models from PyPI wheels
compile as shipped and match ONNX Runtime on realistic inputs.

The tolerance is on ``max|ours - ONNX Runtime| / max|ONNX Runtime|`` per output: 1e-4 for fp32
models; for the int8 models 0.1 and the same top-1 decision (argmax over the last axis) at
every position, because a float difference of one ulp before a quantizer moves a value by one
quantization step that later layers carry on (``zoo.INT8_TOLERANCE``). QDQ models are compared
with ONNX Runtime evaluating the graph as written (graph optimizations off: float dequantize,
op, quantize, the ONNX semantics): its fused ``QLinearConv`` saturates pair sums on CPUs
without VNNI (0.24 off its own unfused result on a Zen 3). Models are fetched on
first use into ``models/`` (or ``TVM_HYBRID_ZOO_DIR``); a test is skipped, saying why, when its
wheel cannot be fetched.
"""

from __future__ import annotations

import numpy as np
import pytest

import tvm_hybrid
from tvm_hybrid.testing import zoo

ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")

#: The models that take longest on 2 cores (20-60 s each on an idle Zen 3), run with -m slow
#: (CI runs them; ``ci/run_tests.sh``). The default run keeps an fp32 CNN, a recurrent model,
#: both int8 kinds and the dynamic-shape ones.
SLOW = {"layout", "captcha_ocr", "ocr_det", "yolox_captcha", "yolov8n", "orientation"}


@pytest.mark.parametrize("entry", [
    pytest.param(m, id=m.name, marks=[pytest.mark.slow] if m.name in SLOW else [])
    for m in zoo.MODELS
])
def test_zoo_model_compiles_as_shipped_and_matches_onnxruntime(entry):
    try:
        path = zoo.fetch(entry)
    except zoo.FetchError as err:
        pytest.skip(f"zoo model {entry.name} not available: {err}")
    feeds = entry.inputs(np.random.default_rng(0))
    compiled = tvm_hybrid.compile(path, input_shapes={k: v.shape for k, v in feeds.items()
                                                      if v.ndim})
    options = ort.SessionOptions()
    if entry.kind == "int8-qdq":  # module docstring: ORT's fused int8 kernels saturate on AVX2
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    out = compiled(**feeds)
    got = list(out) if isinstance(out, (list, tuple)) else [out]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert np.asarray(a).shape == b.shape
    errors = zoo.relative_errors(got, expected)
    assert max(errors) <= entry.tolerance, f"relative errors {errors}"
    if entry.kind.startswith("int8"):
        ours, theirs = np.asarray(got[0]), expected[0]
        np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert all(np.isfinite(np.asarray(a)).all() for a in got)
    # Every convolution runs on the engine (TVM's own conv lowering runs at ~1% of peak).
    stock_convs = [k for k in compiled.kernels if "conv1d" in k or "conv2d" in k]
    assert not stock_convs, stock_convs


@pytest.mark.slow
def test_a_qoperator_model_from_onnxruntimes_quantizer(tmp_path):
    """ocr_cls quantized by ONNX Runtime's own tool in its QOperator format: QLinearConv (TVM
    imports none), per-channel s8 weights that stay float in Constant nodes with a
    QuantizeLinear in the graph (Paddle keeps weights in Constant nodes), u8 activations. It
    compiles, its convolutions run on the int8 kernels, and it matches ONNX Runtime running
    the same file (the int8 models' tolerance: ONNX Runtime's u8 x s8 kernels saturate on
    CPUs without VNNI)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    entry = zoo.BY_NAME["ocr_cls"]
    try:
        path = zoo.fetch(entry)
    except zoo.FetchError as err:
        pytest.skip(f"zoo model ocr_cls not available: {err}")

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.batches = (entry.inputs(np.random.default_rng(seed)) for seed in range(1, 5))

        def get_next(self):
            return next(self.batches, None)

    out = str(tmp_path / "ocr_cls_qoperator.onnx")
    quantize_static(str(path), out, Calibration(), quant_format=QuantFormat.QOperator,
                    op_types_to_quantize=["Conv", "MatMul"], per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("QLinearConv") > 40 and ops.count("QuantizeLinear") > 40
    feeds = entry.inputs(np.random.default_rng(0))
    expected = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = tvm_hybrid.compile(out, input_shapes={k: v.shape for k, v in feeds.items()})
    got = compiled(**feeds)
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    assert max(zoo.relative_errors(got, expected)) <= zoo.INT8_TOLERANCE
    np.testing.assert_array_equal(np.asarray(got[0]).argmax(-1), expected[0].argmax(-1))
    assert sum("int8" in k for k in compiled.kernel_names()) >= 10, compiled.kernel_names()
