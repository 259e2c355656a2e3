"""Bad input gets a tvm_hybrid exception naming the problem, never a crash."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid.bench import workloads


def test_missing_file(tmp_path):
    with pytest.raises(tvm_hybrid.ModelLoadError, match="not found: .*nope.onnx"):
        tvm_hybrid.compile(tmp_path / "nope.onnx")


def test_corrupt_file(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x08\x07 this is not protobuf \xff\xfe" * 10)
    with pytest.raises(tvm_hybrid.ModelLoadError, match="bad.onnx is not a valid ONNX model"):
        tvm_hybrid.compile(path)


def test_truncated_file(tmp_path):
    data = workloads.mlp(2, (8, 4)).model.SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(tvm_hybrid.ModelLoadError, match="cut.onnx"):
        tvm_hybrid.compile(path)


def test_op_tvm_cannot_import():
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="LOWER")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.STRING,
                              [2])], [helper.make_tensor_value_info("y", TensorProto.STRING, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(tvm_hybrid.UnsupportedModelError, match="StringNormalizer"):
        tvm_hybrid.compile(model)


@pytest.fixture(scope="module")
def small_model():
    return tvm_hybrid.compile(workloads.mlp(4, (8, 16)).model)


def test_wrong_input_shape(small_model):
    message = r"input 'x' must have shape \(4, 8\), got \(4, 9\)"
    with pytest.raises(tvm_hybrid.InputError, match=message):
        small_model(np.zeros((4, 9), "float32"))


def test_wrong_input_dtype(small_model):
    with pytest.raises(tvm_hybrid.InputError, match="input 'x' must have dtype float32, got int64"):
        small_model(np.zeros((4, 8), "int64"))


def test_wrong_input_count_and_names(small_model):
    with pytest.raises(tvm_hybrid.InputError, match="takes 1 input"):
        small_model(np.zeros((4, 8), "float32"), np.zeros(3))
    with pytest.raises(tvm_hybrid.InputError, match="unknown input"):
        small_model(y=np.zeros((4, 8), "float32"))


@pytest.mark.parametrize("target,match", [
    ("cuda", "unknown target 'cuda'"),
    ({"kind": "cuda"}, "compiles for x86 CPUs"),
    ({"kind": "llvm", "mcpu": "notacpu"}, "unknown CPU mcpu='notacpu'"),
    ({"kind": "llvm", "mtriple": "aarch64-linux-gnu"}, "mtriple"),
    ('{"kind": "llvm", "mcpu": ', "not valid JSON"),
    ({"kind": "llvm", "bogus": 1}, "invalid target"),
])
def test_unknown_target(target, match):
    with pytest.raises(tvm_hybrid.TargetError, match=match):
        tvm_hybrid.make_target(target)


@pytest.mark.skipif("amx_int8" in tvm_hybrid.describe_host()["isa"],
                    reason="checks the refusal on a CPU without AMX; this host has AMX")
def test_amx_target_refused_on_cpu_without_amx():
    # Runs in a subprocess: were AMX code ever lowered for this CPU, LLVM would abort the process.
    code = (
        "import numpy as np, tvm_hybrid\n"
        "from tvm_hybrid.bench import workloads\n"
        "wl = workloads.mlp(4, (8, 16))\n"
        "m = tvm_hybrid.compile(wl.model, {'kind': 'llvm', 'mcpu': 'sapphirerapids'})\n"
        "try:\n"
        "    m(wl.inputs['x'])\n"
        "except tvm_hybrid.TargetError as e:\n"
        "    print('REFUSED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout and "amx-tile" in out.stdout and "lacks" in out.stdout


def test_relax_module_without_main():
    import tvm

    with pytest.raises(tvm_hybrid.ModelLoadError, match="no 'main'"):
        tvm_hybrid.compile(tvm.IRModule({}))


def test_bad_tuning_records(tmp_path):
    with pytest.raises(tvm_hybrid.TuningRecordsError, match="not found"):
        tvm_hybrid.compile(workloads.mlp(2, (4, 4)).model, tuning_records=tmp_path / "none")
    with pytest.raises(tvm_hybrid.TuningRecordsError, match="no MetaSchedule database"):
        tvm_hybrid.compile(workloads.mlp(2, (4, 4)).model, tuning_records=tmp_path)


def test_errors_share_one_base_class():
    for cls in (tvm_hybrid.ModelLoadError, tvm_hybrid.UnsupportedModelError,
                tvm_hybrid.InputError, tvm_hybrid.TargetError, tvm_hybrid.CompileError):
        assert issubclass(cls, tvm_hybrid.TVMHybridError)


def test_compile_error_names_the_pass_and_the_onnx_node(monkeypatch):
    """A pass that fails is named, and so is the ONNX node whose binding its message mentions
    (bindings are named ``node<index>_`` at import)."""
    import tvm

    from tvm_hybrid import pipeline
    from tvm_hybrid.errors import CompileError

    @tvm.transform.module_pass(opt_level=0, name="BrokenPass")
    def broken(mod, _ctx):
        raise ValueError("node0_ has a shape this pass cannot take")

    original = pipeline.graph_passes
    monkeypatch.setattr(pipeline, "graph_passes", lambda *a, **k: [*original(*a, **k), broken])
    model = workloads.paper_workloads(quick=True)[0].model
    with pytest.raises(CompileError, match=r"in pass BrokenPass \(ONNX node MatMul '\w+'\): "
                                           r"node0_ has a shape"):
        tvm_hybrid.compile(model)
