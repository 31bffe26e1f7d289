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
    commit = Variant(kernel="commit", heads=12, window=8, path="bulk_mma", threads=128)
    with pytest.raises(ValueError, match="sm90_wgmma verify kernels and the bulk"):
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


def _builds_for_sm90a(variant: Variant, source: str, root: Path) -> None:
    """``source`` (a perf build of ``variant``) compiled GPU-less outside the compile cache,
    whose key is the product render (the perf tools build in a scratch cache)."""
    import cutlass.cute as cute

    path = root / "kernel.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("traced_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = getattr(module, variant.spec.class_name)()
    cute.compile(kernel, *placeholder_args(variant), options=compile_options("sm_90a", root))
    assert list(root.glob("*.cubin"))


def test_a_traced_bound_builds_for_sm90a(tmp_path: Path) -> None:
    options = RenderOptions(trace_records=TRACE, bound="no-stores")
    _builds_for_sm90a(BASE, render(BASE, options), tmp_path)


RING = Variant.parse("commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl")


def test_a_traced_commit_stamps_its_stages_and_builds_for_sm90a(tmp_path: Path) -> None:
    """The bulk and bulk_ring commits take trace records (scripts/sweep_model_commit.py
    --trace): every stage and each state piece stamped, the product render untouched."""
    source = render(RING, RenderOptions(trace_records=TRACE))
    for field in ("trace_put(4,", "trace_put(5,", "trace_put(6,", "trace_put(7,", "trace_put(2,"):
        assert field in source, field
    assert "trace_put(TRACE_HEADER + n //" in source and "trace_put" not in render(RING)
    _builds_for_sm90a(RING, source, tmp_path)


def test_the_commit_trace_summary_reads_one_launch(capsys: pytest.CaptureFixture[str]) -> None:
    """Stages are us from the first entry; a stage stamped by an earlier launch (outside the
    CTA's own entry and exit) is left out; SMs are grouped by the CTAs they held."""
    import torch

    from kdagen.render import TRACE_HEADER, TRACE_SLOTS

    spec = importlib.util.spec_from_file_location(
        "sweep_model_commit", Path(__file__).parents[1] / "scripts" / "sweep_model_commit.py"
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    records = torch.zeros(4 * TRACE_SLOTS, dtype=torch.int64)
    rows = records.view(4, TRACE_SLOTS)
    for cta, (sm, entry) in enumerate([(0, 10_000), (0, 10_000), (0, 11_000), (1, 10_000)]):
        rows[cta, 0], rows[cta, 1], rows[cta, 3] = entry, entry + 500, sm
        rows[cta, 5], rows[cta, TRACE_HEADER] = entry + 2_000, entry + 3_000
    rows[:, 2] = torch.tensor([19_000, 19_500, 21_000, 22_000])  # exits
    rows[3, 5] = 1_000  # an earlier launch's stamp
    sweep.summarise_trace(records, 4)
    out = capsys.readouterr().out
    assert "records landed         2.00 /   2.00 /   2.00 /   3.00" in out
    assert "piece 0 landed         3.00 /   3.00 /   3.00 /   4.00" in out
    assert "piece 1" not in out
    assert "SMs holding   1 CTAs:   1, last exit  12.00" in out
    assert "SMs holding   3 CTAs:   1, last exit  11.00" in out
