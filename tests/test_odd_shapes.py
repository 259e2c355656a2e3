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
from tvm_hybrid.host import CacheSizes
from tvm_hybrid.passes import PrepackConstantWeights
from tvm_hybrid.passes.packed_gemm import KERNEL_NAMES, pack_weight, packed_gemm
from tvm_hybrid.schedules.gemm.heuristics import (
    GemmShape,
    padded_rows,
    select,
    thread_balance,
)
from tvm_hybrid.testing.relax_modules import relax_function

ZEN5 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
ZEN3_CACHES = CacheSizes(l1d=32 * 1024, l2=512 * 1024, l3=32 * 1024 * 1024)


@pytest.mark.parametrize("target", [ZEN5, HASWELL], ids=["znver5", "haswell"])
def test_rows_are_padded_only_where_a_thin_tile_would_run(target):
    for m in (97, 197, 257, 777):
        pad = padded_rows(target, "float32", GemmShape(1, m, 768, 333))
        assert pad > 0 or m == 777, m  # 777 = 3 * 7 * 37 has good exact tiles
        best = select(target, "float32", GemmShape(1, m + pad, 768, 333), packing=True)[0]
        accumulators = best.mr * best.nr // best.lanes
        assert (m + pad) % best.mr == 0 and accumulators >= 8, (m, pad, best.name)
        assert pad < best.mr
    # Tiles that divide M already, a GEMV, too few columns on a good exact tile (7x32 or 7x8),
    # or a narrow N on the transposed tail: no padding.
    for m, n in ((1, 768), (192, 768), (256, 768), (49, 16), (197, 1), (197, 4)):
        assert padded_rows(target, "float32", GemmShape(1, m, n, 333)) == 0, (m, n)
    # A narrow N the transposed tail does not take, on a 1-row tile: padded (measured 1.5x);
    # so are narrow integer GEMMs, which have no transposed tail (1.2-3.2x).
    assert padded_rows(target, "float32", GemmShape(1, 197, 16, 333)) > 0
    for dtype in ("uint8", "int16"):
        if select(target, dtype, GemmShape(1, 197, 4, 332), packing=True):
            assert padded_rows(target, dtype, GemmShape(1, 197, 4, 332)) > 0, dtype
            assert padded_rows(target, dtype, GemmShape(1, 196, 4, 332)) == 0, dtype


def test_rows_are_padded_where_the_exact_tiles_leave_threads_idle():
    """777 rows on 16 AVX-512 cores: the exact 7x32 tiles of 896 columns make 12 blocks for 16
    threads, so the rows are padded to 784 (14x32 tiles, 16 blocks); on 2 threads the same
    tiles keep both busy and nothing is padded. (Measured with 768 columns: padded to 784 the
    777x768x333 GEMM ran 1.16-1.27x faster on a 16-core Emerald Rapids. 768 columns now take
    7x48 tiles, whole 48-column panels, whose 16 blocks keep 16 threads busy unpadded.) On a
    2-core AVX2 Zen 3, small weights of odd row counts."""
    spr16 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16})
    l2_2mib = CacheSizes(l1d=48 * 1024, l2=2 * 1024 * 1024, l3=300 * 1024 * 1024)
    shape = GemmShape(1, 777, 896, 333)
    exact = select(spr16, "float32", shape, packing=True)[0]
    assert (exact.mr, exact.nr) == (7, 32)
    assert thread_balance(shape, exact, l2_2mib, 16) == 0.75
    assert thread_balance(shape, exact, l2_2mib, 2) == 1.0
    assert padded_rows(spr16, "float32", shape, l2_2mib, 16) == 7
    best = select(spr16, "float32", GemmShape(1, 784, 896, 333), packing=True)[0]
    assert thread_balance(GemmShape(1, 784, 896, 333), best, l2_2mib, 16) == 1.0
    assert padded_rows(spr16, "float32", shape, l2_2mib, 2) == 0
    # Tiles that divide M with every thread busy: nothing to gain.
    assert padded_rows(spr16, "float32", GemmShape(1, 768, 896, 333), l2_2mib, 16) == 0
    wide = GemmShape(1, 777, 768, 333)
    exact = select(spr16, "float32", wide, packing=True)[0]
    assert (exact.mr, exact.nr) == (7, 48) and thread_balance(wide, exact, l2_2mib, 16) == 1.0
    assert padded_rows(spr16, "float32", wide, l2_2mib, 16) == 0

    def zen3(m):
        return padded_rows(HASWELL, "float32", GemmShape(1, m, 256, 256), ZEN3_CACHES, 2)

    assert (zen3(117), zen3(255), zen3(405)) == (3, 1, 3)  # measured 1.16-1.28x faster
    assert zen3(120) == 0


