"""Shared fixtures and markers; prints the ONNX conformance counts at the end of the run.

Tests must pass on any x86-64 Linux host (AVX2-only laptops and VMs, AVX-512 servers, AMX
hosts). A test about one ISA's code compiles for a named ``mcpu`` and reads the assembly, which
works everywhere; a test that *runs* code needing a CPU feature says so with the marker::

    @pytest.mark.requires("avx512vnni")          # LLVM feature names, all of them needed
    def test_...():

or names the target whose code it runs (``requires({"kind": "llvm", "mcpu": "znver4"})``: the
features that code needs, AVX512-BF16 among them, which an Ice Lake lacks), and is skipped,
with the missing features and this CPU named, where the host lacks them.
``TVM_HYBRID_HOST_CPU=znver3 pytest`` runs the suite as an AVX2-only host would (see
``tvm_hybrid/host.py``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TVM_BIND_THREADS", "0")
# A template that matches a function and then fails is a test failure, not a slow fallback.
os.environ.setdefault("TVM_HYBRID_STRICT", "1")

import tvm_hybrid  # noqa: E402,F401  (sets thread defaults before TVM's pool starts)
from tvm_hybrid.host import (  # noqa: E402
    host_cpu,
    host_features,
    real_host_cpu,
    request_amx_permission,
    required_features,
)

CONFORMANCE: dict[str, list[str]] = {"both": [], "stock_fails": [], "regressions": []}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires(*features): runs only where the host CPU has all these LLVM features "
        "(e.g. 'avx512f', 'avx512vnni', 'avx512bf16', 'amx-int8'), or that code compiled for "
        "these targets (dicts) can run; skipped with the reason elsewhere",
    )


def missing_features(features) -> str | None:
    """Why this host cannot run code needing ``features`` (LLVM names, or targets: the features
    their code needs), or None if it can."""
    names = []
    for feature in features:
        names += [feature] if isinstance(feature, str) else sorted(required_features(feature))
    missing = [f for f in dict.fromkeys(names) if f not in host_features()]
    cpu = host_cpu() if host_cpu() == real_host_cpu() else f"{host_cpu()} emulated"
    if missing:
        return f"needs a CPU with {', '.join(missing)}; this host ({cpu}) lacks it"
    if any(f.startswith("amx") for f in names) and not request_amx_permission():
        return f"needs Linux's AMX tile permission (XTILEDATA), refused on this host ({cpu})"
    return None


def pytest_runtest_setup(item):
    for mark in item.iter_markers(name="requires"):
        reason = missing_features(mark.args)
        if reason:
            pytest.skip(reason)


def pytest_report_header(config):
    info = tvm_hybrid.describe_host()
    line = f"tvm_hybrid host: {info['cpu']} ({info['model']}), ISA {', '.join(info['isa'])}"
    return line + (f"; emulating: {info['emulating']}" if "emulating" in info else "")


def pytest_terminal_summary(terminalreporter):
    total = sum(len(v) for v in CONFORMANCE.values())
    if not total:
        return
    terminalreporter.section("ONNX backend conformance (onnx package test data)")
    terminalreporter.write_line(
        f"{total} cases: stock TVM and hybrid both pass {len(CONFORMANCE['both'])}; "
        f"stock TVM fails {len(CONFORMANCE['stock_fails'])} (listed as xfail with the reason); "
        f"hybrid regressions {len(CONFORMANCE['regressions'])}"
    )


@pytest.fixture
def rng():
    return __import__("numpy").random.default_rng(0)
