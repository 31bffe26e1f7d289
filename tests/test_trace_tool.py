"""The perf-work render options (``kdagen.render.RenderOptions``, driven by
`scripts/trace_verify.py`): each renders valid Python where it applies and refuses clearly
where it does not, and the defaults leave every product render as it was."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from kdagen.compile import compile_options
from kdagen.render import BOUNDS, RenderOptions, render
from kdagen.serve.abi import placeholder_args
from kdagen.serve.variant import Variant

BASE = Variant(kernel="verify", heads=12, window=8, path="sm90_wgmma", ctas=396)
VARIANTS = [
    BASE,  # one warpgroup, conv off, kda gate
    replace(BASE, threads=256, ctas=264),  # two warpgroups
    replace(BASE, conv=True),
    replace(BASE, gate="softplus"),
    replace(BASE, conv=True, gate="softplus", window=5),
]
TRACE = 1 << 40  # a records address: any value renders
OPTIONS = [RenderOptions(trace_records=TRACE)] + [
    RenderOptions(trace, bound) for trace in (0, TRACE) for bound in BOUNDS
]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_option_renders_python_or_refuses(variant: Variant) -> None:
    plain = render(variant)
    for options in OPTIONS:
        applies = options.bound is None or BOUNDS[options.bound][0](variant)
        if not applies:
            with pytest.raises(ValueError, match=f"bound '{options.bound}' needs"):
                render(variant, options)
            continue
        source = render(variant, options)
        assert source != plain, options
        compile(source, f"{variant.name} {options}", "exec")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_default_options_render_the_product_kernel(variant: Variant) -> None:
    assert _sha(render(variant, RenderOptions())) == _sha(render(variant))
    assert "trace_put" not in render(variant)


def test_a_bound_refuses_what_it_does_not_apply_to() -> None:
    with pytest.raises(
        ValueError, match="conv-bytes-only.*needs an sm90_wgmma verify with the conv"
    ):
        render(BASE, RenderOptions(bound="conv-bytes-only"))
    with pytest.raises(
        ValueError, match="loads-stores-only.*needs an sm90_wgmma verify, one warpgroup, r1"
    ):
        render(replace(BASE, row_split=2), RenderOptions(bound="loads-stores-only"))
    with pytest.raises(ValueError, match="unknown bound"):
        render(BASE, RenderOptions(bound="no-math"))
    commit = Variant(kernel="commit", heads=2, window=2)
    with pytest.raises(ValueError, match="sm90_wgmma verify"):
        render(commit, RenderOptions(trace_records=TRACE))


def test_the_commit_bound_drops_the_fold_and_only_applies_to_commits() -> None:
    commit = Variant(kernel="commit", heads=12, window=8, threads=128, vec=4, row_split=2)
    source = render(commit, RenderOptions(bound="no-fold"))
    compile(source, commit.name, "exec")
    assert "cute.math.fma" in render(commit) and "cute.math.fma" not in source
    assert "self.factors(s_kg" in render(commit) and "self.factors(s_kg" not in source
    for bound in (b for b in BOUNDS if b != "no-fold"):
        with pytest.raises(ValueError, match=f"bound '{bound}' needs an sm90_wgmma verify"):
            render(commit, RenderOptions(bound=bound))


def test_a_traced_bound_builds_for_sm90a(tmp_path: Path) -> None:
    """Compiled GPU-less outside the compile cache, whose key is the product render (the
    trace tool builds in a scratch cache)."""
    import cutlass.cute as cute

    options = RenderOptions(trace_records=TRACE, bound="no-stores")
    path = tmp_path / "kernel.py"
    path.write_text(render(BASE, options))
    spec = importlib.util.spec_from_file_location("traced_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = getattr(module, BASE.spec.class_name)()
    cute.compile(kernel, *placeholder_args(BASE), options=compile_options("sm_90a", tmp_path))
    assert list(tmp_path.glob("*.cubin"))
