"""Conformance against the ONNX backend test data shipped inside the onnx package.

Cases come from ``onnx/backend/test/data/`` (kinds ``pytorch-converted``, ``pytorch-operator``,
``simple`` and ``real``, the last being the light CNN models: ResNet-50, DenseNet, Inception,
VGG, ...), loaded with onnx's own loader and compared with its own ``assert_similar_outputs``
and per-case tolerances. Kind ``node`` holds onnx's per-operator cases (about 1,900: every
op's documented examples, generated in memory by ``onnx.backend.test.case.node``, since the
wheel does not ship their data). :func:`check_case` runs one case through one ONNX backend
(:mod:`tvm_hybrid.onnx_backend`). Run ``python -m tvm_hybrid.testing.conformance`` for the counts.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import time

import onnx
from onnx import numpy_helper
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

KINDS = ("pytorch-converted", "pytorch-operator", "simple", "real")
#: The per-operator cases, generated rather than loaded (module docstring).
NODE = "node"
_LIGHT_PREFIX = "onnx/backend/test/data/light/"


@dataclasses.dataclass
class Case:
    """One conformance case: a model, its input/output data sets and tolerances."""

    name: str
    kind: str
    model_path: str
    data_dirs: list[str]
    rtol: float
    atol: float
    light_outputs: list[str] = dataclasses.field(default_factory=list)
    #: A generated case's model and ``(inputs, outputs)`` data sets (kind ``node``).
    model: onnx.ModelProto | None = None
    data: list | None = None


@dataclasses.dataclass
class Outcome:
    """How one backend did on one case."""

    ok: bool
    reason: str = ""
    seconds: float = 0.0
    #: The backend's prepared model (``BackendRep``), when it compiled.
    rep: object = None


def cases(kinds=KINDS) -> list[Case]:
    """All cases of the given kinds, sorted by name."""
    found = []
    onnx_root = os.path.dirname(os.path.dirname(onnx.__file__))
    if NODE in kinds:
        found.extend(_node_cases())
    for kind in (k for k in kinds if k != NODE):
        for test in load_model_tests(kind=kind):
            if test.model_dir is not None:
                found.append(Case(test.name, kind, os.path.join(test.model_dir, "model.onnx"),
                                  sorted(glob.glob(os.path.join(test.model_dir, "test_data_set*"))),
                                  test.rtol, test.atol))
            elif test.url and test.url.startswith(_LIGHT_PREFIX):
                path = os.path.join(onnx_root, test.url)
                outputs = sorted(glob.glob(os.path.splitext(path)[0] + "_output_*.pb"))
                found.append(Case(test.name, kind, path, [], test.rtol, test.atol, outputs))
    return sorted(found, key=lambda c: (c.kind, c.name))


def _node_cases() -> list[Case]:
    import warnings

    from onnx.backend.test.case import node

    with warnings.catch_warnings():  # the generators' own numpy warnings (log of 0, casts)
        warnings.simplefilter("ignore")
        generated = node.collect_testcases(None)
    return [Case(t.name, NODE, "", [], t.rtol, t.atol, model=t.model,
                 data=[(list(i), list(o)) for i, o in t.data_sets])
            for t in generated if t.model is not None and t.data_sets]


def load_data(case: Case, model: onnx.ModelProto) -> list[tuple[list, list]]:
    """The (inputs, expected outputs) data sets of ``case``."""
    runner = Runner.__new__(Runner)  # only its proto loader is used, which needs no state
    if case.light_outputs:  # light models: deterministic dummy inputs, stored outputs
        inits = {i.name for i in model.graph.initializer}
        inputs = [Runner.generate_dummy_data(x, seed=0, name=case.name, random=False)
                  for x in model.graph.input if x.name not in inits]
        outputs = []
        for n, path in enumerate(case.light_outputs):
            runner._load_proto(path, outputs, model.graph.output[n].type)
        return [(inputs, outputs)]
    data = []
    for directory in case.data_dirs:
        inputs, outputs = [], []
        for n in range(len(glob.glob(os.path.join(directory, "input_*.pb")))):
            runner._load_proto(os.path.join(directory, f"input_{n}.pb"), inputs,
                               model.graph.input[n].type)
        for n in range(len(glob.glob(os.path.join(directory, "output_*.pb")))):
            runner._load_proto(os.path.join(directory, f"output_{n}.pb"), outputs,
                               model.graph.output[n].type)
        data.append((inputs, outputs))
    return data


def _arrays(values: list) -> list:
    return [numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in values]


def check_case(case: Case, backend) -> Outcome:
    """Run ``case`` through ``backend`` and compare with the reference outputs."""
    start = time.perf_counter()
    rep = None
    try:
        model = case.model if case.model is not None else onnx.load(case.model_path)
        data = case.data if case.data is not None else load_data(case, model)
        rep = backend.prepare(model, "CPU")
        for inputs, expected in data:
            # Generated cases hold TensorProtos where numpy has no dtype (bfloat16, float8,
            # int4), inputs and expected outputs alike: normalised as onnx's own runner does.
            got = rep.run(_arrays(inputs))
            Runner.assert_similar_outputs(_arrays(expected), got, rtol=case.rtol,
                                          atol=case.atol, model_dir=case.name)
    except AssertionError as err:
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        detail = next((ln.strip() for ln in lines if "Mismatch" in ln or "Max abs" in ln),
                      lines[0] if lines else "")
        return Outcome(False, f"wrong result: {detail}", time.perf_counter() - start, rep)
    except Exception as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return Outcome(False, f"{type(err).__name__}: {text[:200]}", time.perf_counter() - start)
    return Outcome(True, "", time.perf_counter() - start, rep)


def main(argv: list[str] | None = None) -> int:
    """Print stock-vs-hybrid conformance counts (``python -m tvm_hybrid.testing.conformance``)."""
    from ..onnx_backend import HybridBackend, StockTVMBackend

    kinds = tuple(argv or sys.argv[1:]) or KINDS
    counts = {"both": 0, "stock_only": 0, "hybrid_only": 0, "neither": 0}
    for case in cases(kinds):
        stock, hybrid = check_case(case, StockTVMBackend), check_case(case, HybridBackend)
        key = ("both" if hybrid.ok else "stock_only") if stock.ok else \
              ("hybrid_only" if hybrid.ok else "neither")
        counts[key] += 1
        note = "" if stock.ok else f"  stock TVM: {stock.reason}"
        if stock.ok and not hybrid.ok:
            note = f"  HYBRID REGRESSION: {hybrid.reason}"
        print(f"{case.kind:18s} {case.name:45s} stock {'ok ' if stock.ok else 'ERR'} "
              f"hybrid {'ok ' if hybrid.ok else 'ERR'} {stock.seconds:6.1f}s/{hybrid.seconds:5.1f}s"
              f"{note}", flush=True)
    print(f"\n{sum(counts.values())} cases: both pass {counts['both']}, stock TVM fails "
          f"{counts['neither'] + counts['hybrid_only']} (hybrid passes {counts['hybrid_only']} "
          f"of those), hybrid regressions {counts['stock_only']}")
    return 1 if counts["stock_only"] else 0


if __name__ == "__main__":
    sys.exit(main())
