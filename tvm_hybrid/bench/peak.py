"""Measure the machine's peaks: the rate of a register-resident microkernel for each number kind.

The OS-reported clock is wrong on virtual machines (this project's 2-core VM says 2.6 GHz while
the cores run above 4 GHz), so a nominal peak from it is meaningless. Instead a kernel shaped
like our microkernels (``mr`` broadcasts of ``A`` and ``nv`` vectors of ``B`` per step, ``mr x nv``
independent accumulators, enough to fill the pipes), whose operands sit in L1, runs on every
core; its rate is the sustainable peak of that instruction sequence:

========  ====================================================  ========================
kind      instruction sequence (per accumulator update)         multiply-adds per update
========  ====================================================  ========================
fp32      ``vfmadd231ps`` (zmm with AVX-512, else ymm)           lanes
int8      ``vpdpbusd`` (AVX512-VNNI zmm, AVX-VNNI ymm), or       4 x lanes
          ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd`` on AVX2
          (ONNX Runtime's saturating form: the AVX2 int8 peak)
bf16      ``vdpbf16ps`` (AVX512-BF16 only)                       2 x lanes
========  ====================================================  ========================

On AMX hosts int8 and bf16 are measured on the tile unit instead, as the GEMM engine uses it
there: ``tdpbusd`` (16 x 16 x 64 multiply-adds) or ``tdpbf16ps`` (16 x 16 x 32) on four
independent accumulator tiles whose operands stay in tile registers.

Rates count 2 operations per multiply-add. The fp32 rate also gives the effective clock::

    clock = rate / (cores * fma_pipes * lanes * 2)

with ``fma_pipes`` = 2 on every AVX2 or AVX-512 core this project targets (Haswell and later,
Zen 2 to Zen 5).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import tvm
from tvm.script import tirx as T
from tvm.target import Target

from ..host import check_runnable_here, host_target, target_features
from ..microkernels.families.amx import configure_tiles
from ..microkernels.families.bf16_dot import DPBF16PS_IR
from ..thread_pool import num_threads

FMA_PIPES = 2
_PANEL = 64  # steps whose operands cycle through L1
_REPEATS = 1 << 13
#: Separate timer calls per measurement, and the pause between them (:func:`_best_seconds`).
_TIMINGS = 3
_TIMING_PAUSE_S = 0.05
#: kind: (instruction, LLVM feature, multiply-adds per instruction) of the AMX tile unit.
_AMX = {"int8": ("tdpbusd tmm", "amx-int8", 16 * 16 * 64),
        "bf16": ("tdpbf16ps tmm", "amx-bf16", 16 * 16 * 32)}
_AMX_REPEATS = 1 << 10


@dataclasses.dataclass(frozen=True)
class Peak:
    """A measured peak: ``gops`` G operations per second (2 per multiply-add) on ``cores``."""

    kind: str
    instruction: str
    gops: float
    cores: int
    lanes: int

    @property
    def gflops(self) -> float:
        """Alias of :attr:`gops` for floating-point kinds."""
        return self.gops

    @property
    def clock_ghz(self) -> float:
        """The effective clock, from an fp32 peak (2 FMA pipes per core)."""
        if self.kind != "fp32":
            raise ValueError("the clock is derived from the fp32 peak only")
        return self.gops / (self.cores * FMA_PIPES * self.lanes * 2)

    def describe(self) -> str:
        unit = "GOP/s" if self.kind == "int8" else "GFLOP/s"
        text = (f"{self.kind} {self.gops:.0f} {unit} measured ({self.instruction}, "
                f"{self.cores} cores")
        if self.kind == "fp32":
            text += f" x {self.clock_ghz:.2f} GHz x {FMA_PIPES * self.lanes * 2} FLOP/cycle"
        return text + ")"


def peak_instruction(kind: str, target: Target | None = None) -> tuple[str, int] | None:
    """``(instruction, vector bits)`` :func:`measure_peak` times for ``kind`` on ``target``.

    None when the target has no such instruction (bf16 without AVX512-BF16, anything without
    AVX2).
    """
    features = target_features(target or host_target())
    wide = "avx512f" in features
    if kind in _AMX and {"amx-tile", _AMX[kind][1]} <= features:
        return _AMX[kind][0], 512
    if kind == "fp32":
        if wide:
            return "vfmadd231ps zmm", 512
        return ("vfmadd231ps ymm", 256) if {"avx2", "fma"} <= features else None
    if kind == "int8":
        if "avx512vnni" in features and wide:
            return "vpdpbusd zmm", 512
        if "avxvnni" in features:
            return "vpdpbusd ymm", 256
        return ("vpmaddubsw+vpmaddwd ymm", 256) if "avx2" in features else None
    if kind == "bf16":
        return ("vdpbf16ps zmm", 512) if "avx512bf16" in features and wide else None
    raise ValueError(f"unknown peak kind {kind!r}: use 'fp32', 'int8' or 'bf16'")


def measure_peak(kind: str = "fp32", target: Target | None = None,
                 cores: int | None = None) -> Peak:
    """Run the ``kind`` throughput kernel (module docstring) on ``cores`` threads.

    Parameters
    ----------
    kind
        ``"fp32"``, ``"int8"`` or ``"bf16"``.
    target
        The target to compile the kernel for (default: the host). It must run here.
    cores
        Threads to run on (default: TVM's thread count).

    Raises
    ------
    RuntimeError
        When the target has no instruction for ``kind`` (see :func:`peak_instruction`).
    """
    target = target or host_target()
    cores = cores or num_threads()
    found = peak_instruction(kind, target)
    if found is None:
        raise RuntimeError(f"no {kind} multiply-add instruction for target {target}")
    instruction, bits = found
    if instruction.startswith("tdp"):
        check_runnable_here(target)  # and asks Linux for the tile permission
        lib = tvm.compile(_amx_throughput_kernel(kind, cores), target=target)
        tiles = [tvm.runtime.tensor(np.zeros((cores, 4, 16, 64), "uint8")) for _ in range(2)]
        acc = tvm.runtime.tensor(np.zeros((cores, 4, 16, 16), "int32" if kind == "int8"
                                          else "float32"))
        timer = lib.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=7)
        seconds = _best_seconds(timer, [*tiles, acc])
        updates = cores * 4 * _AMX_REPEATS
        return Peak(kind, instruction, 2.0 * updates * _AMX[kind][2] / seconds / 1e9, cores,
                    bits // 32)
    lanes = bits // 32
    registers = 32 if bits == 512 else 16
    # Accumulators to cover the pipes' latency, leaving registers for operands and temporaries.
    mr, nv = (8, 2) if registers == 32 else ((6, 2) if kind == "fp32" else (4, 2))
    func = _throughput_kernel(kind, instruction, lanes, mr, nv, cores)
    lib = tvm.compile(func, target=target)
    a_dtype = "float32" if kind == "fp32" else "int32"
    rng = np.random.default_rng(0)
    if kind == "fp32":
        a = np.full((cores, _PANEL, mr), 1e-3, "float32")
        b = np.full((cores, _PANEL, nv, lanes), 1e-3, "float32")
    else:
        a = rng.integers(0, 1 << 30, (cores, _PANEL, mr)).astype(a_dtype)
        b = rng.integers(0, 1 << 30, (cores, _PANEL, nv, lanes)).astype(a_dtype)
    c = np.zeros((cores, mr, nv, lanes), "float32" if kind != "int8" else "int32")
    args = [tvm.runtime.tensor(x) for x in (a, b, c)]
    timer = lib.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=7)
    seconds = _best_seconds(timer, args)
    per_update = {"fp32": 1, "int8": 4, "bf16": 2}[kind] * lanes
    updates = cores * mr * nv * _PANEL * _REPEATS
    return Peak(kind, instruction, 2.0 * updates * per_update / seconds / 1e9, cores, lanes)


def _best_seconds(timer, args: list) -> float:
    """The fastest run of :data:`_TIMINGS` timer calls (each of 7 repeats; the fp32 kernel's
    call takes about 25 ms).

    On a shared VM a vCPU sometimes ran at half speed for longer than one call: a process's
    first call gave 234 GFLOP/s and its next ones 435-461 (a 2-core Zen 5), and a benchmark's
    table then read 149-168% of that peak. Separate calls 50 ms apart keep such a moment out
    of the best."""
    best = math.inf
    for attempt in range(_TIMINGS):
        if attempt:
            time.sleep(_TIMING_PAUSE_S)
        best = min(best, min(timer(*args).results))
    return best


def measure_fp32_peak(target: Target | None = None, cores: int | None = None) -> Peak:
    """The fp32 peak (:func:`measure_peak` for ``"fp32"``)."""
    return measure_peak("fp32", target, cores)


def _throughput_kernel(kind: str, instruction: str, lanes: int, mr: int, nv: int, cores: int):
    """``C[p] = sum over steps of update(A[p, step, i], B[p, step, v])`` per accumulator."""
    bits = lanes * 32
    acc_dtype = "int32" if kind == "int8" else "float32"
    vec = f"{acc_dtype}x{lanes}"
    in_dtype = "float32" if kind == "fp32" else "int32"
    steps = _PANEL * _REPEATS

    def update(acc, a, b):
        if kind == "fp32":
            return T.call_llvm_pure_intrin(vec, "llvm.fma", T.broadcast(a, lanes), b, acc)
        if kind == "bf16":
            return T.call_extern(vec, "hybrid_dpbf16ps_512", acc, T.broadcast(a, lanes), b)
        a_bytes = T.reinterpret(T.broadcast(a, lanes), dtype=f"int8x{4 * lanes}")
        b_bytes = T.reinterpret(b, dtype=f"int8x{4 * lanes}")
        if instruction.startswith("vpdpbusd"):
            return T.call_llvm_pure_intrin(vec, f"llvm.x86.avx512.vpdpbusd.{bits}", acc,
                                           a_bytes, b_bytes)
        pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", a_bytes,
                                        b_bytes)
        return acc + T.call_llvm_pure_intrin(vec, "llvm.x86.avx2.pmadd.wd", pairs,
                                             T.broadcast(T.int16(1), 16))

    annotations = {"pragma_import_llvm": DPBF16PS_IR} if kind == "bf16" else {}

    @T.prim_func
    def kernel(A: T.Buffer((cores, _PANEL, mr), in_dtype),
               B: T.Buffer((cores, _PANEL, nv, lanes), in_dtype),
               C: T.Buffer((cores, mr, nv, lanes), acc_dtype)):
        # Without noalias LLVM must store the accumulators to memory after every update.
        T.func_attr({"tirx.noalias": True})
        for p in T.parallel(cores):
            acc = T.alloc_buffer((mr, nv, lanes), acc_dtype, scope="local")
            for i in T.unroll(mr):
                for v in T.unroll(nv):
                    acc[i, v, T.ramp(0, 1, lanes)] = T.broadcast(T.Cast(acc_dtype, 0), lanes)
            for step in T.serial(steps, annotations=annotations):
                for i in T.unroll(mr):
                    for v in T.unroll(nv):
                        acc[i, v, T.ramp(0, 1, lanes)] = update(
                            acc[i, v, T.ramp(0, 1, lanes)], A[p, step % _PANEL, i],
                            B[p, step % _PANEL, v, T.ramp(0, 1, lanes)])
            for i in T.unroll(mr):
                for v in T.unroll(nv):
                    C[p, i, v, T.ramp(0, 1, lanes)] = acc[i, v, T.ramp(0, 1, lanes)]

    return kernel


def _amx_throughput_kernel(kind: str, cores: int):
    """Per core: configure 8 tiles of 16 rows x 64 bytes, load accumulator tiles 0-3 and
    operand tiles 4-7 once, then ``_AMX_REPEATS`` rounds of ``C[t] += A[4 + t // 2] x B[6 + t %
    2]`` on the four accumulators (independent chains, as in the GEMM engine's 32 x 32 block)."""
    dot = "llvm.x86.tdpbusd" if kind == "int8" else "llvm.x86.tdpbf16ps"
    acc_dtype = "int32" if kind == "int8" else "float32"

    @T.prim_func
    def kernel(A: T.Buffer((cores, 4, 16, 64), "uint8"), B: T.Buffer((cores, 4, 16, 64), "uint8"),
               C: T.Buffer((cores, 4, 16, 16), acc_dtype)):
        for p in T.parallel(cores):
            configure_tiles()
            for t in T.unroll(4):
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.Cast("int8", t),
                                              T.address_of(C[p, t, 0, 0]), T.int64(64)))
            for t in T.unroll(2):
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.x86.tileloadd64", T.Cast("int8", 4 + t),
                    T.address_of(A[p, t, 0, 0]), T.int64(64)))
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.x86.tileloadd64", T.Cast("int8", 6 + t),
                    T.address_of(B[p, t, 0, 0]), T.int64(64)))
            for _ in range(_AMX_REPEATS):
                for t in T.unroll(4):
                    T.evaluate(T.call_llvm_intrin("void", dot, T.Cast("int8", t),
                                                  T.Cast("int8", 4 + t // 2),
                                                  T.Cast("int8", 6 + t % 2)))
            for t in T.unroll(4):
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.Cast("int8", t),
                                              T.address_of(C[p, t, 0, 0]), T.int64(64)))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return kernel
