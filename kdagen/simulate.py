"""A simulated GPU and compiler for the tuner: tests and CI exercise every path without a GPU.

Nothing here is a measurement. Times come from a toy model of a memory-bound kernel (launch
cost, bytes over bandwidth, waves of CTAs, a few config effects) with seeded noise, so TPE
has a landscape to learn and the finalists have noise to sit within. Failure modes are chosen
by substrings of variant names: ``compile`` (compile error), ``wrong`` (a check case fails),
``launch`` (the check raises), ``hang`` (the check never returns), ``die`` (the worker
process exits during the check) and ``kill`` (it is killed, SIGKILL, while timing). Outputs of
a simulated run say SIMULATED wherever they show a time.

A timing's noise is drawn from the variant, the batch, the seed and how many times this worker
has timed that (variant, batch): each study times its own batch, so its results do not depend
on which GPU, or which process, ran the studies before it. For the tests of tuning on several
GPUs and hosts: the simulated host has ``KDAGEN_SIMULATE_GPUS`` GPUs (default 1), every check
and timing is logged as a JSON line to the file ``KDAGEN_SIMULATE_LOG`` names, if any, and each
takes ``KDAGEN_SIMULATE_DELAY`` seconds (default 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from kdagen.compile import CompileRecord
from kdagen.serve.variant import Variant

DEVICE = {
    "fingerprint": "simulated-h200-sm90-132sm",
    "name": "Simulated H200",
    "compute_capability": "9.0",
    "sms": 132,
    "arch": "sm_90a",
    "simulated": True,
}
BANDWIDTH = 4.2e12  # bytes/s of the toy model (H200-like)

# What a `kdagen tune --simulate` run fails on: one compile error, one wrong result, one
# worker death, among the commit variants a default run visits.
DEFAULT_FAILURES: dict[str, list[str]] = {
    "compile": ["-t256-v8-r4-"],
    "wrong": ["h12-q8-i32-bulk-t128-v8-r2-"],
    "die": ["h12-q4-i32-bulk-t256-v4-r2-"],
}


def visible_gpus() -> int:
    """GPUs the simulated host has (``KDAGEN_SIMULATE_GPUS``, default 1)."""
    return int(os.environ.get("KDAGEN_SIMULATE_GPUS", "1"))


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(p in name for p in patterns)


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts``."""
    h = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


def model_us(variant: Variant, batch: int) -> float:
    """Toy latency: launch + max(bytes / bandwidth, waves x per-CTA chain), with config
    effects that make the best config depend on the batch (row_split pays at small batch)."""
    items = batch * variant.heads
    floor = floor_us(variant, batch)
    tuning = variant.tuning
    split = int(tuning.get("row_split", 1))
    threads = int(tuning.get("threads", 128))
    resident = 8 if threads <= 128 else 4
    waves = math.ceil(items * split / (DEVICE["sms"] * resident))
    chain = 3.0 / split + 0.4 * split
    vec_penalty = 1.0 + (0.04 if tuning.get("vec") == 8 and variant.window >= 8 else 0.0)
    thread_penalty = 1.0 + (0.03 if threads >= 256 and items < 512 else 0.0)
    ctas = int(tuning.get("ctas", 0))
    cta_penalty = 1.0 + (0.1 * abs(math.log2(ctas / 528)) if ctas else 0.0)
    pdl = 0.0 if tuning.get("pdl", True) else 0.5
    quirk = 1.0 + 0.02 * _unit(variant.name)  # what a model leaves out
    body = max(floor / 0.85, waves * chain) * vec_penalty * thread_penalty * cta_penalty
    return (2.0 + pdl + body) * quirk


def floor_us(variant: Variant, batch: int) -> float:
    """Bytes a launch must move (state read + written, window rows read) over bandwidth."""
    per_item = 128 * 128 * 2 * 2 + variant.window * 128 * (4 + 2 * 2)
    return batch * variant.heads * per_item / BANDWIDTH * 1e6


