"""Measure the machine's fp32 peak: the FMA rate of a register-resident kernel, and the clock.

The OS-reported clock is wrong on virtual machines (this project's 2-core VM says 2.6 GHz while
the cores run above 4 GHz), so a nominal peak from it is meaningless. Instead a kernel with
``mr x nr / lanes`` independent accumulators (enough to fill both FMA pipes), whose operands sit
in L1, runs for a fixed number of FMAs on every core; its rate is the sustainable fp32 peak, and
dividing by the FMAs each core can issue per cycle gives the effective clock::

    clock = rate / (cores * fma_pipes * lanes * 2)

``fma_pipes`` is 2 on every AVX-512 or AVX2 core this project targets (Zen 4/5, Skylake-SP and
later Xeons).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import s_tir, te
from tvm.target import Target

from .host import host_target
from .microkernels import fp32_microkernels
from .thread_pool import num_threads

FMA_PIPES = 2


@dataclasses.dataclass(frozen=True)
class Peak:
    """A measured fp32 peak."""

    gflops: float
    clock_ghz: float
    cores: int
    lanes: int

    def describe(self) -> str:
        return (f"{self.gflops:.0f} GFLOP/s measured = {self.cores} cores x "
                f"{self.clock_ghz:.2f} GHz x {FMA_PIPES * self.lanes * 2} FLOP/cycle")

    @property
    def bf16_gflops(self) -> float:
        """The AVX512-BF16 peak at the measured clock: ``vdpbf16ps`` issues on the FMA pipes,
        each doing 2 multiply-adds per 32-bit lane (twice the fp32 rate)."""
        return 2 * self.gflops

    @property
    def vnni_gops(self) -> float:
        """The u8 x s8 VNNI peak at the measured clock: ``vpdpbusd`` issues on the same pipes as
        FMA, each doing 4 multiply-adds per 32-bit lane (256 int8 ops/cycle/core with
        AVX-512)."""
        return self.cores * self.clock_ghz * FMA_PIPES * self.lanes * 4 * 2


def measure_fp32_peak(target: Target | None = None, cores: int | None = None) -> Peak:
    """Run the FMA-throughput kernel on ``cores`` threads (default: TVM's thread count)."""
    target = target or host_target()
    cores = cores or num_threads()
    kernels = [k for k in fp32_microkernels(target) if k.mr * k.nr // k.lanes >= 16]
    if not kernels:
        raise RuntimeError(f"no fp32 FMA microkernel for target {target}")
    kernel = min(kernels, key=lambda k: k.mr)
    mr, nr, lanes = kernel.mr, kernel.nr, kernel.lanes
    panel, repeats = 64, 1 << 15
    a = te.placeholder((cores, mr, panel), name="A")
    b = te.placeholder((cores, panel, nr), name="B")
    k = te.reduce_axis((0, panel * repeats), name="k")
    c = te.compute(
        (cores, mr, nr),
        lambda p, i, j: te.sum(a[p, i, k % panel] * b[p, k % panel, j], axis=k),
        name="C",
    )
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    block = sch.get_sblock("C")
    p, i, j, kk = sch.get_loops(block)
    k_outer, k_inner = sch.split(kk, [None, panel])
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, p)
    sch.parallel(p)
    sch.reorder(k_outer, k_inner, i, j)
    sch.unroll(i)
    vec_outer, vec_inner = sch.split(j, [None, lanes])
    sch.unroll(vec_outer)
    sch.vectorize(vec_inner)
    init = sch.decompose_reduction(block, k_outer)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(acc)[-1])
    lib = tvm.compile(sch.mod, target=target)
    args = [
        tvm.runtime.tensor(np.full(shape, 1e-3, "float32"))
        for shape in ((cores, mr, panel), (cores, panel, nr), (cores, mr, nr))
    ]
    timer = lib.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=7)
    seconds = min(timer(*args).results)
    gflops = 2.0 * cores * mr * nr * panel * repeats / seconds / 1e9
    clock = gflops / (cores * FMA_PIPES * lanes * 2)
    return Peak(gflops, clock, cores, lanes)
