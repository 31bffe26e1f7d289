"""The GPUs one ``kdagen tune`` spreads its studies over, one supervised worker pinned to each.

``--devices all`` (the default) takes every GPU this process sees; ``--devices 0,2`` takes
those indices, numbered as CUDA numbers them here (after any CUDA_VISIBLE_DEVICES). A worker
is pinned by its own CUDA_VISIBLE_DEVICES: it sees one GPU, as device 0, so everything it runs
(check, timing, the DSL's module loading) stays on that GPU without being told. Studies are
independent and each runs start to finish on one GPU, so the GPUs must be one model: one
fingerprint, one table.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from kdagen.studies import TuneError
from kdagen.worker import Worker, WorkerFailure

ALL = "all"


def parse(spec: str) -> list[int] | None:
    """``all`` -> None; ``0,2`` -> [0, 2]."""
    text = spec.strip().lower()
    if text == ALL:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise TuneError(f"--devices {spec}: give {ALL} or GPU indices such as 0,1")
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise TuneError(f"--devices {spec}: a GPU is named twice")
    return indices


def select(spec: str, visible: int) -> list[int]:
    """The indices ``spec`` names among ``visible`` GPUs."""
    indices = parse(spec)
    if visible < 1:
        raise TuneError("no CUDA GPU is visible to this process")
    if indices is None:
        return list(range(visible))
    missing = [i for i in indices if i >= visible]
    if missing:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else ""
        raise TuneError(f"--devices {spec}: no GPU {missing[0]}; this process sees {visible}"
                        f"{seen}, numbered 0-{visible - 1}")  # fmt: skip
    return indices


def visible_count(simulated: bool) -> int:
    """GPUs this process sees (the simulated host's for a simulated run)."""
    if simulated:
        from kdagen.simulate import visible_gpus

        return visible_gpus()
    import torch

    return torch.cuda.device_count()


def label(index: int) -> str:
    return f"gpu{index}"


def child_env(index: int) -> dict[str, str]:
    """The environment that pins a worker to GPU ``index`` of this process: its own
    CUDA_VISIBLE_DEVICES, the entry of ours at ``index`` where we have one (an index, a UUID
    or a MIG instance), else the index."""
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in ours.split(",")] if ours else []
    return {"CUDA_VISIBLE_DEVICES": entries[index] if index < len(entries) else str(index)}


def start(workers: Sequence[Worker], indices: Sequence[int], timeout: float) -> dict[str, Any]:
    """Every worker started at once (each imports torch and the DSL and initialises CUDA); the
    device they all report. A worker that cannot start ends the run (``TuneError``)."""
    answers: list[Any] = [None] * len(workers)

    def ask(k: int) -> None:
        try:
            answers[k] = workers[k].call("device", timeout=timeout)
        except BaseException as err:  # raised below, in the caller's thread
            answers[k] = err

    threads = [threading.Thread(target=ask, args=(k,), daemon=True) for k in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # an interrupt ends the run: the caller closes the workers
    for index, answer in zip(indices, answers, strict=True):
        if isinstance(answer, WorkerFailure):
            where = f"{label(index)}: " if len(workers) > 1 else ""
            raise TuneError(where + answer.reason)
        if isinstance(answer, BaseException):
            raise answer
    return one_model(answers, indices)


def one_model(infos: Sequence[dict[str, Any]], indices: Sequence[int]) -> dict[str, Any]:
    """The device every worker reported (the first one's), refusing GPUs of different
    fingerprints: each model has its own table."""
    first = infos[0]["fingerprint"]
    other = next((i for i, info in enumerate(infos) if info["fingerprint"] != first), None)
    if other is not None:
        raise TuneError(
            f"GPUs of different models: {label(indices[0])} is {first}, {label(indices[other])}"
            f" is {infos[other]['fingerprint']}; tune each model on its own (--devices)"
        )
    return infos[0]
