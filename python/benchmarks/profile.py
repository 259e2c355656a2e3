"""How well the profile report accounts for the model's time, on the benchmark models.

For each workload: the model's median latency, the sum of its kernels' times from the profile
report (each kernel timed alone on the arguments it received in a run), their ratio, and the
kernels each schedule holds. The issue's criterion is a sum within 10% of the latency. Also the
compile cache: a second compile of the BERT layer against the first (which stores it) and a
plain compile. This prints; it is not a test.

    python python/benchmarks/profile.py
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import onnx.backend.test

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import host_banner


def main() -> None:
    print(host_banner())
    path = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "light",
                        "light_squeezenet.onnx")
    cases = [(wl.name, wl.model, wl.inputs) for wl in workloads.paper_workloads(quick=True)]
    squeeze = tvm_hybrid.compile(path)
    rng = np.random.default_rng(0)
    cases.append(("light_squeezenet", path, {s.name: rng.standard_normal(s.shape).astype(s.dtype)
                                             for s in squeeze.inputs}))
    print(f"{'model':22s} {'latency ms':>10s} {'kernels ms':>10s} {'sum/latency':>11s}  "
          "template / fallback / stock ms")
    for name, model, feeds in cases:
        report = tvm_hybrid.compile(model).profile(**feeds)
        parts = report.by_schedule()
        print(f"{name:22s} {report.model_ms:10.3f} {report.kernels_ms:10.3f} "
              f"{report.kernels_ms / report.model_ms:11.2f}  {parts['template']:.3f} / "
              f"{parts['fallback']:.3f} / {parts['stock']:.3f}", flush=True)
    bert = workloads.bert_layer(1, 128)
    start = time.perf_counter()
    tvm_hybrid.compile(bert.model)
    plain = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        tvm_hybrid.compile(bert.model, cache_dir=cache)
        first = time.perf_counter() - start
        start = time.perf_counter()
        tvm_hybrid.compile(bert.model, cache_dir=cache)
        second = time.perf_counter() - start
    print(f"BERT layer compile: plain {plain:.2f} s; with the cache: first {first:.2f} s "
          f"(compiles and stores), second {second:.3f} s (loads): {first / second:.0f}x the "
          f"first, {plain / second:.0f}x a plain compile")


if __name__ == "__main__":
    main()
