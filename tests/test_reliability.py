"""Reliability: hostile and careless inputs give clear errors, never a signal or a wrong answer.

Each crash class runs in a subprocess (a segfault there fails the test instead of killing the
run) and must end in a clean ``TVMHybridError``. The corpus is ``tvm_hybrid/testing/corpus.py``;
the seeded fuzzer ``tvm_hybrid/testing/fuzz.py`` runs a short slice here
(``python -m tvm_hybrid.testing.fuzz --graphs 2000`` is the long mode).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

import tvm_hybrid
from tvm_hybrid.artifact import file_digest
from tvm_hybrid.bench import workloads
from tvm_hybrid.testing import corpus

PYTHON = [sys.executable, "-c"]


def _run(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; fail the test if it dies from a signal."""
    out = subprocess.run([*PYTHON, textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, **(env or {})))
    assert out.returncode >= 0, f"killed by signal {-out.returncode}:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "tvm_hybrid", *args], capture_output=True,
                         text=True, timeout=600, cwd=cwd)
    assert out.returncode >= 0, f"killed by signal {-out.returncode}:\n{out.stderr[-3000:]}"
    return out


def _error_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.strip()]


# --- gathers with bad indices (out-of-bounds reads) ----------------------------------------------


@pytest.mark.parametrize("op, id_type", [("Gather", "INT64"), ("Gather", "INT32"),
                                         ("GatherElements", "INT64")])
def test_out_of_range_indices_raise_input_error(op, id_type):
    """Ids outside the table read heap memory or segfaulted; now the compiled code refuses."""
    out = _run(f"""
        import numpy as np, tvm_hybrid
        from onnx import TensorProto
        from tvm_hybrid.testing import corpus
        shape = (3,) if "{op}" == "Gather" else (2, 4)
        model = tvm_hybrid.compile(corpus.gather_model(ids_shape=shape, op="{op}",
                                                       id_type=TensorProto.{id_type}))
        dtype = np.{id_type.lower()}
        for name, ids in corpus.bad_index_inputs().items():
            if np.iinfo(dtype).min > ids.min() or np.iinfo(dtype).max < ids.max():
                ids = np.clip(ids, np.iinfo(dtype).min, np.iinfo(dtype).max)
            data = np.zeros(shape, dtype); data.flat[:3] = ids.astype(dtype)
            try:
                model(data)
            except tvm_hybrid.InputError as err:
                print("REFUSED", name, "|", err)
            else:
                print("ACCEPTED", name)
    """)
    lines = out.stdout.splitlines()
    assert len(lines) == len(corpus.bad_index_inputs()) and not any("ACCEPTED" in x for x in lines)
    assert all(f"{op} on input 'ids'" in x and "outside [-10, 10)" in x for x in lines), lines
    assert any("holds values from" in x for x in lines)


def test_valid_indices_follow_onnx_negative_semantics():
    model = tvm_hybrid.compile(corpus.gather_model(vocab=10, ids_shape=(6,)))
    ids = np.array([0, 9, -1, -10, 3, -4], np.int64)
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.testing.assert_array_equal(model(ids), np.take(table, ids, axis=0))
    assert "hybrid_check_indices" in model.kernel_names()  # the check is compiled code


# --- threads --------------------------------------------------------------------------------


def test_one_model_called_from_eight_threads():
    """One CompiledModel shared by 8 threads (it segfaulted in 8 of 8 runs): same results."""
    out = _run("""
        import threading, numpy as np, tvm_hybrid
        from tvm_hybrid.bench import workloads
        wl = workloads.bert_layer(1, 16, hidden=64, heads=4, ffn=128)
        model = tvm_hybrid.compile(wl.model)
        rng = np.random.default_rng(0)
        feeds = [{k: (rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f"
                      else v) for k, v in wl.inputs.items()} for _ in range(8)]
        want = [model(**f) for f in feeds]
        bad = []
        def work(t):
            for i in range(40):
                got = model(**feeds[(t + i) % 8])
                if not np.array_equal(got, want[(t + i) % 8]):
                    bad.append((t, i))
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print("MISMATCHES", len(bad))
    """)
    assert "MISMATCHES 0" in out.stdout


