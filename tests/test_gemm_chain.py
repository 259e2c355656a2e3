"""MLP chain fusion: the pass that merges GEMM layers, the chain template, its cost model and
knob space.

Numerics: the chained kernel against numpy in float64 (rtol 1e-5, atol 1e-5 times the output's
scale) and against the per-layer kernels (the same products and sums: within 1e-6), for AVX2
(``haswell``) and AVX-512 (``znver4``) code where the host runs them.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.errors import OptionError
from tvm_hybrid.frontend.importer import import_model
from tvm_hybrid.host import CacheSizes
from tvm_hybrid.passes.gemm_chain import (
    CHAIN_COMPOSITE,
    CHAINS_VARIABLE,
    INTEL_L3_ROWS_PER_THREAD,
    MAX_CHAIN_ROWS,
    MIN_ROWS_PER_THREAD,
    chain_wins,
    streamed_rows_per_thread,
)
from tvm_hybrid.pipeline import fusion_passes, graph_passes, normalize_passes
from tvm_hybrid.schedules.gemm.heuristics import panel_width
from tvm_hybrid.schedules.gemm.template import TEMPLATE_ANNOTATION
from tvm_hybrid.schedules.gemm_chain import (
    CHAIN_ANNOTATION,
    ChainShape,
    chain_variants,
    thin_tiles,
)
from tvm_hybrid.tuning import extract_tasks
from tvm_hybrid.tuning.space import config_key, knobs_from_dict

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
ZNVER4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}
CASCADELAKE = {"kind": "llvm", "mcpu": "cascadelake", "num-cores": 2}  # VNNI, no AMX
DIMS = (24, 64, 48, 16)


def _graph(model, target, monkeypatch, mode: str) -> tvm.IRModule:
    """``model`` just before ``FuseTIR`` (after ``FuseGemmChains``), chains in ``mode``."""
    monkeypatch.setenv(CHAINS_VARIABLE, mode)
    tgt = tvm_hybrid.make_target(target)
    with tgt:
        fusion = [p for p in fusion_passes(tgt) if p.info.name != "FuseTIR"]
        passes = [*normalize_passes(tgt), *graph_passes(tgt), *fusion]
        return tvm.transform.Sequential(passes)(import_model(model).mod)


def _called(mod: tvm.IRModule) -> list[str]:
    """The Composite names of the fused functions ``main`` calls, in order."""
    names = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
                names.append(str((mod[value.op].attrs or {}).get("Composite", "")))
    return names


def _reference(wl, dims, final=None) -> np.ndarray:
    """The MLP in float64 from the ONNX initializers (MatMul weights then Add biases)."""
    from onnx import numpy_helper

    consts = {i.name: numpy_helper.to_array(i).astype("float64")
              for i in wl.model.graph.initializer}
    x = wl.inputs["x"].astype("float64")
    nodes = list(wl.model.graph.node)
    for node in nodes:
        if node.op_type == "MatMul":
            x = x @ consts[node.input[1]]
        elif node.op_type == "Add":
            x = x + consts[node.input[1]]
        elif node.op_type == "Gemm":
            x = x @ consts[node.input[1]] + consts[node.input[2]]
        elif node.op_type == "Relu":
            x = np.maximum(x, 0)
        elif node.op_type == "Sigmoid":
            x = 1 / (1 + np.exp(-x))
    return x


# --- the pass: before and after ---------------------------------------------------------------


def test_layers_merge_into_one_chain_function(monkeypatch):
    wl = workloads.mlp(8, DIMS, final="Sigmoid")
    layers = _graph(wl.model, HASWELL, monkeypatch, "off")
    gemms = [c for c in _called(layers) if c.startswith("hybrid.matmul")]
    assert len(gemms) == 3 and CHAIN_COMPOSITE not in _called(layers), _called(layers)
    chained = _graph(wl.model, HASWELL, monkeypatch, "auto")
    assert [c for c in _called(chained) if c.startswith("hybrid.")] == [CHAIN_COMPOSITE], \
        _called(chained)
    (chain,) = [f for f in chained.functions.values()
                if (f.attrs or {}).get("Composite") == CHAIN_COMPOSITE]
    text = chain.script()
    assert len(re.findall(r"hybrid_packed_matmul\d*", text)) >= 3
    assert (chain.attrs or {}).get("Primitive")


def test_no_chain_where_an_intermediate_has_another_use(monkeypatch):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal(s).astype("float32") for s in ((16, 32), (32, 32)))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("Relu", ["a"], ["h"]),
         helper.make_node("MatMul", ["h", "W2"], ["y"])], "branch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, None)],  # h is also an output
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert CHAIN_COMPOSITE not in _called(_graph(model, HASWELL, monkeypatch, "all"))


def test_no_chain_with_fewer_rows_than_threads(monkeypatch):
    # One row on two threads: the per-layer kernels split N over the cores; a chain could not.
    wl = workloads.mlp(1, DIMS)
    assert CHAIN_COMPOSITE not in _called(_graph(wl.model, HASWELL, monkeypatch, "all"))


@pytest.mark.parametrize("target,chained", [(CASCADELAKE, False), (ZNVER4, True)],
                         ids=["intel", "amd"])
def test_no_chain_of_weights_the_other_layers_evict(target, chained, monkeypatch):
    """Quantized MLP_2 at batch 8 with a 2 MiB L2: its last two layers' 0.65 MB of int8
    weights fit the L2 share, all its layers' 2.2 MB do not, so between calls the other
    layers evict them. From an Intel L3 the chain's 4 rows a thread lost (0.91-0.93x on an
    Emerald Rapids VM): no chain; from an AMD L3 the chain stays."""
    from tvm_hybrid.passes import gemm_chain as chain_pass

    monkeypatch.setattr(chain_pass, "cache_sizes",
                        lambda: CacheSizes(l1d=48 << 10, l2=2 << 20, l3=256 << 20))
    wl = workloads.qdq_mlp(8, (479, 1024, 1024, 512, 256, 1), final="Sigmoid")
    graph = _graph(wl.model, target, monkeypatch, "auto")
    assert (CHAIN_COMPOSITE in _called(graph)) is chained, _called(graph)


@pytest.mark.parametrize("target,chained", [(HASWELL, False), (ZNVER4, True)],
                         ids=["avx2", "avx512"])
def test_no_chain_where_the_row_blocks_take_thin_tiles(target, chained, monkeypatch):
    # 196 rows on two threads: 98-row blocks, which on AVX2's 24-wide panels only a 2x24
    # tile divides (0.9 against 4x24's 1.71 for the per-layer kernel): apart there; AVX-512's
    # 14x32 is a good tile. 192 rows chain on both.
    tgt = tvm_hybrid.make_target(target)
    panels = [(n, k, panel_width(tgt, "float32", 196, n, k)) for n, k in ((96, 64), (48, 96))]
    layers = tuple((-(-n // p) * p, k, p) for n, k, p in panels)  # N padded, as packed
    shape_196 = ChainShape(196, layers, ("float32", "float32"))
    knobs = chain_variants(shape_196, tgt)[0]
    assert thin_tiles(shape_196, knobs, tgt) is not chained
    for batch, expected in ((196, chained), (192, True)):
        graph = _graph(workloads.mlp(batch, (64, 96, 48)).model, target, monkeypatch, "auto")
        assert (CHAIN_COMPOSITE in _called(graph)) is expected, (batch, _called(graph))


def test_the_mode_variable_is_checked(monkeypatch):
    monkeypatch.setenv(CHAINS_VARIABLE, "sometimes")
    with pytest.raises(OptionError, match=CHAINS_VARIABLE):
        tvm_hybrid.compile(workloads.mlp(8, DIMS).model)


def test_the_cost_model():
    caches = CacheSizes(l1d=32 << 10, l2=1 << 20, l3=32 << 20)
    assert chain_wins(32, 700 << 10, caches, threads=2)
    assert chain_wins(MAX_CHAIN_ROWS, 9 << 20, caches, threads=2)  # weights in half the L3
    assert not chain_wins(1, 1 << 10, caches, threads=2)  # fewer rows than threads
    assert chain_wins(8, 1 << 10, caches, threads=2)
    assert not chain_wins(32, 1 << 10, caches, threads=16)  # 2 rows a thread: thin tiles
    assert not chain_wins(MAX_CHAIN_ROWS * 2, 1 << 10, caches, threads=2)
    assert not chain_wins(32, 17 << 20, caches, threads=2)  # streams from memory per core
    small_l3 = CacheSizes(l1d=32 << 10, l2=512 << 10, l3=0)
    assert chain_wins(32, 300 << 10, small_l3, threads=2)
    assert not chain_wins(32, 700 << 10, small_l3, threads=2)
    # Weights beyond the L2 share stream from the L3: an Intel L3 needs more rows per thread.
    intel = streamed_rows_per_thread(tvm.target.Target({"kind": "llvm",
                                                        "mcpu": "sapphirerapids"}))
    amd = streamed_rows_per_thread(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))
    assert (amd, intel) == (MIN_ROWS_PER_THREAD, INTEL_L3_ROWS_PER_THREAD)
    assert chain_wins(8, 9 << 20, caches, threads=2, streamed_rows=amd)
    assert not chain_wins(8, 9 << 20, caches, threads=2, streamed_rows=intel)
    assert not chain_wins(32, 9 << 20, caches, threads=2, streamed_rows=intel)
    assert chain_wins(64, 9 << 20, caches, threads=2, streamed_rows=intel)
    assert chain_wins(8, 700 << 10, caches, threads=2, streamed_rows=intel)  # in the L2
    # ...unless more layers' weights evict it between calls: 8 rows a thread then, on Intel.
    beside = {"caches": caches, "threads": 2, "model_weight_bytes": 2200 << 10}
    assert not chain_wins(8, 700 << 10, streamed_rows=intel, **beside)
    assert chain_wins(16, 700 << 10, streamed_rows=intel, **beside)
    assert chain_wins(8, 700 << 10, streamed_rows=amd, **beside)
    assert chain_wins(8, 700 << 10, caches, threads=2, streamed_rows=intel,
                      model_weight_bytes=700 << 10)


# --- the template: numerics and structure -----------------------------------------------------


@pytest.mark.parametrize("target", [
    pytest.param(HASWELL, id="avx2", marks=pytest.mark.requires("avx2", "fma")),
    pytest.param(ZNVER4, id="avx512", marks=pytest.mark.requires(ZNVER4)),
])
@pytest.mark.parametrize("batch,dims,final", [
    (8, DIMS, "Sigmoid"),
    (32, (13, 512, 256, 128), None),  # the paper's MLP_1
    (24, (40, 96, 33, 1), "Sigmoid"),  # odd widths: padded panels sliced in the tile
    (16, (64, 64, 64, 64), None),  # identical layers (one fused function, inlined thrice)
])
def test_chain_kernel_matches_numpy_and_the_per_layer_kernels(target, batch, dims, final,
                                                              monkeypatch):
    wl = workloads.mlp(batch, dims, final=final)
    monkeypatch.setenv(CHAINS_VARIABLE, "off")
    layers = tvm_hybrid.compile(wl.model, target)
    # "all": the template alone decides (the cost model may keep a thin last layer apart:
    # batch 8's 4-row blocks on AVX-512, see test_no_chain_where_the_row_blocks_take_thin_tiles).
    monkeypatch.setenv(CHAINS_VARIABLE, "all")
    chained = tvm_hybrid.compile(wl.model, target)
    names = chained.kernel_names()
    chains = [n for n in names if "gemm_chain" in n]
    assert len(chains) == 1, names
    script = chained.lowered[chains[0]].script()
    assert script.count(f'"{CHAIN_ANNOTATION}"') == 1  # one parallel loop for all layers
    assert script.count(f'"{TEMPLATE_ANNOTATION}"') == len(dims) - 1  # each on a microkernel
    assert script.count("T.parallel(") == 1
    got = np.asarray(chained(**wl.inputs), "float64")
    want = _reference(wl, dims, final)
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(got, np.asarray(layers(**wl.inputs), "float64"), rtol=1e-6,
                               atol=1e-6 * scale)


def test_the_profile_report_names_every_layer(monkeypatch):
    monkeypatch.setenv(CHAINS_VARIABLE, "auto")
    wl = workloads.mlp(8, DIMS)
    model = tvm_hybrid.compile(wl.model, HASWELL)
    report = model.profile(repeat=2, **wl.inputs)
    (chain,) = [k.info for k in report.kernels if "gemm_chain" in k.info.name]
    assert chain.schedule == "template"
    assert "chain of 3 layers" in chain.detail
    assert sum(node.startswith("MatMul") for node in chain.nodes) == 3, chain.nodes
    flops = 2 * 8 * sum(k * n for k, n in zip(DIMS[:-1], DIMS[1:]))
    assert chain.flops >= flops  # every layer counted (padded columns included)


# --- the knob space ---------------------------------------------------------------------------


def test_the_chain_is_tunable_through_the_template_space():
    tasks = extract_tasks(workloads.mlp(32, (13, 512, 256, 128)).model,
                          tvm_hybrid.make_target(HASWELL))
    (space,) = [t.space for t in tasks if t.space.template.name == "gemm_chain"]
    heuristic = space.heuristic()
    assert heuristic[0].rows == 16  # one 16-row block per thread
    moves = space.neighbours(heuristic)
    assert moves and space.size() >= len(moves) + 1
    assert all(config_key(c) != config_key(heuristic) for c in moves)
    for config in [heuristic, *moves]:
        assert tuple(knobs_from_dict(json.loads(json.dumps(k.as_dict()))) for k in config) \
            == config
    extents = re.findall(r"T\.parallel\(T\.int64\((\d+)\)", space.schedule(moves[0]).mod[
        "main"].script())
    assert extents == [str(32 // moves[0][0].rows)]


@pytest.mark.requires("avx2", "fma")
def test_tuned_chain_records_apply(tmp_path, monkeypatch):
    """The tuner measures the chain's rows choices; a compile with its records applies the
    best one and stays exact."""
    monkeypatch.setenv(CHAINS_VARIABLE, "auto")
    wl = workloads.mlp(32, (13, 512, 256, 128))
    records = tvm_hybrid.tune(wl.model, HASWELL, trials=3, work_dir=tmp_path / "work",
                              output=tmp_path / "records.json", progress=False)
    tuned = tvm_hybrid.compile(wl.model, HASWELL, tuning_records=records)
    (chain,) = [n for n in tuned.kernel_names() if "gemm_chain" in n]
    assert f'"{CHAIN_ANNOTATION}"' in tuned.lowered[chain].script()
    want = _reference(wl, (13, 512, 256, 128))
    np.testing.assert_allclose(np.asarray(tuned(**wl.inputs), "float64"), want, rtol=1e-5,
                               atol=1e-5 * max(float(np.abs(want).max()), 1.0))


@pytest.mark.requires("avx2", "fma")
def test_gemm_layers_as_exporters_write_them_chain(monkeypatch):
    """``Gemm(x, W, b, transB=1)`` + ``Relu`` per layer, as ``torch.nn.Linear`` exports."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    dims = (20, 64, 40, 8)
    nodes, inits, x = [], [], "x"
    for n, (k, m) in enumerate(zip(dims[:-1], dims[1:])):
        inits += [numpy_helper.from_array(rng.standard_normal((m, k)).astype("float32") * 0.2,
                                          f"W{n}"),
                  numpy_helper.from_array(rng.standard_normal(m).astype("float32"), f"b{n}")]
        nodes += [helper.make_node("Gemm", [x, f"W{n}", f"b{n}"], [f"g{n}"], transB=1),
                  helper.make_node("Relu", [f"g{n}"], [f"h{n}"])]
        x = f"h{n}"
    graph = helper.make_graph(
        nodes, "gemms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, dims[0]])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    monkeypatch.setenv(CHAINS_VARIABLE, "auto")
    compiled = tvm_hybrid.compile(model, HASWELL)
    assert [n for n in compiled.kernel_names() if "gemm_chain" in n], compiled.kernel_names()
    data = rng.standard_normal((16, dims[0])).astype("float32")
    want = data.astype("float64")
    for n in range(len(dims) - 1):
        w = numpy_helper.to_array(inits[2 * n]).astype("float64")
        b = numpy_helper.to_array(inits[2 * n + 1]).astype("float64")
        want = np.maximum(want @ w.T + b, 0)
    np.testing.assert_allclose(np.asarray(compiled(data), "float64"), want, rtol=1e-5,
                               atol=1e-5 * max(float(np.abs(want).max()), 1.0))


# --- integer layers ---------------------------------------------------------------------------


@pytest.mark.parametrize("target,reduce_range", [
    pytest.param(ZNVER4, False, id="vnni", marks=pytest.mark.requires(ZNVER4)),
    pytest.param(HASWELL, False, id="avx2-s16", marks=pytest.mark.requires("avx2", "fma")),
    pytest.param(HASWELL, True, id="avx2-7bit", marks=pytest.mark.requires("avx2", "fma")),
])
def test_quantized_mlp_chains_bit_exact(target, reduce_range, monkeypatch):
    """QDQ layers: u8 activations requantized in each layer's write-back feed the next layer's
    integer microkernel inside the chain; outputs equal the integer reference bit for bit."""
    wl = workloads.qdq_mlp(32, (13, 512, 256, 128), reduce_range=reduce_range)
    monkeypatch.setenv(CHAINS_VARIABLE, "auto")
    compiled = tvm_hybrid.compile(wl.model, target)
    (chain,) = [n for n in compiled.kernel_names() if "gemm_chain" in n]
    script = compiled.lowered[chain].script()
    assert script.count(f'"{TEMPLATE_ANNOTATION}"') == 3 and script.count("T.parallel(") == 1
    np.testing.assert_array_equal(compiled(**wl.inputs), workloads.qdq_reference(wl))


def _activation_mlp(activation: str, dims=(24, 64, 48, 16), batch=16, seed=3):
    """An MLP whose hidden layers end in ``activation`` spelled as exporters write it, and its
    float64 reference."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    consts = {"three": 3.0, "zero": 0.0, "six": 6.0, "half": 0.5, "one": 1.0,
              "sqrt2": float(np.sqrt(2.0))}
    inits += [numpy_helper.from_array(np.array(v, "float32"), n) for n, v in consts.items()]
    weights = []
    for n, (k, m) in enumerate(zip(dims[:-1], dims[1:])):
        w = (rng.standard_normal((k, m)) / np.sqrt(k)).astype("float32")
        b = (rng.standard_normal(m) * 0.1).astype("float32")
        weights.append((w, b))
        inits += [numpy_helper.from_array(w, f"W{n}"), numpy_helper.from_array(b, f"b{n}")]
        h = f"h{n}"
        nodes += [helper.make_node("MatMul", [x, f"W{n}"], [f"m{n}"]),
                  helper.make_node("Add", [f"m{n}", f"b{n}"], [h])]
        if n == len(dims) - 2:
            x = h
            break
        if activation == "hardswish":  # h * clip(h + 3, 0, 6) / 6: h has two consumers
            nodes += [helper.make_node("Add", [h, "three"], [f"a{n}"]),
                      helper.make_node("Clip", [f"a{n}", "zero", "six"], [f"c{n}"]),
                      helper.make_node("Mul", [h, f"c{n}"], [f"p{n}"]),
                      helper.make_node("Div", [f"p{n}", "six"], [f"y{n}"])]
        elif activation == "silu":  # h * sigmoid(h)
            nodes += [helper.make_node("Sigmoid", [h], [f"s{n}"]),
                      helper.make_node("Mul", [h, f"s{n}"], [f"y{n}"])]
        elif activation == "gelu":  # 0.5 * h * (1 + erf(h / sqrt(2)))
            nodes += [helper.make_node("Div", [h, "sqrt2"], [f"d{n}"]),
                      helper.make_node("Erf", [f"d{n}"], [f"e{n}"]),
                      helper.make_node("Add", [f"e{n}", "one"], [f"o{n}"]),
                      helper.make_node("Mul", [h, f"o{n}"], [f"q{n}"]),
                      helper.make_node("Mul", [f"q{n}", "half"], [f"y{n}"])]
        x = f"y{n}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dims[0]])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = rng.standard_normal((batch, dims[0])).astype("float32")
    from math import erf

    want = data.astype("float64")
    for n, (w, b) in enumerate(weights):
        want = want @ w.astype("float64") + b
        if n < len(weights) - 1:
            if activation == "hardswish":
                want = want * np.clip(want + 3, 0, 6) / 6
            elif activation == "silu":
                want = want / (1 + np.exp(-want))
            else:
                want = 0.5 * want * (1 + np.vectorize(erf)(want / np.sqrt(2)))
    return model, data, want


@pytest.mark.requires("avx2", "fma")
@pytest.mark.parametrize("activation", ["hardswish", "silu", "gelu"])
def test_chains_of_layers_whose_activation_reads_its_input_twice(activation, monkeypatch):
    """HardSwish, SiLU and GELU read the layer's output twice; the chain still takes every
    layer on its microkernel in one parallel loop (not the per-layer fallback)."""
    model, data, want = _activation_mlp(activation)
    monkeypatch.setenv(CHAINS_VARIABLE, "auto")
    compiled = tvm_hybrid.compile(model, HASWELL)
    (chain,) = [n for n in compiled.kernel_names() if "gemm_chain" in n]
    script = compiled.lowered[chain].script()
    assert script.count(f'"{CHAIN_ANNOTATION}"') == 1 and script.count("T.parallel(") == 1
    assert script.count(f'"{TEMPLATE_ANNOTATION}"') == 3
    np.testing.assert_allclose(np.asarray(compiled(data), "float64"), want, rtol=1e-4,
                               atol=1e-4 * max(float(np.abs(want).max()), 1.0))


def test_the_compile_cache_keys_on_the_chain_mode(monkeypatch):
    from tvm_hybrid.compile_cache import cache_key

    target = tvm_hybrid.make_target(HASWELL)
    keys = set()
    for mode in ("auto", "off", "all"):
        monkeypatch.setenv(CHAINS_VARIABLE, mode)
        keys.add(cache_key(b"model", target, None, "fp32", "hybrid", None))
    assert len(keys) == 3
