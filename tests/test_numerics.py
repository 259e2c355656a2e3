"""The hybrid pipeline's kernels against numpy on random inputs, including tails.

Tolerance: fp32 results within rtol 1e-4 / atol 1e-4 of numpy's float64 result.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import relax as R  # noqa: F401

import tvm_hybrid
from tvm_hybrid.bench import workloads

RTOL = ATOL = 1e-4


def _matmul_module(m: int, n: int, k: int, batch: tuple = (), activation: bool = True):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*batch, m, k), "float32"))
    w = relax.Var("w", relax.TensorType((*batch, k, n) if batch else (k, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, w), b))
            if activation:
                y = bb.emit(relax.op.nn.relu(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


SHAPES = [
    (1, 64, 64),  # M = 1
    (7, 13, 5),  # primes everywhere: no vector tail fits
    (33, 48, 17),  # N a multiple of 16, M and K odd
    (96, 256, 100),
    (128, 512, 64),
    (5, 1000, 3),
]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matmul_bias_relu_matches_numpy(m, n, k, rng):
    x = rng.standard_normal((m, k)).astype("float32")
    w = rng.standard_normal((k, n)).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    model = tvm_hybrid.compile(_matmul_module(m, n, k))
    want = np.maximum(x.astype("float64") @ w + b, 0)
    np.testing.assert_allclose(model(x, w, b), want, rtol=RTOL, atol=ATOL)


def test_batched_matmul_matches_numpy(rng):
    x = rng.standard_normal((2, 3, 20, 32)).astype("float32")
    w = rng.standard_normal((2, 3, 32, 48)).astype("float32")
    b = rng.standard_normal(48).astype("float32")
    model = tvm_hybrid.compile(_matmul_module(20, 48, 32, batch=(2, 3), activation=False))
    np.testing.assert_allclose(model(x, w, b), x.astype("float64") @ w + b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("wl", [
    workloads.mlp(32, (13, 512, 256, 128)),
    workloads.mlp(3, (479, 64, 1), final="Sigmoid"),
    workloads.attention(1, 32, heads=2),
    workloads.bert_layer(2, 16, hidden=64, heads=4, ffn=128),
], ids=lambda wl: wl.name)
def test_workloads_match_stock_tvm(wl):
    hybrid = tvm_hybrid.compile(wl.model)
    stock = tvm_hybrid.compile(wl.model, pipeline="stock")
    args = list(wl.inputs.values())
    np.testing.assert_allclose(hybrid(*args), stock(*args), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mcpu, register", [("znver4", "zmm"), ("haswell", "ymm")])
def test_hybrid_kernels_are_parallel_and_vectorised(mcpu, register):
    """Compiled for a named CPU (not run): parallel loops, FMAs on that CPU's full vectors."""
    target = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    model = tvm_hybrid.compile(workloads.mlp(64, (64, 128, 32)).model, target)
    tir = model.inspect_source("tir")
    assert "T.parallel" in tir and "T.vectorized" in tir
    asm = model.inspect_source("asm")
    assert re.search(rf"vfmadd\w+\s+.*%{register}", asm)


def test_fusion_makes_one_kernel_per_linear_layer(monkeypatch):
    monkeypatch.setenv("TVM_HYBRID_GEMM_CHAINS", "off")  # tests/test_gemm_chain.py: chains
    model = tvm_hybrid.compile(workloads.mlp(16, (32, 64, 64, 16)).model)
    names = model.kernel_names()
    assert len(names) == 3  # MatMul+Add+ReLU fused per layer
    assert all("packed_matmul" in n and "relu" in n for n in names)
    stock = tvm_hybrid.compile(workloads.mlp(16, (32, 64, 64, 16)).model, pipeline="stock")
    assert "relu" in stock.kernel_names() and "matmul" in stock.kernel_names()


def test_tvm_compile_with_hybrid_pipeline_name(rng):
    mod = _matmul_module(16, 32, 8)
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm_hybrid.describe_host()["cpu"]})
    ex = tvm.compile(mod, target=target, relax_pipeline="hybrid")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x, w, b = (rng.standard_normal(s).astype("float32") for s in ((16, 8), (8, 32), (32,)))
    out = vm["main"](*(tvm.runtime.tensor(a) for a in (x, w, b))).numpy()
    np.testing.assert_allclose(out, np.maximum(x @ w + b, 0), rtol=RTOL, atol=ATOL)
    # With the hybrid TIR pipeline too, on inputs 4 bytes past a 64-byte boundary, zero-copy.
    ex = tvm.compile(mod, target=target, relax_pipeline="hybrid", tir_pipeline="hybrid")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    moved = []
    for a in (x, w, b):
        room = np.empty(a.size + 32, "float32")
        start = (-room.ctypes.data % 64) // 4 + 1
        moved.append(room[start:start + a.size].reshape(a.shape))
        moved[-1][...] = a
    args = [tvm_ffi.from_dlpack(a, require_alignment=4) for a in moved]
    out = vm["main"](*args).numpy()
    np.testing.assert_allclose(out, np.maximum(x @ w + b, 0), rtol=RTOL, atol=ATOL)


def test_softmax_and_layer_norm_kernels_are_parallel():
    """Row reductions get the fallback's parallel schedule, not stock serial lowering."""
    # large enough (>= 2**14 iterations) for the rule to parallelise
    wl = workloads.bert_layer(2, 64, hidden=128, heads=4, ffn=256)
    model = tvm_hybrid.compile(wl.model)
    for gvar, func in model.lowered.functions.items():
        name = gvar.name_hint
        if isinstance(func, tvm.tirx.PrimFunc) and ("softmax" in name or "layer_norm" in name):
            assert "T.parallel" in func.script(), f"{name} is not parallel"
    stock = tvm_hybrid.compile(wl.model, pipeline="stock")
    args = list(wl.inputs.values())
    np.testing.assert_allclose(model(*args), stock(*args), rtol=RTOL, atol=ATOL)
