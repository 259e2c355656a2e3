"""The machine we compile for: CPU detection, ISA tiers, cache sizes and target construction.

``target="host"`` asks LLVM for the running CPU (``llvm_get_system_cpu``) and its features and
builds a JSON :class:`tvm.target.Target` with ``mcpu`` and ``num-cores``. LLVM's CPU name comes
from the CPU's family and model, not from what the machine lets programs use: a VM or kernel
may hide AMX or AVX-512 of an Emerald Rapids (cpuinfo then lacks ``amx_tile``). The host target
turns such features off with ``mattr`` (``-amx-tile``, ...), read from LLVM's host feature
detection (CPUID and XCR0), so nothing is compiled for an ISA the process cannot run.

A VM may also report a model number older than its CPU: a Sapphire Rapids guest that says
model 167 is named ``rocketlake``, which has no AMX, AVX512-BF16 or AVX512-FP16. When the running
CPU offers vector or matrix features the named CPU lacks, the host CPU is the one LLVM knows whose
features fit the running ones best (:func:`real_host_cpu`), so those features are used.

An explicit target (a dict, a JSON string, or a ``Target``) is validated: tvm_hybrid generates
x86 code, so the kind must be ``llvm`` with an x86 CPU LLVM knows.

``TVM_HYBRID_HOST_CPU=<mcpu>`` makes this machine behave as an older CPU: ``"host"`` compiles for
that CPU and only its ISA features count as present (for what is selected, what may run, and which
tests run). It may only take features away: naming a CPU with a vector or matrix ISA this machine
lacks raises :class:`~tvm_hybrid.errors.TargetError`. It is how an AVX-512 machine checks the
AVX2-only path (``TVM_HYBRID_HOST_CPU=znver3``, ``haswell``), e.g. before a fleet of older hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import cache
from pathlib import Path

import tvm
from tvm.target import Target, codegen

from .errors import TargetError
from .thread_pool import num_threads, physical_cores

# Vector features LLVM may use in any code (not only the microkernels'): a CPU lacking them
# faults on code built for them.
_WATCHED_FEATURES = frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                               "avx512dq", "avx512fp16"})

# Instructions LLVM emits only from intrinsics (system, security and synchronisation ones): a
# CPU name implying them fits a CPU that lacks them (a VM hides many): generated code never uses
# them.
_SYSTEM_FEATURES = frozenset({
    "cldemote", "clflushopt", "clwb", "enqcmd", "hreset", "invpcid", "kl", "movdir64b",
    "movdiri", "pconfig", "pku", "prefetchi", "ptwrite", "rdpid", "rdpru", "rtm", "serialize",
    "sgx", "shstk", "tsxldtrk", "uintr", "usermsr", "waitpkg", "wbnoinvd", "widekl",
})


@dataclasses.dataclass(frozen=True)
class CacheSizes:
    """Per-core data cache sizes in bytes (L3 is shared)."""

    l1d: int = 32 * 1024
    l2: int = 1024 * 1024
    l3: int = 16 * 1024 * 1024


#: Environment variable that makes this machine act as an older CPU (module docstring).
HOST_CPU_VARIABLE = "TVM_HYBRID_HOST_CPU"


@cache
def named_host_cpu() -> str:
    """LLVM's name for the running CPU, from its family and model (a VM may report an old one)."""
    return str(codegen.llvm_get_system_cpu())


@cache
def real_host_cpu() -> str:
    """The CPU this process runs on, as LLVM names it (:data:`HOST_CPU_VARIABLE` aside).

    LLVM's name (:func:`named_host_cpu`) unless the running CPU offers vector or matrix
    features that CPU lacks; then the CPU LLVM knows that has the most of the running CPU's
    features and none it lacks but system instructions a compiler emits only from intrinsics
    (:data:`_SYSTEM_FEATURES`; ties: fewest of those, then LLVM's order).
    """
    named = named_host_cpu()
    running = _running_features()
    if not running:
        return named
    watched = _watched_features()
    offered = {f for f, on in running.items() if on}

    def fit(mcpu: str) -> tuple[int, int, int] | None:
        features = target_features(Target({"kind": "llvm", "mcpu": mcpu}))
        lacking = {f for f in features if running.get(f) is False}
        if lacking - _SYSTEM_FEATURES:
            return None  # code for it could use an instruction the running CPU lacks
        return len(features & offered & watched), -len(lacking), len(features & offered)

    named_target = Target({"kind": "llvm", "mcpu": named})
    if not (offered & watched) - target_features(named_target):
        return named  # features it names but the CPU hides are turned off (hidden_features)
    best, best_fit = named, fit(named) or (-1, 0, -1)
    for cpu in codegen.llvm_get_cpu_archlist(named_target):
        score = fit(str(cpu))
        if score is not None and score > best_fit:
            best, best_fit = str(cpu), score
    return best