def test_few_rows_are_padded_only_for_a_thread_share_of_weights_beyond_l2():
    """7 and 13 rows on AVX2 (best exact tiles 7x8 and 13x8 or 1x32) pad to 8 and 16 rows
    where each thread's share of the weights is 0.75 of an L2 or more (fp32); one or two rows
    never do."""
    def pad(m, n, k, dtype="float32", caches=ZEN3_CACHES, threads=2):
        return padded_rows(HASWELL, dtype, GemmShape(1, m, n, k), caches, threads)

    assert pad(7, 3072, 768) == 1 and pad(13, 1024, 1024) == 3 and pad(7, 512, 512) == 1
    assert pad(7, 384, 384) == 0 and pad(13, 256, 256) == 0  # 0.56 and 0.25 of an L2 a thread
    # A larger L2 (2 MiB) or more threads: each thread's share fits.
    big_l2 = CacheSizes(l1d=48 * 1024, l2=2 * 1024 * 1024, l3=300 * 1024 * 1024)
    assert pad(7, 512, 512, caches=big_l2) == 0 and pad(7, 1024, 1024, threads=16) == 0
    assert pad(7, 1024, 1024, threads=8) == 1
    # The threads default to the target's cores.
    assert padded_rows(HASWELL, "float32", GemmShape(1, 7, 512, 512), ZEN3_CACHES) == 1
    # A GEMV streams each weight once whatever the tile; integer GEMMs keep their few rows.
    assert pad(1, 3072, 768) == 0 and pad(7, 3072, 768, "uint8") == 0
    # A tile that divides M already: nothing to gain.
    assert pad(8, 3072, 768) == 0 and pad(6, 3072, 768) == 0


def test_few_rows_padded_run_and_match():
    """A batch-7 GEMM with 4 MiB of weights (padded to 8 rows on AVX2 hosts of few cores)
    against numpy: the tile taken covers the padded rows."""
    wl = workloads.gemm(7, 1024, 1024)
    model = tvm_hybrid.compile(wl.model, "host")
    pad = padded_rows(model.target, "float32", GemmShape(1, 7, 1024, 1024))
    notes = [m for f in model.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
             for m in re.findall(r'"hybrid.gemm_template": "([^"]+)"', f.script())]
    rows = [int(re.search(r" (\d+)x\d+ microkernel", n).group(1)) for n in notes]
    assert rows and all((7 + pad) % r == 0 for r in rows), (pad, notes)
    assert pad == 0 or all(r > 1 and 7 % r for r in rows), (pad, notes)
    a = wl.inputs["a"]
    w = numpy_helper.to_array(wl.model.graph.initializer[0])
    np.testing.assert_allclose(model(a), a @ w, rtol=1e-4, atol=1e-4)


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


def test_batched_rows_count_the_batch_in_the_thread_split():
    """Blocks of several batches keep the threads busy that one batch's 7x32 tiles would not:
    777 rows are padded for 16 threads in one batch, not in four."""
    spr16 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16})
    l2_2mib = CacheSizes(l1d=48 * 1024, l2=2 * 1024 * 1024, l3=300 * 1024 * 1024)
    assert padded_rows(spr16, "float32", GemmShape(1, 777, 896, 333), l2_2mib, 16) == 7
    assert padded_rows(spr16, "float32", GemmShape(4, 777, 896, 333), l2_2mib, 16) == 0


def test_the_packing_asks_for_rows_with_the_batch(monkeypatch):
    import tvm_hybrid.passes.packed_gemm as packed

    asked = []
    monkeypatch.setattr(packed, "padded_rows",
                        lambda target, dtype, shape, *a, **k: asked.append(shape) or 0)
    w = np.random.default_rng(0).standard_normal((64, 256)).astype("float32")
    x = relax.Var("x", relax.TensorType((4, 197, 64), "float32"))
    PrepackConstantWeights(ZEN5)(relax_function([x], lambda bb, x: relax.op.matmul(
        x, relax.const(w))))
    assert asked == [GemmShape(4, 197, 256, 64)]
