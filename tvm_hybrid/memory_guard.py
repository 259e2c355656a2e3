"""Refuse to run a model whose planned tensors exceed the machine's memory.

A Linux host that overcommits memory (``vm.overcommit_memory = 1``: many VMs and containers)
grants any allocation and then kills the process (SIGKILL) when its pages are touched, so a
model whose tensors need more memory than the machine has took the user's whole process down
instead of raising (a 64 TiB outer product on a 128 GiB Xeon VM). After memory planning the
VM's storage sizes are known (static shapes, and every specialization of a dynamic model is
static): before a model first runs, their sum is checked against the machine's memory (RAM plus
swap) and a model that cannot fit raises :class:`~tvm_hybrid.errors.InputError`. Hosts that do
not overcommit refuse the allocation themselves (``std::bad_alloc``, reported the same way).
"""

from __future__ import annotations

import functools
import os

import tvm
from tvm import relax


def planned_bytes(main: relax.Function) -> int:
    """Bytes of the storages and tensors the lowered Relax ``main`` allocates with a constant
    size (the VM's ``alloc_storage`` and ``builtin.alloc_tensor`` calls); sizes that depend on
    run-time values are not counted."""
    total = 0
    for block in getattr(main.body, "blocks", ()):
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call) or not value.args:
                continue
            name = value.op.name if isinstance(value.op, tvm.ir.Op) else getattr(
                value.op, "global_symbol", "")
            if name == "relax.vm.alloc_storage":
                total += _constant_product(value.args[0])
            elif name == "vm.builtin.alloc_tensor" and len(value.args) >= 3:
                dtype = value.args[2]
                bits = tvm.runtime.DataType(str(getattr(dtype, "value", dtype))).bits \
                    if isinstance(dtype, relax.DataTypeImm) else 0
                total += _constant_product(value.args[1]) * bits // 8
    return total


def _constant_product(shape) -> int:
    if not isinstance(shape, relax.ShapeExpr):
        return 0
    product = 1
    for dim in shape.values:
        if not isinstance(dim, tvm.tirx.IntImm):
            return 0
        product *= int(dim.value)
    return product


@functools.lru_cache(maxsize=1)
def machine_bytes() -> int:
    """The machine's memory: RAM plus swap (``/proc/meminfo``; the physical pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal")
                   if k in fields)
    except (OSError, ValueError, KeyError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def excess(main: relax.Function | None, inputs) -> str | None:
    """Why a model whose lowered ``main`` is this cannot run here (its planned tensors exceed
    :func:`machine_bytes`), or None when it fits or ``main`` is unknown."""
    if main is None:
        return None
    need, have = planned_bytes(main), machine_bytes()
    if need <= have:
        return None
    sizes = ", ".join(f"{spec.name} {tuple(spec.shape)}" for spec in inputs)
    return (f"out of memory: on inputs {sizes} the model's tensors need {_size(need)}, more than "
            f"this machine's {_size(have)} of memory (RAM and swap): reduce the batch or "
            "sequence size")


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}"
