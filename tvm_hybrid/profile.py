"""The profile report: where a model's time goes, kernel by kernel, and why.

TVM 0.27's Relax VM has no profiler in this build, so :func:`profile_model` instruments the VM
itself: one run with an instrument hook (``VirtualMachine.set_instrument``) records every kernel
call and a copy of its arguments, then the recorded calls are replayed in the run's order, each
timed with TVM's ``time_evaluator`` (C++ timers, one call per timing), and each kernel's time is
the median over the replays. Per kernel the report gives its ONNX nodes,
how it was scheduled (expert template, fallback rule or stock lowering) and why, calls, total
and mean time, share of the model's measured latency, and for GEMM-like kernels GFLOP/s and %
of the machine's measured peak of their number kind (``peak.py``). What the kernels do not
account for (the VM's dispatch and allocation) is shown as its own line.
"""

from __future__ import annotations

import dataclasses
import html
import json
from functools import cache

import numpy as np
import tvm
from tvm import relax

from .kernel_info import KernelInfo


@dataclasses.dataclass
class KernelTime:
    """One kernel's line of the report."""

    info: KernelInfo
    calls: int
    total_ms: float
    share: float  # of the model's latency
    gflops: float | None = None
    peak_percent: float | None = None

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.calls


@dataclasses.dataclass
class ProfileReport:
    """Per-kernel times of one model run, slowest first (see the module docstring)."""

    model_ms: float
    kernels: list[KernelTime]
    peaks: dict

    @property
    def kernels_ms(self) -> float:
        return sum(k.total_ms for k in self.kernels)

    def by_schedule(self) -> dict[str, float]:
        """Milliseconds in template, fallback and stock kernels, and the memory-bound ones."""
        out = {"template": 0.0, "fallback": 0.0, "stock": 0.0, "memory-bound": 0.0}
        for k in self.kernels:
            out[k.info.schedule] = out.get(k.info.schedule, 0.0) + k.total_ms
            if not k.info.flops:
                out["memory-bound"] += k.total_ms
        return out

    def summary(self) -> str:
        parts = self.by_schedule()
        other = self.model_ms - self.kernels_ms
        return (f"model {self.model_ms:.3f} ms; kernels {self.kernels_ms:.3f} ms "
                f"({100 * self.kernels_ms / self.model_ms:.0f}%): templates "
                f"{parts['template']:.3f}, fallback {parts['fallback']:.3f}, stock "
                f"{parts['stock']:.3f} (memory-bound {parts['memory-bound']:.3f}); outside "
                f"the kernels (VM dispatch, allocation, cache effects) {max(other, 0.0):.3f} ms")

    def rows(self) -> list[dict]:
        return [{"kernel": k.info.name, "nodes": k.info.nodes, "schedule": k.info.schedule,
                 "detail": k.info.detail, "calls": k.calls, "total_ms": k.total_ms,
                 "mean_ms": k.mean_ms, "share": k.share, "gflops": k.gflops,
                 "peak_percent": k.peak_percent} for k in self.kernels]

    def to_json(self) -> str:
        return json.dumps({"model_ms": self.model_ms, "kernels_ms": self.kernels_ms,
                           "peaks_gops": self.peaks, "kernels": self.rows()}, indent=1)

    def __str__(self) -> str:
        lines = [f"{'kernel':44s} {'schedule':8s} {'calls':>5s} {'total ms':>9s} "
                 f"{'share':>6s} {'GFLOP/s':>8s} {'% peak':>6s}  nodes / detail"]
        for k in self.kernels:
            rate = f"{k.gflops:8.1f}" if k.gflops is not None else f"{'':8s}"
            peak = f"{k.peak_percent:5.1f}%" if k.peak_percent is not None else f"{'':6s}"
            nodes = ", ".join(k.info.nodes[:4]) + (" ..." if len(k.info.nodes) > 4 else "")
            lines.append(f"{_short(k.info.name, 44):44s} {k.info.schedule:8s} {k.calls:5d} "
                         f"{k.total_ms:9.3f} {100 * k.share:5.1f}% {rate} {peak}  {nodes}")
            if k.info.detail:
                lines.append(f"{'':44s} {'':8s} {'':5s} {'':9s} {'':6s} {'':8s} {'':6s}  "
                             f"-> {k.info.detail}")
        lines.append(self.summary())
        return "\n".join(lines)

    def to_html(self, path) -> None:
        """Write the report as an HTML page with a bar per kernel (share of the time)."""
        colours = {"template": "#2e7d32", "fallback": "#f9a825", "stock": "#c62828"}
        rows = []
        for k in self.kernels:
            width = max(0.5, 100 * k.share)
            rate = (f"{k.gflops:.1f} GFLOP/s ({k.peak_percent:.0f}% of peak)"
                    if k.gflops is not None and k.peak_percent is not None else "")
            rows.append(
                f"<tr><td title='{html.escape(k.info.name)}'>{html.escape(_short(k.info.name, 60))}"
                f"</td><td>{k.info.schedule}</td><td class=n>{k.calls}</td>"
                f"<td class=n>{k.total_ms:.3f}</td><td><div class=bar style='width:{width:.1f}%;"
                f"background:{colours.get(k.info.schedule, '#555')}'></div>"
                f"{100 * k.share:.1f}%</td><td>{rate}</td>"
                f"<td>{html.escape(', '.join(k.info.nodes))}<br><i>"
                f"{html.escape(k.info.detail)}</i></td></tr>")
        page = f"""<!doctype html><meta charset=utf-8><title>tvm_hybrid profile</title>
<style>body{{font:14px sans-serif;margin:2em}}table{{border-collapse:collapse;width:100%}}
td,th{{border-bottom:1px solid #ddd;padding:4px;vertical-align:top;text-align:left}}
td.n{{text-align:right}}.bar{{height:12px;display:inline-block;margin-right:6px}}
td:nth-child(5){{width:30%}}</style>
<h1>tvm_hybrid profile</h1><p>{html.escape(self.summary())}</p>
<p><span style='color:{colours["template"]}'>&#9632;</span> expert template
<span style='color:{colours["fallback"]}'>&#9632;</span> fallback rule
<span style='color:{colours["stock"]}'>&#9632;</span> stock lowering</p>
<table><tr><th>kernel</th><th>schedule</th><th>calls</th><th>ms</th><th>share of the model's
time</th><th>rate</th><th>ONNX nodes / why</th></tr>{''.join(rows)}</table>"""
        with open(path, "w") as stream:
            stream.write(page)


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