@cache
def _running_features() -> dict[str, bool]:
    """LLVM's host feature detection: which features the running process may use."""
    detect = tvm.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures", allow_missing=True)
    if detect is None:  # an LLVM-less build; trust the CPU name
        return {}
    return {str(k): bool(v) for k, v in detect().items()}


def hidden_features(mcpu: str) -> list[str]:
    """The ISA features ``mcpu`` implies that the running CPU does not offer (hidden by the
    hypervisor or the kernel), as ``mattr`` entries that turn them off (``-amx-tile``, ...)."""
    running = _running_features()
    implied = _isa_features(Target({"kind": "llvm", "mcpu": mcpu}))
    return [f"-{f}" for f in sorted(implied) if running.get(f) is False]


def _cpu_target(mcpu: str, **attrs) -> Target:
    """A target for ``mcpu`` as this machine runs it: the features it hides turned off, and
    512-bit vectors for all code where it has AVX-512 (:func:`wide_vectors`)."""
    spec = {"kind": "llvm", "mcpu": mcpu, **attrs}
    hidden = hidden_features(mcpu)
    if hidden:
        spec["mattr"] = hidden
    return wide_vectors(Target(spec))


#: The LLVM tuning feature of Intel's AVX-512 CPUs (Skylake-X to Emerald Rapids) under which
#: LLVM's vectorizers make vectors of at most 256 bits.
NARROW_VECTORS = "prefer-256-bit"


def wide_vectors(target: Target) -> Target:
    """``target`` with LLVM's vectorizers making 512-bit vectors where it has AVX-512.

    TVM leaves some operations scalar in a vectorized loop (the rounding of a quantization,
    ``nearbyint``, and what is computed with it), and LLVM's loop and SLP vectorizers vectorize
    them again, at most as wide as the target prefers. LLVM gives Intel's AVX-512 CPUs the
    tuning feature :data:`NARROW_VECTORS` (AMD's Zen 4/5 do not have it), so the quantized
    epilogues of the int8 kernels ran on ymm there. Turning it off (``mattr``
    ``-prefer-256-bit``) vectorizes them on zmm, as on AMD. On the 2-core Emerald Rapids VM
    (whole models, the two targets in the same process, 7 rounds, outputs identical):
    orientation_qdq_int8 1.40x and 1.44x faster (two runs); the other 21 models of
    ``real_models.py --all`` 0.98-1.07x (geometric mean of all 22 1.027x), those under 1.0x
    0.995-1.012x in a rerun of 15 rounds. A target whose ``mattr`` already names the feature
    (either way) is left as it is.
    """
    features = target_features(target)
    if NARROW_VECTORS not in features or "avx512f" not in features:
        return target
    spec = target_to_dict(target)
    mattr = spec.get("mattr", [])
    if any(names_narrow_vectors(m) for m in mattr):
        return target
    spec["mattr"] = [*mattr, f"-{NARROW_VECTORS}"]
    return Target(spec)


def names_narrow_vectors(mattr_entry: str) -> bool:
    """Whether an ``mattr`` entry turns :data:`NARROW_VECTORS` on or off."""
    return str(mattr_entry).lstrip("+-") == NARROW_VECTORS


@cache
def host_cpu() -> str:
    """LLVM's name for the host CPU, e.g. ``znver5`` or ``sapphirerapids``.

    The running CPU, or the one :data:`HOST_CPU_VARIABLE` names (checked to ask for no ISA the
    running CPU lacks).

    Raises
    ------
    TargetError
        When the variable names a CPU LLVM does not know, or one with vector or matrix features
        the running CPU lacks (its code would fault here).
    """
    wanted = os.environ.get(HOST_CPU_VARIABLE, "").strip()
    real = real_host_cpu()
    if not wanted or wanted == real:
        return real
    real_target = _cpu_target(real)
    known = {str(c) for c in codegen.llvm_get_cpu_archlist(real_target)}
    if wanted not in known:
        raise TargetError(f"{HOST_CPU_VARIABLE}={wanted!r} is not a CPU LLVM {_llvm_major()} "
                          f"knows (e.g. haswell, znver3, skylake-avx512, znver5)")
    extra = _isa_features(Target({"kind": "llvm", "mcpu": wanted})) - _isa_features(real_target)
    if extra:
        raise TargetError(
            f"{HOST_CPU_VARIABLE}={wanted} would use {', '.join(sorted(extra))}, which this CPU "
            f"({real}) lacks; it can only emulate a CPU with fewer ISA features")
    return wanted