def test_concurrent_compiles_in_threads():
    """Two models compiled at once in threads failed in most rounds ("nested op_tag")."""
    out = _run("""
        import threading, numpy as np, tvm_hybrid
        from tvm_hybrid.bench import workloads
        wls = [workloads.mlp(8, (16, 32, 8)), workloads.attention(1, 16, heads=2),
               workloads.qdq_mlp(4, (32, 16)), workloads.bert_layer(1, 8, hidden=32, heads=2,
                                                                    ffn=64)]
        want = [tvm_hybrid.compile(wl.model)(**wl.inputs) for wl in wls]
        errors, wrong = [], []
        def work(i):
            try:
                got = tvm_hybrid.compile(wls[i].model)(**wls[i].inputs)
                if not np.allclose(got, want[i], rtol=1e-5, atol=1e-6):
                    wrong.append(i)
            except Exception as err:
                errors.append(repr(err))
        for _ in range(3):
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(wls))]
            [t.start() for t in threads]; [t.join() for t in threads]
        print("ERRORS", errors, "WRONG", wrong)
    """)
    assert "ERRORS [] WRONG []" in out.stdout, out.stdout


# --- exported artifacts ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifact")
    wl = workloads.mlp(4, (8, 16))
    path = tvm_hybrid.compile(wl.model).export(root / "model.so")
    np.savez(root / "inputs.npz", x=wl.inputs["x"])
    return path


@pytest.mark.parametrize("damage", list(corpus.damaged_libraries(b"\0" * 2000)))
def test_damaged_libraries_are_refused_before_loading(exported, tmp_path, damage):
    """A .so cut to 10% or 50% died with SIGBUS (API and CLI); now a ModelLoadError."""
    bad = tmp_path / "bad.so"
    bad.write_bytes(corpus.damaged_libraries(exported.read_bytes())[damage])
    shutil.copy(str(exported) + ".json", str(bad) + ".json")
    out = _run(f"""
        import tvm_hybrid
        try:
            tvm_hybrid.load({str(bad)!r})
        except tvm_hybrid.ModelLoadError as err:
            print("REFUSED", err)
    """)
    assert "REFUSED" in out.stdout
    cli = _cli("run", str(bad))
    assert cli.returncode == 2 and len(_error_lines(cli)) == 1, cli.stderr
    assert "tvm-hybrid: error:" in cli.stderr


def test_library_for_another_cpu_is_refused_even_with_a_lying_sidecar(tmp_path):
    """A library built for another CPU whose sidecar claims this one died with SIGILL."""
    from tvm_hybrid.host import host_features

    if "amx-tile" in host_features():
        pytest.skip("needs a host without AMX (the foreign library is built for AMX)")
    wl = workloads.mlp(4, (8, 16))
    spr = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
    path = tvm_hybrid.compile(wl.model, spr).export(tmp_path / "spr.so")
    with pytest.raises(tvm_hybrid.TargetError, match="amx"):
        tvm_hybrid.load(path)
    sidecar = Path(str(path) + ".json")
    meta = json.loads(sidecar.read_text())
    meta["target"] = tvm_hybrid.host.target_to_dict(tvm_hybrid.make_target("host"))
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(tvm_hybrid.ModelLoadError, match="'target' differs"):
        tvm_hybrid.load(path)


def test_avx512_library_on_an_avx2_host_is_refused(tmp_path):
    """On an AVX2-only CPU (emulated), code with AVX-512 is refused, never run."""
    wl = workloads.mlp(4, (8, 16))
    path = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": "skylake-avx512"}).export(
        tmp_path / "skx.so")
    out = _run(f"""
        import tvm_hybrid
        try:
            tvm_hybrid.load({str(path)!r})
        except tvm_hybrid.TargetError as err:
            print("REFUSED", err)
    """, env={"TVM_HYBRID_HOST_CPU": "haswell"})
    assert "REFUSED" in out.stdout and "avx512f" in out.stdout


