"""Pack the AMX numeric checks into a runtime-only bundle for a host with no package index.

The bundle holds models compiled here for the AMX target (exported ``.so`` files), their inputs
and the expected outputs (integer references for int8: bit-exact; bf16-rounded references for
bf16), TVM's runtime (the ``tvm`` Python package without its compiler library, run with
``TVM_USE_RUNTIME_LIB=1``), ``tvm_ffi`` and numpy for this Python version, and ``run_check.py``.
On the AMX host::

    tar xzf amx_bundle.tar.gz && python3.11 amx_bundle/run_check.py

prints the CPU, requests the XTILEDATA permission, runs every model and compares its outputs;
the exit status is 0 only if all match. ``--target host --check-here`` builds the same bundle
for this machine (no AMX here: the VNNI and AVX512-BF16 kernels) and runs it with
``python -S`` (no site-packages), which checks the bundle is self-contained.

    python python/tools/amx_bundle.py -o amx_bundle.tar.gz
    python python/tools/amx_bundle.py --target host --check-here -o /tmp/host_bundle.tar.gz
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from onnx import numpy_helper

import tvm_hybrid
from tvm_hybrid.bench import workloads

SPR = '{"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16}'
SKIP = ("libtvm_compiler.so", "libtvm_runtime_cuda.so",
        "__pycache__", "3rdparty", "include", "src", "*.h", "*.cc", "*.pyi")

RUN_CHECK = r'''"""Run the bundled models; compare with the expected outputs (manifest.json)."""
import ctypes, json, os, platform, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "site"))
os.environ["TVM_USE_RUNTIME_LIB"] = "1"
manifest = json.load(open(os.path.join(HERE, "manifest.json")))
if tuple(sys.version_info[:2]) != tuple(manifest["python"]):
    sys.exit(f"this bundle needs Python {manifest['python']}, not {platform.python_version()}")
flags = open("/proc/cpuinfo").read()
model = next((l.split(":", 1)[1].strip() for l in flags.splitlines() if "model name" in l), "?")
print("cpu:", model, "| amx_tile:", "amx_tile" in flags, "| amx_int8:", "amx_int8" in flags,
      "| amx_bf16:", "amx_bf16" in flags)
libc = ctypes.CDLL(None, use_errno=True)
granted = libc.syscall(158, 0x1023, 18) == 0   # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
print("XTILEDATA permission:", granted)
if manifest["amx"] and not ("amx_tile" in flags and granted):
    sys.exit("this CPU cannot run AMX code (no amx_tile, or permission refused)")
import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine
failures = 0
for case in manifest["cases"]:
    lib = tvm.runtime.load_module(os.path.join(HERE, case["so"]))
    vm = VirtualMachine(lib, tvm.cpu())
    data = np.load(os.path.join(HERE, case["data"]))
    inputs = [data[f"in{i}"] for i in range(case["inputs"])]
    got = vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()
    want = data["expected"]
    if case["exact"]:
        ok = got.dtype == want.dtype and np.array_equal(got, want)
        detail = "bit-exact" if ok else f"{int(np.sum(got != want))} elements differ"
    else:
        err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
        ok = err <= case["tolerance"]
        detail = f"max error {err:.2e} of the output scale (tolerance {case['tolerance']:.0e})"
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {case['name']}: {detail}")
print("all passed" if not failures else f"{failures} failed")
sys.exit(1 if failures else 0)
'''


def build_cases(target, out: Path) -> tuple[list[dict], bool]:
    """Compile the check models for ``target`` into ``out``; return the manifest cases."""
    cases = []

    def add(name, model, inputs, expected, exact, tolerance=0.0):
        so = out / f"{name}.so"
        model.export(so)
        np.savez(out / f"{name}.npz", expected=expected,
                 **{f"in{i}": x for i, x in enumerate(inputs)})
        cases.append({"name": name, "so": so.name, "data": f"{name}.npz",
                      "inputs": len(inputs), "exact": exact, "tolerance": tolerance})
        print(f"  {name}: {model.kernel_names()}")

    for m, n, k in ((64, 64, 128), (256, 512, 1024), (32, 96, 64)):
        wl = workloads.matmul_integer(m, n, k, activations="int8", zero_point=-3)
        add(f"int8_gemm_{m}x{n}x{k}", tvm_hybrid.compile(wl.model, target), [wl.inputs["a"]],
            workloads.matmul_integer_reference(wl), exact=True)
    wl = workloads.qdq_mlp(32, (256, 128, 64))
    add("qdq_mlp", tvm_hybrid.compile(wl.model, target), [wl.inputs["x"]],
        workloads.qdq_reference(wl), exact=True)
    wl = workloads.gemm(128, 128, 256)
    x = wl.inputs["a"]
    w = numpy_helper.to_array(wl.model.graph.initializer[0])
    want = (x.astype(ml_dtypes.bfloat16).astype(np.float64)
            @ w.astype(ml_dtypes.bfloat16).astype(np.float64)).astype(np.float32)
    add("bf16_gemm_128x128x256", tvm_hybrid.compile(wl.model, target, precision="bf16"), [x],
        want, exact=False, tolerance=1e-5)
    amx = tvm_hybrid.host.uses_amx(tvm_hybrid.make_target(target))
    return cases, amx


def copy_runtime(site: Path, with_numpy: bool) -> None:
    """The runtime-only Python packages of this environment, without compiler parts."""
    import tvm
    import tvm_ffi

    ignore = shutil.ignore_patterns(*SKIP)
    packages = [Path(tvm.__file__).parent, Path(tvm_ffi.__file__).parent]
    if with_numpy:
        packages.append(Path(np.__file__).parent)
        libs = Path(np.__file__).parent.parent / "numpy.libs"
        if libs.is_dir():
            packages.append(libs)
    for package in packages:
        shutil.copytree(package, site / package.name, ignore=ignore)
    import typing_extensions  # tvm_ffi imports it: a single module

    shutil.copy(typing_extensions.__file__, site)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="amx_bundle.tar.gz")
    parser.add_argument("--target", default=SPR, help="target JSON (default: Sapphire Rapids)")
    parser.add_argument("--no-numpy", action="store_true",
                        help="leave numpy out (the host has it for this Python version)")
    parser.add_argument("--check-here", action="store_true",
                        help="run the bundle on this machine with python -S afterwards")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "amx_bundle"
        root.mkdir()
        print(f"compiling the check models for {args.target}")
        cases, amx = build_cases(args.target, root)
        copy_runtime(root / "site", with_numpy=not args.no_numpy)
        (root / "run_check.py").write_text(RUN_CHECK)
        (root / "manifest.json").write_text(json.dumps(
            {"python": list(sys.version_info[:2]), "amx": amx, "target": args.target,
             "cases": cases}, indent=1))
        output = Path(args.output).resolve()
        with tarfile.open(output, "w:gz") as tar:
            tar.add(root, arcname="amx_bundle")
        size = output.stat().st_size / 2**20
        print(f"wrote {output} ({size:.1f} MiB)")
        if size >= 64:
            sys.exit(f"the bundle is {size:.1f} MiB: over the 64 MiB carry limit")
        if args.check_here:
            check = Path(tmp) / "check"
            with tarfile.open(output) as tar:
                tar.extractall(check)  # noqa: S202 - our own archive
            result = subprocess.run([sys.executable, "-S", str(check / "amx_bundle" /
                                                               "run_check.py")])
            sys.exit(result.returncode)


if __name__ == "__main__":
    main()
