"""The perf-work trace tool (`scripts/trace_verify.py`) still patches the renders it names:
each experiment either applies, giving valid Python with and without the trace records, or
refuses a render it does not target. Catches a template change that silently breaks an
A/B baseline (CPU only: nothing is compiled or run)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

from kdagen.serve.variant import Variant

TOOL = Path(__file__).resolve().parents[1] / "scripts" / "trace_verify.py"
CONV_OFF = "verify-h12-q8-i32-sm90_wgmma-t128-r1-c396-s1-pdl"
CONV = "verify-h12-q8-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c396-s1-pdl"
# The patches that target the other kind of render, and so must refuse this one.
REFUSED = {
    CONV_OFF: {"conv-bytes-only", "conv-no-silu", "silu-no-test", "silu-settle-kv"},
    CONV: {"tma-window-late", "window-guess", "window-misguess", "branch-stores"},
}


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    """The tool as a module; its import points KDAGEN_CACHE at a scratch folder, which is
    put back so the rest of the session keeps its cache."""
    saved = os.environ.get("KDAGEN_CACHE")
    spec = importlib.util.spec_from_file_location("trace_verify", TOOL)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("KDAGEN_CACHE", None)
        else:
            os.environ["KDAGEN_CACHE"] = saved
    return module


@pytest.mark.parametrize("name", [CONV_OFF, CONV])
def test_every_experiment_applies_or_refuses_its_render(tool: ModuleType, name: str) -> None:
    source = tool.ORIGINAL_RENDER(Variant.parse(name))
    applied = []
    for config, apply in tool.CONFIGS.items():
        if config in REFUSED[name]:
            with pytest.raises(SystemExit):
                apply(source)
            continue
        patched = apply(source)
        compile(patched, f"{name}+{config}", "exec")
        compile(tool.patch(patched, 0), f"{name}+{config} (traced)", "exec")
        applied.append(config)
    assert "prologue" in applied and len(applied) == len(tool.CONFIGS) - len(REFUSED[name])


def test_a_patch_changes_the_render(tool: ModuleType) -> None:
    """The bounds are not silent no-ops: each rewrites the render it applies to."""
    source = tool.ORIGINAL_RENDER(Variant.parse(CONV_OFF))
    bounds = ("io-only", "l2-resident", "l2-spread", "probe-hi-only", "probe-lo-as-hi")
    bounds += ("no-fence", "lookahead-wide", "no-stores", "norms-free")
    moves = ("lookahead-after-fence", "io-after-fence", "window-guess", "window-misguess")
    moves += ("serial-coupling", "branch-stores", "early-states", "late-third", "staggered")
    for config in (*bounds, *moves, "accurate-decay"):
        assert tool.CONFIGS[config](source) != source, config
