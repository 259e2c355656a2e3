"""Arrays into and out of the VM (``transfer.py``): zero-copy where safe, never aliased."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid import transfer
from tvm_hybrid.bench import workloads
from tvm_hybrid.transfer import ALIGNMENT, fresh_outputs, to_device


@pytest.fixture(scope="module")
def outputs_model():
    """Outputs of every kind: computed, the input itself, a constant, a view of another
    output, and a second computed one."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["x"], ["i"]),
        helper.make_node("Constant", [], ["c"],
                         value=helper.make_tensor("cv", TensorProto.FLOAT, [2], [1.0, 2.0])),
        helper.make_node("Reshape", ["r", "shape"], ["rs"]),
        helper.make_node("Sigmoid", ["x"], ["s"]),
    ]
    graph = helper.make_graph(
        nodes, "outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
         for n in ("r", "i", "c", "rs", "s")],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [1], [32])])
    return tvm_hybrid.compile(helper.make_model(graph,
                                                opset_imports=[helper.make_opsetid("", 17)]))


def test_only_outputs_on_their_own_storage_are_views(outputs_model):
    assert fresh_outputs(outputs_model.lowered["main"]) == (False, False, False, False, True)


def test_returned_arrays_never_alias(outputs_model):
    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    first = outputs_model(x.copy())
    kept = [a.copy() for a in first]
    for array in first:
        assert array.flags.writeable
        array[...] = 7.0  # the caller owns what it got
    second = outputs_model(x.copy())
    np.testing.assert_array_equal(second[2], [1.0, 2.0])  # the constant is intact
    for got, want in zip(second, kept):
        np.testing.assert_array_equal(got, want)
    # The identity output is a copy, not the caller's input; the reshape not the Relu's.
    assert not np.shares_memory(second[1], x)
    assert not np.shares_memory(second[0], second[3])
    third = outputs_model(x.copy())
    assert not np.shares_memory(third[4], second[4])  # each call's views are its own


def test_inputs_aligned_or_not():
    wl = workloads.attention(1, 40, heads=2, head_dim=32)
    model = tvm_hybrid.compile(wl.model)
    want = model(**wl.inputs)
    for offset in (0, 1, 4):  # floats: 0 and 64-byte aligned, or not
        moved = {}
        for name, array in wl.inputs.items():
            room = np.empty(array.size + 32, array.dtype)
            start = (-room.ctypes.data % ALIGNMENT) // array.itemsize + offset
            moved[name] = room[start:start + array.size].reshape(array.shape)
            moved[name][...] = array
        np.testing.assert_array_equal(model(**moved), want)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_large_staged_copies_split_across_threads(monkeypatch, threads):
    """A call's copies are dealt out to ``threads`` threads (one per PARALLEL_BYTES) in parts
    that cover every input exactly once (parts may span inputs of different dtypes), odd sizes
    and non-contiguous sources included."""
    monkeypatch.setattr(transfer, "PARALLEL_BYTES", 8)
    monkeypatch.setattr(transfer, "_threads", lambda: threads)
    rng = np.random.default_rng(0)
    for shape in [(1001,), (7, 13, 5), (3, 1)]:
        base = rng.standard_normal((*shape[:-1], 2 * shape[-1])).astype("float32")
        for array in (base[..., 1:shape[-1] + 1], base[..., ::2]):  # unaligned, strided
            (tensor,) = to_device([array], {})
            np.testing.assert_array_equal(tensor.numpy(), array)
    arrays = [rng.standard_normal(333).astype("float32")[1:],
              rng.integers(-9, 9, (5, 7)).astype("int64"),
              rng.integers(0, 255, 1001).astype("uint8")[1:], np.arange(3, dtype="int16")]
    staging: dict = {}
    for _ in range(2):  # the second call reuses the staging tensors
        for tensor, array in zip(to_device(arrays, staging), arrays):
            np.testing.assert_array_equal(tensor.numpy(), array)
        arrays = [a[::-1].copy()[: a.size] if a.ndim == 1 else a + 1 for a in arrays]


def test_staging_follows_the_shapes():
    staging: dict = {}
    a = np.arange(6, dtype="float32").reshape(2, 3)[:, ::-1]  # not contiguous: staged
    (t,) = to_device([a], staging)
    np.testing.assert_array_equal(t.numpy(), a)
    b = np.arange(12, dtype="float32").reshape(3, 4)[:, ::-1]
    (u,) = to_device([b], staging)
    np.testing.assert_array_equal(u.numpy(), b)
    assert isinstance(u, tvm.runtime.Tensor) and tuple(u.shape) == (3, 4)


def test_a_single_computed_output_is_a_view():
    wl = workloads.attention(1, 40, heads=2, head_dim=32)
    model = tvm_hybrid.compile(wl.model)
    assert fresh_outputs(model.lowered["main"]) == (True,)
    first = model(**wl.inputs)
    kept = first.copy()
    second = model(**wl.inputs)
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)


def _aligned(shape, fill):
    room = np.empty(int(np.prod(shape)) + 16, "float32")
    start = (-room.ctypes.data % ALIGNMENT) // 4
    array = room[start:start + int(np.prod(shape))].reshape(shape)
    array[...] = fill
    return array


def test_small_inputs_are_copied_into_staging_large_aligned_ones_shared():
    staging: dict = {}
    small = _aligned((4, 8), 1.0)  # aligned, but small: copied
    (t,) = to_device([small], staging)
    (u,) = to_device([_aligned((4, 8), 2.0)], staging)
    assert u is t and np.all(u.numpy() == 2.0)  # the same staging tensor, fresh contents
    assert not np.shares_memory(np.from_dlpack(u), small)
    large = _aligned((64, 256), 3.0)  # 64 KiB, aligned: passed as it is
    (w,) = to_device([large], staging)
    assert np.shares_memory(np.from_dlpack(w), large)


def test_calls_on_small_inputs_see_each_call_inputs():
    wl = workloads.mlp(4, (8, 16), name="tiny")
    model = tvm_hybrid.compile(wl.model)
    reference = tvm_hybrid.compile(wl.model, pipeline="stock")
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((4, 8)).astype("float32") for _ in range(3)]
    for x in inputs + inputs[::-1]:
        np.testing.assert_allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    # The unchecked fast path of positional inputs still rejects a wrong dtype or shape.
    with pytest.raises(tvm_hybrid.InputError):
        model(inputs[0].astype("float64"))
    with pytest.raises(tvm_hybrid.InputError):
        model(inputs[0][:2])
    # By name too.
    np.testing.assert_array_equal(model(x=inputs[1]), model(inputs[1]))
    with pytest.raises(tvm_hybrid.InputError):
        model(x=inputs[0].astype("float64"))
    with pytest.raises(tvm_hybrid.InputError, match="unknown input"):
        model(y=inputs[0])
