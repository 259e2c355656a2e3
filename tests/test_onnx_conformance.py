"""Every ONNX backend test case that stock TVM gets right must also be right under hybrid.

The cases are the ones shipped inside the installed onnx package (pytorch-converted,
pytorch-operator, simple, and the light CNN models), checked with onnx's own comparison and
tolerances. A case stock TVM fails is an xfail whose reason is stock TVM's error.
"""

from __future__ import annotations

import pytest
from conftest import CONFORMANCE

from tvm_hybrid.onnx_backend import HybridBackend, StockTVMBackend
from tvm_hybrid.testing.conformance import cases, check_case

CASES = cases()
#: The light CNNs that take a minute or more to compile on 2 cores: run with ``-m slow``
#: (CI runs them; ``ci/run_tests.sh``). SqueezeNet, AlexNet and ZFNet-512 stay in the default run.
SLOW = {"test_densenet121", "test_inception_v1", "test_inception_v2", "test_resnet50",
        "test_shufflenet", "test_vgg19"}


def test_cases_were_found():
    kinds = {case.kind for case in CASES}
    assert kinds == {"pytorch-converted", "pytorch-operator", "simple", "real"}
    assert len(CASES) > 100


@pytest.mark.parametrize("case", [
    pytest.param(c, id=f"{c.kind}/{c.name}", marks=[pytest.mark.slow] if c.name in SLOW else [])
    for c in CASES])
def test_hybrid_matches_reference_where_stock_does(case):
    stock = check_case(case, StockTVMBackend)
    if not stock.ok:
        CONFORMANCE["stock_fails"].append(case.name)
        pytest.xfail(f"stock TVM fails: {stock.reason}")
    hybrid = check_case(case, HybridBackend)
    if not hybrid.ok:
        CONFORMANCE["regressions"].append(case.name)
    else:
        CONFORMANCE["both"].append(case.name)
    assert hybrid.ok, f"stock TVM passes {case.name} but hybrid does not: {hybrid.reason}"
    if case.kind == "real":  # the light CNNs: every convolution on the engine's kernels
        stock = stock_convolutions(hybrid.rep.compiled)
        assert not stock, f"{case.name}: convolutions left to TVM's lowering: {stock}"


def stock_convolutions(compiled) -> list[str]:
    """The kernels of ``compiled`` that are TVM's own convolution lowering (the engine's are
    GEMMs, direct convolutions and depthwise kernels), with the ONNX nodes they compute."""
    return [f"{k.name} ({', '.join(k.nodes)})" for k in compiled.kernels.values()
            if "conv2d" in k.name or "conv1d" in k.name]


def test_backend_api_runs_a_model():
    import numpy as np
    import onnx.backend.base

    from tvm_hybrid import onnx_backend
    from tvm_hybrid.bench.workloads import mlp

    wl = mlp(4, (8, 16, 4))
    assert issubclass(HybridBackend, onnx.backend.base.Backend)
    assert onnx_backend.supports_device("CPU") and not onnx_backend.supports_device("CUDA")
    (out,) = onnx_backend.run_model(wl.model, [wl.inputs["x"]])
    (want,) = StockTVMBackend.run_model(wl.model, [wl.inputs["x"]])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
