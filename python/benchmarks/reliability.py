"""The cost of the run-time index checks: a BERT-base layer fed by a token-embedding lookup.

``ids [batch, 128]`` (int64) -> ``Gather`` on a 30522 x 768 table -> a BERT-base encoder layer,
compiled twice: as tvm_hybrid compiles it (every gather checks its indices in the compiled code,
``passes/check_indices.py``), and with the check pass replaced by a no-op (measurement only: the
unchecked model reads out of bounds on bad ids). Both are timed interleaved in one process
(medians); the outputs must agree exactly. This prints ratios; it is not a test.

    python python/benchmarks/reliability.py [--rounds 30]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper

import tvm_hybrid
from tvm_hybrid import pipeline
from tvm_hybrid.bench import workloads
from tvm_hybrid.bench.comparison import host_banner, time_interleaved


def embedded_bert_layer(batch: int, seq: int = 128, vocab: int = 30522) -> tuple:
    """The ONNX model and its inputs (ids, mask)."""
    layer = workloads.bert_layer(batch, seq)
    graph = layer.model.graph
    hidden = layer.inputs["x"].shape[-1]
    table = np.random.default_rng(0).standard_normal((vocab, hidden)).astype(np.float32) * 0.02
    gather = helper.make_node("Gather", ["embeddings", "ids"], ["x"], axis=0)
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, seq]),
              *[i for i in graph.input if i.name != "x"]]
    new_graph = helper.make_graph([gather, *graph.node], "embedded_bert", inputs,
                                  list(graph.output),
                                  [numpy_helper.from_array(table, "embeddings"),
                                   *graph.initializer])
    model = helper.make_model(new_graph, opset_imports=list(layer.model.opset_import))
    model.ir_version = layer.model.ir_version
    onnx.checker.check_model(model)
    ids = np.random.default_rng(1).integers(0, vocab, (batch, seq)).astype(np.int64)
    return model, {"ids": ids, "mask": layer.inputs["mask"]}


@tvm.transform.module_pass(opt_level=0, name="NoIndexCheck")
def _no_check(mod, _ctx):
    return mod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    args = parser.parse_args()
    print(host_banner())
    for batch in (1, 8):
        model, feeds = embedded_bert_layer(batch)
        checked = tvm_hybrid.compile(model)
        original = pipeline.CheckIndices
        pipeline.CheckIndices = lambda: _no_check
        try:
            unchecked = tvm_hybrid.compile(model)
        finally:
            pipeline.CheckIndices = original
        assert "hybrid_check_indices" in checked.kernel_names()
        assert "hybrid_check_indices" not in unchecked.kernel_names()
        np.testing.assert_array_equal(checked(**feeds), unchecked(**feeds))
        times = time_interleaved({"checked": lambda f, m=checked: m(**f),
                                  "unchecked": lambda f, m=unchecked: m(**f)}, feeds,
                                 rounds=args.rounds)
        a, b = np.median(times["checked"]), np.median(times["unchecked"])
        print(f"embedding + BERT-base layer b{batch} s128: checked {a:.3f} ms, unchecked "
              f"{b:.3f} ms: the checks cost {100 * (a / b - 1):+.1f}%")


if __name__ == "__main__":
    main()
