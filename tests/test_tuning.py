"""Template-restricted tuning: the knob space, the search, records, reuse, CLI and RPC."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time

import numpy as np
import onnx
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.cli import main as cli
from tvm_hybrid.host import host_target, make_target
from tvm_hybrid.tuning import RPCError, RPCSettings, extract_tasks, load_records, tune
from tvm_hybrid.tuning.measure import Measurer
from tvm_hybrid.tuning.search import neighbourhood_search
from tvm_hybrid.tuning.space import config_key, knobs_from_dict
from tvm_hybrid.tuning.tune import split_budget

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def target():
    tgt = make_target("host")
    if not tvm_hybrid.microkernels.microkernels_for(tgt, "float32"):
        pytest.skip("needs an AVX2 or AVX-512 host (the template's microkernels)")
    return tgt


@pytest.fixture(scope="module")
def gemm_task(target):
    (task,) = extract_tasks(workloads.gemm(128, 256, 96).model, target)
    return task


def _loop_extents(func) -> list[int]:
    return [int(m) for m in re.findall(r"for \w+ in (?:T\.parallel\(|range\(|T\.serial\()"
                                       r"T\.int64\((\d+)\)", func.script())]


# --- the knob space ---------------------------------------------------------------------------


def test_space_holds_the_heuristic_and_its_neighbours(gemm_task, target):
    space = gemm_task.space
    heuristic = space.heuristic()
    assert space.template.name == "gemm"
    (gemm,) = space.workloads
    # N = 256 padded to whole panels of the prepacked weight
    padded_n = -(-256 // gemm.packed_nr) * gemm.packed_nr
    assert (gemm.shape.m, gemm.shape.n, gemm.shape.k) == (128, padded_n, 96)
    # The heuristic's knobs are those an untuned compile uses.
    from tvm_hybrid.schedules.gemm.template import knobs_for

    assert heuristic == (knobs_for(gemm, target),)
    moves = space.neighbours(heuristic)
    keys = [config_key(c) for c in moves]
    assert config_key(heuristic) not in keys
    assert len(keys) == len(set(keys)) >= 3
    assert any(c[0].order != heuristic[0].order for c in moves)  # the loop order is a knob
    for config in moves:
        knobs = config[0]
        assert (128 // knobs.kernel.mr) % knobs.m_block == 0
        assert (gemm.shape.n // knobs.kernel.nr) % knobs.n_block == 0
    assert space.size() >= len(moves)
    # Other knobs give another loop nest (block extents) from the same template.
    other = next(c for c in moves if c[0].m_block != heuristic[0].m_block)
    assert _loop_extents(space.schedule(other).mod["main"]) != \
        _loop_extents(space.schedule(heuristic).mod["main"])


def _conv_model():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.2).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_convolution_template_is_tunable_through_the_same_space(target):
    """The tuner knows no template: the direct convolution's knobs (microkernel, pixel block)
    come through the Template protocol like the GEMM's."""
    tasks = extract_tasks(_conv_model(), target)
    spaces = [t.space for t in tasks if t.space.template.name == "direct_conv"]
    assert len(spaces) == 1, [t.space.template.name for t in tasks]
    space = spaces[0]
    heuristic = space.heuristic()
    moves = space.neighbours(heuristic)
    assert moves and space.size() >= len(moves)
    assert all(config_key(c) != config_key(heuristic) for c in moves)
    for config in [heuristic, *moves]:
        assert tuple(knobs_from_dict(json.loads(json.dumps(k.as_dict()))) for k in config) \
            == config
    other = next(c for c in moves if c[0].kernel == heuristic[0].kernel)  # another pixel block
    assert _loop_extents(space.schedule(other).mod["main"]) != \
        _loop_extents(space.schedule(heuristic).mod["main"])
    assert space.flops == 2 * 16 * 32 * 32 * 9 * 16


def test_knobs_round_trip_through_json(gemm_task):
    for config in [gemm_task.space.heuristic(), *gemm_task.space.neighbours(
            gemm_task.space.heuristic())]:
        assert tuple(knobs_from_dict(json.loads(json.dumps(k.as_dict()))) for k in config) \
            == config


