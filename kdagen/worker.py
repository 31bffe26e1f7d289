"""The tuner's GPU processes: a supervised worker per GPU, serving the GPU evaluator.

A candidate kernel can hang, fault the GPU context or kill its process. So every GPU call
runs in a spawned worker process with a deadline; a worker that times out is killed, one
that dies is noticed (its pipe closes), and either is replaced before the next call. The
tuner records the candidate as failed with the reason and carries on.

The GPU worker serves an evaluator object built in the child from a ``"module:Class"``
factory: ``GpuEvaluator`` (kdagen.check and kdagen.bench, imported there only) or the
simulated one of ``kdagen.simulate``. Compilation runs apart, in ``kdagen.compile.CompilePool``
(the on-disk cache shared with every other run), so candidate n+1 compiles while candidate n
is checked and timed.

A tune on several GPUs has a worker per GPU, each pinned by the environment it is spawned
with (``kdagen.devices.child_env``), and one compile pool that every GPU's thread submits to.
Workers ignore SIGINT: an interrupt is the tuner's to handle (it stops its studies first,
then the workers), so no candidate is recorded as failed because Ctrl-C killed its worker.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

from kdagen.serve.variant import Variant

START_TIMEOUT_S = 600.0  # importing torch and the DSL, CUDA init, first bandwidth probe


class WorkerFailure(RuntimeError):
    """A GPU call that gave no result: ``kind`` is start, timeout, died or error."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _describe(err: BaseException) -> str:
    lines = [s for s in traceback.format_exception_only(type(err), err) if s.strip()]
    return "".join(lines).strip()[-600:]


def _build(factory: str, kwargs: dict[str, Any]) -> Any:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


def _serve(
    conn: Connection, factory: str, kwargs: dict[str, Any], env: dict[str, str] | None = None
) -> None:
    """The worker's loop: build the evaluator, then answer (method, args) until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env or {})  # before the evaluator initialises CUDA
    try:
        target = _build(factory, kwargs)
    except BaseException as err:
        conn.send(("error", _describe(err)))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the tuner is gone
            return
        if message is None:
            return
        method, args = message
        try:
            conn.send(("ok", getattr(target, method)(*args)))
        except Exception as err:  # reported to the tuner; the worker is replaced after it
            conn.send(("error", _describe(err)))


class Worker:
    """A spawned process serving calls on one evaluator, replaced whenever it fails."""

    def __init__(
        self,
        factory: str,
        kwargs: dict[str, Any] | None = None,
        start_timeout: float = START_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.factory = factory
        self.kwargs = kwargs or {}
        self.start_timeout = start_timeout
        self.env = env or {}  # set in the worker before it starts (its GPU: CUDA_VISIBLE_DEVICES)
        self.starts = 0
        self._proc: Any = None
        self._conn: Connection | None = None
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        """``method(*args)`` in the worker; raises ``WorkerFailure`` and replaces the worker
        when it times out, dies or raises."""
        conn = self._ensure()
        try:
            conn.send((method, args))
        except (BrokenPipeError, OSError):  # died between calls: not this call's doing
            self.kill()
            conn = self._ensure()
            conn.send((method, args))
        if not conn.poll(timeout):
            self.kill()
            raise WorkerFailure("timeout", f"timeout: no answer in {timeout:g} s ({method})")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            reason = self._death(method)
            raise WorkerFailure("died", reason) from None
        if status == "error":
            self.kill()  # an exception may have left the CUDA context unusable
            raise WorkerFailure("error", payload)
        return payload

    def _ensure(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self.kill()
        if self._stopped:
            raise WorkerFailure("stopped", "the tuner is stopping")
        ctx = multiprocessing.get_context("spawn")  # CUDA and MLIR do not survive a fork
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_serve, args=(child, self.factory, self.kwargs, self.env), daemon=True,
            name="kdagen-gpu-worker",
        )  # fmt: skip
        proc.start()
        child.close()  # so the parent sees EOF when the worker dies
        self._proc, self._conn = proc, parent
        self.starts += 1
        if self._stopped:  # stopped while it was starting: stop() may have missed it
            proc.kill()
        if not parent.poll(self.start_timeout):
            self.kill()
            raise WorkerFailure(
                "start", f"the GPU worker did not start in {self.start_timeout:g} s"
            )
        try:
            status, payload = parent.recv()
        except (EOFError, OSError):
            raise WorkerFailure("start", self._death("start")) from None
        if status != "ready":
            self.kill()
            raise WorkerFailure("start", f"the GPU worker could not start: {payload}")
        return parent

    def _death(self, during: str) -> str:
        proc = self._proc
        proc.join(timeout=10)
        code = proc.exitcode
        self.kill()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown"
            return f"worker died: signal {-code} ({name}) during {during}"
        return f"worker died: exit code {code} during {during}"

    def kill(self) -> None:
        """Stop the worker now (it is started again by the next call)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def stop(self) -> None:
        """Kill the worker for good, from any thread: a call in flight fails at once (its
        caller drops the answer) and no call starts it again."""
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            try:
                self._conn.send(None)
                self._proc.join(timeout=5)
            except (BrokenPipeError, OSError):
                pass
        self.kill()


