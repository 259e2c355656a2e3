"""Measuring candidate schedules, here or on remote machines through TVM's RPC.

Remote measurement (tuning for another machine, or a fleet) uses MetaSchedule's ``RPCRunner``
with TVM's own RPC tracker and servers (``python -m tvm.exec.rpc_tracker`` and
``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY`` on each device).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import tempfile

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..compile_lock import COMPILER_LOCK
from ..errors import RPCError, TargetError
from ..host import check_runnable_here

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RPCSettings:
    """Where to measure remotely: an RPC tracker and the key its servers registered with.

    Parameters
    ----------
    tracker
        ``"host:port"`` of a running ``tvm.exec.rpc_tracker``.
    key
        The device key the servers registered (``rpc_server --key``).
    session_timeout_s
        How long one measurement session may take.
    """

    tracker: str
    key: str
    session_timeout_s: int = 60

    @property
    def host(self) -> str:
        return self.tracker.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        try:
            return int(self.tracker.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            raise RPCError(f"RPC tracker must be HOST:PORT, got {self.tracker!r}") from None

    def config(self) -> ms.runner.RPCConfig:
        return ms.runner.RPCConfig(tracker_host=self.host, tracker_port=self.port,
                                   tracker_key=self.key,
                                   session_timeout_sec=self.session_timeout_s)

    def check(self) -> None:
        """Raise :class:`RPCError` unless the tracker answers and lists a server under key."""
        try:  # fail fast: TVM's own client retries for a minute before giving up
            socket.create_connection((self.host, self.port), timeout=5).close()
        except OSError as err:
            raise RPCError(f"cannot reach the RPC tracker at {self.tracker}: "
                           f"{err.strerror or err}") from None
        try:
            summary = self.config().connect_tracker().summary()
        except Exception as err:  # noqa: BLE001 - TVM raises several kinds here
            raise RPCError(f"cannot reach the RPC tracker at {self.tracker}: "
                           f"{str(err).strip().splitlines()[0] if str(err).strip() else err}"
                           ) from None
        keys = [str(k) for k in summary.get("queue_info", {})]
        if self.key not in keys:
            raise RPCError(f"the RPC tracker at {self.tracker} has no server with key "
                           f"{self.key!r} (registered keys: {keys or 'none'})")


class Measurer:
    """Compile and time schedules of one task; failures time as infinity.

    Candidates are compiled in this process (each one is the template with other knobs, so
    there is nothing to isolate, and this avoids starting worker processes per round). They run
    here through the runtime's time evaluator, or, with ``rpc``, on a remote server through
    MetaSchedule's ``RPCRunner``.

    Parameters
    ----------
    target
        The target to compile for.
    rpc
        Measure through this RPC tracker instead of on this machine.
    repeat
        Timed repeats per candidate (each at least ``min_repeat_ms`` long).
    min_repeat_ms
        Minimum duration of one repeat.
    """

    def __init__(self, target: Target, *, rpc: RPCSettings | None = None, repeat: int = 3,
                 min_repeat_ms: int = 40):
        self.target = target
        self.rpc = rpc
        self.repeat = repeat
        self.min_repeat_ms = min_repeat_ms
        self.runner = None
        if rpc is None:
            # Candidates run in this process: refuse code this CPU cannot run (AMX on a CPU
            # without it aborts the process) and ask Linux for the AMX tile permission, without
            # which the first tile instruction is an illegal instruction.
            try:
                check_runnable_here(target)
            except TargetError as err:
                raise TargetError(f"{err} To tune for that CPU, measure on one: "
                                  "--rpc-tracker HOST:PORT (RPCSettings).") from None
        else:
            rpc.check()
            evaluator = ms.runner.EvaluatorConfig(number=1, repeat=repeat,
                                                  min_repeat_ms=min_repeat_ms,
                                                  enable_cpu_cache_flush=False)
            self.runner = ms.runner.RPCRunner(rpc_config=rpc.config(),
                                              evaluator_config=evaluator, max_workers=1)

    def measure(self, mods: list[tvm.IRModule], args_info,
                rounds: int = 1) -> list[list[float]]:
        """Seconds of each repeat for each scheduled module (``[inf]`` when it failed).

        With ``rounds`` above 1 the modules are built once and timed in turn ``rounds`` times
        (interleaved, so that a slow moment of the machine hits them alike), their repeats
        concatenated.
        """
        built = [self._build(m) for m in mods]
        times: list[list[float]] = [[] for _ in mods]
        args = [_random_tensor(info) for info in args_info] if self.runner is None else None
        for _ in range(rounds):
            runs = (self._measure_remote(built, args_info) if self.runner is not None
                    else [self._run(lib, args) for lib in built])
            for index, seconds in enumerate(runs):
                times[index] += seconds
        return times

    def _run(self, lib, args) -> list[float]:
        if lib is None:
            return [math.inf]
        try:
            timer = lib.time_evaluator("main", tvm.cpu(), number=1, repeat=self.repeat,
                                       min_repeat_ms=self.min_repeat_ms)
            return list(timer(*args).results)
        except Exception as err:  # noqa: BLE001 - a failed candidate is just slow
            logger.debug("candidate failed to run: %s", err)
            return [math.inf]

    def _build(self, mod: tvm.IRModule):
        try:
            with COMPILER_LOCK:
                return tvm.compile(mod, target=self.target).mod
        except Exception as err:  # noqa: BLE001 - a candidate that does not build is skipped
            logger.debug("candidate failed to build: %s", err)
            return None

    def _measure_remote(self, built, args_info) -> list[list[float]]:
        times: list[list[float]] = [[math.inf] for _ in built]
        with tempfile.TemporaryDirectory(prefix="tvm_hybrid_rpc_") as tmp:
            inputs, slots = [], []
            for index, lib in enumerate(built):
                if lib is None:
                    continue
                path = os.path.join(tmp, f"candidate{index}.tar")
                lib.export_library(path)
                inputs.append(ms.runner.RunnerInput(path, device_type="cpu",
                                                    args_info=args_info))
                slots.append(index)
            for index, future in zip(slots, self.runner.run(inputs) if inputs else []):
                result = future.result()
                if result.error_msg is None and result.run_secs:
                    times[index] = [float(t) for t in result.run_secs]
                else:
                    logger.debug("remote candidate failed: %s", result.error_msg)
        return times


def _random_tensor(info) -> tvm.runtime.Tensor:
    shape = [int(d) for d in info.shape]
    dtype = str(info.dtype)
    rng = np.random.default_rng(0)
    if dtype.startswith("float"):
        data = rng.uniform(-1, 1, shape).astype(dtype)
    else:
        data = rng.integers(0, 8, shape).astype(dtype)
    return tvm.runtime.tensor(data)
