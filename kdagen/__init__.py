"""kdagen: autotuning and code generation for KDA speculative verify/commit kernels.

``kdagen.verify``, ``kdagen.commit`` and ``kdagen.ModelCommit`` are the run-time API
(``kdagen.runtime``, ``kdagen.model_commit``), imported on first use so that the command line
need not load torch.
"""

__version__ = "0.1.0"

_RUNTIME = {
    "verify": "kdagen.runtime",
    "commit": "kdagen.runtime",
    "ModelCommit": "kdagen.model_commit",
}


def __getattr__(name: str) -> object:
    if name in _RUNTIME:
        import importlib

        return getattr(importlib.import_module(_RUNTIME[name]), name)
    raise AttributeError(f"module 'kdagen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_RUNTIME])
