"""Host detection, target construction and the thread pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import tvm

import tvm_hybrid
from tvm_hybrid.host import isa_tiers, make_target, target_features
from tvm_hybrid.thread_pool import physical_cores


def test_host_target_has_cpu_and_cores():
    target = make_target("host")
    info = tvm_hybrid.describe_host()
    assert str(target.attrs["mcpu"]) == info["cpu"]
    assert int(target.attrs["num-cores"]) == physical_cores() == info["physical_cores"]
    assert info["cache"]["l1d"] > 0 and info["cache"]["l2"] > info["cache"]["l1d"]


def test_explicit_targets_accepted():
    for spec in ({"kind": "llvm", "mcpu": "skylake-avx512"},
                 '{"kind": "llvm", "mcpu": "skylake-avx512"}',
                 tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})):
        target = make_target(spec)
        assert str(target.attrs["mcpu"]) == "skylake-avx512"
    assert make_target("llvm").kind.name == "llvm"


def test_isa_tiers_from_features():
    spr = target_features(make_target({"kind": "llvm", "mcpu": "sapphirerapids"}))
    assert {"avx512", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"} <= set(isa_tiers(spr))
    hsw = target_features(make_target({"kind": "llvm", "mcpu": "haswell"}))
    assert isa_tiers(hsw) == ["avx2"]


def test_thread_pool_uses_all_physical_cores_and_does_not_pin():
    code = (
        "import os, tvm_hybrid, numpy as np\n"
        "from tvm_hybrid import workloads\n"
        "before = os.sched_getaffinity(0)\n"
        "wl = workloads.mlp(64, (64, 64))\n"
        "tvm_hybrid.compile(wl.model)(wl.inputs['x'])\n"
        "print(tvm_hybrid.num_threads(), before == os.sched_getaffinity(0))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "TVM_BIND_THREADS",
                                                            "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    threads, unpinned = out.stdout.split()
    assert int(threads) == physical_cores() and unpinned == "True"


def test_set_num_threads():
    full = tvm_hybrid.num_threads()
    assert tvm_hybrid.set_num_threads(1) == 1
    assert tvm_hybrid.set_num_threads(full) == full


def test_plain_import_tvm_registers_hybrid_pipeline():
    code = "import tvm; from tvm import relax; print('hybrid' in relax.pipeline.PIPELINE_MAP)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


def test_describe_host_is_json_serialisable():
    json.dumps(tvm_hybrid.describe_host())
