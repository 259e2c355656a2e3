"""GEMMs whose M no good register tile divides: x padded with zero rows, sliced in the kernel.

The choice is checked for named CPUs (any host); the numeric test runs on the host's kernels.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes import PrepackConstantWeights
from tvm_hybrid.passes.packed_gemm import KERNEL_NAMES, pack_weight, packed_gemm
from tvm_hybrid.schedules.gemm.heuristics import GemmShape, padded_rows, select
from tvm_hybrid.testing.relax_modules import relax_function

ZEN5 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


@pytest.mark.parametrize("target", [ZEN5, HASWELL], ids=["znver5", "haswell"])
def test_rows_are_padded_only_where_a_thin_tile_would_run(target):
    for m in (97, 197, 257, 777):
        pad = padded_rows(target, "float32", GemmShape(1, m, 768, 333))
        assert pad > 0 or m == 777, m  # 777 = 3 * 7 * 37 has good exact tiles
        best = select(target, "float32", GemmShape(1, m + pad, 768, 333), packing=True)[0]
        accumulators = best.mr * best.nr // best.lanes
        assert (m + pad) % best.mr == 0 and accumulators >= 8, (m, pad, best.name)
        assert pad < best.mr
    # Tiles that divide M already, a GEMV, or too few columns to pay for the copy: no padding.
    for m, n in ((7, 768), (1, 768), (192, 768), (256, 768), (197, 16)):
        assert padded_rows(target, "float32", GemmShape(1, m, n, 333)) == 0, (m, n)


def test_padded_gemm_structure():
    """197 rows on AVX-512: x padded to whole 14-row tiles, the GEMM's output sliced back."""
    w = np.random.default_rng(0).standard_normal((64, 256)).astype("float32")
    x = relax.Var("x", relax.TensorType((197, 64), "float32"))
    pad = padded_rows(ZEN5, "float32", GemmShape(1, 197, 256, 64))
    nr = select(ZEN5, "float32", GemmShape(1, 197 + pad, 256, 64), packing=True)[0].nr

    def build(body):
        return relax_function([x], body)

    def expected(bb, x):
        padded = bb.emit(relax.op.nn.pad(x, [0, pad, 0, 0]))

        def compute(x, packed):
            return packed_gemm(x, packed, 256, "float32", "float32", out_rows=197)

        return bb.call_te(compute, padded, relax.const(pack_weight(w, nr)),
                          primfunc_name_hint=KERNEL_NAMES["float32"])

    after = PrepackConstantWeights(ZEN5)(build(lambda bb, x: relax.op.matmul(x, relax.const(w))))
    tvm.ir.assert_structural_equal(after, build(expected), map_free_vars=True)


def test_odd_rows_run_on_a_full_tile_and_match():
    wl = workloads.gemm(197, 256, 333)
    model = tvm_hybrid.compile(wl.model, "host")
    notes = [m for f in model.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
             for m in re.findall(r'"hybrid.gemm_template": "([^"]+)"', f.script())]
    assert notes and all(int(re.search(r" (\d+)x\d+ microkernel", n).group(1)) >= 4
                         for n in notes), notes
    a = wl.inputs["a"]
    w = numpy_helper.to_array(wl.model.graph.initializer[0])
    np.testing.assert_allclose(model(a), a @ w, rtol=1e-4, atol=1e-4)
