"""Shared fixtures: kernels compiled on first use for every test that launches (or reads a
table against the templates through the run-time), and one GPU-less compile of a pairwise
covering of the shipped variants completed to every line shape of their renders (every template
branch, not every variant: ``kdagen check`` on the GPU host compiles them all), reused by the
test files that inspect what the compiler made.

A test module that inspects particular variants' builds lists their names in a module-level
``INSPECTED``; the covering includes them whenever that module is collected."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen import first_use
from kdagen.coverage import branch_cover
from kdagen.serve.variant import Variant
from kdagen.space import default_variants


@pytest.fixture(scope="session", autouse=True)
def compile_on_first_use() -> None:
    first_use.enable()


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kdagen-cache")


@pytest.fixture(scope="session")
def covered(request: pytest.FixtureRequest) -> list[Variant]:
    """The branch covering of the shipped variants plus every collected ``INSPECTED``."""
    modules = {item.module for item in request.session.items if hasattr(item, "module")}
    inspected = {name for m in modules for name in getattr(m, "INSPECTED", ())}
    return branch_cover(default_variants(), required=map(Variant.parse, inspected))


@pytest.fixture(scope="session")
def records(covered: list[Variant], cache: Path) -> list[kcompile.CompileRecord]:
    """The covered variants compiled for every arch each targets (the others are skipped)."""
    return kcompile.compile_many(covered, kcompile.ARCHS, jobs=2, root=cache)
