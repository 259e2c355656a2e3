"""The microkernel registry: families as data, one selection, a new family as one module.

Runs on any x86 host: kernels are selected and scheduled for named CPUs, never run here.
"""

from __future__ import annotations

import re

import pytest
from tvm import s_tir, te

from tvm_hybrid.host import isa_tiers, make_target, target_features
from tvm_hybrid.microkernels import (
    Family,
    all_families,
    ensure_tensor_intrin,
    family_of,
    microkernel_by_name,
    microkernels_for,
    register_family,
    registry,
    vector_bits,
    vector_tiles,
)
from tvm_hybrid.microkernels.tiles import plain_tile_functions
from tvm_hybrid.schedules import GemmTemplate, apply_template
from tvm_hybrid.schedules.gemm.heuristics import GemmShape, panel_width, select

HASWELL = make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
ZEN5 = make_target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
SPR = make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})


def test_every_family_is_consistent():
    names = set()
    for family in all_families():
        assert family_of(family.first) is family
        for kernel in family.kernels:
            assert kernel.fits_registers(), kernel.name
            assert kernel.name not in names
            names.add(kernel.name)
            assert microkernel_by_name(kernel.name) == kernel
    # Every operand dtype the passes produce has a family on both ISA tiers we develop on.
    for dtype in ("float32", "int16", "bfloat16"):
        assert microkernels_for(HASWELL, dtype), dtype
    for dtype in ("float32", "uint8", "bfloat16"):
        assert microkernels_for(ZEN5, dtype)[0].vector_bits == 512, dtype


def test_preference_follows_rank_and_features():
    assert microkernels_for(ZEN5, "float32")[0].isa == "avx512"
    assert microkernels_for(HASWELL, "float32")[0].isa == "avx2"
    assert microkernels_for(ZEN5, "bfloat16")[0].isa == "avx512_bf16"
    assert microkernels_for(HASWELL, "bfloat16")[0].isa == "avx2_bf16emu"
    # Without VNNI, u8 x s8 is AVX2's vpmaddubsw, exact only for bounded weights.
    assert [f.pair_bound for f in {family_of(k) for k in microkernels_for(HASWELL, "uint8")}] \
        == [128]
    assert microkernels_for(SPR, "uint8")[0].isa == "amx"
    assert microkernels_for(SPR, "uint8", include_blocks=False)[0].isa == "avx512_vnni"
    assert microkernels_for(make_target({"kind": "llvm", "mcpu": "x86-64"}), "float32") == []


def test_isa_tiers_and_vector_width_come_from_the_families():
    assert isa_tiers(target_features(HASWELL)) == ["avx2"]
    assert {"avx512", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"} <= set(
        isa_tiers(target_features(SPR)))
    assert "amx_int8" not in isa_tiers(target_features(ZEN5))
    assert vector_bits(HASWELL) == 256 and vector_bits(ZEN5) == 512
    assert vector_bits(make_target({"kind": "llvm", "mcpu": "x86-64"})) == 128


def test_select_is_the_one_ranking():
    square = GemmShape(1, 64, 64, 128)
    amx = select(SPR, "uint8", square)
    assert amx[0].per_block and all(64 % k.mr == 0 and 64 % k.nr == 0 for k in amx)
    # K not a whole AMX tile row: the VNNI tiles, no AMX (per-block kernels never pad).
    assert not any(k.per_block for k in select(SPR, "uint8", GemmShape(1, 64, 64, 96)))
    # Packing pads N (and K): only mr must divide M; the prepacking's panel is the first's.
    odd = GemmShape(1, 64, 50, 30)
    assert not select(ZEN5, "float32", odd)
    packed = select(ZEN5, "float32", odd, packing=True)
    assert packed and panel_width(ZEN5, "float32", 64, 50, 30) == packed[0].panel_width
    assert all(k.panel_width == 16 for k in select(ZEN5, "float32", square, panel=16))
    # Padded columns are wasted work: 32 columns take a 32-wide panel on AVX2, not the 24-wide
    # panel of the 4 x 24 tile (48 columns computed); 1000 columns (1008 computed) keep it.
    assert panel_width(HASWELL, "float32", 64, 32, 64) == 32
    assert panel_width(HASWELL, "float32", 64, 1000, 64) == 24
    assert panel_width(HASWELL, "float32", 64, 16, 64) == 16
    # Equal FMAs per load: the tile of more accumulators first (AVX2's 6x16 before 3x24, 12
    # accumulators against 9), then the wider one.
    tied = GemmShape(1, 198, 768, 333)
    assert [(k.mr, k.nr) for k in select(HASWELL, "float32", tied)[:2]] == [(6, 16), (3, 24)]
    assert (select(HASWELL, "float32", GemmShape(1, 32, 64, 64))[0].nr) == 32  # 2x32 vs 4x16

