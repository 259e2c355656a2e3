"""AMX microkernels (int8 tdpbusd, bf16 tdpbf16ps): assembly, selection, safety, numerics.

Code for ``mcpu=sapphirerapids`` is compiled and its assembly inspected on any host, never run
where the CPU lacks AMX. The numeric tests run only where the CPU has AMX (and Linux grants the
tile permission); ``python/tools/amx_bundle.py`` packs them for such a host.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import host_features, make_target
from tvm_hybrid.microkernels import ensure_tensor_intrin, microkernels_for
from tvm_hybrid.microkernels.families.amx import AMX_BF16, AMX_INT8

SPR = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 4}


def _asm(model) -> str:
    return model.inspect_source("asm")


def _template_notes(model) -> list[str]:
    return [m for f in model.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
            for m in re.findall(r'"hybrid.gemm_template": "([^"]+)"', f.script())]


def _blocks(target, dtype):
    return [k for k in microkernels_for(target, dtype) if k.per_block]


def test_amx_is_selected_only_with_amx_features():
    assert _blocks(make_target(SPR), "uint8") == [AMX_INT8]
    assert _blocks(make_target(SPR), "bfloat16") == [AMX_BF16]
    assert microkernels_for(make_target(SPR), "uint8")[0] == AMX_INT8  # ahead of VNNI
    for mcpu in ("znver5", "icelake-server", "cooperlake"):
        assert _blocks(make_target({"kind": "llvm", "mcpu": mcpu}), "uint8") == []
    assert AMX_INT8.registers_used == 8 and AMX_INT8.fits_registers()


def test_amx_int8_assembly():
    wl = workloads.matmul_integer(128, 128, 256)
    model = tvm_hybrid.compile(wl.model, SPR)
    asm = _asm(model)
    for instruction in ("ldtilecfg", "tileloadd", "tdpbusd", "tilestored", "tilerelease"):
        assert instruction in asm, instruction
    # One tile configuration per kernel (per block), not per 32x32 tile.
    assert asm.count("ldtilecfg") == 1
    assert asm.count("tdpbusd") >= 4
    assert any(note.startswith("amx uint8") for note in _template_notes(model))


def test_amx_bf16_assembly():
    wl = workloads.gemm(64, 128, 256)
    model = tvm_hybrid.compile(wl.model, SPR, precision="bf16")
    asm = _asm(model)
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert instruction in asm, instruction
    assert "vdpbf16ps" not in asm


def test_amx_qdq_mlp_assembly():
    wl = workloads.qdq_mlp(32, (256, 128, 64))
    assert "tdpbusd" in _asm(tvm_hybrid.compile(wl.model, SPR))


def test_shapes_amx_cannot_tile_use_vnni_on_an_amx_target():
    wl = workloads.matmul_integer(7, 48, 40)  # M, N not multiples of 32, K not of 64
    asm = _asm(tvm_hybrid.compile(wl.model, SPR))
    assert "tdpbusd" not in asm and "vpdpbusd" in asm


def test_rows_are_padded_to_whole_amx_tiles_where_the_kept_rows_pay():
    """M is padded to AMX's 32-row tiles where the rows kept pay for the zero ones (int8 from
    16 rows, bf16 from 6: on an Emerald Rapids VM 197 x 768 x 768 ran 2.06x (int8) and 6.7x
    (bf16) as fast as on the vector tiles); fewer rows, or N and K that are not whole tiles,
    keep the vector tiles."""
    from tvm_hybrid.schedules.gemm.heuristics import GemmShape, padded_rows

    spr = make_target(SPR)
    rows = (3, 5, 6, 7, 12, 15, 16, 17, 197, 224, 777)
    assert [padded_rows(spr, "uint8", GemmShape(1, m, 768, 768)) for m in rows] == \
        [0, 0, 0, 0, 0, 0, 16, 15, 27, 0, 23]
    assert [padded_rows(spr, "bfloat16", GemmShape(1, m, 768, 768)) for m in rows] == \
        [0, 0, 26, 25, 20, 17, 16, 15, 27, 0, 23]
    # N padded too where the work kept still pays (197x48: AMX on 224x64), else, and for K
    # not whole tile steps, the vector tiles' own padding rules (VNNI 11x32 for 197).
    assert padded_rows(spr, "uint8", GemmShape(1, 197, 48, 768)) == 27
    assert padded_rows(spr, "uint8", GemmShape(1, 197, 16, 768)) == 1
    assert padded_rows(spr, "uint8", GemmShape(1, 197, 768, 40)) == 1
    znver5 = make_target({"kind": "llvm", "mcpu": "znver5", "num-cores": 4})
    assert padded_rows(znver5, "uint8", GemmShape(1, 197, 768, 768)) == 1


def test_padded_rows_run_on_amx_tiles():
    """An int8 GEMM of 197 rows and a bf16 one of 7, compiled for Sapphire Rapids: AMX tiles
    over the padded rows (the padding is a kernel of its own); 12 int8 rows stay on VNNI."""
    model = tvm_hybrid.compile(workloads.matmul_integer(197, 64, 128).model, SPR)
    asm = _asm(model)
    assert "tdpbusd" in asm and "vpdpbusd" not in asm
    assert any(note.startswith("amx uint8") for note in _template_notes(model))
    assert "pad" in " ".join(model.kernels)
    model = tvm_hybrid.compile(workloads.gemm(7, 64, 64).model, SPR, precision="bf16")
    asm = _asm(model)
    assert "tdpbf16ps" in asm and "vdpbf16ps" not in asm
    asm = _asm(tvm_hybrid.compile(workloads.matmul_integer(12, 64, 128).model, SPR))
    assert "tdpbusd" not in asm and "vpdpbusd" in asm


def test_columns_are_padded_to_whole_amx_tiles_but_k_is_not():
    """N is padded to whole 32-column tiles (the weights' zero columns, sliced off in the
    epilogue) where the work kept pays (``block_padding_pays``); K is not (on small K, AMX is
    bound by its accumulators' traffic)."""
    from tvm_hybrid.schedules.gemm.heuristics import GemmShape, block_padding_pays, select

    spr = make_target(SPR)

    def best(dtype, m, n, k):
        return select(spr, dtype, GemmShape(1, m, n, k), packing=True)[0]

    assert best("uint8", 64, 48, 768) == AMX_INT8 and best("uint8", 64, 16, 768) == AMX_INT8
    assert best("bfloat16", 64, 40, 128) == AMX_BF16
    assert best("uint8", 64, 768, 40) != AMX_INT8 and best("bfloat16", 64, 768, 28) != AMX_BF16
    assert not block_padding_pays(AMX_BF16, GemmShape(1, 7, 40, 768), 32)  # 7x40x6 < 32x64
    model = tvm_hybrid.compile(workloads.matmul_integer(64, 40, 128).model, SPR)
    asm = _asm(model)
    assert "tdpbusd" in asm and "vpdpbusd" not in asm


def test_amx_intrinsic_names_round_trip():
    assert ensure_tensor_intrin(f"{AMX_INT8.name}_b64x64_k128")
    assert not ensure_tensor_intrin(f"{AMX_INT8.name}_k128")  # AMX names carry the block
    # the zeroing intrinsic a tuning record's trace names, too
    assert ensure_tensor_intrin(f"{AMX_BF16.name}_b64x32_zero")
    vector = next(k for k in microkernels_for(make_target(SPR), "uint8") if not k.per_block)
    assert not ensure_tensor_intrin(f"{vector.name}_b64x32_zero")


def test_amx_blocks_start_from_zero_tiles():
    """The block's accumulator tiles start with ``tilezero`` in its first ``K`` block: the
    reduction's init is tensorized with an intrinsic that writes nothing, so no pass zeroes
    the accumulators before the block and none loads them back (u8 x s8 256x768x64 1.10-1.23x,
    3136x64x64 1.10-1.16x, 197x768x768 1.07x the model's speed, 2-core Emerald Rapids)."""
    from tvm_hybrid.microkernels.families.amx import amx_block_functions

    _, impl = amx_block_functions(AMX_INT8, 64, 64, 1024)
    script = impl.script()
    assert "if kb == 0:" in script and "llvm.x86.tilezero" in script, script
    for wl, precision in ((workloads.matmul_integer(128, 128, 256), "fp32"),
                          (workloads.gemm(64, 128, 256), "bf16")):
        model = tvm_hybrid.compile(wl.model, SPR, precision=precision)
        kernels = [f.script() for f in model.lowered.functions.values()
                   if isinstance(f, tvm.tirx.PrimFunc) and "llvm.x86.ldtilecfg" in f.script()]
        assert len(kernels) == 1
        # no store of zeros into the accumulators: the init block is the empty intrinsic
        init = kernels[0].split('_init_o"):')[1].split("T.sblock(")[0]
        assert "T.evaluate(0)" in init and " = 0" not in init and "for " not in init, init
        # (bit-exact on AMX hosts: test_amx_int8_numerics runs these kernels)
        assert "tilezero" in _asm(model)


def test_nothing_amx_is_lowered_for_a_non_amx_target():
    """In a subprocess, since LLVM aborts the whole process if AMX reaches a non-AMX target.

    Forcing AMX knobs onto a non-AMX target (this host's own, or Ice Lake on an AMX host) is
    declined (the template falls back), a model compiled for it has no tile instructions and
    runs correctly here, and running code compiled for Sapphire Rapids on a CPU without AMX is
    refused with TargetError.
    """
    script = textwrap.dedent("""
        import numpy as np, tvm
        import tvm_hybrid
        from tvm_hybrid.bench import workloads
        from tvm_hybrid.schedules.gemm.heuristics import GemmKnobs
        from tvm_hybrid.host import host_features, make_target
        from tvm_hybrid.microkernels.families.amx import AMX_INT8
        from tvm_hybrid.schedules import GemmTemplate, apply_template
        from tvm_hybrid.tuning import extract_tasks

        spr = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
        amx_host = "amx-tile" in host_features()
        zen = make_target({"kind": "llvm", "mcpu": "icelake-server", "num-cores": 2}
                          if amx_host else "host")
        wl = workloads.matmul_integer(64, 64, 128)
        (task,) = extract_tasks(wl.model, make_target(spr))   # packed for AMX
        func = task.mod["main"]
        assert GemmTemplate().workloads(func, make_target(spr))
        forced = apply_template(GemmTemplate(), func, zen, [GemmKnobs(AMX_INT8, 1, 1)])
        assert forced is None, "AMX knobs must be declined for a non-AMX target"
        model = tvm_hybrid.compile(wl.model, zen)
        asm = model.inspect_source("asm")
        assert "tdpbusd" not in asm and "ldtilecfg" not in asm
        np.testing.assert_array_equal(model(**wl.inputs),
                                      workloads.matmul_integer_reference(wl))
        if "amx-tile" not in host_features():
            amx_model = tvm_hybrid.compile(wl.model, spr)
            try:
                amx_model(**wl.inputs)
            except tvm_hybrid.TargetError as err:
                print("refused:", err)
            else:
                raise AssertionError("AMX code ran on a CPU without AMX")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
    if "amx-tile" not in host_features():
        assert "refused:" in out.stdout and "amx" in out.stdout


@pytest.mark.requires("amx-tile", "amx-int8")
@pytest.mark.parametrize("m, n, k", [(64, 64, 128), (256, 512, 1024), (32, 96, 64)])
def test_amx_int8_numerics(m, n, k):
    wl = workloads.matmul_integer(m, n, k, activations="int8", zero_point=-3)
    model = tvm_hybrid.compile(wl.model)  # host target: AMX selected
    assert "tdpbusd" in _asm(model)
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


@pytest.mark.requires("amx-tile", "amx-int8")
def test_amx_on_padded_rows_is_exact():
    """Padded rows and columns on AMX tiles (197 and 17 rows, 40 and 48 columns): bit-exact
    against int64 numpy, and a QDQ MLP of batch 50 against its integer reference."""
    for m in (197, 17):
        wl = workloads.matmul_integer(m, 96, 192, activations="int8", zero_point=-3)
        model = tvm_hybrid.compile(wl.model)
        assert "tdpbusd" in _asm(model)
        np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))
    wl = workloads.qdq_mlp(50, (256, 128, 64))
    model = tvm_hybrid.compile(wl.model)
    assert "tdpbusd" in _asm(model)
    np.testing.assert_array_equal(model(**wl.inputs), workloads.qdq_reference(wl))
    for m, n, k in ((64, 40, 128), (197, 48, 256)):  # N padded to whole tiles (and M)
        wl = workloads.matmul_integer(m, n, k, activations="int8", zero_point=5)
        model = tvm_hybrid.compile(wl.model)
        assert "tdpbusd" in _asm(model)
        np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


@pytest.mark.requires("amx-tile", "amx-bf16")
@pytest.mark.parametrize("m, n", [(7, 128), (128, 128), (64, 40)])
def test_amx_bf16_numerics(m, n):
    import ml_dtypes
    from onnx import numpy_helper

    wl = workloads.gemm(m, n, 256)
    model = tvm_hybrid.compile(wl.model, precision="bf16")
    assert "tdpbf16ps" in _asm(model)
    x = wl.inputs["a"]
    w = numpy_helper.to_array(wl.model.graph.initializer[0])
    want = (x.astype(ml_dtypes.bfloat16).astype(np.float64)
            @ w.astype(ml_dtypes.bfloat16).astype(np.float64))
    np.testing.assert_allclose(model(x), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_runtime_bundle_runs_without_site_packages(tmp_path):
    """The AMX bundle tool, built for this host (no AMX needed), runs under ``python -S``."""
    from pathlib import Path

    tool = Path(__file__).parent.parent / "python" / "tools" / "amx_bundle.py"
    out = subprocess.run([sys.executable, str(tool), "--target", "host", "--check-here",
                          "-o", str(tmp_path / "bundle.tar.gz")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all passed" in out.stdout and "FAIL" not in out.stdout
    assert (tmp_path / "bundle.tar.gz").stat().st_size < 64 * 2**20


def test_amx_blocks_keep_their_accumulators_to_an_eighth_of_l2():
    """An AMX block accumulates in memory (zeroed, loaded and stored by the tiles, read by the
    epilogue). With 2 threads the traffic model alone took one 512 x 1024 block per thread for
    1024^3 (2 MB of int32 accumulators, all of L2: 0.755 ms on a 2-core Emerald Rapids VM); the
    blocks now hold at most 256 KB of them (0.64 ms), and still cover M and N exactly."""
    from tvm_hybrid.host import CacheSizes
    from tvm_hybrid.schedules.gemm.heuristics import GemmShape, choose_blocks

    caches = CacheSizes(48 * 1024, 2 << 20, 64 << 20)
    for kernel, shape in ((AMX_INT8, GemmShape(1, 1024, 1024, 1024, 1)),
                          (AMX_BF16, GemmShape(1, 1024, 3072, 768, 2)),
                          (AMX_BF16, GemmShape(1, 128, 768, 3072, 2))):
        mb, nb = choose_blocks(shape, kernel, caches, threads=2)
        rows, cols = mb * kernel.mr, nb * kernel.nr
        assert rows * cols * 4 <= caches.l2 // 8, (shape, rows, cols)
        assert shape.m % rows == 0 and shape.n % cols == 0
        assert (shape.m // rows) * (shape.n // cols) >= 2  # both threads busy


def test_small_amx_gemms_keep_their_block_accumulators_in_l1():
    """Where B read once per 32-row tile is at most 4 L2s, blocks hold a third of L1 of
    accumulators (their passes then stay in L1; int8 256x768x64 2.1x, bf16 224x768x768 1.3x
    faster on a 2-core Emerald Rapids VM); larger GEMMs keep an eighth of L2."""
    from tvm_hybrid.host import CacheSizes
    from tvm_hybrid.schedules.gemm.heuristics import (
        GemmShape,
        block_accumulator_bytes,
        choose_blocks,
    )

    caches = CacheSizes(48 * 1024, 2 << 20, 64 << 20)
    for kernel, shape in ((AMX_INT8, GemmShape(1, 256, 768, 64, 1)),
                          (AMX_INT8, GemmShape(1, 224, 768, 768, 1)),
                          (AMX_BF16, GemmShape(1, 3136, 64, 64, 2))):
        assert block_accumulator_bytes(shape, kernel, caches) == 16 * 1024
        mb, nb = choose_blocks(shape, kernel, caches, threads=2)
        assert mb * nb * 32 * 32 * 4 <= 16 * 1024, shape
    for kernel, shape in ((AMX_INT8, GemmShape(1, 1024, 1024, 512, 1)),
                          (AMX_BF16, GemmShape(1, 1024, 3072, 768, 2))):
        assert block_accumulator_bytes(shape, kernel, caches) == (2 << 20) // 8


def test_amx_blocks_sweep_k_in_blocks_of_512_bytes():
    """Each ``K`` block of up to 8 tile steps (512 bytes of a row of ``A``) is swept over the
    whole block of tiles, so ``A``'s 32 rows of it stay in L1 while the ``N`` tiles pass (bf16
    1024x3072x768 1.3x faster on an Emerald Rapids VM); a step count with no divisor of 4 to 8
    keeps the whole ``K`` (a block of 1 step would reload the accumulators every step)."""
    from tvm_hybrid.microkernels.families.amx import amx_block_functions, k_block_steps

    assert [k_block_steps(k) for k in (1, 4, 7, 8, 12, 13, 16, 24, 96)] == \
        [1, 4, 7, 8, 6, 13, 8, 8, 8]
    _, impl = amx_block_functions(AMX_INT8, 64, 64, 1024)  # 16 steps: 2 K blocks of 8
    script = impl.script()
    assert "for kb, mt, nt in T.grid(2, 2, 2):" in script, script
    assert "for kt in range(kb * 8, kb * 8 + 8):" in script, script
    _, impl = amx_block_functions(AMX_BF16, 32, 32, 32 * 13)  # 13 steps: one K block
    assert "T.grid(1, 1, 1)" in impl.script()