def test_search_measures_heuristic_first_and_walks_to_the_optimum(gemm_task):
    """With a synthetic cost that is lowest two moves away, the search finds that optimum."""
    space = gemm_task.space
    heuristic = space.heuristic()
    target_config = space.neighbours(space.neighbours(heuristic)[0])[1]
    goal = config_key(target_config)
    order: list[str] = []

    def cost(config) -> float:
        knobs = config[0]
        want = target_config[0]
        return (1.0 + abs(math.log2(knobs.m_block * knobs.kernel.mr)
                          - math.log2(want.m_block * want.kernel.mr))
                + abs(math.log2(knobs.n_block * knobs.kernel.nr)
                      - math.log2(want.n_block * want.kernel.nr))
                + (knobs.order != want.order) + (knobs.kernel != want.kernel))

    def measure(configs):
        order.extend(config_key(c) for c in configs)
        return [cost(c) for c in configs]

    state = neighbourhood_search(space, measure, budget=24, batch=4)
    assert order[0] == config_key(heuristic)
    assert len(order) == len(set(order)) == len(state.trials) == 24  # no repeats, exact budget
    assert state.best().key == goal


def test_budget_split_gives_every_task_the_heuristic(target, monkeypatch):
    monkeypatch.setenv("TVM_HYBRID_GEMM_CHAINS", "off")  # one task per layer
    tasks = extract_tasks(workloads.mlp(32, (64, 256, 256, 16)).model, target)
    assert len(tasks) == 3 and all(t.templated for t in tasks)
    split_budget(tasks, 2)
    assert [t.budget for t in tasks] == [1, 1, 1]  # fewer trials than tasks: heuristic only
    split_budget(tasks, 40)
    assert sum(t.budget for t in tasks) == 40
    big = max(tasks, key=lambda t: t.cost)
    assert big.budget == max(t.budget for t in tasks)


def test_rpc_settings_errors_are_clear():
    with pytest.raises(RPCError, match="HOST:PORT"):
        RPCSettings("localhost", "k").port  # noqa: B018
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.perf_counter()
    with pytest.raises(RPCError, match="cannot reach the RPC tracker"):
        RPCSettings(f"127.0.0.1:{port}", "k").check()
    assert time.perf_counter() - start < 10  # no minute of retries


# --- tuning, records and reuse ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, target):
    wl = workloads.gemm(128, 256, 96)
    work = tmp_path_factory.mktemp("tune")
    path = tune(wl.model, target, trials=6, work_dir=work, progress=False)
    return wl, path


def test_tune_writes_records_with_the_heuristic_measured(tuned, gemm_task):
    wl, path = tuned
    assert path.name == "records.json" and path.is_file()
    records = load_records(path)
    (task,) = records.tasks.values()
    assert len(task.state.trials) == 6
    assert task.state.heuristic_key == config_key(gemm_task.space.heuristic())
    assert task.state.heuristic.ok
    assert task.best is not None
    assert task.summary()["kept"] in task.state.trials
    assert records.target["identity"]["mcpu"] == str(make_target("host").attrs["mcpu"])


def test_compile_with_records_applies_them_without_measuring(tuned, target, monkeypatch,
                                                             tmp_path):
    wl, path = tuned
    records = load_records(path)
    (task,) = records.tasks.values()
    space = tvm_hybrid.tuning.TemplateSpace(task.workload.mod["main"], target)
    heuristic = space.heuristic()
    # Store a configuration that is not the heuristic's, so that applying it is visible.
    other = next(c for c in space.neighbours(heuristic) if c[0].m_block != heuristic[0].m_block)
    sch = space.schedule(other)
    task.best = tvm.s_tir.meta_schedule.database.TuningRecord(
        sch.trace, task.workload, [1e-3], target, task.best.args_info)
    edited = records.save(tmp_path / "edited.json")

    def no_measuring(*_args, **_kwargs):
        raise AssertionError("compiling with records must not measure")

    monkeypatch.setattr(Measurer, "measure", no_measuring)
    model = tvm_hybrid.compile(wl.model, target, tuning_records=edited)
    (func,) = [f for g, f in model.lowered.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and "packed_matmul" in g.name_hint]
    assert func.attrs["tirx.is_scheduled"]
    assert _loop_extents(func) == _loop_extents(sch.mod["main"])
    assert _loop_extents(func) != _loop_extents(space.schedule(heuristic).mod["main"])
    reference = tvm_hybrid.compile(wl.model, target, pipeline="stock")
    np.testing.assert_allclose(model(**wl.inputs), reference(**wl.inputs), rtol=1e-4, atol=1e-4)
    # The records as tuned compile too, to the same numbers.
    tuned_model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    np.testing.assert_allclose(tuned_model(**wl.inputs), reference(**wl.inputs), rtol=1e-4,
                               atol=1e-4)