def test_avx512_three_vector_tiles_need_whole_panels():
    """AVX-512's 48-column tiles (up to 27 accumulators) lead where N fills their panels, and
    are never taken, nor padded to, where a tail panel would be left (``whole_panels``)."""
    bert = GemmShape(1, 1024, 768, 3072)
    for packing in (False, True):
        assert (select(SPR, "float32", bert, packing=packing)[0].mr,
                select(SPR, "float32", bert, packing=packing)[0].nr) == (8, 48)
    assert select(SPR, "float32", GemmShape(1, 1026, 768, 768), packing=True)[0].nr == 48  # 9
    tail = GemmShape(1, 1024, 256, 512)  # 256 columns: 5 whole panels and 16 columns
    assert not any(k.nr == 48 for k in select(SPR, "float32", tail, packing=True))
    assert panel_width(SPR, "float32", 1024, 256, 512) == 32
    wide = [k for k in microkernels_for(SPR, "float32") if k.nr == 48]
    assert wide and all(k.whole_panels for k in wide)
    assert not any(k.whole_panels for k in microkernels_for(HASWELL, "float32"))


def test_direct_convolution_panels_count_useful_channels():
    from tvm_hybrid.schedules.conv_template import conv_panel

    kernels = microkernels_for(HASWELL, "float32")
    assert conv_panel(kernels, 32, 32) == 16  # 4 x 16 (2 x 32 is below the conv's 4 rows)
    assert conv_panel(kernels, 32, 96) == 24  # 4 x 24, no padding
    assert conv_panel(kernels, 7, 64) is None  # no tile of at least 4 rows divides 7


def test_intrinsic_names_round_trip():
    kernel = microkernels_for(HASWELL, "float32")[0]
    assert ensure_tensor_intrin(f"{kernel.name}_k48")
    assert s_tir.TensorIntrin.get(f"{kernel.name}_k48") is not None
    assert not ensure_tensor_intrin(f"{kernel.name}_b64x64_k48")  # blocks: per-block only
    assert not ensure_tensor_intrin("hybrid_gemm_nosuchisa_float32_4x16_k8")
    assert not ensure_tensor_intrin("some_other_intrin")


def test_registering_an_inconsistent_family_fails(monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    with pytest.raises(ValueError, match="no kernels"):
        register_family(Family("x", (), rank=1, tile_functions=plain_tile_functions))
    tiles = vector_tiles("avx2", ("avx2", "fma"), 256, 16)
    with pytest.raises(ValueError, match="already registered"):
        register_family(Family("avx2", tiles[:3], rank=99, tile_functions=plain_tile_functions))
    with pytest.raises(ValueError, match="no intrinsic generator"):
        register_family(Family("y", vector_tiles("new_isa", ("avx2",), 256, 16), rank=1))


def test_a_new_family_is_one_registration(monkeypatch):
    """What a new module in ``microkernels/families/`` does: register a family. Selection,
    the template, intrinsic names and the weight layout follow with no other change."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    narrow = [k for k in vector_tiles("avx2_narrow", ("avx2", "fma"), 256, 16) if k.mr <= 2]
    register_family(Family("avx2", tuple(narrow), rank=15, tile_functions=plain_tile_functions))

    assert microkernels_for(HASWELL, "float32")[0].isa == "avx2_narrow"
    assert microkernels_for(ZEN5, "float32")[0].isa == "avx512"  # rank 20 still wins there
    a, b = te.placeholder((64, 32), name="A"), te.placeholder((32, 64), name="B")
    r = te.reduce_axis((0, 32), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    sch, knobs = apply_template(GemmTemplate(), te.create_prim_func([a, b, c]), HASWELL)
    assert knobs[0].kernel.isa == "avx2_narrow" and knobs[0].kernel.mr <= 2
    assert re.search(r"hybrid_gemm_avx2_narrow_float32_\dx\d+_k32", str(sch.trace))
