"""Side-by-side benchmark of tvm_hybrid against stock TVM, ONNX Runtime and OpenVINO.

The oneDNN Graph Compiler paper's fp32 workloads (MLP_1, MLP_2, BERT-base MHA, a BERT-base
encoder layer, a 1024³ GEMM) are built as ONNX, every runtime's outputs are checked against stock
TVM's, and then all runtimes are timed interleaved in one process; medians are printed with
GFLOP/s, % of the machine's measured fp32 peak (``tvm_hybrid.bench.peak``; the summary takes the
higher of a measurement before and one after the workloads) and the speed-up over the first
runtime listed (stock TVM by default), then hybrid's speed ratio over each other runtime.
This prints ratios; it is not a test.

    python python/benchmarks/peers.py            # all workloads (stock TVM makes this slow)
    python python/benchmarks/peers.py --quick    # one of each kind
    python python/benchmarks/peers.py --peers hybrid,onnxruntime,openvino   # no stock TVM
"""

from __future__ import annotations

import argparse

from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import compare, format_ratios, format_table, host_banner
from tvm_hybrid.bench.peak import measure_fp32_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one workload of each kind")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--peers", default="tvm,hybrid,onnxruntime,openvino")
    parser.add_argument("--only", help="run only workloads whose name contains this")
    args = parser.parse_args()

    print(host_banner())
    measured = measure_fp32_peak()
    peak = measured.gflops
    print(f"peak: {measured.describe()} (register-resident FMA kernel, operands in L1)")
    peers = [p.strip() for p in args.peers.split(",")]
    results = []
    for wl in workloads.paper_workloads(quick=args.quick):
        if args.only and args.only not in wl.name:
            continue
        print(f"running {wl.name} ...", flush=True)
        results.append(compare(wl.name, wl.model, wl.inputs, peers, flops=wl.flops,
                               rounds=args.rounds))
        print(format_table(results[-1:], baseline=peers[0], peak_gflops=peak), flush=True)
    # A shared machine can run slower for a while (another tenant, a lower clock): a peak
    # measured in such a moment made a table's % of peak read above 100%. The summary takes
    # the higher of a measurement before and one after the workloads.
    again = measure_fp32_peak()
    higher = max(peak, again.gflops)
    if abs(again.gflops - peak) > 0.05 * higher:
        print(f"peak measured again: {again.describe()}; the summary's % of peak uses "
              f"{higher:.0f} GFLOP/s (the machine's speed changed during the run)")
    peak = higher
    baseline = peers[0]
    print(f"\nSummary (median of interleaved rounds; speed-up over {baseline})")
    print(format_table(results, baseline=baseline, peak_gflops=peak))
    if "hybrid" in peers and len(peers) > 1:
        print("\nhybrid's speed ratio over each runtime (above 1.00x: hybrid is faster)")
        print(format_ratios(results))


if __name__ == "__main__":
    main()
