"""kdagen: autotuning and code generation for KDA speculative verify/commit kernels.

``kdagen.verify``, ``kdagen.commit``, ``kdagen.ModelCommit`` and ``kdagen.KdaInputError`` are
the serving API (``kdagen.serve``) with kernels compiled on first use (``kdagen.first_use``),
imported on first access so that the command line need not load torch.
"""

__version__ = "0.1.0"

_SERVE = ("verify", "commit", "ModelCommit", "KdaInputError")


def __getattr__(name: str) -> object:
    if name in _SERVE:
        from kdagen import first_use, serve

        first_use.enable()
        return getattr(serve, name)
    raise AttributeError(f"module 'kdagen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SERVE])