@cache
def host_target() -> Target:
    """The target for this machine: its CPU (less the features it hides, :func:`hidden_features`)
    and its physical core count."""
    return _cpu_target(host_cpu(), **{"num-cores": physical_cores()})


def target_features(target: Target) -> frozenset[str]:
    """LLVM features enabled for ``target`` (``avx512f``, ``amx-tile``, ...)."""
    return frozenset(str(f) for f in codegen.llvm_get_cpu_features(target))


@cache
def host_features() -> frozenset[str]:
    """LLVM features of the running CPU."""
    return target_features(host_target())


def isa_tiers(features: frozenset[str]) -> list[str]:
    """The ISA tiers of the registered microkernel families (``avx2``, ``avx512``,
    ``avx512_vnni``, ``amx_int8``...) whose features are all in ``features``, oldest first."""
    from .microkernels import isa_tiers as tiers  # the registry needs this module first

    return [name for name, needed in tiers() if all(f in features for f in needed)]


@cache
def cache_sizes() -> CacheSizes:
    """Data cache sizes of CPU 0, read from sysfs (defaults where sysfs is silent)."""
    found: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        scale = {"K": 1024, "M": 1024 * 1024}.get(size[-1:], 1)
        found[{"1": "l1d", "2": "l2", "3": "l3"}.get(level, "")] = int(size.rstrip("KM")) * scale
    found.pop("", None)
    return CacheSizes(**found)


def make_target(target: str | dict | Target | None = "host") -> Target:
    """Build and validate a compilation target.

    Parameters
    ----------
    target
        ``"host"`` (or ``None``) for this machine; ``"llvm"`` for generic x86-64; a dict such as
        ``{"kind": "llvm", "mcpu": "sapphirerapids"}``; its JSON text; or a ``tvm.target.Target``.

    Returns
    -------
    Target
        A Target of kind ``llvm`` with a valid x86 ``mcpu`` and ``num-cores`` set (and
        512-bit vectors for all code on an Intel AVX-512 CPU: :func:`wide_vectors`).

    Raises
    ------
    TargetError
        If the target cannot be parsed, is not an LLVM CPU target, or names a CPU LLVM does not
        know.
    """
    if target is None or (isinstance(target, str) and target.strip() == "host"):
        return host_target()
    if isinstance(target, str):
        text = target.strip()
        if text.startswith("{"):
            try:
                target = json.loads(text)
            except json.JSONDecodeError as err:
                raise TargetError(f"target is not valid JSON ({err}): {text!r}") from None
        elif text == "llvm":
            target = {"kind": "llvm"}
        else:
            raise TargetError(
                f"unknown target {text!r}: use 'host', 'llvm', or a JSON dict such as "
                '\'{"kind": "llvm", "mcpu": "skylake-avx512"}\''
            )
    if isinstance(target, Target):
        spec = {str(k): v for k, v in target.export().items()}
    elif isinstance(target, dict):
        spec = dict(target)
    else:
        raise TargetError(f"target must be 'host', a dict or a tvm.target.Target, not {target!r}")

    if spec.get("kind") != "llvm":
        raise TargetError(
            f"tvm_hybrid compiles for x86 CPUs (target kind 'llvm'); got kind {spec.get('kind')!r}"
        )
    triple = str(spec.get("mtriple") or "x86_64")
    if not triple.startswith(("x86_64", "i686", "i386")):
        raise TargetError(f"tvm_hybrid compiles for x86 CPUs; got mtriple {triple!r}")
    spec.setdefault("num-cores", physical_cores())
    if isinstance(spec.get("keys"), tuple):
        spec["keys"] = list(spec["keys"])
    try:
        built = Target(spec)
    except (ValueError, TypeError, RuntimeError) as err:
        raise TargetError(f"invalid target {spec}: {str(err).splitlines()[0]}") from None
    mcpu = built.attrs.get("mcpu")
    if mcpu is not None and str(mcpu) not in {str(c) for c in codegen.llvm_get_cpu_archlist(built)}:
        raise TargetError(f"unknown CPU mcpu={str(mcpu)!r}: LLVM {_llvm_major()} does not know it")
    return wide_vectors(built)


