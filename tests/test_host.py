"""Host detection, target construction and the thread pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
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
        "from tvm_hybrid.bench import workloads\n"
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


def _host_info_with(cpu: str) -> subprocess.CompletedProcess:
    code = "import json, tvm_hybrid; print(json.dumps(tvm_hybrid.describe_host()))"
    env = dict(os.environ, TVM_HYBRID_HOST_CPU=cpu)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_host_cpu_variable_emulates_an_older_cpu():
    """TVM_HYBRID_HOST_CPU=haswell: "host" compiles for Haswell and only AVX2 counts."""
    out = _host_info_with("haswell")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["cpu"] == "haswell" and info["isa"] == ["avx2"]
    assert info["emulating"].startswith("haswell on a ")


def test_host_cpu_variable_cannot_add_features():
    from tvm_hybrid import host

    # The real CPU's features: this suite may itself run under the variable (a Haswell pass).
    if "amx-tile" in target_features(host._cpu_target(host.real_host_cpu())):
        pytest.skip("this host has AMX: sapphirerapids adds no feature it lacks")
    out = _host_info_with("sapphirerapids")
    assert out.returncode != 0
    assert "TargetError" in out.stderr and "amx-tile" in out.stderr and "lacks" in out.stderr


def test_host_cpu_variable_names_an_unknown_cpu():
    out = _host_info_with("pentium9000")
    assert out.returncode != 0 and "not a CPU LLVM" in out.stderr


def test_features_the_machine_hides_are_turned_off(monkeypatch):
    """A VM that hides AMX (and AVX-512) of a Sapphire Rapids: the CPU name still implies them,
    the host target turns them off, so nothing selects AMX kernels the process cannot run."""
    from tvm_hybrid import host

    running = {f: True for f in target_features(make_target(
        {"kind": "llvm", "mcpu": "sapphirerapids"}))}
    running.update({"amx-tile": False, "amx-int8": False, "amx-bf16": False})
    monkeypatch.setattr(host, "_running_features", lambda: running)
    assert host.hidden_features("sapphirerapids") == ["-amx-bf16", "-amx-int8", "-amx-tile"]
    target = host._cpu_target("sapphirerapids")
    tiers = isa_tiers(target_features(target))
    assert "avx512_vnni" in tiers and not any(t.startswith("amx") for t in tiers)
    assert not host.uses_amx(target)

    running["avx512f"] = False  # AVX-512 hidden too: every AVX-512 tier goes with it
    tiers = isa_tiers(target_features(host._cpu_target("sapphirerapids")))
    assert not any(t.startswith(("avx512", "amx")) for t in tiers) and "avx2" in tiers


def test_host_target_offers_only_what_the_process_can_run():
    """Every ISA feature of the host target is one LLVM's host detection says the running
    process may use (CPUID and the OS's XCR0), whatever LLVM's CPU name implies."""
    from tvm_hybrid import host

    running = host._running_features()
    if not running:
        pytest.skip("this TVM build has no LLVM host feature detection")
    unusable = [f for f in host._isa_features(make_target("host")) if running.get(f) is False]
    assert not unusable, f"the host target enables {unusable}, which this process cannot use"


def test_a_cpu_named_from_an_older_model_gets_the_features_it_runs(monkeypatch):
    """A Sapphire Rapids VM that reports model 167: LLVM names it rocketlake (no AMX, AVX512-BF16
    or AVX512-FP16). The host CPU is then one LLVM knows with the running features, none more."""
    from tvm_hybrid import host

    def detected(named: str, running: dict) -> str:
        monkeypatch.setattr(host, "_running_features", lambda: running)
        monkeypatch.setattr(host, "named_host_cpu", lambda: named)
        host.real_host_cpu.cache_clear()
        try:
            return host.real_host_cpu()
        finally:
            host.real_host_cpu.cache_clear()

    spr = target_features(make_target({"kind": "llvm", "mcpu": "sapphirerapids"}))
    running = {f: True for f in spr}
    # As such a VM says: system instructions hidden, and no AMX-FP16 (Granite Rapids has it).
    running.update({"enqcmd": False, "pconfig": False, "waitpkg": False, "amx-fp16": False})
    cpu = detected("rocketlake", running)
    features = target_features(make_target({"kind": "llvm", "mcpu": cpu}))
    assert {"amx-tile", "amx-int8", "amx-bf16", "avx512bf16", "avx512fp16"} <= features, cpu
    assert "amx-fp16" not in features, cpu
    assert "amx_int8" in isa_tiers(features)

    # A name that already has every running vector feature is kept.
    assert detected("sapphirerapids", running) == "sapphirerapids"
    rkl = {f: True for f in target_features(make_target({"kind": "llvm", "mcpu": "rocketlake"}))}
    assert detected("rocketlake", rkl) == "rocketlake"
    # A VM hiding AMX keeps its name: hidden_features turns AMX off in the target.
    hidden = {**running, "amx-tile": False, "amx-int8": False, "amx-bf16": False}
    assert detected("sapphirerapids", hidden) == "sapphirerapids"