def test_tuning_resumes_from_its_records(tuned, target, monkeypatch):
    wl, path = tuned
    calls: list[int] = []
    real = Measurer.measure

    def counting(self, mods, args_info, rounds=1):
        calls.extend([len(mods)] * rounds)  # one entry per timing round
        return real(self, mods, args_info, rounds)

    monkeypatch.setattr(Measurer, "measure", counting)
    before = load_records(path)
    tune(wl.model, target, trials=6, output=path, progress=False)
    records = load_records(path)
    (task,) = records.tasks.values()
    assert task.state.trials.keys() == next(iter(before.tasks.values())).state.trials.keys()
    # Nothing searched again; at most the confirmation re-times (heuristic, winner) 3 times.
    assert calls in ([], [2, 2, 2])
    tune(wl.model, target, trials=8, output=path, progress=False, batch=2)
    (task,) = load_records(path).tasks.values()
    assert len(task.state.trials) == 8


def test_records_for_another_target_are_refused(tuned):
    wl, path = tuned
    other = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
    if str(make_target("host").attrs["mcpu"]) == "haswell":
        other["mcpu"] = "skylake-avx512"
    with pytest.raises(tvm_hybrid.TuningRecordsError, match="tuned for another target.*mcpu"):
        tvm_hybrid.compile(wl.model, other, tuning_records=path)


@pytest.mark.parametrize("content, match", [
    ("not json", "not a JSON tuning-records file"),
    ('{"a": 1}', "not a tvm_hybrid tuning-records file"),
    ('{"format": "tvm_hybrid.tuning_records", "version": 99}', "version 99"),
])
def test_bad_records_files(tmp_path, content, match):
    bad = tmp_path / "records.json"
    bad.write_text(content)
    with pytest.raises(tvm_hybrid.TuningRecordsError, match=match):
        tvm_hybrid.compile(workloads.gemm(16, 32, 8).model, tuning_records=bad)
    with pytest.raises(tvm_hybrid.TuningRecordsError, match="not found"):
        tvm_hybrid.compile(workloads.gemm(16, 32, 8).model,
                           tuning_records=tmp_path / "missing.json")


