"""Kernels that take inputs at any element-aligned address (``ElementAlignedArguments``), and
models that pass large numpy inputs zero-copy at such addresses."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import host_target
from tvm_hybrid.transfer import ALIGNMENT, SMALL_BYTES


@T.prim_func
def _double(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "int8")):
    T.func_attr({"global_symbol": "double", "tirx.noalias": True})
    for i in T.vectorized(64):
        b[i] = T.Cast("int8", a[i] * T.float32(2))


def _argument_alignments(pipeline: str) -> list[tuple[str, int]]:
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})
    lib = tvm.tirx.build(tvm.IRModule({"double": _double}), target, pipeline=pipeline)
    return [(ty, int(align)) for ty, align in re.findall(
        r"(?:load|store) <64 x (\w+)>[^\n]*, align (\d+)", lib.inspect_source("ll"))]


def test_kernels_assume_element_alignment_of_their_arguments():
    # Stock TVM's pipeline assumes 64-byte aligned arguments; the hybrid one their element size.
    assert _argument_alignments("default") == [("float", 64), ("i8", 64)]
    assert _argument_alignments("hybrid") == [("float", 4), ("i8", 1)]


def _moved(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``array`` at ``offset`` bytes past a 64-byte boundary."""
    room = np.empty(array.nbytes + 2 * ALIGNMENT, np.uint8)
    start = (-room.ctypes.data) % ALIGNMENT + offset
    moved = room[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    moved[...] = array
    return moved


def _workload(kind: str) -> workloads.Workload:
    if kind == "attention":
        return workloads.attention(1, 96, heads=4, head_dim=32)
    if kind == "gemm":
        return workloads.mlp(97, (160, 96, 33))
    if kind == "int8":
        return workloads.matmul_integer(67, 48, 300)
    if kind == "qdq_attention":
        return workloads.qdq_attention(1, 96, heads=4, head_dim=32)
    return workloads.resnet(size=40, widths=(8, 16), classes=10)


@pytest.mark.parametrize("kind", ["attention", "gemm", "int8", "qdq_attention", "conv",
                                  pytest.param("bf16", marks=pytest.mark.requires("avx512bf16"))])
def test_large_inputs_run_zero_copy_at_any_element_alignment(kind):
    wl = _workload("gemm" if kind == "bf16" else kind)
    model = tvm_hybrid.compile(wl.model, host_target(),
                               precision="bf16" if kind == "bf16" else "fp32")
    names = [spec.name for spec in model.inputs]
    want = model(**{n: _moved(wl.inputs[n], 0) for n in names})
    large = [i for i, n in enumerate(names) if wl.inputs[n].nbytes > SMALL_BYTES]
    assert large, "the workload needs an input above SMALL_BYTES to test the zero-copy path"
    for offset in (4, 16, 36):  # element-aligned, not 64-byte aligned; bytes at odd addresses
        model._local.staging = {}
        got = model(**{n: _moved(wl.inputs[n], offset + 1 if wl.inputs[n].itemsize == 1
                                 else offset) for n in names})
        assert not set(large) & set(model._local.staging), "a large input was copied"
        np.testing.assert_array_equal(got, want)
