"""``tvm-hybrid``: the command line (tvmc's verbs and flags; tvmc no longer exists upstream).

The CLI only parses flags and calls library functions. Errors print one line naming the
problem and exit with status 2 (bad input) or 1 (anything else); ``--verbose`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .errors import TVMHybridError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tvm-hybrid`` console script and ``python -m tvm_hybrid``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except TVMHybridError as err:
        if args.verbose:
            raise
        print(f"tvm-hybrid: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tvm-hybrid: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug or a TVM failure we did not anticipate: still one line
        if args.verbose:
            raise
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"tvm-hybrid: error: {type(err).__name__}: {message} (rerun with --verbose for "
              "the traceback)", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvm-hybrid",
        description="Compile, run and benchmark ONNX models with TVM and tvm_hybrid on x86 CPUs.",
    )
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("compile", help="compile an ONNX model to a shared library")
    p.add_argument("model", help="path to the .onnx model")
    p.add_argument("-o", "--output", required=True, help="where to write the .so")
    _add_target_flags(p)
    p.add_argument("--tuning-records", metavar="FILE|DIR",
                   help="records from `tvm-hybrid tune` (or a MetaSchedule work directory) to "
                        "apply; nothing is measured")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: GEMMs with constant weights in bf16 (AVX512-BF16), fp32 in/out")
    p.set_defaults(handler=_cmd_compile)

    p.add_argument("--cache-dir", metavar="DIR",
                   help="keep compiled models here and reuse them (default: "
                        "$TVM_HYBRID_CACHE_DIR, else none)")

    p = sub.add_parser("profile", help="time every kernel of a model: where the time goes and "
                                       "why")
    p.add_argument("model", help="path to the .onnx model")
    p.add_argument("--inputs", help=".npz with one array per model input (by name); random "
                   "inputs (seed 0) if omitted")
    p.add_argument("--html", metavar="FILE", help="also write the report as an HTML bar chart")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--repeat", type=_positive_int, default=10,
                   help="timing repetitions per kernel (default 10)")
    p.add_argument("--tuning-records", metavar="FILE|DIR", help="records to apply")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--cache-dir", metavar="DIR", help="compile cache (as for compile)")
    _add_target_flags(p)
    p.set_defaults(handler=_cmd_profile)

    p = sub.add_parser("tune", help="search the expert templates' knobs; write tuning records")
    p.add_argument("model", help="path to the .onnx model")
    p.add_argument("-o", "--output", required=True, help="records file to write (JSON)")
    p.add_argument("--trials", type=_positive_int, default=64,
                   help="configurations to measure over all kernels (default 64); each kernel "
                        "measures the heuristic's first")
    p.add_argument("--search", choices=("neighbourhood", "evolutionary"),
                   default="neighbourhood",
                   help="neighbourhood moves from the heuristic (default), or MetaSchedule's "
                        "evolutionary search over the same knobs")
    p.add_argument("--cost-model", choices=("random", "xgb"), default="random",
                   help="cost model of --search evolutionary (xgb needs xgboost)")
    p.add_argument("--others", choices=("skip", "metaschedule"), default="skip",
                   help="kernels no template covers: keep the fallback schedule (default) or "
                        "search them with MetaSchedule's stock rules")
    p.add_argument("--rpc-tracker", metavar="HOST:PORT",
                   help="measure on the servers registered with this TVM RPC tracker")
    p.add_argument("--rpc-key", help="device key of those servers (with --rpc-tracker)")
    p.add_argument("--restart", action="store_true",
                   help="start over instead of resuming from the records in --output")
    p.add_argument("--work-dir", default=None,
                   help="directory for search logs (default: next to --output)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="tune the kernels of this precision mode (as for compile)")
    _add_target_flags(p)
    p.set_defaults(handler=_cmd_tune)

    p = sub.add_parser("run", help="run a compiled model on inputs from an .npz file")
    p.add_argument("model", help="a .so written by `tvm-hybrid compile`")
    p.add_argument("--inputs", help=".npz with one array per model input (by name); "
                   "random inputs (seed 0) if omitted")
    p.add_argument("-o", "--outputs", help="write the outputs to this .npz (in a directory: "
                   "DIR/outputs.npz)")
    p.add_argument("--print-time", action="store_true", help="time the model and print it")
    p.add_argument("--print-top", type=_positive_int, metavar="N",
                   help="print the first N output values")
    p.add_argument("--repeat", type=_positive_int, default=30,
                   help="timing repetitions (default 30)")
    p.set_defaults(handler=_cmd_run)

    p = sub.add_parser("bench", help="compare hybrid with stock TVM and other runtimes")
    p.add_argument("model", help="path to the .onnx model")
    p.add_argument("--compare", default="tvm,onnxruntime,openvino",
                   help="comma-separated runtimes besides hybrid (tvm, onnxruntime, openvino)")
    p.add_argument("--rounds", type=_positive_int, default=15, help="interleaved timing rounds")
    _add_target_flags(p)
    p.set_defaults(handler=_cmd_bench)

    p = sub.add_parser("demo", help="compile the embedded MLP and BERT layer, stock vs hybrid")
    p.add_argument("--rounds", type=_positive_int, default=10, help="interleaved timing rounds")
    p.set_defaults(handler=_cmd_demo)

    p = sub.add_parser("info", help="host ISA, chosen kernels and versions")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_cmd_info)
    return parser


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="host",
                   help="'host' (default), 'llvm', or a JSON dict such as "
                        '\'{"kind": "llvm", "mcpu": "skylake-avx512"}\'')
    p.add_argument("--input-shapes", metavar="NAME:D1xD2,...",
                   help="static shapes for dynamic inputs, e.g. 'x:1x3x224x224,mask:1x128'")


def _input_shapes(text: str | None) -> dict[str, tuple] | None:
    if not text:
        return None
    shapes = {}
    for item in text.split(","):
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            raise TVMHybridError(
                f"--input-shapes: cannot parse {item!r} (want NAME:D1xD2)"
            ) from None
    return shapes


def _cmd_compile(args) -> int:
    from .compiler import compile as hybrid_compile
    from .specializing_model import SpecializingModel

    start = time.perf_counter()
    options = dict(tuning_records=args.tuning_records,
                   input_shapes=_input_shapes(args.input_shapes), precision=args.precision,
                   cache_dir=args.cache_dir)
    model = hybrid_compile(args.model, args.target, **options)
    if isinstance(model, SpecializingModel):  # one file for every size: symbolic shapes
        dims = ", ".join(f"{s.name}: {'x'.join(str(d) for d in s.shape)}" for s in model.inputs)
        print(f"note: dynamic input dimensions ({dims}) are compiled symbolically, which runs "
              "much slower than a static compile; pass --input-shapes for speed")
        model = hybrid_compile(args.model, args.target, dynamic="symbolic", **options)
    path = model.export(args.output)
    print(f"compiled {args.model} for {model.target.attrs.get('mcpu')} in "
          f"{time.perf_counter() - start:.1f} s -> {path}")
    return 0


def _cmd_profile(args) -> int:
    from .compiler import compile as hybrid_compile

    model = hybrid_compile(args.model, args.target, tuning_records=args.tuning_records,
                           input_shapes=_input_shapes(args.input_shapes),
                           precision=args.precision, cache_dir=args.cache_dir)
    report = model.profile(**_feeds(model.inputs, args.inputs), repeat=args.repeat)
    print(report)
    if args.html:
        report.to_html(args.html)
        print(f"wrote {args.html}")
    if args.json:
        Path(args.json).write_text(report.to_json())
        print(f"wrote {args.json}")
    return 0


def _cmd_tune(args) -> int:
    from .tuning import RPCSettings, load_records, tune

    rpc = None
    if args.rpc_tracker or args.rpc_key:
        if not (args.rpc_tracker and args.rpc_key):
            raise TVMHybridError("--rpc-tracker and --rpc-key go together")
        rpc = RPCSettings(args.rpc_tracker, args.rpc_key)
    output = Path(args.output)
    start = time.perf_counter()
    path = tune(args.model, args.target, trials=args.trials, output=output,
                work_dir=args.work_dir or output.parent, search=args.search,
                cost_model=args.cost_model, others=args.others, rpc=rpc,
                resume=not args.restart,
                input_shapes=_input_shapes(args.input_shapes), progress=not args.no_progress,
                precision=args.precision)
    records = load_records(path)
    print(f"tuned {len(records.tasks)} kernel(s) of {args.model} in "
          f"{time.perf_counter() - start:.1f} s -> {path}")
    for task in records.tasks.values():
        info = task.summary()
        if info["kept_ms"] is None:
            print(f"  {info['name']}: no configuration ran")
            continue
        kept = "the heuristic's" if info["kept"] == task.state.heuristic_key else info["kept"]
        print(f"  {info['name']}: {info['trials']} trial(s); heuristic "
              f"{info['heuristic_ms']:.3f} ms, best {info['best_ms']:.3f} ms; kept {kept} "
              f"({info['kept_ms']:.3f} ms in the confirmation run)")
    print(f"use it: tvm-hybrid compile {args.model} -o model.so --tuning-records {path}")
    return 0


def _cmd_run(args) -> int:
    from .compiled_model import load

    model = load(args.model)
    arrays = _feeds(model.inputs, args.inputs)
    outputs = model(**arrays)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for n, out in enumerate(outputs):
        line = f"output_{n}: shape {out.shape} dtype {out.dtype}"
        if args.print_top:
            line += f" first values {out.reshape(-1)[: args.print_top].tolist()}"
        print(line)
    if args.outputs:
        target = _outputs_path(args.outputs)
        np.savez(target, **{f"output_{n}": o for n, o in enumerate(outputs)})
        print(f"wrote {target}")
    if args.print_time:
        stats = model.benchmark(**arrays, repeat=args.repeat)
        print(f"latency: median {stats['median_ms']:.3f} ms, p10 {stats['p10_ms']:.3f} ms, "
              f"p90 {stats['p90_ms']:.3f} ms over {stats['repeat']} runs")
    return 0


def _outputs_path(text: str) -> Path:
    """Where ``run -o TEXT`` writes: TEXT itself (``.npz`` added, as numpy does), or
    ``TEXT/outputs.npz`` for a directory."""
    path = Path(text)
    if path.is_dir() or text.endswith(("/", "\\")):
        path.mkdir(parents=True, exist_ok=True)
        return path / "outputs.npz"
    if not path.parent.is_dir():
        raise TVMHybridError(f"-o {text}: directory {path.parent} does not exist")
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def _feeds(specs, inputs: str | None) -> dict[str, np.ndarray]:
    """One array per model input: from the ``--inputs`` .npz, else random (seed 0)."""
    if not inputs:
        print("no --inputs given: using random inputs (seed 0)")
        return _random_inputs(specs, "--inputs")
    feeds = _read_npz(inputs)
    missing = [spec.name for spec in specs if spec.name not in feeds]
    if missing:
        raise TVMHybridError(f"{inputs} lacks input(s) {missing}; it has {sorted(feeds)}")
    return {spec.name: feeds[spec.name] for spec in specs}


def _random_inputs(specs, flag: str) -> dict[str, np.ndarray]:
    """Random inputs (seed 0) for static-shaped ``specs``; ``flag`` is what to pass otherwise."""
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in specs:
        if not all(isinstance(d, int) for d in spec.shape):
            raise TVMHybridError(f"input {spec.name!r} has a dynamic shape; pass {flag}")
        feeds[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
    return feeds


def _read_npz(path: str) -> dict[str, np.ndarray]:
    if not Path(path).is_file():
        raise TVMHybridError(f"inputs file not found: {path}")
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except Exception as err:
        raise TVMHybridError(f"{path} is not a readable .npz file ({err})") from None


def _cmd_bench(args) -> int:
    from .bench.comparison import compare, format_table
    from .frontend import import_model, load_onnx
    from .host import make_target

    target = make_target(args.target)
    proto = load_onnx(args.model)
    inputs = import_model(proto, input_shapes=_input_shapes(args.input_shapes)).inputs
    feeds = _random_inputs(inputs, "--input-shapes")
    peers = ["hybrid"] + [p.strip() for p in args.compare.split(",") if p.strip() != "hybrid"]
    if "tvm" in peers:  # stock TVM is the reference the outputs are checked against
        peers.remove("tvm")
        peers.insert(0, "tvm")
    result = compare(Path(args.model).stem, proto, feeds, peers, rounds=args.rounds, target=target)
    print(format_table([result]))
    return 0 if all(r.ok or r.error == "not installed" for r in result.results) else 1


def _cmd_demo(args) -> int:
    from .bench.comparison import compare, format_table
    from .bench.workloads import demo_workloads
    from .host import describe_host

    host = describe_host()
    print(f"host: {host['cpu']}, {host['physical_cores']} cores, TVM threads {host['threads']}, "
          f"ISA {', '.join(host['isa']) or 'baseline x86-64'}")
    results = []
    for wl in demo_workloads():
        print(f"compiling {wl.name} with stock TVM and with hybrid, checking outputs ...",
              flush=True)
        results.append(compare(wl.name, wl.model, wl.inputs, ["tvm", "hybrid"], flops=wl.flops,
                               rounds=args.rounds))
    print()
    print(format_table(results))
    failed = [f"{c.model}/{r.name}: {r.error}" for c in results for r in c.results if not r.ok]
    if failed:
        print("\nFAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    print("\noutputs agree (rtol 1e-3, atol 1e-3 against stock TVM)")
    return 0


def _cmd_info(args) -> int:
    import onnx
    import tvm
    import tvm_ffi

    from . import __version__
    from .host import describe_host, host_target, target_to_dict
    from .schedules import default_rules

    info = describe_host()
    info["target"] = target_to_dict(host_target())
    info["schedule_rules"] = [type(rule).__name__ for rule in default_rules()]
    info["versions"] = {"tvm_hybrid": __version__, "tvm": tvm.__version__,
                        "tvm_ffi": tvm_ffi.__version__, "onnx": onnx.__version__}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"CPU            {info['cpu']} ({info['model']}; {info['physical_cores']} physical "
          f"cores, TVM threads {info['threads']})")
    if "named" in info:
        print(f"CPU name       {info['named']}")
    if "emulating" in info:
        print(f"emulating      {info['emulating']}")
    print(f"ISA tiers      {', '.join(info['isa']) or 'baseline x86-64'}")
    cache = info["cache"]
    print(f"caches         L1d {cache['l1d'] // 1024} KiB, L2 {cache['l2'] // 1024} KiB, "
          f"L3 {cache['l3'] // 1024 // 1024} MiB")
    print(f"target         {json.dumps(info['target'])}")
    print(f"schedule rules {', '.join(info['schedule_rules'])}")
    print("versions       " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
