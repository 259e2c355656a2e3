"""Arrays into and out of the Relax VM without needless copies.

A model call used to copy every input into a freshly allocated TVM tensor and every output back
into a fresh numpy array. For large tensors that dominated: an attention over three
``32 x 12 x 384 x 64`` inputs spent ~50 ms of a ~95 ms call copying (page faults of the fresh
allocations, single-threaded memcpy), more than the fused kernel itself.

* An input already laid out as the kernels need is passed zero-copy through DLPack:
  C-contiguous, and aligned to its element size for the hybrid pipeline's kernels
  (``passes/element_aligned_arguments.py``), to 64 bytes for stock TVM's (numpy aligns large
  arrays to 16 bytes only).
* Other inputs are copied into a staging tensor kept per
  thread and input, so the copy reuses memory already mapped; a call's copies are dealt out to
  a thread per :data:`PARALLEL_BYTES` (at most TVM's thread count; one
  thread's memcpy moves a fraction of the memory's bandwidth: three 12 MB attention inputs took
  ~3 ms of an 8.6 ms call on a 16-core Xeon). Small contiguous inputs (up to
  :data:`SMALL_BYTES`) are always staged: copying them takes less time than the alignment
  check and the DLPack exchange (a model call of ~75 us spent ~10 us preparing one input).
* Outputs the VM allocated for themselves (``fresh_outputs``: a tensor on a storage of its
  own, not a constant, an input, a view of another output) are returned as numpy views that
  keep the VM's tensor alive; others are copied, so a returned array never aliases a model
  constant, an input or another output.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi

#: The data alignment stock TVM's kernels assume of their arguments.
ALIGNMENT = 64
#: Contiguous inputs up to this size are copied into their staging tensor without trying the
#: zero-copy path first.
SMALL_BYTES = 16384
#: A call's staged copies run on one thread per this many bytes (at most TVM's thread count):
#: handing a thread less costs more than it saves (attention inputs of 3.5 and 9.4 MB were no
#: faster split on 2 cores; 38 MB were 11% faster on 2 cores and 15% on 16).
PARALLEL_BYTES = 1 << 22
_DLPACK_KINDS = "biuf"
_POOL: list = []


def to_device(arrays: list[np.ndarray], staging: dict,
              element_aligned: bool = False) -> list[tvm.runtime.Tensor]:
    """TVM tensors holding ``arrays``: zero-copy when possible, else copied into the
    ``staging`` tensors (one per position, reused while shape and dtype stay).
    ``element_aligned``: the kernels take arrays at any element-aligned address, else they need
    :data:`ALIGNMENT`."""
    out, copies = [], []
    for position, array in enumerate(arrays):
        held = staging.get(position)
        if (held is not None and array.nbytes <= SMALL_BYTES and array.shape == held[1].shape
                and array.dtype == held[1].dtype and array.flags.c_contiguous):
            np.copyto(held[1], array, casting="no")  # the common small case, fast
            out.append(held[0])
            continue
        # np.require keeps 0-d inputs 0-d (np.ascontiguousarray would make them 1-d).
        array = np.require(array, requirements="C")
        tensor = (None if 0 < array.nbytes <= SMALL_BYTES
                  else _zero_copy(array, array.itemsize if element_aligned else ALIGNMENT))
        if tensor is None:
            tensor = _staged(array, position, staging, copies)
        out.append(tensor)
    if copies:
        _copy(copies)
    return out


def _zero_copy(array: np.ndarray, alignment: int) -> tvm.runtime.Tensor | None:
    if (array.ndim == 0 or array.dtype.kind not in _DLPACK_KINDS or array.size == 0
            or array.ctypes.data % alignment):
        return None
    try:
        return tvm_ffi.from_dlpack(array, require_alignment=alignment, require_contiguous=True)
    except Exception:  # read-only arrays, dtypes DLPack lacks: copy instead
        return None


def _staged(array: np.ndarray, position: int, staging: dict,
            copies: list) -> tvm.runtime.Tensor:
    """The staging tensor of ``position`` for ``array``; the copy into it is added to
    ``copies``."""
    if array.dtype.kind not in _DLPACK_KINDS or array.size == 0:
        return tvm.runtime.tensor(array, tvm.cpu())
    held = staging.get(position)
    if held is None or held[1].shape != array.shape or held[1].dtype != array.dtype:
        tensor = tvm.runtime.empty(array.shape, str(array.dtype))
        held = staging[position] = (tensor, np.from_dlpack(tensor))  # a view, for np.copyto
    copies.append((held[1], array))
    return held[0]


def _copy(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``dst[...] = src`` for each pair (both C-contiguous, same shape and dtype). Their bytes
    are dealt out evenly to a thread per :data:`PARALLEL_BYTES` (at most TVM's thread count),
    one dispatch for all inputs (numpy releases the GIL while it copies)."""
    total = sum(src.nbytes for _, src in copies)
    threads = min(_threads(), total // PARALLEL_BYTES) if total >= 2 * PARALLEL_BYTES else 1
    if threads < 2:
        for dst, src in copies:
            np.copyto(dst, src, casting="no")
        return
    share = -(-total // threads)
    jobs: list[list] = [[]]
    room = share
    for dst, src in copies:
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        start, size, item = 0, flat_src.size, flat_src.itemsize
        while start < size:
            if room < item:
                jobs.append([])
                room = share
            end = min(size, start + room // item)
            jobs[-1].append((flat_dst[start:end], flat_src[start:end]))
            room -= (end - start) * item
            start = end
    futures = [_pool(threads).submit(_run, job) for job in jobs[1:]]
    _run(jobs[0])
    for future in futures:
        future.result()


def _run(job: list) -> None:
    for dst, src in job:
        np.copyto(dst, src, casting="no")


def _threads() -> int:
    from .thread_pool import num_threads

    return num_threads()


def _pool(threads: int):
    """A thread pool for copies, created on first use and kept."""
    if not _POOL or _POOL[0][0] < threads:
        from concurrent.futures import ThreadPoolExecutor

        if _POOL:  # a smaller one, from before the thread count grew
            _POOL[0][1].shutdown(wait=False)
        _POOL[:] = [(threads, ThreadPoolExecutor(threads - 1, thread_name_prefix="hybrid-copy"))]
    return _POOL[0][1]


def fresh_outputs(main) -> tuple[bool, ...] | None:
    """Per output of the lowered Relax ``main``: whether the VM allocates it on a storage of
    its own that no other output shares (so a numpy view of it is safe to hand out). None when
    ``main`` is not in the expected form (then every output is copied)."""
    from tvm import relax

    bindings = {}
    storage_uses: dict = {}
    try:
        for block in main.body.blocks:
            for binding in block.bindings:
                bindings[binding.var] = binding.value
                value = binding.value
                if _is_op(value, "relax.vm.alloc_tensor"):
                    storage_uses[value.args[0]] = storage_uses.get(value.args[0], 0) + 1
        result = main.body.body
        while isinstance(result, relax.Var) and isinstance(bindings.get(result),
                                                           (relax.Var, relax.Tuple)):
            result = bindings[result]
        fields = list(result.fields) if isinstance(result, relax.Tuple) else [result]
    except AttributeError:
        return None

    def root(expr):
        while isinstance(expr, relax.Var) and expr in bindings:
            value = bindings[expr]
            if not _is_extern(value, "vm.builtin.reshape"):  # a view of its first argument
                return expr
            expr = value.args[0]
        return expr

    roots = [root(f) for f in fields]
    out = []
    for r in roots:
        value = bindings.get(r) if isinstance(r, relax.Var) else None
        own = (value is not None and _is_op(value, "relax.vm.alloc_tensor")
               and storage_uses.get(value.args[0]) == 1
               and _is_op(bindings.get(value.args[0]), "relax.vm.alloc_storage"))
        out.append(bool(own) and sum(x.same_as(r) for x in roots) == 1)
    return tuple(out)


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, tvm.relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
        expr.op.name == name


def _is_extern(expr, symbol: str) -> bool:
    return (isinstance(expr, tvm.relax.Call) and isinstance(expr.op, tvm.relax.ExternFunc)
            and expr.op.global_symbol == symbol)


def to_numpy(value, fresh: tuple[bool, ...] | None):
    """The VM's result as numpy arrays (a tuple for a tuple): views of the outputs ``fresh``
    marks, copies of the others."""
    if isinstance(value, tvm.runtime.Tensor):
        return _array(value, bool(fresh and fresh[0]))
    if isinstance(value, (list, tuple)) or type(value).__name__ in ("Array", "Tuple"):
        flags = fresh if fresh is not None and len(fresh) == len(value) else (False,) * len(value)
        return tuple(_array(v, f) if isinstance(v, tvm.runtime.Tensor) else to_numpy(v, None)
                     for v, f in zip(value, flags))
    return value


def _array(tensor: tvm.runtime.Tensor, fresh: bool) -> np.ndarray:
    if str(tensor.dtype)[0] in "biuf":
        try:
            view = np.from_dlpack(tensor)
            # A copy through the view: 1 us for a small output, against 12 us for .numpy().
            return view if fresh else view.copy()
        except Exception:  # noqa: BLE001 - dtypes numpy's DLPack import lacks: copy
            pass
    return tensor.numpy()
