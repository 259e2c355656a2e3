"""The benchmark comparison's output check (``tvm_hybrid.bench.comparison``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tvm_hybrid.bench import comparison


@pytest.fixture
def fake_peers(monkeypatch):
    """Peers whose outputs the test sets; "tvm" is not installed."""
    outputs = {}
    monkeypatch.setattr(comparison, "available", lambda name: name != "tvm")
    monkeypatch.setattr(comparison, "make_runner",
                        lambda name, model, target: lambda feeds: [outputs[name]])
    return outputs


def test_nan_outputs_are_reported_as_nan_not_as_agreement(fake_peers):
    want = np.linspace(-1, 1, 12, dtype="float32")
    fake_peers["hybrid"] = want
    fake_peers["openvino"] = np.where(np.arange(12) == 3, np.nan, want).astype("float32")
    fake_peers["onnxruntime"] = want + 0.5
    result = comparison.compare("m", None, {}, ["tvm", "hybrid", "openvino", "onnxruntime"],
                                rounds=1, min_round_ms=0.0)
    by_name = {r.name: r for r in result.results}
    assert by_name["tvm"].error == "not installed"
    assert by_name["hybrid"].ok
    # The reference is the first peer that ran (hybrid), not the first one asked for (tvm).
    assert by_name["openvino"].error == "outputs differ from hybrid (NaN where it has none)"
    assert np.isnan(by_name["openvino"].max_rel_err)
    assert by_name["onnxruntime"].error == "outputs differ from hybrid (rel err 5.00e-01)"


def test_nan_where_the_reference_has_nan_agrees(fake_peers):
    want = np.array([1.0, np.nan, -2.0], dtype="float32")
    fake_peers["hybrid"] = want
    fake_peers["openvino"] = want + np.float32(1e-5)
    result = comparison.compare("m", None, {}, ["hybrid", "openvino"], rounds=1,
                                min_round_ms=0.0)
    openvino = result.results[1]
    assert openvino.ok and openvino.median_ms > 0
    assert openvino.max_rel_err == pytest.approx(5e-6, rel=1e-2)


def test_rounds_are_sized_from_warm_calls():
    """A runner whose first call is slow (hybrid's creates its VM) still gets rounds of many
    calls: sized from that call, each round was one call, right after the other runners'."""
    calls = []

    def runner(_):
        calls.append(None)
        time.sleep(0.03 if len(calls) == 1 else 0.0002)

    samples = comparison.time_interleaved({"runner": runner}, {}, rounds=3, min_round_ms=5)
    assert len(samples["runner"]) == 3
    assert len(calls) > 3 * 10  # rounds of about 5 ms of 0.2-ms calls, not of one call
    assert max(samples["runner"]) < 5  # ms a call: the first call is not in any round


def test_timed_calls_follow_their_own_runner_and_rounds_alternate_order():
    """A call right after another runner's is slower than after its own (cold buffers): each
    round's timed call follows an untimed call of the same runner, and every other round runs
    the runners in reverse, so no runner always comes after the same one."""
    log = []

    def make(name):
        def runner(_):
            log.append(name)
            time.sleep(0.002)  # longer than a round: one timed call a round
        return runner

    samples = comparison.time_interleaved({n: make(n) for n in "abc"}, {}, rounds=4,
                                          min_round_ms=1)
    assert all(len(samples[n]) == 4 for n in "abc")
    runs = []  # [runner, calls in a row]
    for name in log:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    # Sizing: a first call and one warm call each. Rounds a b c | c b a | a b c | c b a, each
    # an untimed and a timed call; a runner ending one round and starting the next runs 4.
    assert runs == [["a", 2], ["b", 2], ["c", 2],
                    ["a", 2], ["b", 2], ["c", 4], ["b", 2], ["a", 4], ["b", 2], ["c", 4],
                    ["b", 2], ["a", 2]]
