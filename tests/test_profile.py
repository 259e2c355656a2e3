"""The profile report (per-kernel times, ONNX nodes, schedule and why) and the compile cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm_hybrid
from tvm_hybrid import compiler
from tvm_hybrid.bench import workloads

BERT = workloads.bert_layer(1, 32, hidden=128, heads=4, ffn=256)


@pytest.fixture(scope="module")
def bert_report():
    model = tvm_hybrid.compile(BERT.model)
    return model, model.profile(**BERT.inputs, repeat=3)


def test_every_kernel_is_timed_and_attributed(bert_report):
    model, report = bert_report
    assert {k.info.name for k in report.kernels} == set(model.kernel_names())
    onnx_nodes = {f"{n.op_type} '{n.name or n.output[0]}'" for n in BERT.model.graph.node}
    attributed = {node for k in report.kernels for node in k.info.nodes}
    assert attributed <= onnx_nodes and all(k.info.nodes for k in report.kernels)
    matmuls = {n for n in onnx_nodes if n.startswith("MatMul")}
    assert matmuls <= attributed  # every GEMM's node is in some kernel
    assert all(k.total_ms > 0 and k.calls >= 1 for k in report.kernels)
    # Q, K and V share one kernel: three calls, three MatMul nodes.
    shared = [k for k in report.kernels if k.calls == 3]
    assert shared and sum(n.startswith("MatMul") for n in shared[0].info.nodes) == 3
    assert report.kernels == sorted(report.kernels, key=lambda k: -k.total_ms)


def test_schedules_details_and_rates(bert_report):
    _, report = bert_report
    templates = [k for k in report.kernels if k.info.schedule == "template"]
    # Four GEMM groups (QKV, output projection, FFN up and down) and the fused attention.
    assert len(templates) >= 5
    for k in templates:
        assert "microkernel" in k.info.detail or "fused attention" in k.info.detail
        assert k.info.flops > 0 and k.gflops > 0
        assert k.peak_percent is None or 0 < k.peak_percent < 150
    attention = next(k for k in templates if "fused attention" in k.info.detail)
    assert "Softmax 'softmax_27'" in attention.info.nodes
    others = [k for k in report.kernels if k.info.schedule != "template"]
    assert others and all(k.info.detail for k in others)
    assert all((k.gflops is None) == (not k.info.flops) for k in report.kernels)
    norm = next(k for k in others if "layer_norm" in k.info.name)
    assert "reduction" in norm.info.detail
    text = str(report)
    assert "outside the kernels" in text and norm.info.name in text
    parts = report.by_schedule()
    assert abs(parts["template"] + parts["fallback"] + parts["stock"] - report.kernels_ms) < 1e-9


def test_fallback_hint_names_the_shape():
    """A GEMM the template cannot tile says so, with its shape and what to try."""
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, [7, 13]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, [13, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 5])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    model = tvm_hybrid.compile(proto)
    (info,) = model.kernels.values()
    assert info.schedule == "fallback" and info.nodes == ["MatMul 'y'"]
    assert "GEMM 7x5x13" in info.detail and "--others metaschedule" in info.detail


def test_fallback_hint_names_a_depthwise_convolution():
    """A depthwise convolution is named as one, not as elementwise data movement."""
    weight = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((16, 1, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=16, pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 12])], [weight])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    model = tvm_hybrid.compile(proto)
    details = [info.detail for name, info in model.kernels.items() if "depthwise" in name]
    assert details and all("depthwise convolution" in d for d in details), model.kernels


def test_html_and_json(bert_report, tmp_path):
    _, report = bert_report
    report.to_html(tmp_path / "p.html")
    page = (tmp_path / "p.html").read_text()
    assert page.count("<tr>") == len(report.kernels) + 1 and "class=bar" in page
    data = json.loads(report.to_json())
    assert len(data["kernels"]) == len(report.kernels) and data["model_ms"] > 0


def test_cli_profile(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(workloads.mlp(8, (32, 64, 16)).model, path)
    out = subprocess.run([sys.executable, "-m", "tvm_hybrid", "profile", str(path), "--html",
                          str(tmp_path / "p.html"), "--json", str(tmp_path / "p.json"),
                          "--repeat", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "template" in out.stdout and "outside the kernels" in out.stdout
    assert (tmp_path / "p.html").is_file() and json.loads((tmp_path / "p.json").read_text())


# --- the compile cache -------------------------------------------------------------------------


def test_cache_hit_loads_without_compiling(tmp_path, monkeypatch):
    first = tvm_hybrid.compile(BERT.model, cache_dir=tmp_path)
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again despite the cache")

    monkeypatch.setattr(compiler, "_compile", no_compile)
    second = tvm_hybrid.compile(BERT.model, cache_dir=tmp_path)
    np.testing.assert_array_equal(first(**BERT.inputs), second(**BERT.inputs))
    # The loaded model keeps its kernel descriptions: it can be profiled.
    assert set(second.kernel_names()) == set(first.kernel_names())
    report = second.profile(**BERT.inputs, repeat=2)
    assert any(k.info.schedule == "template" and k.info.nodes for k in report.kernels)


def test_cache_key_separates_what_changes_the_code(tmp_path):
    wl = workloads.mlp(4, (16, 32))
    tvm_hybrid.compile(wl.model, cache_dir=tmp_path)
    tvm_hybrid.compile(wl.model, cache_dir=tmp_path, precision="bf16")
    tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": "haswell"}, cache_dir=tmp_path)
    tvm_hybrid.compile(workloads.mlp(4, (16, 32), seed=1).model, cache_dir=tmp_path)
    tvm_hybrid.compile(wl.model, cache_dir=tmp_path)  # a hit
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 4


def test_corrupted_entry_is_recompiled_not_run(tmp_path):
    wl = workloads.mlp(4, (16, 32))
    want = tvm_hybrid.compile(wl.model, cache_dir=tmp_path)(**wl.inputs)
    (entry,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    library = entry / "model.so"
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    got = tvm_hybrid.compile(wl.model, cache_dir=tmp_path)(**wl.inputs)
    np.testing.assert_array_equal(got, want)
    assert tvm_hybrid.load(library) is not None  # the entry was rewritten whole


def test_cache_is_bounded(tmp_path):
    for seed in range(3):
        tvm_hybrid.compile(workloads.mlp(4, (16, 32), seed=seed).model, cache_dir=tmp_path,
                           cache_max_bytes=1)
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1


def test_concurrent_processes_share_the_cache(tmp_path):
    code = textwrap.dedent(f"""
        import numpy as np, tvm_hybrid
        from tvm_hybrid.bench import workloads
        wl = workloads.mlp(8, (32, 64, 16))
        out = tvm_hybrid.compile(wl.model, cache_dir={str(tmp_path)!r})(**wl.inputs)
        print(float(np.abs(out).sum()))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    assert len({r[0] for r in results}) == 1
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1


def test_cache_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_HYBRID_CACHE_DIR", str(tmp_path))
    tvm_hybrid.compile(workloads.mlp(4, (16, 32)).model)
    assert os.listdir(tmp_path)
