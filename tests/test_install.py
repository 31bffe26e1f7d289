"""A non-editable install works: the wheel built from this checkout, installed into a fresh
virtualenv, lists, renders, compiles and emits from another directory (its templates, spaces
and shipped table come from the package, not from the checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANT = "commit-h12-q1-i32-bulk-t128-v4-r4-pdl"


def run(*args: str | Path, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv's kdagen script, an empty working directory, the environment)."""
    tmp = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDAGEN_TEMPLATES",
                                                             "KDAGEN_GENERATED")}  # fmt: skip
    env["KDAGEN_CACHE"] = str(tmp / "cache")
    wheels = tmp / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", wheels, ROOT, cwd=tmp, env=env)  # fmt: skip
    (wheel,) = wheels.glob("kdagen-*.whl")
    venv = tmp / "venv"
    # The venv sees this interpreter's packages (torch, nvidia-cutlass-dsl, ...), not kdagen's
    # checkout: kdagen itself comes from the wheel.
    run(sys.executable, "-m", "venv", "--system-site-packages", venv, cwd=tmp, env=env)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp, env=env)
    work = tmp / "elsewhere"
    work.mkdir()
    where = run(python, "-c", "import kdagen.serve.resources as r; print(r.data_dir('templates'))",
                cwd=work, env=env)  # fmt: skip
    assert str(venv) in where and ROOT.as_posix() not in where
    return venv / "bin" / "kdagen", work, env


def test_the_wheel_lists_renders_compiles_and_emits(installed) -> None:
    kdagen, work, env = installed
    assert VARIANT in run(kdagen, "variants", "--space", "commit.yaml", cwd=work, env=env)
    source = run(kdagen, "render", VARIANT, cwd=work, env=env)
    assert source.startswith('"""KDA commit kernel, variant ' + VARIANT)
    compiled = run(kdagen, "compile", "--arch", "sm_90a", "--match", VARIANT, "-j", "1",
                   cwd=work, env=env)  # fmt: skip
    assert "1 ok, 0 failed" in compiled
    out = work / "dist"
    emitted = run(kdagen, "emit", "--key", "commit-h12-q1-i32", "--out", out, cwd=work, env=env)
    assert "wrote" in emitted and (out / "kda_kernels" / "kernels" / "manifest.json").exists()
    assert (out / "kda_kernels" / "generated").is_dir()