def target_to_dict(target: Target) -> dict:
    """``target`` as a plain JSON-serialisable dict, accepted back by :func:`make_target`."""

    def plain(value):
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        if isinstance(value, dict) or hasattr(value, "items"):
            return {str(k): plain(v) for k, v in value.items()}
        if hasattr(value, "__iter__"):
            return [plain(v) for v in value]
        return str(value)

    return plain(target.export())


def _llvm_major() -> int:
    return int(codegen.llvm_version_major())


def uses_amx(target: Target) -> bool:
    """Whether ``target`` enables any feature of a per-block (AMX) microkernel family."""
    from .microkernels import all_families

    matrix = {f for family in all_families() if family.first.per_block for f in family.features}
    return bool(matrix & target_features(target))


_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 0x1022, 0x1023, 18
_SYS_ARCH_PRCTL = 158
_TILE_PERMISSION: list[bool] = []


def request_amx_permission() -> bool:
    """Ask Linux (once per process) for permission to use AMX tile data (XTILEDATA).

    Linux 5.16+ requires ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` before a
    thread executes tile instructions; without it the first ``ldtilecfg`` faults. Returns
    whether permission is held (False on CPUs or kernels without AMX).
    """
    if _TILE_PERMISSION:
        return _TILE_PERMISSION[0]
    granted = False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0:
            granted = bool(mask.value & (1 << _XFEATURE_XTILEDATA))
            if not granted:
                granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM,
                                       _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        granted = False
    _TILE_PERMISSION.append(granted)
    return granted


def check_runnable_here(target: Target) -> None:
    """Raise :class:`TargetError` if code built for ``target`` would fault on this CPU.

    Running code that uses an ISA the CPU lacks (AMX on an AMD host, AVX-512 on an AVX2 laptop)
    ends in SIGILL, or for AMX in an LLVM abort of the whole process, so we refuse up front.
    """
    missing = sorted(isa_feature for isa_feature in _isa_features(target) - host_features())
    if not missing and uses_amx(target) and not request_amx_permission():
        missing = ["amx-tile (Linux refused the XTILEDATA permission)"]
    if missing:
        raise TargetError(
            f"this model was compiled for mcpu={target.attrs.get('mcpu')!s}, which uses "
            f"{', '.join(missing)}; this CPU ({host_cpu()}) lacks "
            f"{'them' if len(missing) > 1 else 'it'}. Compile with target='host' to run here."
        )


@cache
def _watched_features() -> frozenset[str]:
    """Vector and matrix features that matter for running code: the microkernel families' and
    :data:`_WATCHED_FEATURES`."""
    from .microkernels import isa_tiers as tiers

    return frozenset({f for _, needed in tiers() for f in needed} | _WATCHED_FEATURES)


def required_features(target: str | dict | Target) -> frozenset[str]:
    """The vector and matrix ISA features code compiled for ``target`` needs to run (LLVM names,
    e.g. ``avx512bf16`` for ``znver4``): compare with :func:`host_features`."""
    return _isa_features(make_target(target))


def _isa_features(target: Target) -> frozenset[str]:
    """The vector/matrix ISA features of ``target`` that matter for running its code."""
    return frozenset(f for f in target_features(target) if f in _watched_features())


@cache
def cpu_model_name() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo`` (``"unknown"`` where it says none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def describe_host() -> dict:
    """Report what tvm_hybrid sees on this machine.

    Returns
    -------
    dict
        ``cpu`` (LLVM's name), ``model`` (the CPU's own name), ``physical_cores``, ``threads``
        (TVM's pool size), ``isa`` (the ISA tiers found, :func:`isa_tiers`), ``cache``
        (bytes), ``llvm`` and ``tvm`` versions; ``named`` when LLVM's name for the CPU lacks
        features it has (:func:`real_host_cpu`); and ``emulating`` when
        :data:`HOST_CPU_VARIABLE` makes the machine act as another CPU.
    """
    info = {
        "cpu": host_cpu(),
        "model": cpu_model_name(),
        "physical_cores": physical_cores(),
        "threads": num_threads(),
        "isa": isa_tiers(host_features()),
        "cache": dataclasses.asdict(cache_sizes()),
        "llvm": _llvm_major(),
        "tvm": tvm.__version__,
    }
    if real_host_cpu() != named_host_cpu():
        info["named"] = (f"LLVM names this CPU {named_host_cpu()} from its model number; its "
                         f"features are {real_host_cpu()}'s")
    if host_cpu() != real_host_cpu():
        info["emulating"] = f"{host_cpu()} on a {real_host_cpu()} ({HOST_CPU_VARIABLE})"
    return info
