"""bf16: hybrid's ``precision="bf16"`` mode against OpenVINO's default (bf16) precision.

A 1024³ GEMM (against the bf16 peak measured by ``tvm_hybrid.bench.peak``; on CPUs without
AVX512-BF16, where hybrid emulates bf16 compute, against the fp32 peak) and a BERT-base encoder
layer at batch 1 and 8. Every bf16 output is compared with hybrid's fp32 output
(the error a user accepts with bf16 is printed); all runtimes are timed interleaved in one
process (medians). This prints ratios; it is not a test.

    python python/benchmarks/bf16.py [--rounds 15]
"""

from __future__ import annotations

import argparse

import numpy as np

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import compare, format_ratios, host_banner
from tvm_hybrid.bench.peak import measure_peak, peak_instruction
from tvm_hybrid.bench.peers import make_runner

#: hybrid (fp32) first: every runtime's output is checked against it, within bf16's error.
PEERS = ["hybrid", "hybrid_bf16", "openvino_default", "openvino", "onnxruntime"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    args = parser.parse_args()
    print(host_banner())
    measured = measure_peak("bf16" if peak_instruction("bf16") else "fp32")
    print(f"peak: {measured.describe()}"
          + ("" if measured.kind == "bf16" else " (no AVX512-BF16: bf16 compute is emulated)"))
    gemm = workloads.gemm(1024, 1024, 1024)
    model = tvm_hybrid.compile(gemm.model, precision="bf16")
    ms = model.benchmark(**gemm.inputs)["median_ms"]
    gflops = gemm.flops / ms / 1e6
    print(f"{gemm.name} bf16, device tensors (model.benchmark): {ms:.3f} ms, {gflops:.0f} "
          f"GFLOP/s = {100 * gflops / measured.gops:.1f}% of the {measured.kind} peak")
    rows = []
    for wl in (gemm, workloads.bert_layer(1, 128), workloads.bert_layer(8, 128)):
        reference = make_runner("hybrid", wl.model)(wl.inputs)
        for peer in ("hybrid_bf16", "openvino_default"):
            out = make_runner(peer, wl.model)(wl.inputs)
            err = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                      for a, b in zip(out, reference))
            print(f"{wl.name} {peer}: max error relative to the fp32 output's scale {err:.1e}")
        # bf16 errors are relative to the output's scale, not to each element.
        scale = max(float(np.max(np.abs(r))) for r in reference)
        result = compare(wl.name, wl.model, wl.inputs, PEERS, flops=wl.flops,
                         rounds=args.rounds, rtol=0, atol=0.1 * scale)
        rows.append(result)
        for peer in result.results:
            status = f"{peer.median_ms:8.3f} ms" if peer.ok else peer.error
            print(f"  {peer.name:17s} {status}")
    print("\nhybrid_bf16's speed ratio over each runtime (above 1.00x: hybrid_bf16 is faster)")
    print(format_ratios(rows, subject="hybrid_bf16"))


if __name__ == "__main__":
    main()
