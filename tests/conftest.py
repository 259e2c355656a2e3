"""Shared fixtures; prints the ONNX conformance counts at the end of the run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TVM_BIND_THREADS", "0")

import tvm_hybrid  # noqa: E402,F401  (sets thread defaults before TVM's pool starts)

CONFORMANCE: dict[str, list[str]] = {"both": [], "stock_fails": [], "regressions": []}


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
