"""Row tails: a GEMM whose ``x`` was padded with zero rows runs its last row tile on ``x``'s own
rows only, and ``DropRowPadding`` removes the copy that padded ``x``.

The structure is checked for named CPUs (any host); the numeric tests run the host's kernels.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.microkernels import microkernel_by_name
from tvm_hybrid.microkernels.registry import ensure_tensor_intrin, tensor_intrin
from tvm_hybrid.microkernels.tiles import RowTail
from tvm_hybrid.passes.packed_gemm import KERNEL_NAMES, pack_weight, packed_gemm
from tvm_hybrid.pipeline import hybrid_pipeline
from tvm_hybrid.schedules.gemm.heuristics import GemmShape, padded_rows, select
from tvm_hybrid.testing.relax_modules import relax_function

ZEN5 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
_NOTE = re.compile(r'"hybrid.gemm_template": "([^"]+)"')


def _notes(mod: tvm.IRModule) -> list[str]:
    return [m for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
            for m in _NOTE.findall(f.script())]


def _kernel_calls(mod: tvm.IRModule) -> list[str]:
    """The kernels ``main`` calls, in order (after lowering: ``kernel(args..., out)``)."""
    kernels = {gv.name_hint for gv, f in mod.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    return [name for name in re.findall(r"\b(\w+)\(", mod["main"].script()) if name in kernels]


def _padded_gemm(target, m: int, n: int, k: int, return_padded: bool = False):
    """``x[m, k] @ w`` as the packing emits it for ``target`` (``x`` padded with zero rows to
    whole tiles), optionally also returning the padded ``x``; and the rows added."""
    w = np.random.default_rng(0).standard_normal((k, n)).astype("float32")
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    pad = padded_rows(target, "float32", GemmShape(1, m, n, k))
    nr = select(target, "float32", GemmShape(1, m + pad, n, k), packing=True)[0].nr

    def body(bb, x):
        padded = bb.emit(relax.op.nn.pad(x, [0, pad, 0, 0]))

        def compute(x, packed):
            return packed_gemm(x, packed, n, "float32", "float32", out_rows=m)

        y = bb.call_te(compute, padded, relax.const(pack_weight(w, nr)),
                       primfunc_name_hint=KERNEL_NAMES["float32"])
        return relax.Tuple([y, padded]) if return_padded else y

    return relax_function([x], body), w, pad


@pytest.mark.parametrize("target", [ZEN5, HASWELL], ids=["znver5", "haswell"])
def test_padded_rows_are_read_by_a_row_tail_and_the_padding_goes(target):
    """Before: ``pad`` then the GEMM on the padded rows. After the pipeline: the GEMM kernel
    takes ``x`` itself (its parameter has ``x``'s rows), its last row tile reads ``x``'s rows
    only, and no padding kernel is called."""
    mod, _, pad = _padded_gemm(target, 97, 768, 333)
    assert pad > 0
    assert [call.op.name for call in _relax_calls(mod)] == ["relax.nn.pad", "relax.call_tir"]
    lowered = hybrid_pipeline(target)(mod)
    assert _kernel_calls(lowered) == [KERNEL_NAMES["float32"]]
    kernel = lowered[KERNEL_NAMES["float32"]]
    assert [int(d) for d in kernel.params[0].ty.shape] == [97, 333]
    notes = _notes(lowered)
    mr = int(re.search(r" (\d+)x\d+ microkernel", notes[0]).group(1))
    assert f"last row tile {97 - (97 + pad - mr)} of {mr} rows" in notes[0], notes


def test_a_padding_read_elsewhere_is_kept():
    """The padded ``x`` is also an output: the copy stays (the row tail still runs)."""
    mod, _, _ = _padded_gemm(ZEN5, 97, 768, 333, return_padded=True)
    lowered = hybrid_pipeline(ZEN5)(mod)
    assert len(_kernel_calls(lowered)) == 2
    assert "last row tile" in _notes(lowered)[0]


def _relax_calls(mod: tvm.IRModule) -> list[relax.Call]:
    calls = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    return calls


@pytest.mark.parametrize("m, n, k", [(97, 768, 333), (257, 256, 96), (197, 97, 333),
                                     (197, 768, 333), (97, 3072, 768), (257, 1024, 4096)])
def test_row_tails_match_numpy(m, n, k):
    """On the host's kernels, against numpy in float64 (1e-5 of the output scale): with a
    column tail (97 columns), with prefetched weights (9 MiB) and with K blocks (16 MiB of
    weights, 4 MiB of ``x``), where the host's kernels take them."""
    wl = workloads.gemm(m, n, k)
    model = tvm_hybrid.compile(wl.model, "host")
    a = wl.inputs["a"].astype(np.float64)
    want = a @ numpy_helper.to_array(wl.model.graph.initializer[0]).astype(np.float64)
    got = model(wl.inputs["a"])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_equal_rows_give_equal_outputs_in_the_row_tail():
    """Every row of ``x`` equal: the last row tile's rows (summed by the row tail) are
    bit-equal to the full tiles' rows."""
    wl = workloads.gemm(97, 768, 333)
    model = tvm_hybrid.compile(wl.model, "host")
    assert any("last row tile" in note for note in _notes(model.lowered)), _notes(model.lowered)
    row = np.random.default_rng(1).standard_normal((1, 333)).astype("float32")
    out = model(np.repeat(row, 97, axis=0))
    assert (out == out[0]).all()


def test_row_tail_intrinsics_are_named_and_replayed():
    """A trace's intrinsic name carries the row tail (``_r<rows>at<offset>``), and
    registering by name (tuning records in a fresh process) gives the same intrinsic."""
    kernel = microkernel_by_name(select(ZEN5, "float32", GemmShape(1, 99, 768, 333))[0].name)
    name = tensor_intrin(kernel, 333, row_tail=RowTail((99 - kernel.mr) * 333, 7))
    assert name.endswith(f"_k333_r7at{(99 - kernel.mr) * 333}")
    assert ensure_tensor_intrin(name)
    with pytest.raises(ValueError, match="row tail"):
        tensor_intrin(kernel, 333, row_tail=RowTail(0, kernel.mr))
