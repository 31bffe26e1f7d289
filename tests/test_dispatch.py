"""The dispatch table: fingerprint, JSON round trip, lookup order with one warning per fallback,
per-process caching, and refusal of stale tables. CPU only: the fingerprint comes from
$KDAGEN_FINGERPRINT."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from tables import serve_tables_from

from kdagen.render import dsl_version, kernels_digest, template_digest
from kdagen.serve import dispatch
from kdagen.serve.dispatch import (
    DispatchFallbackWarning,
    DispatchTable,
    Entry,
    StaleTableError,
    choose,
    load_table,
    write_table,
)
from kdagen.serve.fingerprint import fingerprint_of, slug
from kdagen.serve.variant import Variant

GPU = "nvidia-h200-sm90-132sm"
R4 = {"path": "bulk", "threads": 128, "vec": 4, "row_split": 4, "pdl": True, "fold_paths": 1}
R2 = {"path": "bulk", "threads": 128, "vec": 4, "row_split": 2, "pdl": True, "fold_paths": 1}
R1 = {"path": "bulk", "threads": 256, "vec": 4, "row_split": 1, "pdl": True, "fold_paths": 1}
T256_V8 = {"path": "bulk", "threads": 256, "vec": 8, "row_split": 1, "pdl": True, "fold_paths": 1}


def heuristic(heads: int = 12, window: int = 8, slot_dtype: str = "int32") -> Variant:
    """A stand-in for the run-time heuristic: a fixed config no table entry uses."""
    return Variant(kernel="commit", heads=heads, window=window, slot_dtype=slot_dtype,
                   path="bulk", threads=128, vec=8, row_split=1)  # fmt: skip


def make_table(**changes: object) -> DispatchTable:
    table = DispatchTable(
        fingerprint=GPU,
        dsl_version=dsl_version(),
        template_hashes={"commit": template_digest("commit"), "verify": template_digest("verify")},
        created="2026-01-01T00:00:00Z",
        entries={
            "commit-h12-q8-i32": [
                Entry(1, R4, 3.9),
                Entry(64, R1, 23.2),
                Entry(512, T256_V8, 126.6),
            ]
        },
        defaults={"commit": [Entry(1, R4), Entry(256, R2)]},
    )
    for key, value in changes.items():
        setattr(table, key, value)
    return table


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    serve_tables_from(monkeypatch, tmp_path, GPU)
    yield tmp_path / GPU
    dispatch.reset()


def pick(batch: int, **contract: object) -> tuple[Variant, list[str]]:
    """choose() for commit, and the fallback warnings it raised."""
    base = heuristic(**contract)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = choose("commit", base.contract, batch, lambda: base)
    return chosen, [str(w.message) for w in caught if w.category is DispatchFallbackWarning]


def test_fingerprint_names_the_folder() -> None:
    assert fingerprint_of("NVIDIA H200", 9, 0, 132) == "nvidia-h200-sm90-132sm"
    assert fingerprint_of("NVIDIA B200", 10, 0, 148) == "nvidia-b200-sm100-148sm"
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_table_round_trips_through_json(fresh: Path) -> None:
    write_table(fresh, make_table())
    loaded = load_table(fresh)
    assert loaded == make_table()
    assert load_table(fresh.parent / "no-such-gpu") is None


def test_lookup_order_exact_nearest_default_heuristic_one_warning_each(fresh: Path) -> None:
    write_table(fresh, make_table())

    chosen, warned = pick(64)  # exact key and bucket: no warning
    assert chosen.tuning == R1 and warned == []

    chosen, warned = pick(100)  # nearest bucket on a log scale: 64, not 512
    assert chosen.tuning == R1
    assert len(warned) == 1 and "nearest tuned bucket (64)" in warned[0]
    chosen, warned = pick(300)  # nearer 512 than 64; same (key, reason): no second warning
    assert chosen.tuning == T256_V8 and warned == []

    chosen, warned = pick(2, heads=32, window=4)  # key not tuned: per-GPU default at bucket 1
    assert chosen.tuning == R4 and (chosen.heads, chosen.window) == (32, 4)
    assert len(warned) == 1 and "per-GPU default" in warned[0]
    chosen, warned = pick(200, heads=32, window=4)  # its bucket 256, no new warning
    assert chosen.tuning == R2 and warned == []

    write_table(fresh, make_table(defaults={}))
    dispatch.reset()
    chosen, warned = pick(16, heads=96)  # nothing for the key, no default: the heuristic
    assert chosen == heuristic(heads=96)
    assert len(warned) == 1 and "built-in heuristic" in warned[0]


def test_nearest_bucket_ties_go_to_the_larger_bucket() -> None:
    rows = [Entry(1, R4), Entry(4, R2)]
    assert dispatch.nearest(rows, 2).batch == 4
    assert dispatch.nearest(rows, 1).batch == 1
    assert dispatch.nearest(rows, 1000).batch == 4


def test_entry_that_does_not_fit_the_contract_falls_back_to_the_heuristic(fresh: Path) -> None:
    bad = {"path": "bulk", "threads": 512, "vec": 8, "row_split": 8, "pdl": True}  # 16 < 512
    write_table(fresh, make_table(entries={"commit-h12-q8-i32": [Entry(16, bad)]}))
    chosen, warned = pick(16)
    assert chosen == heuristic()
    assert len(warned) == 1 and "does not fit" in warned[0]


def test_the_lookup_stays_inside_the_tables_search_space(fresh: Path) -> None:
    """An untuned key gets the per-GPU default, or the heuristic, only where the space the
    table was tuned and checked with holds that variant; else its nearest point there."""
    untuned = "commit-h32-q4-i32"
    points = [f"{untuned}-bulk-t128-v4-r4-pdl", f"{untuned}-bulk-t256-v8-r1-pdl"]
    space = {"commit": {untuned: points, "commit-h12-q8-i32": [
        Variant(kernel="commit", heads=12, window=8, slot_dtype="int32", **t).name
        for t in (R4, R1, T256_V8)]}}  # fmt: skip
    write_table(fresh, make_table(space=space))

    chosen, warned = pick(2, heads=32, window=4)  # the default at bucket 1 (R4) is inside
    assert chosen.name == points[0] and ["per-GPU default" in w for w in warned] == [True]
    chosen, warned = pick(200, heads=32, window=4)  # R2 at bucket 256 is not: nearest inside
    assert chosen.name == points[0]  # shares path, threads, vec and pdl with R2
    assert len(warned) == 1 and "outside the search space" in warned[0]
    assert "using commit-h32-q4-i32-bulk-t128-v4-r4-pdl" in warned[0]
    chosen, warned = pick(64)  # a tuned entry lies inside its own space: untouched
    assert chosen.tuning == R1 and warned == []

    write_table(fresh, make_table(space=space, defaults={}))
    dispatch.reset()
    chosen, warned = pick(16, heads=32, window=4)  # no default: the heuristic, moved inside
    assert chosen.name == points[1]  # t128-v8-r1 shares vec, row_split and pdl with t256-v8-r1
    assert any("outside the search space" in w for w in warned)
    chosen, warned = pick(16, heads=96)  # a key the space does not hold: the heuristic
    assert chosen == heuristic(heads=96)


def test_a_key_outside_the_tuned_space_takes_the_heuristic_not_the_default(fresh: Path) -> None:
    """A shipped space the table was not tuned with (e.g. windows past 8): the per-GPU default
    was measured on other keys, so the built-in choice (the point those spaces check) runs."""
    tuned = "commit-h12-q8-i32"
    space = {"commit": {tuned: [Variant(kernel="commit", heads=12, window=8, slot_dtype="int32",
                                        **t).name for t in (R4, R1, T256_V8)]}}  # fmt: skip
    write_table(fresh, make_table(space=space))  # with per-GPU defaults
    chosen, warned = pick(2, heads=32, window=4)
    assert chosen == heuristic(heads=32, window=4)
    assert len(warned) == 1 and "outside the search space the table was tuned with" in warned[0]
    chosen, warned = pick(64)  # a tuned key: its entry
    assert chosen.tuning == R1 and warned == []


def test_a_commit_without_prefix_caching_takes_the_lean_build_once_it_is_tuned(
    fresh: Path,
) -> None:
    """The build without prefix caching serves a commit that passes no block tables only
    where the table measured its key; block tables always take the general build."""
    from kdagen.serve.runtime import _dispatched

    def run(**fields: object) -> Variant:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DispatchFallbackWarning)
            return _dispatched("commit", 12, 8, "int32", 64, None, None, **fields)

    write_table(fresh, make_table())
    assert run().prefix_caching and run().tuning == R1  # its key untuned: the general build
    lean = make_table().entries | {"commit-h12-q8-noprefix-i32": [Entry(64, R4, 20.0)]}
    write_table(fresh, make_table(entries=lean))
    dispatch.reset()
    chosen = run()
    assert not chosen.prefix_caching and chosen.tuning == R4
    assert chosen.name == "commit-h12-q8-noprefix-i32-bulk-t128-v4-r4-pdl"
    assert run(prefix_caching=True).prefix_caching  # block tables: the general build
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KDAGEN_DISPATCH", "off")
        dispatch.reset()
        assert run().prefix_caching  # the heuristic stays on the checked general build


def test_no_table_for_this_gpu_uses_the_heuristic_and_warns_once() -> None:
    chosen, warned = pick(16)
    assert chosen == heuristic() and len(warned) == 1 and "no dispatch table" in warned[0]
    assert pick(64)[1] == []


def test_a_kernel_the_table_does_not_cover_is_never_refused(fresh: Path) -> None:
    write_table(fresh, make_table(template_hashes={"commit": template_digest("commit"),
                                                   "verify": "changed"}))  # fmt: skip
    base = Variant(kernel="verify", heads=12, window=8, path="sm90_wgmma", ctas=528)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert choose("verify", base.contract, 16, lambda: base) == base
    assert "has no verify entries" in str(caught[0].message)
    assert pick(64)[0].tuning == R1  # commit is still served


def test_choices_are_cached_no_file_io_after_the_first(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_table(fresh, make_table())
    first, _ = pick(64)

    def no_io(folder: Path) -> None:
        raise AssertionError("the table was read again")

    monkeypatch.setattr(dispatch, "load_table", no_io)
    assert pick(64)[0] == first
    assert pick(512)[0].tuning == T256_V8  # another batch: the table is held in memory


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"template_hashes": {"commit": "0123456789abcdef"}}, "the commit templates changed"),
        ({"dsl_version": "4.0.0"}, "nvidia-cutlass-dsl changed (table made with 4.0.0"),
    ],
)
def test_stale_table_is_refused_not_used(fresh: Path, changes: dict, says: str) -> None:
    write_table(fresh, make_table(**changes))
    for _ in range(2):  # refused every time, never quietly cached
        with pytest.raises(StaleTableError) as err:
            pick(64)
        assert says in str(err.value) and "refusing the dispatch table" in str(err.value)


def test_dispatch_off_uses_the_heuristic_even_with_a_stale_table(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_table(fresh, make_table(dsl_version="4.0.0"))
    monkeypatch.setenv("KDAGEN_DISPATCH", "off")
    chosen, warned = pick(64)
    assert chosen == heuristic() and "KDAGEN_DISPATCH=off" in warned[0]


def test_staleness_names_every_change() -> None:
    table = make_table()
    assert table.staleness("commit", dsl_version(), template_digest("commit")) is None
    why = table.staleness("commit", "9.9", "ffff")
    assert why is not None and "template hash" in why and "installed 9.9" in why
    assert "no template hash for kernel 'other'" in (
        table.staleness("other", dsl_version(), "x") or ""
    )


MEASURED = ["commit-h12-q8-i32-bulk-t128-v4-r4-pdl", "commit-h12-q8-i32-bulk-t256-v4-r1-pdl"]


@pytest.fixture
def append_to_commit_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Appends text to a copy of the commit template, in use until the test ends (the Jinja
    environment and the renders are made again, as in a new process)."""
    import shutil

    from kdagen import render as render_module

    def forget() -> None:
        render_module.environment.cache_clear()
        render_module.render.cache_clear()

    copy = tmp_path / "templates"
    shutil.copytree(render_module.TEMPLATE_DIR, copy)
    monkeypatch.setattr(render_module, "TEMPLATE_DIR", copy)
    forget()

    def append(text: str) -> None:
        path = copy / "commit" / "bulk.py.j2"
        path.write_text(path.read_text() + text)
        forget()

    yield append
    forget()


def write_table_with_render_hashes(folder: Path) -> None:
    measured = {"commit": MEASURED}
    write_table(
        folder, make_table(measured=measured, render_hashes={"commit": kernels_digest(MEASURED)})
    )


def test_a_template_edit_that_renders_the_same_kernels_keeps_the_table(
    fresh: Path, append_to_commit_template
) -> None:
    write_table_with_render_hashes(fresh)
    template_before = template_digest("commit")
    append_to_commit_template("{# a note, not rendered #}\n")
    assert template_digest("commit") != template_before
    assert pick(64)[0].tuning == R1  # still served: its kernels are the ones it measured


def test_a_template_edit_that_changes_a_measured_kernel_makes_the_table_stale(
    fresh: Path, append_to_commit_template
) -> None:
    write_table_with_render_hashes(fresh)
    append_to_commit_template("# a rendered line\n")
    with pytest.raises(StaleTableError, match="the commit kernels it measured changed"):
        pick(64)
