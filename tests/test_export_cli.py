"""Export/load round trip, inspect_source, benchmark, and the tvm-hybrid command line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

import tvm_hybrid
from tvm_hybrid.bench import workloads


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tvm_hybrid", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_export_and_load_round_trip(tmp_path):
    wl = workloads.mlp(8, (16, 32, 8))
    model = tvm_hybrid.compile(wl.model)
    path = model.export(tmp_path / "mlp.so")
    loaded = tvm_hybrid.load(path)
    assert model.element_aligned and loaded.element_aligned  # recorded in the library
    np.testing.assert_array_equal(loaded(wl.inputs["x"]), model(wl.inputs["x"]))
    with pytest.raises(tvm_hybrid.InputError):
        loaded(np.zeros((8, 3), "float32"))


def test_inspect_source_and_benchmark():
    wl = workloads.mlp(8, (16, 32))
    model = tvm_hybrid.compile(wl.model)
    assert "define" in model.inspect_source("ll")
    assert "ret" in model.inspect_source("asm")
    assert "T.prim_func" in model.inspect_source("tir")
    stats = model.benchmark(wl.inputs["x"], repeat=3, min_repeat_ms=1)
    assert stats["repeat"] == 3 and 0 < stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"]
    with pytest.raises(ValueError, match="unknown source format"):
        model.inspect_source("pdf")


def test_cli_compile_run_round_trip(tmp_path):
    wl = workloads.mlp(4, (8, 16))
    onnx.save(wl.model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=wl.inputs["x"])
    out = _cli("compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.so"))
    assert out.returncode == 0, out.stderr
    out = _cli("run", str(tmp_path / "m.so"), "--inputs", str(tmp_path / "in.npz"), "-o",
               str(tmp_path / "out.npz"), "--print-time", "--repeat", "3")
    assert out.returncode == 0, out.stderr
    assert "latency: median" in out.stdout
    want = tvm_hybrid.compile(wl.model, pipeline="stock")(wl.inputs["x"])
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["output_0"], want, rtol=1e-5)


@pytest.mark.parametrize("args,match", [
    (("compile", "missing.onnx", "-o", "x.so"), "model file not found: missing.onnx"),
    (("run", "missing.so"), "compiled model not found"),
    (("compile", "{model}", "-o", "x.so", "--target", "cuda"), "unknown target 'cuda'"),
])
def test_cli_errors_are_one_line(tmp_path, args, match):
    onnx.save(workloads.mlp(2, (4, 4)).model, tmp_path / "m.onnx")
    args = [a.format(model=tmp_path / "m.onnx") for a in args]
    out = _cli(*args)
    assert out.returncode == 2
    assert match in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_cli_info():
    out = _cli("info", "--json")
    assert out.returncode == 0, out.stderr
    assert '"isa"' in out.stdout and '"versions"' in out.stdout


def test_cli_bench_checks_outputs_and_prints_table(tmp_path):
    onnx.save(workloads.mlp(8, (16, 32)).model, tmp_path / "m.onnx")
    out = _cli("bench", str(tmp_path / "m.onnx"), "--compare", "tvm", "--rounds", "3")
    assert out.returncode == 0, out.stderr
    assert "hybrid" in out.stdout and "vs tvm" in out.stdout


def test_cli_demo_prints_table():
    out = _cli("demo", "--rounds", "3")
    assert out.returncode == 0, out.stderr
    assert "outputs agree" in out.stdout
    assert "dlrm_mlp_b128" in out.stdout and "bert_layer" in out.stdout
