"""Side-by-side comparison of runtimes on one model: outputs checked first, then timed.

Timing is interleaved (each round runs every runtime once, in turn) so that load from other
processes on a shared machine hits all of them alike; the median over rounds is reported.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import onnx

from .peers import available, make_runner


@dataclasses.dataclass
class PeerResult:
    """What one runtime did on one model."""

    name: str
    compile_s: float = float("nan")
    median_ms: float = float("nan")
    max_rel_err: float = float("nan")
    error: str | None = None
    #: Timed although its outputs differ from the reference (``compare(time_inexact=True)``):
    #: a peer whose fast path is not exact (ONNX Runtime's saturating u8 x s8 on AVX2).
    inexact: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class Comparison:
    """Results of :func:`compare` for one model."""

    model: str
    flops: float | None
    results: list[PeerResult]

    def by_name(self, name: str) -> PeerResult | None:
        return next((r for r in self.results if r.name == name), None)


def host_banner() -> str:
    """What a benchmark ran on: the CPU, its ISA tier, cores and threads (one line), plus a
    note when ``TVM_HYBRID_HOST_CPU`` emulates another CPU (hybrid then compiles for that CPU,
    while peer runtimes pick their code from the real one)."""
    from ..host import describe_host

    info = describe_host()
    tiers = info["isa"]
    line = (f"CPU {info['model']} (LLVM {info['cpu']}), ISA tier "
            f"{tiers[-1] if tiers else 'baseline x86-64'} ({', '.join(tiers)}), "
            f"{info['physical_cores']} cores, TVM threads {info['threads']}")
    if "emulating" in info:
        line += (f"\nemulating {info['emulating']}: hybrid's code is for that CPU; peers "
                 "use the real CPU's instructions")
    return line


def compare(
    name: str,
    model: onnx.ModelProto,
    inputs: dict[str, np.ndarray],
    peers: list[str],
    *,
    flops: float | None = None,
    rounds: int = 15,
    min_round_ms: float = 20.0,
    max_seconds_per_peer: float = 20.0,
    rtol: float = 1e-3,
    atol: float = 1e-3,
    target="host",
    time_inexact: bool = False,
) -> Comparison:
    """Compile ``model`` with each peer, check outputs agree, and time them interleaved.

    Parameters
    ----------
    peers
        Runtime names from :data:`tvm_hybrid.bench.peers.PEERS`; the first one that runs is the
        reference for the output check (put ``"tvm"``, stock TVM, first to check against it).
    rounds
        Timing rounds; each round times every peer once.
    min_round_ms
        A round repeats a call until it has taken at least this long, and reports the mean.
    max_seconds_per_peer
        A slow peer (untuned stock TVM) gets fewer rounds so that it takes about this long.
    rtol, atol
        Output agreement tolerance against the reference: ``|a - b| <= atol + rtol * |b|``.
    time_inexact
        Time a peer whose outputs differ too, marked :attr:`PeerResult.inexact` (its speed is
        what a user of it gets, wrong results included); otherwise it is left untimed.
    """
    results, runners, reference, reference_name = [], {}, None, None
    for peer in peers:
        result = PeerResult(peer)
        results.append(result)
        if not available(peer):
            result.error = "not installed"
            continue
        try:
            start = time.perf_counter()
            runner = make_runner(peer, model, target)
            outputs = runner(inputs)
            result.compile_s = time.perf_counter() - start
        except Exception as err:  # a peer failing must not stop the comparison
            result.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            continue
        if reference is None:
            reference, reference_name = outputs, peer
            result.max_rel_err = 0.0
        else:
            result.max_rel_err, agree = _agreement(outputs, reference, rtol, atol)
            if not agree and time_inexact:
                result.inexact = True
            elif not agree:
                result.error = (
                    f"outputs differ from {reference_name}"
                    + (" (NaN where it has none)" if np.isnan(result.max_rel_err)
                       else f" (rel err {result.max_rel_err:.2e})")
                )
                continue
        runners[peer] = runner

    samples = time_interleaved(runners, inputs, rounds=rounds, min_round_ms=min_round_ms,
                               max_seconds_per_peer=max_seconds_per_peer)
    for result in results:
        if result.name in samples and samples[result.name]:
            result.median_ms = float(np.median(samples[result.name]))
    return Comparison(name, flops, results)


def time_interleaved(runners: dict, inputs: dict[str, np.ndarray], *, rounds: int = 15,
                     min_round_ms: float = 20.0,
                     max_seconds_per_peer: float = 20.0) -> dict[str, list[float]]:
    """Time each runner once per round, round after round (ms per call, one sample a round).

    Interleaving spreads the machine's slow and fast moments over every runner alike. Each
    round's timed calls follow an untimed call of the same runner, and every other round runs
    the runners in reverse order: a call right after another runner's is slower than after
    its own (measured; cold caches are the likely cause), so with one fixed order the
    runner after its twin looked faster. Two exported builds of the same model timed against
    each other (one process, 2-core Emerald Rapids, 9-10 rounds) read 1.022-1.094x (ocr_det
    1.094x, 9/9) in one fixed order, 0.993-1.005x with both changes (yolov8n once 1.029x).
    A round repeats a call until it lasts ``min_round_ms``; a slow runner gets fewer rounds so
    that it takes about ``max_seconds_per_peer``. Rounds are sized from warm calls, repeated
    for a quarter of ``min_round_ms`` after a first one: a first call carries one-time costs
    (hybrid's creates its VM, ~30 ms), and sized from it, hybrid's rounds of a 197x7x333 GEMM
    were one call each, right after the other runtimes' rounds (its thread pool asleep): 92 us
    a call, against 17 us in rounds of 20 ms (same process, 2-core Emerald Rapids; ONNX
    Runtime 26 and 25 us, OpenVINO 132 and 113 us).
    """
    samples: dict[str, list[float]] = {peer: [] for peer in runners}
    calls: dict[str, int] = {}
    for peer, runner in runners.items():  # warm up and size each peer's round
        runner(inputs)
        once_ms = _warm_call_ms(runner, inputs, min_round_ms / 4)
        calls[peer] = max(1, int(min_round_ms / max(once_ms, 1e-3)))
        samples[peer].append(once_ms)
    budget_rounds = {  # a round's calls and its untimed first one
        peer: max(2, min(rounds, int(max_seconds_per_peer * 1e3
                                     / max(s[0] * (calls[peer] + 1), 1e-3))))
        for peer, s in samples.items()
    }
    for peer in samples:
        samples[peer].clear()
    order = list(runners.items())
    for round_index in range(rounds):
        for peer, runner in (order if round_index % 2 == 0 else order[::-1]):
            if round_index >= budget_rounds[peer]:
                continue
            runner(inputs)  # untimed: the timed calls follow a call of their own runner
            start = time.perf_counter()
            for _ in range(calls[peer]):
                runner(inputs)
            samples[peer].append((time.perf_counter() - start) * 1e3 / calls[peer])
    return samples


def _warm_call_ms(runner, inputs: dict, budget_ms: float) -> float:
    """Mean ms of ``runner``'s calls repeated for about ``budget_ms`` (at least one call)."""
    start, calls = time.perf_counter(), 0
    while True:
        runner(inputs)
        calls += 1
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if elapsed_ms >= budget_ms:
            return elapsed_ms / calls


def _agreement(outputs, reference, rtol, atol) -> tuple[float, bool]:
    if len(outputs) != len(reference):
        return float("inf"), False
    worst, agree = 0.0, True
    for got, want in zip(outputs, reference, strict=True):
        got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
        if got.shape != want.shape:
            return float("inf"), False
        if not np.array_equal(np.isnan(got), np.isnan(want)):
            return float("nan"), False  # NaN where the reference has none (or the reverse)
        scale = max(float(np.abs(want).max(initial=0.0, where=~np.isnan(want))), 1e-6)
        diff = np.abs(got - want)
        worst = max(worst, float(diff.max(initial=0.0, where=~np.isnan(diff))) / scale)
        agree &= bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
    return worst, agree


def format_table(comparisons: list[Comparison], *, baseline: str = "tvm",
                 peak_gflops: float | None = None) -> str:
    """A plain-text table: one row per model and runtime, with speed-up over ``baseline``."""
    header = f"{'model':24s} {'runtime':12s} {'median ms':>11s} {'GFLOP/s':>9s}"
    header += f" {'% peak':>7s}" if peak_gflops else ""
    header += f" {'vs ' + baseline:>10s} {'compile s':>10s}  note"
    lines = [header, "-" * len(header)]
    for comp in comparisons:
        base = comp.by_name(baseline)
        base_ms = base.median_ms if base and base.ok else float("nan")
        for r in comp.results:
            if not r.ok:
                lines.append(f"{comp.model:24s} {r.name:12s} {'-':>11s}  ({r.error})")
                continue
            gflops = comp.flops / r.median_ms / 1e6 if comp.flops else float("nan")
            row = f"{comp.model:24s} {r.name:12s} {r.median_ms:11.3f} {gflops:9.1f}"
            if peak_gflops:
                row += f" {100 * gflops / peak_gflops:6.1f}%"
            row += f" {base_ms / r.median_ms:9.2f}x {r.compile_s:10.2f}"
            row += f"  rel err {r.max_rel_err:.1e}" + (" INEXACT" if r.inexact else "")
            lines.append(row)
    return "\n".join(lines)


def format_ratios(comparisons: list[Comparison], subject: str = "hybrid") -> str:
    """One row per model: ``subject``'s time and its speed ratio over every other runtime.

    A ratio above 1.00 means ``subject`` is faster (``other_ms / subject_ms``); a ``*`` marks a
    runtime whose outputs were wrong (:attr:`PeerResult.inexact`).
    """
    others = [r.name for r in comparisons[0].results if r.name != subject] if comparisons else []
    header = f"{'model':24s} {subject + ' ms':>11s}" + "".join(
        f" {'vs ' + name:>15s}" for name in others
    )
    lines = [header, "-" * len(header)]
    for comp in comparisons:
        mine = comp.by_name(subject)
        if mine is None or not mine.ok:
            lines.append(f"{comp.model:24s} {'-':>11s}")
            continue
        row = f"{comp.model:24s} {mine.median_ms:11.3f}"
        for name in others:
            other = comp.by_name(name)
            ok = other is not None and other.ok
            mark = "*" if ok and other.inexact else "x"
            row += f" {other.median_ms / mine.median_ms:14.2f}{mark}" if ok else f" {'-':>15s}"
        lines.append(row)
    return "\n".join(lines)
