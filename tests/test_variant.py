"""Variant validation, naming and hashing."""

from __future__ import annotations

import pytest

from kdagen.render import digest, render
from kdagen.serve.variant import Variant, VariantError

BASE = dict(kernel="commit", heads=12, window=8)


def test_name_is_readable_and_parses_back() -> None:
    v = Variant(**BASE, slot_dtype="int64", threads=256, vec=4, row_split=2)
    assert v.name == "commit-h12-q8-i64-bulk-t256-v4-r2-pdl"
    assert Variant.parse(v.name) == v
    assert v.contract_key == "commit-h12-q8-i64"


def test_contract_and_tuning_fields_are_separate() -> None:
    v = Variant(**BASE, threads=256, row_split=4)
    assert set(v.tuning) == {"path", "threads", "vec", "row_split", "pdl", "fold_paths"}
    assert v.contract["heads"] == 12 and "threads" not in v.contract
    assert v.contract_key == v.replace(threads=128, row_split=1).contract_key


def test_fold_paths_name_only_where_they_differ_from_one_path() -> None:
    """The names of kernels tuned before the field existed stay valid: one path is nameless."""
    v = Variant(**BASE)
    assert v.name == "commit-h12-q8-i32-bulk-t128-v8-r1-pdl" and v.fold_paths == 1
    counted = v.replace(fold_paths=8)
    assert counted.name == "commit-h12-q8-i32-bulk-t128-v8-r1-f8-pdl"
    assert Variant.parse(counted.name) == counted
    assert "fold_paths" not in v.tuning_summary and "fold_paths=8" in counted.tuning_summary


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"fold_paths": 8, "window": 4}, "fold_paths=8 does not divide window=4"),
        ({"fold_paths": 3}, "fold_paths"),
        ({"kernel": "verify", "path": "sm90_wgmma", "fold_paths": 2}, "only commit folds"),
    ],
)
def test_fold_paths_are_refused_where_no_update_path_fits(changes, message) -> None:
    with pytest.raises(VariantError, match=message):
        Variant(**{**BASE, **changes})


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"window": 17}, "window", "[1, 16]"),
        ({"window": 0}, "window", "[1, 16]"),
        ({"kernel": "decode"}, "kernel", "'verify', 'commit'"),
        ({"slot_dtype": "int16"}, "slot_dtype", "'int32', 'int64'"),
        ({"threads": 96}, "threads", "32, 64, 128, 256, 512"),
        ({"vec": 3}, "vec", "[4, 8]"),
        ({"pdl": 1}, "pdl", "False, True"),
        ({"heads": 0}, "heads", "[1, 256]"),
        ({"conv": True}, "conv", "[False]"),
        ({"path": "sm90_wgmma"}, "path", "bulk"),
    ],
)
def test_validation_names_the_field_and_the_allowed_values(changes, field, allowed) -> None:
    with pytest.raises(VariantError) as err:
        Variant(**{**BASE, **changes})
    assert field in str(err.value) and allowed in str(err.value)


def test_cross_field_rules_of_the_commit_template() -> None:
    with pytest.raises(VariantError, match="row_split=8"):
        Variant(**BASE, threads=512, row_split=8)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("verify-h12-q9-i32-sm90_wgmma-t256-r1-c264-s1-pdl", "a window of 2..8"),
        ("verify-h12-q17-i32-sm100_tcgen05-c444", r"window=17 is not allowed"),
    ],
)
def test_windows_past_8_are_the_one_warpgroup_kernels(name: str, message: str) -> None:
    """Past 8 tokens: Hopper's one-warpgroup kernel and Blackwell's, either gate."""
    with pytest.raises(VariantError, match=message):
        Variant.parse(name)
    assert Variant.parse("verify-h12-q16-tree-i32-sm90_wgmma-t128-r1-c264-s1-pdl").window == 16
    assert Variant.parse("verify-h16-q9-softplus-i32-sm90_wgmma-t128-r1-c264-s1-pdl").window == 9
    assert Variant.parse("verify-h16-q16-softplus-tree-i32-sm100_tcgen05-c296").tree
    assert Variant.parse("verify-h12-q16-tree-i32-sm100_tcgen05-c296").window == 16


def test_the_commit_without_prefix_caching_is_its_own_contract_key() -> None:
    """``prefix_caching=False``: a commit build without vLLM's block tables, named by a
    ``noprefix`` token; today's names (the general build) are unchanged; verify has no such
    build."""
    lean = Variant(**BASE, prefix_caching=False, threads=256, vec=4)
    assert lean.name == "commit-h12-q8-noprefix-i32-bulk-t256-v4-r1-pdl"
    assert Variant.parse(lean.name) == lean and lean.contract_key == "commit-h12-q8-noprefix-i32"
    general = lean.replace(prefix_caching=True)
    assert general.name == "commit-h12-q8-i32-bulk-t256-v4-r1-pdl"
    assert "prefix_caching=False" in lean.contract_summary
    assert "prefix_caching" not in general.contract_summary
    assert "block_table" in render(general) and "block_table" not in render(lean)
    assert "boundary" not in render(lean)
    with pytest.raises(
        VariantError, match="prefix_caching=False is not allowed for kernel 'verify'"
    ):
        Variant(kernel="verify", heads=12, window=8, path="sm90_wgmma", ctas=528,
                prefix_caching=False)  # fmt: skip


def test_parse_rejects_garbage_with_an_example() -> None:
    with pytest.raises(VariantError, match="cannot parse variant name.*e.g."):
        Variant.parse("commit-twelve-heads")
    with pytest.raises(VariantError, match="unknown variant field"):
        Variant.from_fields({**BASE, "warps": 4})


@pytest.mark.parametrize(("name", "says"), [
    ("bogus", "it ends before the head count"),
    ("verify-h12-q8-i32", "a contract key, not a variant name.*kdagen variants --match"),
    ("commit-h12-q8-i16-bulk-t128-v4-r2-pdl", "expected one of i32, i64, got 'i16'"),
    ("verify-h12-q8-conv-xx-bf16-i32-sm90_wgmma-t128", "expected one of tm, df, got 'xx'"),
    ("commit-hx-q8-i32", "expected h and a number, got 'hx'"),
    ("commit-h12-q8-i32-bulk-x3-pdl", "'x3' is not a tuning token"),
    ("commit-h12-q8-i32-bulk-t-pdl", "'t' is not a tuning token"),
])  # fmt: skip
def test_a_bad_name_says_which_token_and_what_was_expected(name: str, says: str) -> None:
    with pytest.raises(VariantError, match=f"cannot parse variant name '{name}'.*{says}"):
        Variant.parse(name)


def test_digest_is_stable_and_follows_the_rendered_source() -> None:
    a, b = Variant(**BASE), Variant(**BASE)
    assert digest(a) == digest(b) and len(digest(a)) == 16
    c = a.replace(row_split=2)
    assert render(c) != render(a) and digest(c) != digest(a)


def test_digest_covers_the_dsl_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdagen import render as render_module

    v = Variant(**BASE)
    before = digest(v)
    monkeypatch.setattr(render_module, "dsl_version", lambda: "9.9.9")
    assert digest(v) != before