def test_foreign_elf_with_a_matching_sidecar_is_refused(exported, tmp_path):
    """A shared library tvm_hybrid did not write gave an AttributeError; it is never loaded."""
    foreign = tmp_path / "foreign.so"
    shutil.copy(np._core._multiarray_umath.__file__, foreign)
    meta = json.loads(Path(str(exported) + ".json").read_text())
    meta.update(bytes=foreign.stat().st_size, sha256=file_digest(foreign))
    Path(str(foreign) + ".json").write_text(json.dumps(meta))
    with pytest.raises(tvm_hybrid.ModelLoadError, match="no tvm_hybrid metadata"):
        tvm_hybrid.load(foreign)


@pytest.mark.parametrize("tamper", ["not json", "format", "inputs", "sha256", "missing"])
def test_tampered_sidecars_are_refused(exported, tmp_path, tamper):
    """Tampered sidecars gave raw TVM errors."""
    path = tmp_path / "model.so"
    shutil.copy(exported, path)
    meta = json.loads(Path(str(exported) + ".json").read_text())
    sidecar = Path(str(path) + ".json")
    if tamper == "not json":
        sidecar.write_text("{not json")
    elif tamper == "format":
        sidecar.write_text(json.dumps(dict(meta, format="other/1")))
    elif tamper == "inputs":
        sidecar.write_text(json.dumps(dict(meta, inputs=[{"name": "x", "shape": [9],
                                                          "dtype": "float32"}])))
    elif tamper == "sha256":
        sidecar.write_text(json.dumps(dict(meta, sha256="0" * 64)))
    with pytest.raises(tvm_hybrid.ModelLoadError):
        tvm_hybrid.load(path)


# --- numerics that were silently wrong ---------------------------------------------------------


def test_erf_propagates_nan_under_fast_math():
    x = np.array([np.nan, np.inf, -np.inf, 0.5, -100, 100, 3, -3], np.float32)
    got = tvm_hybrid.compile(corpus.erf_model())(x)
    assert np.isnan(got[0]) and not np.isnan(got[1:]).any()
    from math import erf
    np.testing.assert_allclose(got[1:], [erf(v) for v in x[1:]], atol=1e-6)


def test_scalar_inputs():
    """0-d inputs failed with a deep TVM error (np.ascontiguousarray made them 1-d)."""
    model = tvm_hybrid.compile(corpus.scalar_model())
    got = model(np.array(3.0, np.float32))
    assert got.shape == () and float(got) == 7.0


# --- bad models and options ---------------------------------------------------------------------


@pytest.mark.parametrize("proto, error, match", [
    (corpus.relu_model(opset=99), tvm_hybrid.ModelLoadError, "opset 99"),
    (corpus.relu_model(ir=99), tvm_hybrid.ModelLoadError, "IR version 99"),
    (corpus.relu_model(domain="my.company"), tvm_hybrid.UnsupportedModelError,
     "Relu of domain 'my.company'"),
    (corpus.bad_reshape_model(), tvm_hybrid.UnsupportedModelError, "at a Reshape node"),
], ids=["opset 99", "IR version 99", "custom-domain Relu", "impossible Reshape"])
def test_models_onnx_cannot_describe_are_refused(proto, error, match, tmp_path):
    """Opset 99 and IR version 99 compiled silently; a custom-domain Relu ran as ONNX Relu;
    importer failures printed stray TVM lines around the CLI's one-line error."""
    with pytest.raises(error, match=match):
        tvm_hybrid.compile(proto)
    path = tmp_path / "bad.onnx"
    onnx.save(proto, path)
    cli = _cli("compile", str(path), "-o", str(tmp_path / "bad.so"))
    assert cli.returncode == 2 and len(_error_lines(cli)) == 1, cli.stderr
    assert match in cli.stderr