class SimulatedEvaluator:
    """The GPU worker's target in simulation: same methods as ``worker.GpuEvaluator``."""

    def __init__(self, failures: dict[str, list[str]] | None = None, noise: float = 0.01) -> None:
        self.failures = DEFAULT_FAILURES if failures is None else failures
        self.noise = noise
        self.calls: Counter[tuple[str, int]] = Counter()  # timings per (variant, batch)
        self.log = os.environ.get("KDAGEN_SIMULATE_LOG")
        self.delay_s = float(os.environ.get("KDAGEN_SIMULATE_DELAY", "0"))

    def device(self) -> dict[str, Any]:
        return dict(DEVICE)

    def check(self, name: str, seed: int) -> str | None:
        self._note("check", name)
        self._maybe_fail(name)
        time.sleep(self.delay_s)
        if _matches(name, self.failures.get("wrong", ())):
            return "wrong result: case padded-stride (max_rel 3.10e-01, rel_l2 4.20e-02)"
        return None

    def time(self, name: str, batch: int, seed: int) -> dict[str, float]:
        self._note("time", name, batch)
        if _matches(name, self.failures.get("kill", ())):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay_s)
        self.calls[name, batch] += 1
        rng = random.Random(f"{name}|{batch}|{seed}|{self.calls[name, batch]}")
        base = model_us(Variant.parse(name), batch)
        samples = sorted(base * (1 + rng.gauss(0, self.noise)) for _ in range(20))
        return {"median_us": samples[10], "p10_us": samples[2], "p90_us": samples[17], "sets": 8}

    def default(self, name: str, batch: int) -> str:
        """A stand-in heuristic: split items over more CTAs while they are few."""
        v = Variant.parse(name)
        items = batch * v.heads
        split = 4 if items < 128 else 2 if items < 384 else 1
        for s in (split, 2, 1):
            try:
                return v.replace(row_split=s).name
            except ValueError:
                continue
        return v.name

    def floor(self, name: str, batch: int) -> float:
        return floor_us(Variant.parse(name), batch)

    def peers(self, name: str, batch: int) -> dict[str, float]:
        return {}

    def _note(self, method: str, name: str, batch: int | None = None) -> None:
        """One line per GPU call in the log (appended whole: several workers share it)."""
        if not self.log:
            return
        line = {"pid": os.getpid(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "method": method, "variant": name, "batch": batch}  # fmt: skip
        with open(self.log, "a") as out:
            out.write(json.dumps(line) + "\n")

    def _maybe_fail(self, name: str) -> None:
        if _matches(name, self.failures.get("die", ())):
            os._exit(3)
        if _matches(name, self.failures.get("hang", ())):
            time.sleep(3600)
        if _matches(name, self.failures.get("launch", ())):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class SimulatedCompiler:
    """Compiles nothing: a record per variant, an error for the ``compile`` patterns."""

    def __init__(self, arch: str, failures: dict[str, list[str]] | None = None) -> None:
        self.arch = arch
        self.failures = DEFAULT_FAILURES if failures is None else failures
        self.submitted: dict[str, None] = {}  # in order; shared by the threads of every GPU

    def submit(self, variant: Variant) -> None:
        self.submitted.setdefault(variant.name)

    def result(self, variant: Variant) -> CompileRecord:
        self.submit(variant)
        if _matches(variant.name, self.failures.get("compile", ())):
            return CompileRecord(
                variant.name, self.arch, "simulated", "error", 0.0,
                error="error: simulated: shared memory 240 KiB exceeds 227 KiB per block",
            )  # fmt: skip
        return CompileRecord(variant.name, self.arch, "simulated", "ok", 0.0, cached=True,
                             machine=simulated_machine(variant))  # fmt: skip

    def close(self) -> None:
        pass


def simulated_machine(variant: Variant) -> str:
    """The simulated compiler's machine digest: its render without comments and blank lines
    (a comment-only edit compiles to the same code, any other edit does not)."""
    from kdagen.render import render

    code = [line.split("#")[0].rstrip() for line in render(variant).splitlines()]
    return hashlib.sha256("\n".join(line for line in code if line).encode()).hexdigest()[:16]
