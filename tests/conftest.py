"""Shared fixtures: kernels compiled on first use for every test that launches (or reads a
table against the templates through the run-time), and one GPU-less compile of every shipped
variant, reused by the test files that inspect what the compiler made."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen import first_use
from kdagen.space import default_variants


@pytest.fixture(scope="session", autouse=True)
def compile_on_first_use() -> None:
    first_use.enable()


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kdagen-cache")


@pytest.fixture(scope="session")
def records(cache: Path) -> list[kcompile.CompileRecord]:
    """Every shipped variant compiled for every arch it targets (the others are skipped)."""
    return kcompile.compile_many(default_variants(), kcompile.ARCHS, jobs=2, root=cache)
