"""Side-by-side benchmark of tvm_hybrid against stock TVM, ONNX Runtime and OpenVINO.

The oneDNN Graph Compiler paper's fp32 workloads (MLP_1, MLP_2, BERT-base MHA, a BERT-base
encoder layer, a 1024³ GEMM) are built as ONNX, every runtime's outputs are checked against stock
TVM's, and then all runtimes are timed interleaved in one process; medians are printed with
GFLOP/s, % of the machine's nominal fp32 peak and the speed-up over stock TVM. This prints
ratios; it is not a test.

    python python/benchmarks/peers.py            # all workloads (stock TVM makes this slow)
    python python/benchmarks/peers.py --quick    # one of each kind
"""

from __future__ import annotations

import argparse
import re

import tvm_hybrid
from tvm_hybrid import workloads
from tvm_hybrid.comparison import compare, format_table
from tvm_hybrid.host import host_features


def nominal_fp32_peak_gflops() -> tuple[float, str]:
    """cores x max clock x FLOPs per cycle (two FMA pipes on the widest vectors)."""
    mhz = 0.0
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            mhz = int(f.read()) / 1e3
    except OSError:
        with open("/proc/cpuinfo") as f:
            found = re.findall(r"cpu MHz\s*:\s*([\d.]+)", f.read())
        mhz = max(map(float, found)) if found else 0.0
    lanes = 16 if "avx512f" in host_features() else 8
    cores = tvm_hybrid.describe_host()["physical_cores"]
    peak = cores * mhz / 1e3 * lanes * 2 * 2
    return peak, f"{cores} cores x {mhz / 1e3:.2f} GHz x {lanes * 4} FLOP/cycle"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one workload of each kind")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--peers", default="tvm,hybrid,onnxruntime,openvino")
    parser.add_argument("--only", help="run only workloads whose name contains this")
    args = parser.parse_args()

    peak, how = nominal_fp32_peak_gflops()
    print(f"host {tvm_hybrid.describe_host()}")
    print(f"nominal fp32 peak {peak:.0f} GFLOP/s ({how}; the clock as the OS reports it)")
    peers = [p.strip() for p in args.peers.split(",")]
    results = []
    for wl in workloads.paper_workloads(quick=args.quick):
        if args.only and args.only not in wl.name:
            continue
        print(f"running {wl.name} ...", flush=True)
        results.append(compare(wl.name, wl.model, wl.inputs, peers, flops=wl.flops,
                               rounds=args.rounds))
        print(format_table(results[-1:], peak_gflops=peak), flush=True)
    print("\nSummary (median of interleaved rounds; speed-up over stock TVM)")
    print(format_table(results, peak_gflops=peak))


if __name__ == "__main__":
    main()
