"""kdagen.serve: the serving run-time, what an inference engine imports.

Verify's and commit's argument types and checks (``contract``, shared with the reference and
the emulator), the opt-in checks of index values (``values``), validation and launch
(``runtime``), the dispatch-table lookup (``dispatch``),
the all-layer commit (``model_commit``), vLLM's entry points (``vllm``) and the torch custom
ops (``ops``).
It imports the standard library, torch, nvidia-cutlass-dsl and its own modules only (no
Jinja, Optuna, Typer, YAML, nor kdagen's build side: pyproject's import-linter contract and
tests/test_serve.py hold it to that), the latter relatively, so ``kdagen emit`` copies the
folder as it is into the package it writes.

Kernels come from ``kernel_source.current()``: in an emitted package its prebuilt
``kernels/`` (``bundle``); in kdagen the build side, which compiles on first use
(``kdagen.first_use``; ``kdagen.verify`` and the rest of kdagen's serving names turn it on).

In kdagen the API below loads on first access, with the torch ops (registered then): the
build side imports the torch-free modules (``variant``, ``fingerprint``, ``resources``)
without torch. An emitted package is imported to serve, so it registers the ops on import.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

_API = {
    "verify": "runtime",
    "commit": "runtime",
    "ModelCommit": "model_commit",
    "KdaInputError": "validate",
    "check_values": "values",
    "kda_recoverssm_verify": "vllm",
    "kda_recoverssm_verify_records": "vllm",
    "KDARecoverSSMCommitContext": "vllm",
    "ops": "ops",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(".ops", __name__)  # registers kdagen::verify, ::commit, ...
    module = importlib.import_module(f".{_API[name]}", __name__)
    return module if name == "ops" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


if (Path(__file__).resolve().parent / "kernels" / "manifest.json").exists():  # emitted
    importlib.import_module(".ops", __name__)