def test_running_out_of_memory_is_an_input_error():
    """A batch too big for memory raised tvm.error.InternalError: std::bad_alloc."""
    out = _run("""
        import numpy as np, tvm_hybrid
        from tvm_hybrid.testing import corpus
        model = tvm_hybrid.compile(corpus.huge_model())
        try:
            model(np.ones((1 << 22, 1), np.float32), np.ones((1, 1 << 22), np.float32))
        except tvm_hybrid.InputError as err:
            print("REFUSED", err)
    """)
    assert "REFUSED out of memory" in out.stdout
    assert "64.0 TiB" in out.stdout  # refused before allocating (memory_guard.py)


def test_tensors_bigger_than_the_machine_are_refused_before_allocating(monkeypatch):
    """On a host that overcommits (vm.overcommit_memory = 1) the 64 TiB allocation above was
    granted and the process was killed (SIGKILL) when its pages were touched. The planned sizes
    are checked against the machine's memory first, whatever the host's policy: here a machine
    of 4 KiB against a 64 x 32 outer product's 8 KiB."""
    from tvm_hybrid import memory_guard

    model = tvm_hybrid.compile(corpus.huge_model(64, 32))
    assert memory_guard.planned_bytes(model.lowered["main"]) == 64 * 32 * 4
    a, b = np.ones((64, 1), np.float32), np.ones((1, 32), np.float32)
    monkeypatch.setattr(memory_guard, "machine_bytes", lambda: 4096)
    with pytest.raises(tvm_hybrid.InputError, match=r"inputs a \(64, 1\), b \(1, 32\) the "
                       r"model's tensors need 8.0 KiB, more than this machine's 4.0 KiB"):
        model(a, b)
    monkeypatch.setattr(memory_guard, "machine_bytes", lambda: 8192)
    np.testing.assert_array_equal(model(a, b), a @ b)


def test_bad_options_are_option_errors():
    """A bad precision or pipeline raised a plain ValueError."""
    wl = workloads.mlp(2, (4, 4))
    for kwargs in ({"precision": "fp16"}, {"pipeline": "fast"}):
        with pytest.raises(tvm_hybrid.OptionError):
            tvm_hybrid.compile(wl.model, **kwargs)
    with pytest.raises(tvm_hybrid.OptionError):
        tvm_hybrid.set_num_threads(0)
    assert issubclass(tvm_hybrid.OptionError, tvm_hybrid.TVMHybridError)


def test_cli_run_options(exported, tmp_path):
    """`run --repeat 0` crashed in numpy; `run -o DIR` wrote DIR.npz and said it wrote DIR."""
    cli = _cli("run", str(exported), "--print-time", "--repeat", "0")
    assert cli.returncode == 2 and "at least 1" in cli.stderr
    out_dir = tmp_path / "outs"
    out_dir.mkdir()
    cli = _cli("run", str(exported), "-o", str(out_dir))
    assert cli.returncode == 0, cli.stderr
    assert (out_dir / "outputs.npz").is_file() and f"wrote {out_dir / 'outputs.npz'}" in cli.stdout
    cli = _cli("run", str(exported), "-o", str(tmp_path / "plain"))
    assert (tmp_path / "plain.npz").is_file() and f"wrote {tmp_path / 'plain.npz'}" in cli.stdout


@pytest.mark.parametrize("content", [b"", b"not a model", b"\x08\x07" * 50])
def test_cli_bad_model_files_are_one_line_errors(tmp_path, content):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    cli = _cli("compile", str(path), "-o", str(tmp_path / "m.so"))
    assert cli.returncode == 2 and len(_error_lines(cli)) == 1, cli.stderr


# --- fuzzing ----------------------------------------------------------------------------------


def test_fuzz_slice():
    """150 random graphs (fp32 DAGs, GEMM epilogues, extreme QDQ, integer matmuls, gathers,
    softmaxes and reductions over any axes) against their references; long mode:
    python -m tvm_hybrid.testing.fuzz --graphs 2000."""
    out = subprocess.run([sys.executable, "-m", "tvm_hybrid.testing.fuzz", "--graphs", "150",
                          "--seed", "12345"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert "0 wrong, 0 failed" in out.stdout
