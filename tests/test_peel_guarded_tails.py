"""Guarded write-backs peeled to whole vectors outside the last panel (``PeelGuardedTails``)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from onnx import numpy_helper
from tvm import s_tir, tirx
from tvm.script import tirx as T

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes import PeelGuardedTails
from tvm_hybrid.passes.peel_guarded_tails import peel_guarded_tails


@T.prim_func(s_tir=True)
def _rows_parallel(a: T.Buffer((8, 48), "float32"), b: T.Buffer((8, 37), "float32")):
    # 7 of 8 rows and 37 of 48 columns kept; the threads split the rows.
    for p in T.parallel(2):
        for j in range(3):
            for i in range(4):
                for v in T.vectorized(16):
                    with T.sblock("write_back"):
                        vi = T.axis.spatial(8, p * 4 + i)
                        vj = T.axis.spatial(48, j * 16 + v)
                        T.where(p * 4 + i < 7 and j * 16 + v < 37)
                        T.reads(a[vi, vj])
                        T.writes(b[vi, vj])
                        b[vi, vj] = a[vi, vj]


@T.prim_func(s_tir=True)
def _columns_parallel(a: T.Buffer((48,), "float32"), b: T.Buffer((37,), "float32")):
    # The threads split the columns: the guard uses the parallel loop's variable.
    for p in T.parallel(3):
        for v in T.vectorized(16):
            with T.sblock("write_back"):
                vj = T.axis.spatial(48, p * 16 + v)
                T.where(p * 16 + v < 37)
                T.reads(a[vj])
                T.writes(b[vj])
                b[vj] = a[vj]


@T.prim_func(s_tir=True)
def _scalar(a: T.Buffer((48,), "float32"), b: T.Buffer((37,), "float32")):
    for j in range(3):
        for v in range(16):
            with T.sblock("write_back"):
                vj = T.axis.spatial(48, j * 16 + v)
                T.where(j * 16 + v < 37)
                T.reads(a[vj])
                T.writes(b[vj])
                b[vj] = a[vj]


def _predicates(func: tirx.PrimFunc) -> list[str]:
    found = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlockRealize, lambda r: found.append(
        str(r.predicate)))])
    return [p for p in found if p != "T.bool(True)"]


def test_lane_dependent_conjunct_becomes_likely():
    before = _predicates(_rows_parallel)
    after = _predicates(peel_guarded_tails(_rows_parallel))
    assert len(before) == len(after) == 1 and "likely" not in before[0]
    # The column guard (it uses the vectorised v) is marked; the rows' guard is not.
    assert "T.likely(j * 16 + v < 37)" in after[0]
    assert "T.likely(p" not in after[0] and "p * 4 + i < 7" in after[0]
    # A conjunct marked already is recognised (TVM 0.27 names the op "prim.likely"): a second
    # run changes nothing, no T.likely(T.likely(...)).
    peeled = peel_guarded_tails(_rows_parallel)
    assert peel_guarded_tails(peeled).same_as(peeled)


@pytest.mark.parametrize("func", [_columns_parallel, _scalar], ids=["parallel", "scalar"])
def test_guards_left_alone(func):
    # Partitioning a parallel loop would run its parts one after the other; a loop that is not
    # vectorised does not need it.
    assert peel_guarded_tails(func).same_as(func)


def test_module_pass_rewrites_each_function():
    mod = tvm.IRModule({"rows": _rows_parallel, "columns": _columns_parallel})
    out = PeelGuardedTails()(mod)
    assert "likely" in str(_predicates(out["rows"])) and out["columns"].same_as(mod["columns"])


def _output_stores(mcpu: str, disabled: tuple[str, ...] = ()) -> set[int]:
    """The lanes of the stores to the output of a 197 x 777 GEMM with a HardSwish epilogue
    (1: scalar), in the kernel after TVM's ``VectorizeLoop``, compiled for ``mcpu``."""
    seen = {}

    @tvm.instrument.pass_instrument
    class _AfterVectorize:
        def run_after_pass(self, mod, info):
            if info.name == "tirx.VectorizeLoop":
                seen["mod"] = mod

    wl = workloads.mlp(197, (333, 777), final="HardSwish")
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    with tvm.transform.PassContext(opt_level=3, instruments=[_AfterVectorize()],
                                   disabled_pass=list(disabled)):
        tvm_hybrid.compile(wl.model, target)
    lanes = set()
    for gvar, func in seen["mod"].functions_items():
        if "matmul" not in gvar.name_hint:
            continue
        output = func.params[-1].name

        def on_store(store, output=output):
            if store.buffer.name == output:
                index = store.indices[-1]
                lanes.add(int(index.lanes) if isinstance(index, tirx.Ramp) else 1)

        tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, on_store)])
    return lanes


@pytest.mark.parametrize("mcpu", ["haswell", "skylake-avx512"])
def test_write_back_of_a_column_tail_is_vectorised(mcpu):
    # 777 columns on 32-column panels: 9 kept in the last one, not a whole half vector. TVM
    # scalarises a guard on single lanes: every panel's write-back and HardSwish ran scalar.
    assert _output_stores(mcpu, disabled=("PeelGuardedTails",)) == {1}
    # Whole panels (24 columns on AVX2's 4x24 tile, 32 on AVX-512's 11x32) in vectors; the
    # last panel's 9 columns in a 9-lane store. (The partition's other piece, columns 9 to the
    # panel's end, stays under a false guard until TVM removes it.)
    assert {{"haswell": 24, "skylake-avx512": 32}[mcpu], 9} <= _output_stores(mcpu)


@pytest.mark.parametrize("batch, dims, final", [
    (197, (333, 777), "HardSwish"), (197, (333, 777), "Sigmoid"), (7, (97, 97), "Sigmoid"),
    (13, (40, 23, 9), None), (1, (64, 777), None),
])
def test_peeled_kernels_match_numpy(batch, dims, final):
    wl = workloads.mlp(batch, dims, final=final)
    got = np.asarray(tvm_hybrid.compile(wl.model)(wl.inputs["x"]))
    weights = {t.name: numpy_helper.to_array(t) for t in wl.model.graph.initializer}
    want = wl.inputs["x"].astype(np.float64)
    for node in wl.model.graph.node:
        if node.op_type == "MatMul":
            want = want @ weights[node.input[1]]
        elif node.op_type == "Add":
            want = want + weights[node.input[1]]
        elif node.op_type == "Relu":
            want = np.maximum(want, 0)
        elif node.op_type == "Sigmoid":
            want = 1 / (1 + np.exp(-want))
        elif node.op_type == "HardSwish":
            want = want * np.clip(want / 6 + 0.5, 0, 1)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
