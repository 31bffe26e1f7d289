"""The serving run-time stands alone: kdagen/serve imports only the standard library, torch,
nvidia-cutlass-dsl (and vLLM where it asks for its setting), never kdagen's build side or the
tuning stack, checked three ways (the source's imports, a fresh interpreter's modules, the
import-linter contract in pyproject.toml); and its launches get kernels from the plugged-in
source (``kernel_source``), which kdagen's serving names set to compile on first use."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdagen import first_use
from kdagen.serve import dispatch, kernel_source, runtime
from kdagen.serve.dispatch import DispatchTable, StaleTableError
from kdagen.serve.variant import Variant

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "kdagen" / "serve"
THIRD_PARTY = {"torch", "cutlass", "cuda"}
OPTIONAL = {"vllm.py": {"vllm"}}  # vLLM's conv-state layout setting, when vLLM is installed
TUNING_STACK = ("jinja2", "optuna", "typer", "yaml")


def outside_imports(path: Path) -> list[str]:
    """``line: module`` for every import in ``path`` (module level or in a function) that is
    neither the standard library, an allowed third-party package, nor relative to serve."""
    allowed = set(sys.stdlib_module_names) | THIRD_PARTY | OPTIONAL.get(path.name, set())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [str(node.module)]
        elif isinstance(node, ast.ImportFrom) and node.level > 1:  # out of serve, into kdagen
            names = ["." * node.level + (node.module or alias.name) for alias in node.names]
        else:  # relative to serve (from . / from .module), or not an import
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] not in allowed]
    return found


def test_serve_imports_only_the_stdlib_torch_cutlass_and_itself() -> None:
    modules = sorted(SERVE.glob("*.py"))
    assert len(modules) > 10
    found = {path.name: outside_imports(path) for path in modules}
    assert not {name: lines for name, lines in found.items() if lines}


def test_a_fresh_interpreter_loads_serve_without_the_build_side() -> None:
    """Every serve module and the whole API (torch ops registered), in a fresh process: no
    Jinja, Optuna, Typer or YAML, and no kdagen module outside kdagen.serve."""
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import kdagen.serve as serve
        for module in pkgutil.iter_modules(serve.__path__):
            importlib.import_module(f"kdagen.serve.{module.name}")
        for name in serve.__all__:
            getattr(serve, name)
        assert hasattr(sys.modules["torch"].ops.kdagen, "commit_layers")
        print("\\n".join(sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(done.stdout.split())
    assert "kdagen.serve.ops" in loaded
    stack = sorted(m for m in loaded if m.split(".")[0] in TUNING_STACK)
    # kdagen.render, kdagen.compile, kdagen.tune, ...: anything of kdagen but its (light)
    # __init__ and kdagen.serve
    build = sorted(m for m in loaded if m.startswith("kdagen.") and m.split(".")[1] != "serve")
    assert not stack and not build, (stack, build)


def test_the_import_linter_contract_is_kept() -> None:
    """``lint-imports`` run by this interpreter, on this checkout (it analyses the kdagen
    found from its working directory)."""
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    run = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    done = subprocess.run([sys.executable, "-c", run, "--no-cache"], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 kept, 0 broken" in done.stdout


def test_import_kdagen_ops_registers_the_ops_with_kernels_compiled_on_first_use() -> None:
    """README's ``kdagen.ops``: as an import of its own and as an attribute, one module."""
    script = textwrap.dedent(
        """
        import sys, torch
        import kdagen.ops
        import kdagen
        from kdagen import first_use
        from kdagen.serve import kernel_source
        assert hasattr(torch.ops.kdagen, "verify") and hasattr(torch.ops.kdagen, "commit_layers")
        assert isinstance(kernel_source.current(), first_use.FirstUse)
        assert kdagen.ops is sys.modules["kdagen.ops"] and callable(kdagen.ops.register)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


class Recording:
    """A kernel source that hands out a marker and finds every table stale."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, str]] = []

    def load(self, variant: Variant, arch: str) -> object:
        self.loaded.append((variant.name, arch))
        return "kernel"

    def stale(self, table: DispatchTable, kernel: str) -> str | None:
        return f"recorded ({kernel})"


@pytest.fixture
def unregistered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No kernel source registered (as in a process that imported kdagen.serve only)."""
    monkeypatch.setattr(kernel_source, "_registered", None)
    runtime.launcher.cache_clear()
    yield
    runtime.launcher.cache_clear()


COMMIT = Variant.parse("commit-h12-q4-i32-bulk-t128-v4-r4-pdl")


def test_without_a_source_the_run_time_says_how_to_get_kernels(unregistered: None) -> None:
    with pytest.raises(kernel_source.NoKernelSourceError) as err:
        runtime.launcher(COMMIT, "sm_90a")
    assert "manifest.json is missing" in str(err.value)
    assert "`kdagen emit`" in str(err.value) and "kdagen.first_use.enable()" in str(err.value)


def test_launches_and_table_checks_go_through_the_registered_source(unregistered: None) -> None:
    source = Recording()
    kernel_source.register(source)
    assert runtime.launcher(COMMIT, "sm_90a") == "kernel"
    assert source.loaded == [(COMMIT.name, "sm_90a")]
    table = DispatchTable("gpu", "x", {}, "today")
    with pytest.raises(StaleTableError, match=r"refusing the dispatch table t.json .*recorded"):
        dispatch.check_fresh(table, "commit", "t.json")


def test_kdagens_serving_names_compile_on_first_use(unregistered: None) -> None:
    """kdagen.<name> is kdagen.serve's, with compile on first use turned on."""
    import kdagen
    from kdagen import serve
    from kdagen.serve import vllm

    assert set(serve.__all__) <= set(dir(kdagen))
    assert kdagen.KDARecoverSSMCommitContext is vllm.KDARecoverSSMCommitContext
    assert kernel_source.current() is first_use.SOURCE
