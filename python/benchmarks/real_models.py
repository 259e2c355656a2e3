"""The real-model zoo side by side: tvm_hybrid, ONNX Runtime and OpenVINO (f32), one run.

Per model: compile seconds, kernels on a template / the fallback rule / stock lowering,
convolutions left to TVM's own lowering (``convs``: 0 when every convolution runs on the
engine), the largest relative difference from ONNX Runtime, and median latency of each runtime
(timed interleaved, all on the physical cores), then hybrid's speed relative to each peer and
the geometric means. ``--light`` runs the light CNNs of the ONNX backend data that ship with
the onnx package (ResNet-50, DenseNet-121, Inception v1/v2, SqueezeNet, ShuffleNet, VGG-19,
AlexNet, ZFNet-512; their weights are constants, inputs standard normal) instead of the zoo,
``--all`` both. This prints; it is not a test.

    python python/tools/fetch_models.py          # once
    python python/benchmarks/real_models.py [NAME ...] [--rounds 9] [--light | --all]
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import time

import numpy as np
import onnx

import tvm_hybrid
from tvm_hybrid.bench import peers
from tvm_hybrid.bench.comparison import host_banner, time_interleaved
from tvm_hybrid.frontend.fold import fold_constants
from tvm_hybrid.testing import zoo


def _hybrid_runner(compiled):
    names = [spec.name for spec in compiled.inputs]

    def run(feeds):
        out = compiled(*[feeds[n] for n in names])
        return list(out) if isinstance(out, tuple) else [out]

    return run


def light_cnns() -> list[tuple[str, str]]:
    """``(name, path)`` of the light CNN models in the installed onnx package."""
    import onnx.backend.test

    folder = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "light")
    return [(os.path.basename(p)[len("light_"):-len(".onnx")], p)
            for p in sorted(glob.glob(os.path.join(folder, "light_*.onnx")))]


def _light_feeds(path: str) -> dict:
    model = onnx.load(path, load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype("float32") for i in model.graph.input if i.name not in inits}


def _models(args) -> list[tuple[str, object, object]]:
    """``(name, path or fetch error, feeds)`` of the models to run."""
    out = []
    if not args.light or args.all:
        for entry in zoo.MODELS:
            try:
                path = zoo.fetch(entry)
            except zoo.FetchError as err:
                path = err
            out.append((entry.name, path, lambda e=entry: e.inputs(np.random.default_rng(0))))
    if args.light or args.all:
        out += [(name, path, lambda p=path: _light_feeds(p)) for name, path in light_cnns()]
    return [m for m in out if not args.names or m[0] in args.names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--light", action="store_true",
                        help="the light CNNs of the onnx package instead of the zoo")
    parser.add_argument("--all", action="store_true", help="the zoo and the light CNNs")
    args = parser.parse_args()
    print(host_banner())
    others = [p for p in ("onnxruntime", "openvino") if peers.available(p)]
    header = (f"{'model':22s} {'compile s':>9s} {'tmpl/fallb/stock':>16s} {'convs':>5s} "
              f"{'max err':>8s} {'hybrid ms':>10s} "
              + " ".join(f"{p + ' ms':>14s}" for p in others)
              + " " + " ".join(f"{'vs ' + p:>14s}" for p in others))
    print(header, flush=True)
    ratios: dict[str, list[float]] = {p: [] for p in others}
    for name, path, make_feeds in _models(args):
        if isinstance(path, Exception):
            print(f"{name:22s} not fetched: {path}")
            continue
        feeds = make_feeds()
        shapes = {k: v.shape for k, v in feeds.items()}
        start = time.perf_counter()
        try:
            compiled = tvm_hybrid.compile(path, input_shapes={k: v.shape for k, v in
                                                              feeds.items() if v.ndim})
        except tvm_hybrid.errors.TVMHybridError as err:
            print(f"{name:22s} FAILED: {err}", flush=True)
            continue
        compile_s = time.perf_counter() - start
        counts = {"template": 0, "fallback": 0, "stock": 0}
        for kernel in compiled.kernels.values():
            counts[kernel.schedule] = counts.get(kernel.schedule, 0) + 1
        stock_convs = sum("conv1d" in k or "conv2d" in k for k in compiled.kernels)
        proto = onnx.load(str(path))
        runners = {"hybrid": _hybrid_runner(compiled)}
        notes = []
        for p in others:
            try:
                runners[p] = peers.make_runner(p, proto)
            except Exception:  # noqa: BLE001 - a peer that cannot load the model as shipped
                # gets it with the input shapes fixed (and shape arithmetic folded)
                try:
                    static, _ = fold_constants(proto, shapes)
                    runners[p] = peers.make_runner(p, static)
                    notes.append(f"{p} needed the input shapes fixed")
                except Exception as err:  # noqa: BLE001
                    notes.append(f"{p} failed: {str(err).strip().splitlines()[0][:80]}")
        reference = runners["onnxruntime"](feeds) if "onnxruntime" in runners else None
        for p in [p for p in others if p in runners]:
            try:
                runners[p](feeds)
            except Exception as err:  # noqa: BLE001 - loads but cannot run these inputs
                del runners[p]
                notes.append(f"{p} failed to run: {str(err).strip().splitlines()[0][:80]}")
        error = (max(zoo.relative_errors(runners["hybrid"](feeds), reference)) if reference
                 else float("nan"))
        samples = time_interleaved(runners, feeds, rounds=args.rounds)
        ms = {p: float(np.median(s)) for p, s in samples.items()}
        speed = {p: ms[p] / ms["hybrid"] for p in others if p in ms}
        for p, value in speed.items():
            ratios[p].append(value)
        print(f"{name:22s} {compile_s:9.1f} "
              f"{counts['template']:>6d}/{counts['fallback']:>4d}/{counts['stock']:>4d} "
              f"{stock_convs:5d} {error:8.1e} {ms['hybrid']:10.2f} "
              + " ".join(f"{ms[p]:14.2f}" if p in ms else f"{'-':>14s}" for p in others) + " "
              + " ".join(f"{speed[p]:13.2f}x" if p in speed else f"{'-':>14s}" for p in others)
              + (f"  ({'; '.join(notes)})" if notes else ""), flush=True)
    for p in others:
        if ratios[p]:
            geo = math.exp(sum(math.log(r) for r in ratios[p]) / len(ratios[p]))
            print(f"hybrid speed vs {p}: geometric mean {geo:.2f}x over {len(ratios[p])} "
                  f"models, lowest {min(ratios[p]):.2f}x")


if __name__ == "__main__":
    main()
