"""Template-restricted tuning against the heuristic and against stock MetaSchedule, in one run.

For each workload (1024³ fp32 GEMM, MLP_2 at batch 32, a BERT-base layer at batch 1):

1. hybrid with the heuristic's knobs (an untuned ``tvm_hybrid.compile``);
2. ``tvm_hybrid.tune`` with N trials (neighbourhood search over the template's knobs), then a
   compile with the records (which measures nothing);
3. stock MetaSchedule given 4N trials: TVM's ``zero`` pipeline, ``tune_relax`` with the stock
   CPU rules and the ``random`` cost model, then ``compile_relax``.

Tuning wall times are printed; the three builds' outputs are checked against each other, then
timed interleaved in one process (medians). This prints ratios; it is not a test.

    python python/benchmarks/tuning.py                 # all three workloads
    python python/benchmarks/tuning.py --only gemm --trials 16
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import host_banner, time_interleaved
from tvm_hybrid.frontend import import_model

#: (workload, hybrid trials); stock MetaSchedule gets 4x as many.
DEFAULT = (("gemm1024x1024x1024", 16), ("mlp2_b32", 32), ("bert_layer_b1_s128", 32))


def stock_metaschedule(wl, target, trials: int, work_dir: Path):
    """Stock MetaSchedule as a TVM user runs it; returns (runner, tuning seconds)."""
    mod = import_model(wl.model).mod
    start = time.perf_counter()
    with warnings.catch_warnings(), target:
        warnings.simplefilter("ignore")
        fused = relax.get_pipeline("zero")(mod)
        database = ms.relax_integration.tune_relax(
            fused, params={}, target=target, work_dir=str(work_dir),
            max_trials_global=trials, num_trials_per_iter=16, cost_model="random")
        wall = time.perf_counter() - start
        executable = ms.relax_integration.compile_relax(database, mod, target, params=None)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    names = [spec.name for spec in import_model(wl.model).inputs]

    def run(feeds):
        out = vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in names])
        return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]

    return run, wall


def runner_of(model):
    names = [spec.name for spec in model.inputs]

    def run(feeds):
        out = model(*[feeds[n] for n in names])
        return list(out) if isinstance(out, tuple) else [out]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only workloads whose name contains this")
    parser.add_argument("--trials", type=int, help="hybrid trials (default: per workload)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--factor", type=int, default=4,
                        help="stock MetaSchedule gets this many times the trials (default 4)")
    parser.add_argument("--no-stock", action="store_true", help="skip stock MetaSchedule")
    args = parser.parse_args()

    target = tvm_hybrid.make_target("host")
    print(host_banner())
    by_name = {wl.name: wl for wl in workloads.paper_workloads()}
    rows = []
    for name, default_trials in DEFAULT:
        if args.only and args.only not in name:
            continue
        wl, trials = by_name[name], args.trials or default_trials
        print(f"\n== {name}: hybrid {trials} trials, stock MetaSchedule "
              f"{args.factor * trials} trials", flush=True)
        runners = {"heuristic": runner_of(tvm_hybrid.compile(wl.model, target))}
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            records = tvm_hybrid.tune(wl.model, target, trials=trials, work_dir=tmp,
                                      progress=False)
            hybrid_wall = time.perf_counter() - start
            start = time.perf_counter()
            tuned = tvm_hybrid.compile(wl.model, target, tuning_records=records)
            reuse_s = time.perf_counter() - start
            runners["tuned"] = runner_of(tuned)
            print(f"hybrid tuning {hybrid_wall:.1f} s; compile with records {reuse_s:.2f} s",
                  flush=True)
            stock_wall = None
            if not args.no_stock:
                runners["stock MS"], stock_wall = stock_metaschedule(
                    wl, target, args.factor * trials, Path(tmp) / "ms")
                print(f"stock MetaSchedule tuning {stock_wall:.1f} s", flush=True)
        reference = runners["heuristic"](wl.inputs)
        for label, run in runners.items():
            for got, want in zip(run(wl.inputs), reference):
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))
                assert err < 1e-4, f"{name}: {label} differs from the heuristic (rel {err:.1e})"
        samples = time_interleaved(runners, wl.inputs, rounds=args.rounds)
        ms_ = {k: float(np.median(v)) for k, v in samples.items()}
        rows.append((name, trials, hybrid_wall, reuse_s, ms_, args.factor * trials, stock_wall))
        print(", ".join(f"{k} {v:.3f} ms" for k, v in ms_.items()), flush=True)

    print("\n| workload | hybrid trials | hybrid tune s | heuristic ms | tuned ms | "
          "tuned vs heuristic | stock MS trials | stock MS tune s | stock MS ms | "
          "tuned vs stock MS | compile with records s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, trials, wall, reuse_s, times, stock_trials, stock_wall in rows:
        stock = times.get("stock MS")
        versus = f"{stock / times['tuned']:.2f}x" if stock else "-"
        print(f"| {name} | {trials} | {wall:.1f} | {times['heuristic']:.3f} | "
              f"{times['tuned']:.3f} | {times['heuristic'] / times['tuned']:.2f}x | "
              f"{stock_trials if stock else '-'} | "
              f"{f'{stock_wall:.1f}' if stock else '-'} | {f'{stock:.3f}' if stock else '-'} | "
              f"{versus} | {reuse_s:.2f} |")


if __name__ == "__main__":
    main()