@cache
def _peak_gops(kind: str) -> float | None:
    from .bench.peak import measure_peak, peak_instruction

    if not kind:
        return None
    if kind == "bf16" and peak_instruction("bf16") is None:
        kind = "fp32"  # emulated bf16 runs on the fp32 FMA units
    if peak_instruction(kind) is None:
        return None
    return measure_peak(kind).gops


def _kernel_modules(executable) -> list:
    root = getattr(executable, "mod", executable)
    found, stack = [], [root]
    while stack:
        module = stack.pop()
        found.append(module)
        stack.extend(module.imports)
    return found


def profile_model(model, arrays: list[np.ndarray], repeat: int = 10) -> ProfileReport:
    """Profile ``model`` (a :class:`~tvm_hybrid.compiled_model.CompiledModel`) on ``arrays``."""
    infos = model.kernels
    model_ms = model.benchmark(*arrays, repeat=max(repeat, 3))["median_ms"]
    args = model._to_device(arrays)
    modules = _kernel_modules(model.executable)

    @cache
    def owner(name: str):
        """The module holding kernel ``name`` (None for the VM's own functions)."""
        return next((m for m in modules if m.implements_function(name, False)), None)

    calls: list[tuple[str, list]] = []

    def instrument(func, name, before_run, ret_value, *call_args):
        if before_run and not name.startswith("vm.") and owner(name) is not None:
            calls.append((name, [tvm.runtime.tensor(a.numpy()) if isinstance(
                a, tvm.runtime.Tensor) else a for a in call_args]))
        return relax.VMInstrumentReturnKind.NO_OP

    vm = relax.VirtualMachine(model.executable, tvm.cpu())
    vm.set_instrument(instrument)
    vm["main"](*args)
    # Replay the run's calls in order, each timed by TVM (one call per timing), ``repeat``
    # times: every kernel runs after the one before it, as in the model (caches included).
    timers = {name: owner(name).time_evaluator(name, tvm.cpu(), number=1, repeat=1)
              for name, _ in calls}
    rounds: list[dict[str, float]] = []
    for _ in range(repeat):
        spent: dict[str, float] = {}
        for name, call_args in calls:
            spent[name] = spent.get(name, 0.0) + timers[name](*call_args).mean * 1e3
        rounds.append(spent)
    counts: dict[str, int] = {}
    for name, _ in calls:
        counts[name] = counts.get(name, 0) + 1
    kernels, peaks = [], {}
    for name, calls_of in counts.items():
        info = infos.get(name) or KernelInfo(name, [], "unknown", "")
        total = float(np.median([spent[name] for spent in rounds]))
        line = KernelTime(info, calls_of, total, total / model_ms)
        if info.flops:
            line.gflops = info.flops * calls_of / total / 1e6
            peak = _peak_gops(info.kind)
            if peak:
                peaks[info.kind] = peak
                line.peak_percent = 100 * line.gflops / peak
        kernels.append(line)
    kernels.sort(key=lambda k: -k.total_ms)
    return ProfileReport(model_ms, kernels, peaks)
