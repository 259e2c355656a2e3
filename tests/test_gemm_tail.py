"""The last weight panel's tail: the microkernel computes only the columns the GEMM keeps.

Packed weights pad ``N`` to whole panels (32 columns with AVX-512, 24 with AVX2); on the last
panel the microkernel branches and updates only the vectors covering the kept columns
(``microkernels/tiles.py``, ``schedules/gemm/template.py``). The choice and the instructions are
checked for named CPUs (any host); the numeric tests run what the host can run.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import numpy_helper
from tvm import s_tir, te

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.microkernels import (
    ensure_tensor_intrin,
    microkernel_by_name,
    tensor_intrin,
    vector_tiles,
)
from tvm_hybrid.microkernels.tiles import Tail, tail_pieces
from tvm_hybrid.passes.packed_gemm import packed_gemm
from tvm_hybrid.schedules.gemm.analysis import match_gemm
from tvm_hybrid.schedules.gemm.template import gemm_tail
from tvm_hybrid.testing.onnx_checks import linear_relu

ZMM_11x32 = microkernel_by_name("hybrid_gemm_avx512_float32_11x32")
YMM_4x24 = microkernel_by_name("hybrid_gemm_avx2_float32_4x24")
VNNI = "hybrid_gemm_avx512_vnni_uint8_"


def assert_close(got, want, tol: float) -> None:
    """Within ``tol`` of the output's scale."""
    want = np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol * scale)


def _targets():
    return {"znver4": {"kind": "llvm", "mcpu": "znver4", "num-cores": 2},
            "haswell": {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}}


def test_tail_pieces_cover_the_used_columns_with_the_fewest_lanes():
    # (whole vectors, lanes of one narrower vector): an xmm or ymm for the rest in fp32
    assert tail_pieces(ZMM_11x32, 1) == (0, 4)
    assert tail_pieces(ZMM_11x32, 5) == (0, 8)
    assert tail_pieces(ZMM_11x32, 8) == (0, 8)
    assert tail_pieces(ZMM_11x32, 9) == (1, 0)  # 16 lanes: the kernel's own vector
    assert tail_pieces(ZMM_11x32, 16) == (1, 0)
    assert tail_pieces(ZMM_11x32, 17) == (1, 4)
    assert tail_pieces(YMM_4x24, 1) == (0, 4)
    assert tail_pieces(YMM_4x24, 5) == (1, 0)
    assert tail_pieces(YMM_4x24, 16) == (2, 0)
    assert tail_pieces(YMM_4x24, 17) == (2, 4)
    # grouped families (integer, bf16): whole vectors only
    assert tail_pieces(ZMM_11x32, 1, narrow=False) == (1, 0)
    assert tail_pieces(ZMM_11x32, 17, narrow=False) == (2, 0)


