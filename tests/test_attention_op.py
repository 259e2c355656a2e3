"""ONNX's ``Attention`` op (opset 23): imported as the ops ``FuseAttention`` fuses
(``frontend/attention.py``), checked against ONNX Runtime's implementation of the op
(tolerance 1e-5 of the output scale) in its forms: 4-d heads with a float mask, 3-d inputs
with head counts and ``is_causal``, grouped-query heads with a boolean mask and a scale, and a
decoding step with ``past_key``/``past_value`` and their ``present`` outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid.errors import UnsupportedModelError
from tvm_hybrid.passes.fuse_attention import FUSED_ATTENTION

F, B = TensorProto.FLOAT, TensorProto.BOOL


def _model(inputs, attrs, outputs=("y",)) -> onnx.ModelProto:
    node = helper.make_node("Attention", [n for n, _, _ in inputs], list(outputs),
                            name="attn", **attrs)
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(o, F, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


CASES = {
    "4d_float_mask": ([("q", F, [2, 4, 40, 32]), ("k", F, [2, 4, 50, 32]),
                       ("v", F, [2, 4, 50, 32]), ("m", F, [2, 1, 40, 50])], {}, ("y",)),
    "3d_causal": ([("q", F, [2, 40, 128]), ("k", F, [2, 40, 128]), ("v", F, [2, 40, 128])],
                  {"q_num_heads": 4, "kv_num_heads": 4, "is_causal": 1}, ("y",)),
    "gqa_bool_mask": ([("q", F, [1, 8, 30, 32]), ("k", F, [1, 2, 30, 32]),
                       ("v", F, [1, 2, 30, 32]), ("m", B, [30, 30])], {"scale": 0.3}, ("y",)),
    "past_and_present": ([("q", F, [1, 4, 1, 32]), ("k", F, [1, 4, 1, 32]),
                          ("v", F, [1, 4, 1, 32]), ("m", F, [1, 1, 1, 20]),
                          ("pk", F, [1, 4, 19, 32]), ("pv", F, [1, 4, 19, 32])], {},
                         ("y", "present_key", "present_value")),
}


def _feeds(model, rng):
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == B:  # attend to the past and some others
            feeds[value.name] = np.tril(np.ones(shape, bool)) | (rng.random(shape) < 0.3)
        elif value.name == "m":
            feeds[value.name] = np.where(rng.random(shape) < 0.2, -1e4, 0).astype("float32")
        else:
            feeds[value.name] = rng.standard_normal(shape).astype("float32")
    return feeds


@pytest.mark.parametrize("case", list(CASES))
def test_attention_op_is_fused_and_matches_onnxruntime(case):
    import onnxruntime as ort

    inputs, attrs, outputs = CASES[case]
    model = _model(inputs, attrs, outputs)
    feeds = _feeds(model, np.random.default_rng(0))
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = tvm_hybrid.compile(model)
    names = compiled.kernel_names()
    assert [n for n in names if n.startswith(FUSED_ATTENTION)] == [FUSED_ATTENTION], names
    assert not any("softmax" in n for n in names), names
    got = compiled(**feeds)
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-5 * np.abs(w).max())


def test_unsupported_attention_attributes_name_the_node():
    inputs = [("q", F, [1, 2, 8, 16]), ("k", F, [1, 2, 8, 16]), ("v", F, [1, 2, 8, 16])]
    with pytest.raises(UnsupportedModelError, match="'attn'.*softcap"):
        tvm_hybrid.compile(_model(inputs, {"softcap": 30.0}))
    with pytest.raises(UnsupportedModelError, match="'attn'.*qk_matmul_output"):
        tvm_hybrid.compile(_model(inputs, {}, ("y", "pk", "pv", "qk")))