def test_cli_tune_then_compile(tmp_path, capsys, target, monkeypatch):
    monkeypatch.setenv("TVM_HYBRID_GEMM_CHAINS", "off")  # one task per layer
    model = tmp_path / "mlp.onnx"
    onnx.save(workloads.mlp(8, (32, 64, 16)).model, model)
    records = tmp_path / "records.json"
    assert cli(["tune", str(model), "--trials", "3", "-o", str(records), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tuned 2 kernel(s)" in out and "heuristic" in out
    assert len(load_records(records).tasks) == 2
    so = tmp_path / "mlp.so"
    assert cli(["compile", str(model), "-o", str(so), "--tuning-records", str(records)]) == 0
    assert so.is_file()
    assert cli(["tune", str(model), "--trials", "3", "-o", str(records), "--rpc-key", "x"]) == 2
    assert "--rpc-tracker and --rpc-key go together" in capsys.readouterr().err


@pytest.mark.slow  # ~2 minutes on 2 cores
def test_evolutionary_search_stays_in_the_template(tmp_path, target):
    """MetaSchedule's own search over the template's space; the result is never slower."""
    wl = workloads.gemm(64, 64, 32)
    path = tune(wl.model, target, trials=4, work_dir=tmp_path, search="evolutionary",
                progress=False)
    (task,) = load_records(path).tasks.values()
    assert len(task.state.trials) >= 2
    tensorized = [i for i in task.best.trace.insts if i.kind.name == "Tensorize"]
    assert tensorized and str(tensorized[0].attrs[0]).startswith("hybrid_gemm_")
    model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    reference = tvm_hybrid.compile(wl.model, target, pipeline="stock")
    np.testing.assert_allclose(model(**wl.inputs), reference(**wl.inputs), rtol=1e-4, atol=1e-4)


def test_rpc_tuning_on_loopback(tmp_path, target):
    """A TVM RPC tracker and server on 127.0.0.1; candidates are timed on the server."""
    pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado")
    from tvm.rpc.server import Server
    from tvm.rpc.tracker import Tracker

    tracker = Tracker(host="127.0.0.1", port=9190, port_end=9390, silent=True)
    server = Server(host="127.0.0.1", port=9400, port_end=9600, key="loopback",
                    tracker_addr=("127.0.0.1", tracker.port), silent=True)
    try:
        settings = RPCSettings(f"127.0.0.1:{tracker.port}", "loopback")
        for _ in range(50):  # the server registers with the tracker asynchronously
            try:
                settings.check()
                break
            except RPCError:
                time.sleep(0.2)
        wl = workloads.gemm(64, 64, 32)
        path = tune(wl.model, target, trials=3, work_dir=tmp_path, rpc=settings,
                    progress=False)
        (task,) = load_records(path).tasks.values()
        assert len(task.state.trials) == 3
        assert all(t.ok for t in task.state.trials.values())  # every candidate ran remotely
        with pytest.raises(RPCError, match="no server with key 'nope'"):
            RPCSettings(settings.tracker, "nope").check()
    finally:
        server.terminate()
        tracker.terminate()


@pytest.mark.slow  # ~2 minutes on 2 cores
def test_other_kernels_can_be_tuned_with_stock_metaschedule_rules(tmp_path, target):
    """others="metaschedule": layer-norm kernels are searched too; the fallback schedule is
    measured first and kept unless beaten. (A BERT layer: attention alone is one generated
    kernel, which tuning leaves alone.)"""
    wl = workloads.bert_layer(1, 16, hidden=64, heads=2, ffn=128)
    path = tune(wl.model, target, trials=24, work_dir=tmp_path, others="metaschedule",
                progress=False)
    records = load_records(path)
    untemplated = [t for t in records.tasks.values() if t.search == "metaschedule"]
    assert untemplated, [t.name for t in records.tasks.values()]
    assert all(t.state.heuristic_key == "baseline" for t in untemplated)
    assert all(t.best is not None for t in untemplated)
    # MetaSchedule measured candidates beyond the fallback schedule for some kernel.
    assert max(len(t.state.trials) for t in untemplated) > 1
    model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    reference = tvm_hybrid.compile(wl.model, target, pipeline="stock")
    np.testing.assert_allclose(model(**wl.inputs), reference(**wl.inputs), rtol=1e-4,
                               atol=1e-5)


def test_attention_knobs_are_tuned_and_applied(tmp_path, target, caplog):
    """The fused attention's knobs are searched on regenerated kernels (the heuristic's
    first), the records keep them by workload, and compiling with the records uses them."""
    from tvm_hybrid.schedules.attention import AttentionShape, knobs_from_dict, variants

    wl = workloads.attention(1, 40, heads=2, head_dim=32)
    path = tune(wl.model, target, trials=6, work_dir=tmp_path, progress=False)
    records = load_records(path)
    (record,) = records.attention.values()
    shape = AttentionShape.from_key(record.key)
    assert (shape.q_len, shape.kv_len, shape.head_dim) == (40, 40, 32)
    candidates = variants(target, shape)
    assert record.heuristic == candidates[0].key and record.heuristic in record.measured
    assert 4 <= len(record.measured) <= len(candidates)
    kept = knobs_from_dict(target, record.kept)
    assert kept.key in record.measured
    model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    (info,) = [k for k in model.kernels.values() if "fused attention" in k.detail]
    assert info.detail == kept.describe()
    reference = tvm_hybrid.compile(wl.model, target, pipeline="stock")
    np.testing.assert_allclose(model(**wl.inputs), reference(**wl.inputs), rtol=1e-4,
                               atol=1e-5)
    # Knobs that cannot apply (another vector family) fall back to the heuristic, loudly.
    data = json.loads(path.read_text())
    data["attention"][0]["kept"]["isa"] = "not-an-isa"
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    assert "do not apply" in caplog.text
    (info,) = [k for k in model.kernels.values() if "fused attention" in k.detail]
    assert info.detail == candidates[0].describe()
    # A damaged record (a field missing) likewise: a warning, not a crash.
    del data["attention"][0]["kept"]["qk"]
    data["attention"][0]["kept"]["isa"] = kept.qk.isa
    path.write_text(json.dumps(data))
    caplog.clear()
    with caplog.at_level("WARNING"):
        model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    assert "do not apply" in caplog.text


def test_int8_attention_knobs_are_tuned_and_applied(tmp_path, target):
    """A QDQ attention's knobs (query block, ``qk`` and ``pv`` tiles of the host's int8
    family) are searched like the fp32 ones; compiling with the records uses the kept knobs,
    which still give the integer reference's result."""
    from tvm_hybrid.schedules.attention import AttentionShape, knobs_from_dict, variants

    wl = workloads.qdq_attention(1, 40, heads=2, causal=True)
    path = tune(wl.model, target, trials=8, work_dir=tmp_path, progress=False)
    records = load_records(path)
    (record,) = records.attention.values()
    shape = AttentionShape.from_key(record.key)
    assert shape.quant is not None and shape.cond_shape is not None
    candidates = variants(target, shape)
    # Query blocks of one, two and four vectors, each with several tiles.
    assert len({k.q_block for k in candidates}) == 3 and len(candidates) >= 6
    assert record.heuristic == candidates[0].key and record.heuristic in record.measured
    assert 4 <= len(record.measured) <= len(candidates)
    kept = knobs_from_dict(target, record.kept, shape)
    assert kept is not None and kept.key in record.measured
    # The fp32 family's reading of int8 knobs does not apply (another family).
    assert knobs_from_dict(target, record.kept) is None
    model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
    (info,) = [k for k in model.kernels.values() if "fused attention" in k.detail]
    assert info.detail == kept.describe()
    reference, step = workloads.qdq_attention_reference(wl)
    got = np.asarray(model(**wl.inputs))
    assert np.abs(got - reference).max() <= 3 * step
    # Other candidates, kept by the records, compute the same attention (the tails of each
    # query block and tile).
    data = json.loads(path.read_text())
    for knobs in [k for k in candidates if k.key != kept.key][:3]:
        data["attention"][0]["kept"] = knobs.as_dict()
        path.write_text(json.dumps(data))
        model = tvm_hybrid.compile(wl.model, target, tuning_records=path)
        (info,) = [k for k in model.kernels.values() if "fused attention" in k.detail]
        assert info.detail == knobs.describe()
        assert np.abs(np.asarray(model(**wl.inputs)) - reference).max() <= 3 * step


@pytest.mark.requires("amx-tile", "amx-bf16", "avx512bf16")
def test_amx_bf16_attention_knobs_are_tuned_and_applied(tmp_path):
    """With ``precision="bf16"`` on an AMX host the attention's query blocks (32, 64, 128) are
    measured on the AMX kernel (with the preparation's padded words as its operands), and
    compiling with the records uses the kept block, within bf16's error of fp32."""
    from tvm_hybrid.schedules.attention import AttentionShape, knobs_from_dict, variants
    from tvm_hybrid.schedules.attention.heuristics import amx_query_block
    from tvm_hybrid.schedules.gemm.heuristics import target_threads

    wl = workloads.attention(1, 100, heads=2, head_dim=64)
    target = host_target()
    path = tune(wl.model, target, trials=6, work_dir=tmp_path, progress=False,
                precision="bf16")
    (record,) = load_records(path).attention.values()
    shape = AttentionShape.from_key(record.key)
    assert shape.bf16
    candidates = variants(target, shape)
    assert sorted(k.q_block for k in candidates) == [32, 64, 128]
    assert candidates[0].qk.per_block
    assert candidates[0].q_block == amx_query_block(shape, target_threads(target))
    assert set(record.measured) == {k.key for k in candidates}
    kept = knobs_from_dict(target, record.kept, shape)
    assert kept is not None and kept.qk.per_block and kept.key in record.measured
    model = tvm_hybrid.compile(wl.model, target, tuning_records=path, precision="bf16")
    (info,) = [k for k in model.kernels.values() if "fused attention" in k.detail]
    assert info.detail == kept.describe()
    want = tvm_hybrid.compile(wl.model, target)(**wl.inputs)
    assert np.abs(model(**wl.inputs) - want).max() <= 2e-2 * np.abs(want).max()


@pytest.mark.requires("amx-tile", "amx-int8")
def test_tuning_amx_kernels_here_asks_for_the_tile_permission(tmp_path):
    """The tuner runs candidates in its own process: without Linux's XTILEDATA permission the
    first AMX candidate died of an illegal instruction (the whole ``tvm-hybrid tune``). In a
    fresh process (the permission is per process), the int8 GEMM tunes on AMX tiles."""
    import subprocess
    import sys

    onnx.save(workloads.matmul_integer(128, 128, 256).model, str(tmp_path / "m.onnx"))
    out = subprocess.run([sys.executable, "-m", "tvm_hybrid", "tune", str(tmp_path / "m.onnx"),
                          "-o", str(tmp_path / "r.json"), "--trials", "3", "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "amx" in (tmp_path / "r.json").read_text()
    # The records replay in another fresh process: the block's zeroing intrinsic, which its
    # trace names too, is registered from the records (it was not, and they were unreadable).
    code = ("import numpy as np, tvm_hybrid\n"
            "from tvm_hybrid.bench import workloads\n"
            "wl = workloads.matmul_integer(128, 128, 256)\n"
            f"m = tvm_hybrid.compile({str(tmp_path / 'm.onnx')!r}, "
            f"tuning_records={str(tmp_path / 'r.json')!r})\n"
            "out = m(*[wl.inputs[s.name] for s in m.inputs])\n"
            "assert np.array_equal(np.asarray(out), workloads.matmul_integer_reference(wl))\n"
            "print(sorted(k.schedule for k in m.kernels.values()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "['template']" in out.stdout


def test_records_register_every_intrinsic_their_traces_name():
    """A trace names the microkernels' intrinsics and the per-block kernels' zeroing one;
    reading records registers both (names of other forms are left alone)."""
    import json

    import tvm

    from tvm_hybrid.microkernels.families.amx import AMX_INT8
    from tvm_hybrid.tuning.records import register_intrinsics_named

    zero, block = f"{AMX_INT8.name}_b96x160_zero", f"{AMX_INT8.name}_b96x160_k192"
    text = json.dumps([["Tensorize", [zero]], ["Tensorize", [block]], "hybrid_gemm_nonsense"])
    assert register_intrinsics_named(text) == [zero, block]
    tvm.s_tir.TensorIntrin.get(zero)
    tvm.s_tir.TensorIntrin.get(block)


def test_tuning_here_for_a_cpu_this_one_is_not_is_refused():
    """Measuring here code for a CPU with features this one lacks (AMX code on a CPU without
    it aborts the process) is refused with the features named; an RPC runner is the way."""
    import subprocess
    import sys

    code = ("from tvm_hybrid.host import make_target\n"
            "from tvm_hybrid.tuning.measure import Measurer\n"
            "Measurer(make_target({'kind': 'llvm', 'mcpu': 'sapphirerapids'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TVM_HYBRID_HOST_CPU": "haswell"})
    assert out.returncode != 0
    assert "TargetError" in out.stderr and "amx-tile" in out.stderr and "lacks" in out.stderr