def _packed_func(m: int, n: int, k: int, panel: int):
    """A packed GEMM's TIR as the packing pass emits it: ``acc`` over whole panels, then the
    slice keeping ``n`` columns."""
    x = te.placeholder((m, k), name="x")
    packed = te.placeholder((-(-n // panel), k, panel), name="packed")
    y = packed_gemm(x, packed, n, "float32", "float32")
    return te.create_prim_func([x, packed, y])


def test_used_columns_are_read_from_the_slice():
    """Before: ``acc[197, 128]`` sliced to 97 columns. The analysis finds 97 and the tail the
    last panel's 1 column, starting at panel 3 of ``B``; weights that fill their panels, or a
    GEMM whose output is the function's, keep every column."""
    sch = s_tir.Schedule(_packed_func(197, 97, 333, 32))
    gemm = match_gemm(sch, sch.get_sblock("packed_matmul"))
    assert (gemm.shape.n, gemm.packed_nr, gemm.columns) == (128, 32, 97)
    assert gemm_tail(gemm, ZMM_11x32) == Tail(3 * 333 * 32, 1)
    full = s_tir.Schedule(_packed_func(197, 96, 333, 32))
    gemm = match_gemm(full, full.get_sblock("packed_matmul"))
    assert gemm.columns is None and gemm_tail(gemm, ZMM_11x32) is None
    # Plain B (not packed): N is whole tiles, nothing to skip.
    a, b = te.placeholder((8, 16), name="A"), te.placeholder((16, 48), name="B")
    r = te.reduce_axis((0, 16), name="k")
    c = te.compute((8, 48), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    plain = s_tir.Schedule(te.create_prim_func([a, b, c]))
    assert match_gemm(plain, plain.get_sblock("C")).columns is None


def test_tail_intrinsic_names_round_trip():
    """A trace names the intrinsic; replaying it (tuning records) registers it again."""
    name = tensor_intrin(ZMM_11x32, 333, tail=Tail(31968, 1))
    assert name == "hybrid_gemm_avx512_float32_11x32_k333_t1at31968"
    assert ensure_tensor_intrin(name)
    assert not ensure_tensor_intrin("hybrid_gemm_avx512_float32_11x32_k333_t32at0")  # not a tail
    with pytest.raises(ValueError, match="no tail"):
        tensor_intrin(ZMM_11x32, 333, tail=Tail(0, 32))


@pytest.mark.parametrize("mcpu,full,part,n,detail", [
    ("znver4", "zmm", "xmm", 113, "last panel 17 of 32 columns"),
    ("znver4", "zmm", "ymm", 213, "last panel 21 of 32 columns"),
    ("haswell", "ymm", "xmm", 113, "last panel 17 of 24 columns"),
])
def test_the_tail_runs_on_a_narrower_vector(mcpu, full, part, n, detail):
    """The assembly of the kernel: the full panels' FMAs on the kernel's registers, the last
    panel's on a narrower one (an xmm for the last of 17 columns), and the annotation says so.
    (Fewer used columns take the transposed copy: ``test_transposed_tail.py``.)"""
    model = tvm_hybrid.compile(workloads.gemm(197, n, 333).model, _targets()[mcpu])
    assert any(detail in info.detail for info in model.kernels.values()), \
        [info.detail for info in model.kernels.values()]
    asm = model.inspect_source("asm")  # one kernel (the GEMM) and the row padding
    assert re.search(rf"vfmadd\d+ps\s[^\n]*%{full}", asm)
    assert re.search(rf"vfmadd\d+ps\s[^\n]*%{part}", asm), "no narrower FMA for the tail"


@pytest.mark.parametrize("m,n,k", [(197, 97, 333), (197, 197, 64), (5, 1000, 37),
                                   (64, 40, 129), (3, 17, 8)])
def test_tails_match_numpy(m, n, k, rng):
    """fp32 GEMMs with bias and ReLU whose last panel is partly used, on this host's kernels,
    within 1e-5 of the output scale of float64 numpy."""
    proto, w, b = linear_relu(m, n, k, rng)
    model = tvm_hybrid.compile(proto)
    details = [info.detail for info in model.kernels.values()]
    assert any("last panel" in d for d in details), details
    x = rng.standard_normal((m, k)).astype("float32")
    want = np.maximum(x.astype("float64") @ w + b, 0)
    assert_close(model(x), want, 1e-5)


def test_integer_tails_are_exact():
    """u8 x s8 GEMMs whose last panel is partly used (VNNI, vpmaddubsw or s16, whatever the
    host has): bit-exact against the integer reference."""
    for n in (97, 21):
        wl = workloads.matmul_integer(37, n, 132, zero_point=3)
        model = tvm_hybrid.compile(wl.model)
        details = [info.detail for info in model.kernels.values()]
        assert any("last panel" in d for d in details), details
        np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


def test_bf16_tails_match_fp32():
    """precision="bf16" (the dot product, or the widening kernel without it) on a partly used
    last panel: within the bf16 tolerance of the fp32 result. (K = 250, not whole AMX tile
    steps: the vector tiles on AMX hosts too.)"""
    wl = workloads.gemm(33, 97, 250)
    model = tvm_hybrid.compile(wl.model, precision="bf16")
    details = [info.detail for info in model.kernels.values()]
    assert any("last panel" in d for d in details), details
    want = tvm_hybrid.compile(wl.model)(**wl.inputs)
    assert_close(model(**wl.inputs), want, 2e-2)


def test_bf16_tail_on_the_only_panel_keeps_its_llvm_import():
    """N = 17: one panel, so the tail's branch always runs and TVM drops the full branch,
    which alone carried the vdpbf16ps IR import; the call stayed unresolved and the model
    crashed when run ("Symbols not found: hybrid_dpbf16ps_512", then a segfault). Compiled for
    a named AVX512-BF16 CPU (any host): the tail's dot products are in the assembly, with no
    call left to the helper; run where the host has the instruction."""
    wl = workloads.gemm(64, 17, 32)
    target = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}
    model = tvm_hybrid.compile(wl.model, target, precision="bf16")
    details = [info.detail for info in model.kernels.values()]
    assert any("last panel 17 of 32 columns" in d for d in details), details
    asm = model.inspect_source("asm")
    assert "vdpbf16ps" in asm and "hybrid_dpbf16ps_512" not in asm
    if "avx512bf16" in tvm_hybrid.host.host_features():
        want = tvm_hybrid.compile(wl.model, target)(**wl.inputs)
        assert_close(model(**wl.inputs), want, 2e-2)


def test_integer_tail_asm_on_vnni():
    """The VNNI kernel's tail: whole zmm vectors, fewer of them (97 columns: 3 panels of 32,
    then one of the last panel's two vectors)."""
    wl = workloads.matmul_integer(37, 97, 132)
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    details = [info.detail for info in model.kernels.values()]
    assert any("last panel 1 of 32 columns" in d for d in details), details
    assert "vpdpbusd" in model.inspect_source("asm")


def test_a_family_without_tails_computes_the_whole_panel(monkeypatch):
    """A family whose intrinsic generator takes ``(kernel, k)`` only (written before tails)
    still schedules packed GEMMs, on whole panels: no tail is asked of it."""
    from tvm_hybrid.microkernels import Family, microkernels_for, register_family, registry
    from tvm_hybrid.microkernels.registry import supports_tail
    from tvm_hybrid.microkernels.tiles import plain_tile_functions

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    narrow = [k for k in vector_tiles("avx2_old", ("avx2", "fma"), 256, 16) if k.nr == 16]
    register_family(Family("avx2", tuple(narrow), rank=15,
                           tile_functions=lambda kernel, kc: plain_tile_functions(kernel, kc)))
    haswell = tvm_hybrid.make_target(_targets()["haswell"])
    kernel = microkernels_for(haswell, "float32")[0]
    assert kernel.isa == "avx2_old" and not supports_tail(kernel)
    assert supports_tail(ZMM_11x32) and supports_tail(YMM_4x24)
    sch = s_tir.Schedule(_packed_func(24, 20, 16, 16))
    gemm = match_gemm(sch, sch.get_sblock("packed_matmul"))
    assert gemm.columns == 20 and gemm_tail(gemm, kernel) is None
    with pytest.raises(ValueError, match="no tail"):
        tensor_intrin(kernel, 16, tail=Tail(256, 4))


def test_tuned_tail_records_replay_in_a_fresh_process(tmp_path):
    """Records of a tuned GEMM with a tail name its tail intrinsic; a new process (where it
    is not registered yet) compiles with them to the same numbers."""
    import subprocess
    import sys

    from tvm_hybrid.tuning import tune

    wl = workloads.gemm(24, 40, 16)
    onnx_path = tmp_path / "gemm.onnx"
    onnx_path.write_bytes(wl.model.SerializeToString())
    records = tune(wl.model, "host", trials=2, work_dir=tmp_path / "tune", progress=False)
    assert re.search(r"_k16_t\d+at\d+", records.read_text()), "no tail in the records"
    np.save(tmp_path / "a.npy", wl.inputs["a"])
    script = (
        "import sys, numpy as np, tvm_hybrid\n"
        f"m = tvm_hybrid.compile({str(onnx_path)!r}, tuning_records={str(records)!r})\n"
        "assert any('last panel' in i.detail for i in m.kernels.values())\n"
        f"np.save({str(tmp_path / 'out.npy')!r}, m(np.load({str(tmp_path / 'a.npy')!r})))\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    want = wl.inputs["a"].astype(np.float64) @ numpy_helper.to_array(
        wl.model.graph.initializer[0]).astype(np.float64)
    assert_close(np.load(tmp_path / "out.npy"), want, 1e-5)
