"""GEMMs of odd shapes against the nearest aligned shape and against ONNX Runtime and OpenVINO.

For each odd ``M`` (1, 7, 97, 197, 257, 777: a GEMV, a small batch, primes, ViT token counts)
and odd ``N``, with an odd ``K``, this times ``x[M, K] @ W[K, N]`` (constant ``W``) with
tvm_hybrid, ONNX Runtime and OpenVINO (f32) interleaved in one process, and prints GFLOP/s,
hybrid's GFLOP/s as a fraction of the same runtime's on the nearest aligned shape (the issue's
bar is 90%) and hybrid's speed ratio over the fastest peer (bar 1.0x). This prints ratios; it
is not a test.

    python python/benchmarks/odd_shapes.py [--rounds 9] [--k 333] [--n 768]
"""

from __future__ import annotations

import argparse

from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import compare, host_banner

#: (odd shape, its aligned neighbour) as (M, N) pairs for the given N and K.
ODD_M = (1, 7, 97, 197, 257, 777)
ALIGNED_M = {1: 1, 7: 8, 97: 96, 197: 192, 257: 256, 777: 768}
ODD_N = (97, 197, 777)
ALIGNED_N = {97: 96, 197: 192, 777: 768}


def _gflops(comparison, runtime: str) -> float | None:
    result = comparison.by_name(runtime)
    if result is None or result.median_ms is None:
        return None
    return comparison.flops / result.median_ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--k", type=int, default=333, help="the (odd) reduction length")
    parser.add_argument("--n", type=int, default=768, help="N for the odd-M rows")
    parser.add_argument("--m", type=int, default=197, help="M for the odd-N rows")
    args = parser.parse_args()
    print(host_banner())
    peers = ["hybrid", "onnxruntime", "openvino"]
    cases = [((m, args.n), (ALIGNED_M[m], args.n)) for m in ODD_M]
    cases += [((args.m, n), (args.m, ALIGNED_N[n])) for n in ODD_N]
    rows = []
    for (m, n), (am, an) in cases:
        measured = []
        for mm, nn in ((m, n), (am, an)):
            wl = workloads.gemm(mm, nn, args.k)
            print(f"running {wl.name} ...", flush=True)
            measured.append(compare(wl.name, wl.model, wl.inputs, peers, flops=wl.flops,
                                    rounds=args.rounds))
        odd, aligned = measured
        hybrid = _gflops(odd, "hybrid")
        hybrid_aligned = _gflops(aligned, "hybrid")
        fastest = max((g for g in (_gflops(odd, p) for p in peers[1:]) if g), default=None)
        rows.append((odd.model, hybrid, _gflops(odd, "onnxruntime"), _gflops(odd, "openvino"),
                     aligned.model, hybrid_aligned,
                     hybrid / hybrid_aligned if hybrid and hybrid_aligned else None,
                     hybrid / fastest if hybrid and fastest else None))

    def show(value, spec):
        return format(value, spec) if value is not None else "-"

    print(f"\nGFLOP/s (median of {args.rounds} interleaved rounds), K = {args.k}")
    print(f"{'shape':<20}{'hybrid':>9}{'ORT':>9}{'OV':>9}  {'aligned':<20}{'hybrid':>9}"
          f"{'of aligned':>12}{'vs fastest':>12}")
    for name, hyb, ort, ov, aligned_name, hyb_aligned, fraction, ratio in rows:
        print(f"{name:<20}{show(hyb, '9.1f')}{show(ort, '9.1f')}{show(ov, '9.1f')}  "
              f"{aligned_name:<20}{show(hyb_aligned, '9.1f')}"
              f"{show(fraction and fraction * 100, '11.0f')}%{show(ratio, '11.2f')}x")


if __name__ == "__main__":
    main()
