"""512-bit vectors for all code on Intel AVX-512 targets (``host.wide_vectors``).

LLVM's Intel AVX-512 CPUs carry the tuning feature ``prefer-256-bit``, under which LLVM's
vectorizers make ymm vectors of what TVM left scalar (a quantization's rounding). Targets are
compiled and their assembly read; nothing here runs AVX-512 code.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import tvm_hybrid
from tvm_hybrid.host import NARROW_VECTORS, make_target, target_features, wide_vectors
from tvm_hybrid.tuning.records import target_identity


@pytest.mark.parametrize("mcpu", ["skylake-avx512", "icelake-server", "sapphirerapids",
                                  "emeraldrapids"])
def test_intel_avx512_targets_take_512_bit_vectors(mcpu):
    target = make_target({"kind": "llvm", "mcpu": mcpu})
    assert [str(m) for m in target.attrs["mattr"]] == [f"-{NARROW_VECTORS}"]
    features = target_features(target)
    assert "avx512f" in features and NARROW_VECTORS not in features
    assert wide_vectors(target).export() == target.export()  # applied once


@pytest.mark.parametrize("mcpu", ["znver4", "znver5", "haswell", "znver3", "alderlake"])
def test_other_targets_are_left_as_they_are(mcpu):
    target = make_target({"kind": "llvm", "mcpu": mcpu})
    assert "mattr" not in target.attrs
    assert NARROW_VECTORS not in target_features(target)


def test_a_target_that_names_the_feature_keeps_it():
    target = make_target({"kind": "llvm", "mcpu": "sapphirerapids",
                          "mattr": [f"+{NARROW_VECTORS}"]})
    assert [str(m) for m in target.attrs["mattr"]] == [f"+{NARROW_VECTORS}"]
    assert NARROW_VECTORS in target_features(target)


def test_a_hidden_feature_is_kept_beside_it():
    target = make_target({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": ["-amx-tile"]})
    assert [str(m) for m in target.attrs["mattr"]] == ["-amx-tile", f"-{NARROW_VECTORS}"]


def _scaled_round() -> onnx.ModelProto:
    """``relu(round(x * a))`` over NCHW channels, a quantization's arithmetic: TVM leaves the
    rounding scalar and LLVM's vectorizers vectorize it."""
    rng = np.random.default_rng(0)
    a = numpy_helper.from_array(rng.standard_normal((1, 64, 1, 1)).astype("float32"), "a")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "a"], ["t"]), helper.make_node("Round", ["t"], ["u"]),
         helper.make_node("Relu", ["u"], ["y"])], "scaled_round",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 32, 32])], [a])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rounding_registers(mattr: list[str]) -> set[str]:
    spec = {"kind": "llvm", "mcpu": "sapphirerapids"}
    if mattr:
        spec["mattr"] = mattr
    asm = tvm_hybrid.compile(_scaled_round(), target=spec).inspect_source("asm")
    rounding = re.findall(r"^\s*v(?:rndscale|round)ps\s+.*$", asm, re.MULTILINE)
    assert rounding, "no vector rounding in the kernel"
    return {reg for line in rounding for reg in re.findall(r"%([xyz]mm)\d+", line)}


def test_the_rounding_is_vectorized_on_zmm():
    wide, narrow = _rounding_registers([]), _rounding_registers([f"+{NARROW_VECTORS}"])
    assert "zmm" in wide and "ymm" not in wide
    assert "ymm" in narrow and "zmm" not in narrow


def test_tuning_records_made_without_it_still_apply():
    made = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    now = make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    assert "mattr" not in made.attrs and "mattr" in now.attrs
    assert target_identity(made) == target_identity(now)
    hidden = make_target({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": ["-amx-tile"]})
    assert target_identity(hidden)["mattr"] == ["-amx-tile"]
