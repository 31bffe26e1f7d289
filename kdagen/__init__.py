"""kdagen: autotuning and code generation for KDA speculative verify/commit kernels.

The serving API (``kdagen.serve``: ``verify``, ``commit``, ``ModelCommit``,
``KdaInputError``, ``check_values``, ``kda_recoverssm_verify_records`` (vLLM 0.33's verify),
``kda_recoverssm_verify`` (FlashInfer 0.7.2's), ``KDARecoverSSMCommitContext``,
``ops``) is
reachable here too, with kernels compiled on first use (``kdagen.first_use``), and imported
on first access so that the command line need not load torch.
"""

from kdagen import serve  # light: its API loads on first access

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "ops":  # a module of its own, so that `import kdagen.ops` works as well
        import importlib

        return importlib.import_module("kdagen.ops")
    if name in serve.__all__:
        from kdagen import first_use

        first_use.enable()
        return getattr(serve, name)
    raise AttributeError(f"module 'kdagen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *serve.__all__])
