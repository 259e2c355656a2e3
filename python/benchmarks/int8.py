"""int8: integer GEMMs (``MatMulInteger``), QDQ MLPs and QDQ attention against ONNX Runtime and
OpenVINO.

Each runtime's output is checked bit for bit against an int64 numpy reference, then all are
timed interleaved in one process (medians). GOP/s are printed against the int8 peak measured by
``tvm_hybrid.bench.peak`` on this CPU: ``vpdpbusd`` with VNNI, else ONNX Runtime's (saturating)
``vpmaddubsw`` + ``vpmaddwd`` sequence on AVX2. A peer whose outputs are wrong (ONNX Runtime's
saturating ``vpmaddubsw`` on CPUs without VNNI) is timed all the same and marked ``*`` in the
ratio table: its speed is what its users get. This prints ratios; it is not a test.

    python python/benchmarks/int8.py [--rounds 15] [--peers hybrid,onnxruntime,openvino]
    python python/benchmarks/int8.py --only mha     # the rows whose name has "mha"
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import compare, format_ratios, host_banner
from tvm_hybrid.bench.peak import measure_peak
from tvm_hybrid.bench.peers import available, make_runner
from tvm_hybrid.passes.fuse_attention import FUSED_ATTENTION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--peers", default="hybrid,onnxruntime,openvino")
    parser.add_argument("--only", help="run only the rows whose name has this (e.g. mha_b32, "
                        "matmul, mlp2)")
    args = parser.parse_args()
    print(host_banner())
    measured = measure_peak("int8")
    peak, label = measured.gops, f"of the {measured.instruction} peak"
    print(f"peak: {measured.describe()}")
    peers = [p.strip() for p in args.peers.split(",")]
    rows = []
    # 7-bit weights (ONNX Runtime's reduce_range): exact on AVX2's vpmaddubsw (no VNNI).
    seven_bit = workloads.matmul_integer(1024, 1024, 1024, weight_range=(-64, 65))
    gemms = (workloads.matmul_integer(1024, 1024, 1024),
             workloads.matmul_integer(1024, 1024, 1024, activations="int8", zero_point=3),
             dataclasses.replace(seven_bit, name=seven_bit.name + "_w7"))
    for wl in gemms:
        if args.only and args.only not in wl.name:
            continue
        reference = workloads.matmul_integer_reference(wl)
        for peer in peers:
            if not available(peer):
                continue
            try:
                out = make_runner(peer, wl.model)(wl.inputs)[0]
                exact = np.array_equal(out, reference)
            except Exception as err:  # noqa: BLE001 - a peer lacking the op is reported
                exact = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
            print(f"{wl.name} {peer}: bit-exact vs int64 numpy: {exact}")
        hybrid = tvm_hybrid.compile(wl.model)
        kernel_ms = hybrid.benchmark(**wl.inputs)["median_ms"]
        gops = wl.flops / kernel_ms / 1e6
        print(f"  hybrid, device tensors in and out (model.benchmark): {kernel_ms:.3f} ms "
              f"{gops:.0f} GOP/s ({100 * gops / peak:.1f}% {label})")
        print("  numpy in, numpy out, interleaved with the peers:")
        result = compare(wl.name, wl.model, wl.inputs, peers, flops=wl.flops, rounds=args.rounds,
                         rtol=0, atol=0, time_inexact=True)
        rows.append(result)
        for peer in result.results:
            if peer.ok:
                gops = wl.flops / peer.median_ms / 1e6
                print(f"  {peer.name:12s} {peer.median_ms:8.3f} ms {gops:7.0f} GOP/s "
                      f"({100 * gops / peak:.1f}% {label})"
                      + (f"  WRONG RESULTS (rel err {peer.max_rel_err:.1e})"
                         if peer.inexact else ""))
            else:
                print(f"  {peer.name:12s} {peer.error}")
    print("\nQDQ MLPs (u8 activations, per-channel s8 weights; _rr: 7-bit weights, ONNX Runtime's")
    print("reduce_range): hybrid is checked bit for bit")
    print("against the QDQ integer reference; peers (float QDQ semantics) within 2% or 0.02")
    for batch, reduce_range in ((32, False), (128, False), (32, True), (128, True)):
        for wl in (workloads.qdq_mlp(batch, (13, 512, 256, 128), name="mlp1",
                                     reduce_range=reduce_range),
                   workloads.qdq_mlp(batch, (479, 1024, 1024, 512, 256, 1), final="Sigmoid",
                                     name="mlp2", reduce_range=reduce_range)):
            if args.only and args.only not in wl.name:
                continue
            hybrid = tvm_hybrid.compile(wl.model)
            got, want = hybrid(**wl.inputs), workloads.qdq_reference(wl)
            err = float(np.max(np.abs(got - want)))
            print(f"{wl.name}: hybrid vs integer reference max |diff| {err:.1e}"
                  f"{' (bit-exact)' if err == 0 else ' (float sigmoid at the end)'}")
            result = compare(wl.name, wl.model, wl.inputs, peers, flops=wl.flops,
                             rounds=args.rounds, rtol=0.02, atol=0.02, time_inexact=True)
            rows.append(result)
            for peer in result.results:
                status = f"{peer.median_ms:8.3f} ms" if peer.ok else peer.error
                if peer.inexact:
                    status += f"  WRONG RESULTS (rel err {peer.max_rel_err:.1e})"
                print(f"  {peer.name:12s} {status}")
    print("\nQDQ multi-head attention (ONNX Runtime's QDQ form: u8 Q, K, V and probabilities;")
    print("BERT-base heads): hybrid against the integer reference of its arithmetic (exact")
    print("products, float64 softmax); peers (which quantize P their own way) within 3 P steps")
    for batch, seq in ((1, 128), (1, 384), (32, 128), (32, 384)):
        if args.only and args.only not in f"qdq_mha_b{batch}_s{seq}":
            continue
        wl = workloads.qdq_attention(batch, seq)
        want, step = workloads.qdq_attention_reference(wl)
        compiled = tvm_hybrid.compile(wl.model)
        got = compiled(**wl.inputs)
        exact = np.mean(np.all(got == want, axis=-1))
        fused = any(name.startswith(FUSED_ATTENTION) for name in compiled.kernel_names())
        print(f"{wl.name}: hybrid vs integer reference: {exact:.2%} of rows bit-exact, max "
              f"|diff| {np.abs(got - want).max() / step:.2f} P steps"
              + ("" if fused else " (not fused on this CPU: the per-op QDQ kernels, float "
                                  "dequantized products, so rows differ in the last bits)"))
        result = compare(wl.name, wl.model, wl.inputs, peers, flops=wl.flops,
                         rounds=args.rounds, rtol=0, atol=3 * step)
        rows.append(result)
        for peer in result.results:
            status = (f"{peer.median_ms:8.3f} ms {wl.flops / peer.median_ms / 1e6:7.0f} GOP/s"
                      if peer.ok else peer.error)
            print(f"  {peer.name:12s} {status}")
    print("\nhybrid's speed ratio over each runtime (above 1.00x: hybrid is faster; "
          "* that runtime's results were wrong)")
    print(format_ratios(rows))


if __name__ == "__main__":
    main()
