"""``LRN`` as one NHWC kernel (``frontend/lrn.py``) and the permutes around it cancelled
(``conv_layout.CancelPermutes``): ONNX Runtime's results (relative 1e-5 of the output's
scale; for an even window, which ONNX Runtime refuses, a numpy form of the ONNX definition:
onnx 1.23's reference evaluator loops over the batch instead of the channels), no pooling or
``power`` kernels, no transposes inside a conv chain."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_hybrid
from tvm_hybrid.passes.conv_layout import CancelPermutes
from tvm_hybrid.passes.relax_rewrite import rewrite_functions
from tvm_hybrid.testing.onnx_checks import compiles_and_matches, main_calls


def _model(c=64, size=5, beta=0.75, pool=True):
    """``Conv -> Relu -> LRN -> [MaxPool ->] Conv`` (GoogLeNet's stem)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((c, 8, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((16, c, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"], pads=[1] * 4),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("LRN", ["r"], ["l"], size=size, alpha=1e-2, beta=beta, bias=2.0)]
    last = "l"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["l"], ["p"], kernel_shape=[3, 3],
                                      strides=[2, 2], pads=[1] * 4))
        last = "p"
    nodes.append(helper.make_node("Conv", [last, "W2"], ["y"], pads=[1] * 4))
    graph = helper.make_graph(
        nodes, "lrn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 24, 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return model, rng.standard_normal((1, 8, 24, 24)).astype(np.float32)


ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")


def _matches_reference(model, x, target=None, expected=None):
    return compiles_and_matches(model, {"x": x}, target=target, rtol=1e-5, expected=expected)


@pytest.mark.parametrize("case", [dict(), dict(size=3, beta=0.5), dict(size=7, beta=1.0),
                                  dict(beta=0.6, c=40), dict(c=5, pool=False)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "googlenet")
def test_lrn_is_one_nhwc_kernel_between_nhwc_convolutions(case):
    """Odd and even windows, each ``beta`` form (square roots, ``pow``), as few channels as
    the window: one ``hybrid_lrn`` kernel; no ``avg_pool3d`` or ``power``; the pool after it
    NHWC too, so the only layout changes are the model's input and output."""
    model, x = _model(**case)
    compiled = _matches_reference(model, x)
    calls = main_calls(compiled)
    assert len([n for n in calls if n.startswith("hybrid_lrn")]) == 1, calls
    assert not [n for n in calls if re.search("pool3d|power", n)], calls
    assert len([n for n in calls if "transpose" in n]) == 2, calls


def test_lrn_with_an_even_window_matches_the_onnx_definition():
    """size 4: one channel more above than below (ONNX: ``floor((size - 1) / 2)`` below)."""
    c, size, alpha, beta, bias = 12, 4, 0.02, 0.75, 1.5
    graph = helper.make_graph(
        [helper.make_node("LRN", ["x"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias)],
        "lrn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 5, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = np.random.default_rng(1).standard_normal((2, c, 5, 7)).astype(np.float32) * 3
    below, above = (size - 1) // 2, size - 1 - (size - 1) // 2
    square_sum = np.stack([(x[:, max(0, i - below):i + above + 1] ** 2).sum(axis=1)
                           for i in range(c)], axis=1)
    expected = x / (bias + alpha / size * square_sum) ** beta
    compiled = _matches_reference(model, x, expected=expected)
    assert [n for n in main_calls(compiled) if n.startswith("hybrid_lrn")]


@pytest.mark.parametrize("case", [dict(c=4, pool=False), dict(size=1, pool=False)],
                         ids=["fewer-channels", "size-1"])
def test_lrn_with_fewer_channels_than_its_window_or_a_window_of_one_keeps_tvms_form(case):
    model, x = _model(**case)
    compiled = _matches_reference(model, x)
    assert not [n for n in main_calls(compiled) if n.startswith("hybrid_lrn")]


@pytest.mark.parametrize("mcpu,register", [("haswell", "ymm"), ("znver4", "zmm")])
def test_lrn_kernel_is_vectorised_with_square_roots(mcpu, register):
    """beta 0.75 as ``1 / (sqrt(d) * sqrt(sqrt(d)))``: packed square roots, no ``powf``."""
    model, _ = _model()
    compiled = tvm_hybrid.compile(model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    asm = compiled.inspect_source("asm")
    assert re.search(rf"vsqrtps\s+%{register}", asm)
    assert "powf" not in asm


def _function(build):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 6, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod) -> list[str]:
    names = []
    relax.analysis.post_order_visit(mod["main"], lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def test_cancel_permutes_structure():
    """A permute pair that cancels is its input; one that does not is one permute; an NCHW pool
    of a permuted NHWC tensor pools NHWC and permutes after (which the next permute cancels)."""
    def pair(bb, x):
        t = bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2]))
        return relax.op.permute_dims(t, [0, 2, 3, 1])

    def chain(bb, x):
        t = bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2]))
        return relax.op.permute_dims(t, [0, 1, 3, 2])

    def pooled(bb, x):
        t = bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2]))
        p = bb.emit(relax.op.nn.max_pool2d(t, pool_size=(3, 3), strides=(2, 2),
                                           padding=(1, 1, 1, 1)))
        return relax.op.permute_dims(p, [0, 2, 3, 1])

    xv = np.random.default_rng(0).standard_normal((1, 6, 6, 8)).astype(np.float32)
    for build, expected in ((pair, []), (chain, ["relax.permute_dims"]),
                            (pooled, ["relax.nn.max_pool2d"])):
        before = _function(build)
        after = rewrite_functions(before, CancelPermutes(before), eliminate_dead_code=True)
        assert _ops(after) == expected, after
        results = []
        for mod in (before, after):
            vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
            results.append(vm["main"](tvm.runtime.tensor(xv)).numpy())
        np.testing.assert_array_equal(results[0], results[1])
