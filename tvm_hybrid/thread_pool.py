"""TVM's thread pool: use every physical core, and never pin the caller's thread.

TVM sizes its pool at first use from ``TVM_NUM_THREADS`` (or ``OMP_NUM_THREADS``) and otherwise
takes half the logical CPUs, assuming hyper-threading; on a 2-core VM that is one thread. With one
thread it also pins the calling thread to CPU 0, which every thread created afterwards (OpenBLAS,
PyTorch, ONNX Runtime) inherits. :func:`configure_defaults` runs before TVM's pool exists (at
``import tvm_hybrid`` and from the ``tvm.backends`` autoload hook) and sets both variables unless
the user already did.
"""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Number of physical cores available to this process (not hyper-threads)."""
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
    except ImportError:
        count = None
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(count or logical or 1, logical or 1))


def configure_defaults() -> None:
    """Default TVM's pool to all physical cores and turn thread pinning off.

    Values the user set in the environment are kept.
    """
    os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))
    os.environ.setdefault("TVM_BIND_THREADS", "0")


def num_threads() -> int:
    """Number of threads TVM's pool runs kernels on."""
    import tvm

    return int(tvm.runtime.num_threads())


def set_num_threads(count: int) -> int:
    """Set the number of threads TVM's pool uses from now on.

    Parameters
    ----------
    count
        Wanted number of threads, at least 1. The pool cannot grow past the size it was created
        with (``TVM_NUM_THREADS`` at first use, all physical cores by default).

    Returns
    -------
    int
        The number of threads now in use.
    """
    import tvm

    from .errors import OptionError

    if count < 1:
        raise OptionError(f"thread count must be at least 1, got {count}")
    tvm.get_global_func("runtime.config_threadpool")(0, int(count))
    return num_threads()
