"""Rendering: every shipped variant renders to plain CuTe-DSL Python for its variant only.

Every variant, not the covering the compile tests build (tests/conftest.py): a render
takes milliseconds and catches a Jinja error in any combination of branches."""

from __future__ import annotations

import ast
import re
import types

import jinja2
import pytest

from kdagen.render import environment, render, template_digest
from kdagen.serve.variant import Variant
from kdagen.space import default_variants

VARIANTS = default_variants()


def test_environment_is_strict() -> None:
    assert environment().undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        environment().from_string("{{ variant.no_such_field }}").render(variant=VARIANTS[0])


def test_every_shipped_variant_renders_to_valid_python() -> None:
    for v in VARIANTS:
        source = render(v)
        ast.parse(source, filename=v.name)
        assert v.name in source.splitlines()[0]
        assert "{{" not in source and "{%" not in source


def test_rendered_code_has_no_branches_for_other_variants() -> None:
    on = render(Variant(kernel="commit", heads=12, window=8, pdl=True))
    off = render(Variant(kernel="commit", heads=12, window=8, pdl=False))
    assert "griddepcontrol_wait" in on and "griddepcontrol_wait" not in off
    assert "use_pdl=False" in off
    for source in (on, off):
        # Constants are plain literals, not lookups of a variant object at run time, and the
        # only trace-time branches are on the index of an unrolled loop (piece boundaries).
        assert "variant" not in source.split('"""', 2)[2]
        conditions = re.findall(r"const_expr\((.*)\):", source)
        assert all(re.match(r"n\b", c) for c in conditions), conditions


def test_constants_follow_the_variant() -> None:
    """The rendered module's constants, as the module defines them when imported."""
    variant = Variant(kernel="commit", heads=32, window=4, threads=256, vec=4, row_split=2)
    module = types.ModuleType(variant.name)
    exec(compile(render(variant), variant.name, "exec"), module.__dict__)
    assert (module.H, module.Q, module.THREADS, module.VEC) == (32, 4, 256, 4)
    assert module.ROW_SPLIT == 2 and module.ROWS == 128 // 2  # a CTA's share of the rows
    assert module.STATE_BYTES == module.ROWS * 128 * 2  # its bf16 state rows


def test_template_digest_changes_with_the_templates(tmp_path, monkeypatch) -> None:
    from kdagen import render as render_module

    before = template_digest("commit")
    copy = tmp_path / "templates"
    import shutil

    shutil.copytree(render_module.TEMPLATE_DIR, copy)
    (copy / "commit" / "bulk.py.j2").write_text("changed")
    monkeypatch.setattr(render_module, "TEMPLATE_DIR", copy)
    assert template_digest("commit") != before


def test_a_kernel_digest_follows_only_the_helper_modules_it_imports(tmp_path, monkeypatch) -> None:
    import shutil

    from kdagen import render as render_module

    commit = Variant(kernel="commit", heads=12, window=8)
    verify = Variant(kernel="verify", heads=12, window=8)
    before = {v.kernel: render_module.digest(v) for v in (commit, verify)}
    dsl = tmp_path / "dsl"
    shutil.copytree(render_module.DSL_DIR, dsl)
    monkeypatch.setattr(render_module, "DSL_DIR", dsl)
    render_module.helper_modules.cache_clear()
    (dsl / "verify.py").write_text((dsl / "verify.py").read_text() + "\n# edited\n")
    assert render_module.digest(commit) == before["commit"]  # commit imports common only
    assert render_module.digest(verify) != before["verify"]
    (dsl / "common.py").write_text((dsl / "common.py").read_text() + "\n# edited\n")
    assert render_module.digest(commit) != before["commit"]
    render_module.helper_modules.cache_clear()


def test_verify_renders_only_its_conv_settings() -> None:
    off = render(Variant(kernel="verify", heads=12, window=8))
    dim_first = render(
        Variant(
            kernel="verify",
            heads=12,
            window=8,
            conv=True,
            conv_layout="dim_first",
            conv_weight_dtype="fp32",
        )  # fmt: skip
    )
    assert "conv_state" not in off and "conv_silu" not in off
    assert "dim_first=True" in dim_first and "dim_first=False" not in dim_first
    assert "taps = cute.make_rmem_tensor((3, 4), Float32)" in dim_first
    for source in (off, dim_first):
        assert "self.conv" not in source  # no trace-time switches on the variant
