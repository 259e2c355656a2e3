"""GEMMs of odd shapes against the nearest aligned shape and against ONNX Runtime and OpenVINO.

For each odd ``M`` (1, 7, 97, 197, 257, 777: a GEMV, a small batch, primes, ViT token counts)
and odd ``N`` (the same; 1: a regression head), with an odd ``K``, this times ``x[M, K] @
W[K, N]`` (constant ``W``) with tvm_hybrid, ONNX Runtime and OpenVINO (f32), and prints
GFLOP/s, hybrid's GFLOP/s as a fraction
of the same runtime's on the nearest aligned shape (the issue's bar is 90%) and hybrid's speed
ratio over the fastest peer (bar 1.0x). The odd shape and its aligned neighbour are timed in the
same interleaved rounds, every runtime on both, so a slow moment of a shared machine falls on
both sides of each ratio. Each output is checked against numpy (float64). This prints ratios;
it is not a test.

    python python/benchmarks/odd_shapes.py [--rounds 9] [--k 333] [--n 768]
"""

from __future__ import annotations

import argparse

import numpy as np
from onnx import numpy_helper

from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import host_banner, time_interleaved
from tvm_hybrid.bench.peers import available, make_runner

#: (odd shape, its aligned neighbour) as (M, N) pairs for the given N and K.
ODD_M = (1, 7, 97, 197, 257, 777)
ALIGNED_M = {1: 1, 7: 8, 97: 96, 197: 192, 257: 256, 777: 768}
# N = 1 (a regression head) has no aligned neighbour below it: timed against itself, like
# M = 1, its ratio is the noise; what it must beat is the peers.
ODD_N = (1, 7, 97, 197, 257, 777)
ALIGNED_N = {1: 1, 7: 8, 97: 96, 197: 192, 257: 256, 777: 768}


PEERS = ("hybrid", "onnxruntime", "openvino")


def _runners(wl: workloads.Workload) -> dict:
    """A runner per available peer whose output matches numpy within 1e-4 of its scale."""
    a = wl.inputs["a"].astype(np.float64)
    want = a @ numpy_helper.to_array(wl.model.graph.initializer[0]).astype(np.float64)
    runners = {}
    for peer in PEERS:
        if not available(peer):
            continue
        try:
            runner = make_runner(peer, wl.model)
            got = np.asarray(runner(wl.inputs)[0], np.float64)
        except Exception as err:  # a peer failing must not stop the others
            print(f"  {peer} failed on {wl.name}: {type(err).__name__}: {err}")
            continue
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if err > 1e-4:
            print(f"  {peer} differs from numpy on {wl.name}: {err:.1e} of the output scale")
            continue
        runners[peer] = runner
    return runners


def _pair(odd: workloads.Workload, aligned: workloads.Workload, rounds: int) -> dict:
    """GFLOP/s of every peer on both shapes, all timed in the same interleaved rounds."""
    runners = {}
    for side, wl in (("odd", odd), ("aligned", aligned)):
        for peer, runner in _runners(wl).items():
            runners[(side, peer)] = lambda _, run=runner, inputs=wl.inputs: run(inputs)
    samples = time_interleaved(runners, {}, rounds=rounds)
    flops = {"odd": odd.flops, "aligned": aligned.flops}
    return {key: flops[key[0]] / float(np.median(ms)) / 1e6
            for key, ms in samples.items() if ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--k", type=int, default=333, help="the (odd) reduction length")
    parser.add_argument("--n", type=int, default=768, help="N for the odd-M rows")
    parser.add_argument("--m", type=int, default=197, help="M for the odd-N rows")
    args = parser.parse_args()
    print(host_banner())
    cases = [((m, args.n), (ALIGNED_M[m], args.n)) for m in ODD_M]
    cases += [((args.m, n), (args.m, ALIGNED_N[n])) for n in ODD_N]
    rows = []
    for (m, n), (am, an) in cases:
        odd, aligned = workloads.gemm(m, n, args.k), workloads.gemm(am, an, args.k)
        print(f"running {odd.name} and {aligned.name} ...", flush=True)
        g = _pair(odd, aligned, args.rounds)
        hybrid, hybrid_aligned = g.get(("odd", "hybrid")), g.get(("aligned", "hybrid"))
        fastest = max((g[("odd", p)] for p in PEERS[1:] if ("odd", p) in g), default=None)
        rows.append((odd.name, hybrid, g.get(("odd", "onnxruntime")), g.get(("odd", "openvino")),
                     aligned.name, hybrid_aligned,
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
