"""Schedule rules decline quietly, fail loudly: strict mode, warnings, causes kept.

Runs on any x86 host: the functions are only scheduled for a named CPU, never run.
"""

from __future__ import annotations

import logging

import pytest
import tvm
from tvm import s_tir, te

import tvm_hybrid
from tvm_hybrid.errors import TemplateError
from tvm_hybrid.schedules import ConvTemplate, GemmTemplate, ParallelVectorize, apply_template
from tvm_hybrid.schedules.gemm import template as gemm_template
from tvm_hybrid.schedules.rule_failures import STRICT_VARIABLE, strict

TARGET = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


def _gemm_func(m=64, n=64, k=32):
    a = te.placeholder((m, k), name="A")
    b = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c]).with_attr("global_symbol", "my_gemm")


def _elementwise_func():
    a = te.placeholder((64, 64), name="A")
    c = te.compute((64, 64), lambda i, j: a[i, j] * 2.0, name="C")
    return te.create_prim_func([a, c]).with_attr("global_symbol", "my_scale")


@pytest.fixture
def broken_microkernel(monkeypatch):
    """The GEMM template tensorizes with an intrinsic for another K: TVM's tensorize fails."""
    real = gemm_template.tensor_intrin
    monkeypatch.setattr(gemm_template, "tensor_intrin",
                        lambda kernel, k, **kw: real(kernel, k + 8))


def test_strict_mode_reads_the_variable(monkeypatch):
    for value, expected in [("1", True), ("yes", True), ("0", False), ("", False)]:
        monkeypatch.setenv(STRICT_VARIABLE, value)
        assert strict() is expected
    monkeypatch.delenv(STRICT_VARIABLE)
    assert not strict()


def test_template_applies_cleanly_in_strict_mode(monkeypatch):
    monkeypatch.setenv(STRICT_VARIABLE, "1")
    assert GemmTemplate().apply(_gemm_func(), TARGET, False) is not None


def test_failing_template_raises_in_strict_mode(monkeypatch, broken_microkernel):
    monkeypatch.setenv(STRICT_VARIABLE, "1")
    with pytest.raises(TemplateError) as info:
        GemmTemplate().apply(_gemm_func(), TARGET, False)
    message = str(info.value)
    assert "GEMM template" in message and "my_gemm" in message and "64" in message
    # TVM's error is kept as the cause (for --verbose and debuggers), not dropped.
    assert isinstance(info.value.__cause__, s_tir.ScheduleError)


def test_failing_template_warns_and_falls_back(monkeypatch, caplog, broken_microkernel):
    monkeypatch.setenv(STRICT_VARIABLE, "0")
    func = _gemm_func()
    with caplog.at_level(logging.WARNING, logger="tvm_hybrid.schedules"):
        assert GemmTemplate().apply(func, TARGET, False) is None
    assert any("GEMM template failed on my_gemm" in r.getMessage() for r in caplog.records)
    # The next rule still schedules the function (slower, but it compiles).
    assert ParallelVectorize().apply(func, TARGET, False) is not None


def test_declining_is_silent(monkeypatch, caplog):
    """A function a template does not cover is declined without a warning or an error."""
    monkeypatch.setenv(STRICT_VARIABLE, "1")
    with caplog.at_level(logging.DEBUG, logger="tvm_hybrid.schedules"):
        assert GemmTemplate().apply(_elementwise_func(), TARGET, False) is None
        assert ConvTemplate().apply(_gemm_func(), TARGET, False) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_bug_in_a_rule_is_not_swallowed(monkeypatch):
    """Only ScheduleError and NotApplicable are caught: a Python error propagates, strict or
    not (it used to become a silent fallback)."""
    monkeypatch.setenv(STRICT_VARIABLE, "0")

    def buggy(sch, gemm, knobs):
        raise ZeroDivisionError("a bug in the template")

    monkeypatch.setattr(gemm_template, "schedule_gemm", buggy)
    with pytest.raises(ZeroDivisionError):
        GemmTemplate().apply(_gemm_func(), TARGET, False)


def test_knobs_that_do_not_tile_the_gemm_are_declined():
    from tvm_hybrid.microkernels import microkernels_for
    from tvm_hybrid.schedules.gemm.heuristics import GemmKnobs

    kernel = next(k for k in microkernels_for(TARGET, "float32") if k.mr == 4 and k.nr == 16)
    func = _gemm_func(64, 64, 32)
    assert apply_template(GemmTemplate(), func, TARGET, [GemmKnobs(kernel, 2, 2)]) is not None
    assert apply_template(GemmTemplate(), func, TARGET, [GemmKnobs(kernel, 3, 1)]) is None
    assert apply_template(GemmTemplate(), func, TARGET, [GemmKnobs(kernel, 1, 8)]) is None


def test_template_error_reaches_the_user_through_compile(monkeypatch, broken_microkernel):
    """Through ``tvm_hybrid.compile`` the TemplateError arrives as itself (a CompileError)."""
    from tvm_hybrid.bench import workloads

    monkeypatch.setenv(STRICT_VARIABLE, "1")
    model = workloads.mlp(8, (32, 64), final=None)
    with pytest.raises(TemplateError, match="GEMM template failed"):
        tvm_hybrid.compile(model.model, target=TARGET)


def test_a_tvm_internal_error_in_the_fallback_is_loud_in_strict_mode(monkeypatch, caplog):
    """TVM's own checks inside a schedule primitive raise InternalError, not ScheduleError. The
    fallback rule turns it into a TemplateError in strict mode, and otherwise into a warning
    and stock lowering for that function (one function's TVM bug used to fail the model's
    whole compile)."""
    from tvm_hybrid.schedules import parallel_vectorize

    def trips(sch, target):
        raise tvm.error.InternalError("Check failed: (node.defined()) is false")

    monkeypatch.setattr(parallel_vectorize, "_schedule", trips)
    monkeypatch.setenv(STRICT_VARIABLE, "1")
    with pytest.raises(TemplateError, match="fallback schedule .* my_scale") as info:
        ParallelVectorize().apply(_elementwise_func(), TARGET, False)
    assert isinstance(info.value.__cause__, tvm.error.InternalError)
    monkeypatch.setenv(STRICT_VARIABLE, "0")
    with caplog.at_level(logging.WARNING, logger="tvm_hybrid.schedules"):
        assert ParallelVectorize().apply(_elementwise_func(), TARGET, False) is None
    assert any("stock lowering" in r.getMessage() and "my_scale" in r.getMessage()
               for r in caplog.records)


def test_a_function_without_a_root_block_is_declined_by_every_rule():
    """TOPI writes CumSum as one opaque block of plain loops, with no ``root`` block: every
    template's block lookup raised a ScheduleError outside its try, and any model holding a
    CumSum failed to compile. Now each rule declines it; the model compiles and runs."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from tvm import relax

    from tvm_hybrid.schedules import TEMPLATES

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 64), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit_te(tvm.topi.cumsum, x, 1))
    func = next(f for f in bb.get().functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert func.body.block.name_hint != "root"  # the case under test
    for rule in (*TEMPLATES, ParallelVectorize()):
        assert rule.apply(func, TARGET, False) is None, rule
    graph = helper.make_graph(
        [helper.make_node("CumSum", ["x", "axis"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])],
        initializer=[numpy_helper.from_array(np.array(1, np.int64), "axis")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    a = np.random.default_rng(0).standard_normal((8, 64)).astype("float32")
    np.testing.assert_allclose(tvm_hybrid.compile(proto)(a), np.cumsum(a, 1), rtol=1e-5,
                               atol=1e-5)
