"""kdagen: autotuning and code generation for KDA speculative verify/commit kernels."""

__version__ = "0.1.0"


def commit(*args, **kwargs):  # noqa: ANN002, ANN003 - forwards to the run-time API
    """See ``kdagen.runtime.commit`` (imported lazily: the CLI need not load torch)."""
    from kdagen.runtime import commit as run

    return run(*args, **kwargs)


def verify(*args, **kwargs):  # noqa: ANN002, ANN003 - forwards to the run-time API
    """See ``kdagen.runtime.verify`` (imported lazily: the CLI need not load torch)."""
    from kdagen.runtime import verify as run

    return run(*args, **kwargs)


def __getattr__(name: str) -> object:
    """``kdagen.ModelCommit``: the all-layer commit (``kdagen.model_commit``), imported on
    first use like the functions above."""
    if name == "ModelCommit":
        from kdagen.model_commit import ModelCommit

        return ModelCommit
    raise AttributeError(f"module 'kdagen' has no attribute {name!r}")
