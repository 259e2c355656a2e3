"""Weights larger than L2: the 512-bit fp32 microkernel prefetches the next panel.

``heuristics.prefetches_weights`` (rule 4) and ``tiles.prefetching_fma``: per ``k`` the tile
prefetches into L2 the lines of ``B`` one call's ``K`` ahead (the next packed panel), with its
accumulators in stack arrays so that they stay in registers across the prefetch calls. The
choice and the instructions are checked for named CPUs (any host); the numeric test runs what
the host can run.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tvm_hybrid
from tvm_hybrid.host import CacheSizes
from tvm_hybrid.microkernels import ensure_tensor_intrin, microkernel_by_name, tensor_intrin
from tvm_hybrid.microkernels.registry import supports_prefetch
from tvm_hybrid.microkernels.tiles import prefetch_fits, split_sets
from tvm_hybrid.schedules.gemm.heuristics import GemmShape, prefetches_weights
from tvm_hybrid.testing.onnx_checks import linear_relu

ZMM_8x48 = microkernel_by_name("hybrid_gemm_avx512_float32_8x48")
ZMM_14x32 = microkernel_by_name("hybrid_gemm_avx512_float32_14x32")
YMM_4x24 = microkernel_by_name("hybrid_gemm_avx2_float32_4x24")
CACHES = CacheSizes(l1d=48 * 1024, l2=2 * 1024 * 1024, l3=32 * 1024 * 1024)
# BERT-base's FFN: 9.4 MB of weights, over any L2 of today's CPUs
FFN = (128, 3072, 768)


def _shape(m, n, k):
    return GemmShape(batch=1, m=m, n=n, k=k)


def test_only_fp32_weights_over_l2_on_zmm_are_prefetched():
    assert prefetches_weights(_shape(*FFN), ZMM_8x48, CACHES)
    assert prefetches_weights(_shape(128, 768, 768), ZMM_8x48, CACHES)  # 2.4 MB
    assert not prefetches_weights(_shape(128, 512, 768), ZMM_8x48, CACHES)  # 1.6 MB: in L2
    assert not prefetches_weights(_shape(*FFN), YMM_4x24, CACHES)  # AVX2 lost with it
    int8 = microkernel_by_name("hybrid_gemm_avx512_vnni_uint8_8x32")
    assert not prefetches_weights(_shape(*FFN), int8, CACHES)


def test_prefetching_tiles_keep_their_accumulators_in_stack_arrays():
    """Every 512-bit fp32 tile fits the stack arrays (each under 1 KiB: rows of 48 columns
    five to an array, of 32 seven); integer tiles have no prefetching intrinsic."""
    assert prefetch_fits(ZMM_8x48, 768) and prefetch_fits(ZMM_14x32, 768)
    assert supports_prefetch(ZMM_8x48, 768)
    assert not supports_prefetch(microkernel_by_name("hybrid_gemm_avx512_vnni_uint8_8x32"), 768)


def test_tiles_that_split_their_sums_do_not_prefetch():
    """A 1-row tile sums its ``k`` in partial sets (``tiles.split_sets``) on its full panels and
    its tail alike; the prefetching body sums in one, so it would sum the full panels in
    another order than the tail (AlexNet's equal logits differed by panel)."""
    one_row = microkernel_by_name("hybrid_gemm_avx512_float32_1x32")
    assert split_sets(one_row, 4096) > 1
    assert not prefetch_fits(one_row, 4096) and not supports_prefetch(one_row, 4096)
    assert not ensure_tensor_intrin("hybrid_gemm_avx512_float32_1x32_k4096_p")


def test_prefetch_intrinsic_names_round_trip():
    """A trace names the intrinsic; replaying it (tuning records) registers it again."""
    name = tensor_intrin(ZMM_8x48, 768, prefetch=True)
    assert name == "hybrid_gemm_avx512_float32_8x48_k768_p"
    assert ensure_tensor_intrin(name)
    assert not ensure_tensor_intrin("hybrid_gemm_avx512_vnni_uint8_8x32_k768_p")
    with pytest.raises(ValueError, match="no prefetching"):
        tensor_intrin(microkernel_by_name("hybrid_gemm_avx512_vnni_uint8_8x32"), 768,
                      prefetch=True)


def _ffn_model(rng):
    proto, w, b = linear_relu(*FFN, rng)
    return proto, w, b


def test_the_kernel_prefetches_and_keeps_its_accumulators_in_registers(rng):
    """The assembly for a Zen 4: ``prefetcht1`` of the next panel in the ``k`` loop, and no
    accumulator stored there (a store per FMA made the first try 2x slower)."""
    proto, _, _ = _ffn_model(rng)
    model = tvm_hybrid.compile(proto, {"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    details = [info.detail for info in model.kernels.values()]
    assert any("next panel prefetched" in d for d in details), details
    asm = model.inspect_source("asm")
    loops = re.findall(r"\n(\.LBB\d+_\d+):\n((?:(?!\n\.LBB)[\s\S])*?)\n\s+j\w+\s+\1", asm)
    hot = [body for _, body in loops if "prefetcht1" in body]
    assert hot, "no loop prefetches"
    for body in hot:
        assert len(re.findall(r"vfmadd\d+ps\s[^\n]*%zmm", body)) >= 24
        assert not re.search(r"vmovup\w\s+%zmm\d+, [^\n]*\(", body), "accumulators stored"


@pytest.mark.requires("avx512f")
def test_prefetching_gemm_matches_numpy(rng):
    """On this host: within 1e-5 of the output scale of float64 numpy."""
    proto, w, b = _ffn_model(rng)
    model = tvm_hybrid.compile(proto)
    x = rng.standard_normal(FFN[::2]).astype("float32")
    want = np.maximum(x.astype("float64") @ w + b, 0)
    got = np.asarray(model(x), np.float64)
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