# ---- the GPU evaluator (runs inside the worker) ----


class GpuEvaluator:
    """Check and time variants by name on this process's GPU (the worker's target).

    Reads ``kdagen.check.check_variant``, ``kdagen.check.gpu_refusal``,
    ``kdagen.bench.time_variant``, ``kdagen.bench.copy_bandwidth``, ``kdagen.bench.floor_us``,
    the run-time heuristic (``kdagen.serve.runtime.heuristic_variant``) and, when present,
    ``kdagen.bench.peer_times``.
    """

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible to the tuner's worker")
        from kdagen.serve.fingerprint import device_info
        from kdagen.serve.runtime import device_arch

        self.info = device_info() | {"arch": device_arch(), "simulated": False}
        self._bandwidth: float | None = None

    def device(self) -> dict[str, Any]:
        return self.info

    def check(self, name: str, seed: int) -> str | None:
        """None when every case passes, else why the candidate failed."""
        from kdagen.check import check_variant, gpu_refusal

        variant = Variant.parse(name)
        refusal = gpu_refusal(variant, self.info["arch"])
        if refusal:
            return f"refused: {refusal}"
        return describe_check(check_variant(variant, seed))

    def time(self, name: str, batch: int, seed: int) -> dict[str, float]:
        from kdagen.bench import time_variant

        t = time_variant(Variant.parse(name), batch, seed)
        return {"median_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us, "sets": t.sets}

    def default(self, name: str, batch: int) -> str:
        """The run-time heuristic's variant for ``name``'s contract at ``batch``: the untuned
        default a winner must beat (computed here: it reads the GPU's SM count)."""
        from kdagen.serve import runtime

        v = Variant.parse(name)
        return runtime.heuristic_variant(v.kernel, v.contract, batch, self.info["arch"]).name

    def floor(self, name: str, batch: int) -> float | None:
        from kdagen import bench

        if self._bandwidth is None:
            self._bandwidth = bench.copy_bandwidth()
        return float(bench.floor_us(Variant.parse(name), batch, self._bandwidth))

    def peers(self, name: str, batch: int) -> dict[str, float]:
        from kdagen import bench

        peer_times = getattr(bench, "peer_times", None)
        return (
            {k: float(v) for k, v in peer_times(Variant.parse(name), batch).items()}
            if peer_times
            else {}
        )


def describe_check(cases: list[Any]) -> str | None:
    """The first failing case as a reason: a launch error, or a wrong result with its numbers
    (the case's ``summary()``)."""
    for c in cases:
        if c.passed:
            continue
        if getattr(c, "error", ""):
            return f"launch error: case {c.case}: {c.error}"
        detail = c.summary() if hasattr(c, "summary") else "outside tolerance"
        return f"wrong result: case {c.case} ({detail})"
    return None
