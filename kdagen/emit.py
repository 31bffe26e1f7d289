"""``kdagen emit``: a tuned table turned into a package a serving engine can vendor.

The package needs torch and nvidia-cutlass-dsl only (no kdagen, Jinja, Optuna or YAML), and
never compiles: it holds

- ``kdagen/serve`` copied as it is (validation, dispatch, launch, the vLLM entry points, the
  torch ops; its ``__init__`` is the package's API);
- the dispatch table, under ``generated/<fingerprint>/`` as in a checkout;
- ``kernels/``: the exported object of every variant the table can choose for the selected
  contract keys, and ``manifest.json`` naming each object's symbol (``kdagen.serve.bundle``
  finds it there and makes the package's kernels the launches' source);
- ``README.md``: what it serves and was made from.

Which variants: for each key and each batch bucket the table has for it, the variant the
run-time's own lookup picks (``dispatch.resolve`` over the built-in heuristic), so any batch
resolves to a held kernel: between buckets the lookup takes the nearest one, and it stays
inside the table's search space. A key of a shipped space the table was not tuned with
(the commit after 16 tokens, conv trees, the tree commit) runs the built-in choice: every
variant it takes at any batch is packaged. The package also holds the commit (both builds)
of every verify window it serves, where the table tuned it or a shipped space holds it. A stale
table is refused, as at run time, and so is a key no shipped space holds (no variant of it
was checked on a GPU).
"""

from __future__ import annotations

import datetime
import functools
import json
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kdagen import __version__, first_use
from kdagen.serve.variant import Variant, lean_commit_key, parse_contract_key

if TYPE_CHECKING:
    from kdagen.serve.dispatch import DispatchTable

SERVE = Path(__file__).resolve().parent / "serve"
# The batches at which an untuned key's built-in choice is taken: the heuristics switch at
# batch x heads thresholds of a few hundred (kdagen.serve.runtime), so every choice shows up.
SCANNED_BATCHES = (*range(1, 4097), 1 << 14, 1 << 17, 1 << 20)


class EmitError(RuntimeError):
    """The package cannot be written (no table, a key the table cannot serve, a failed
    compile); the message says which and why."""


@dataclass
class Emitted:
    package: Path
    fingerprint: str
    arch: str
    keys: list[str]
    variants: list[str]
    bytes: int
    choices: dict[str, dict[int, str]] = field(default_factory=dict)  # key -> bucket -> variant


def emit(
    table_dir: Path,
    out: Path,
    name: str = "kda_kernels",
    keys: Sequence[str] | None = None,
    jobs: int = 0,
    on_compiled: Callable[[object, int], None] | None = None,
    gate: str | None = None,
) -> Emitted:
    """Write the package ``out/name`` from the table in ``table_dir``; ``keys``: the contract
    keys to serve (default: every key the table has entries for, or only ``gate``'s: a model
    needs one gate's kernels). ``on_compiled(record, total)`` is called as each of the
    ``total`` kernels compiles (or comes from the cache)."""
    from kdagen.serve import dispatch

    if not name.isidentifier():
        raise EmitError(f"--name {name!r} is not a Python package name")
    if out.exists() and not out.is_dir():
        raise EmitError(f"--out {out} is a file; the package goes in a folder OUT/NAME")
    repeated = sorted({k for k in keys or () if list(keys or ()).count(k) > 1})
    if repeated:
        raise EmitError(f"--key given more than once: {', '.join(repeated)}")
    if jobs < 0:
        raise EmitError(f"--jobs {jobs}: must be 0 (one per CPU) or more")

    package = out / name
    _refuse_foreign(package)
    table = dispatch.load_table(table_dir)
    if table is None:
        raise EmitError(f"no dispatch table in {table_dir} (expected {dispatch.TABLE_FILE})")
    arch = str(table.device.get("arch") or "")
    if not arch:
        raise EmitError(f"the table in {table_dir} does not record its GPU's arch")
    keys = selected_keys(table, keys, gate)
    untuned = {key: _untuned_points(table, key, arch) for key in keys}  # empty: a tuned key
    choices = {key: _choices(table, key, arch, untuned[key]) for key in keys}
    for kernel in sorted({key.split("-", 1)[0] for key in keys}):
        where = str(table_dir / dispatch.TABLE_FILE)
        dispatch.check_fresh(table, kernel, where, first_use.SOURCE)  # against the templates
    chosen = {v for by_batch in choices.values() for v in by_batch.values()}
    variants = sorted(chosen.union(*untuned.values()))
    report = (lambda record: on_compiled(record, len(variants))) if on_compiled else None
    objects = _compile([Variant.parse(v) for v in variants], arch, jobs, report)

    if package.exists():
        shutil.rmtree(package)  # an earlier emit (checked above)
    kernels = _write_kernels(package, arch, objects)
    for module in sorted(SERVE.glob("*.py")):
        shutil.copyfile(module, package / module.name)
    table_folder = package / "generated" / table.fingerprint
    table_folder.mkdir(parents=True)
    shutil.copyfile(table_dir / dispatch.TABLE_FILE, table_folder / dispatch.TABLE_FILE)
    manifest = {
        "package": name,
        "fingerprint": table.fingerprint,
        "arch": arch,
        "dsl_version": table.dsl_version,
        "template_hashes": table.template_hashes,
        "table_created": table.created,
        "emitted": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "kdagen": __version__,
        "keys": keys,
        "choices": choices,
        "kernels": kernels,
    }
    (package / "kernels" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (package / "README.md").write_text(_readme(manifest))
    size = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    return Emitted(package, table.fingerprint, arch, keys, variants, size, choices)


def selected_keys(table: DispatchTable, keys: Sequence[str] | None, gate: str | None) -> list[str]:
    """The contract keys to serve: ``keys`` (with the commit builds the run-time sends their
    calls to), else every tuned key (of ``gate`` when given); either with the commits of
    their verify windows (a package that verifies a window commits it)."""
    if gate not in (None, "kda", "softplus"):
        raise EmitError(f"--gate {gate!r}: expected kda or softplus")
    if gate and keys:
        raise EmitError("--gate selects among the tuned keys; give it or --key, not both")
    if keys:
        served = [*keys, *_lean_commit_keys(table, keys)]
    else:
        gates = {k: str(parse_contract_key(k).get("gate", "kda")) for k in table.entries}
        served = [k for k in table.entries if gate in (None, gates[k])]
    return list(dict.fromkeys([*served, *_window_commit_keys(table, served)]))


def _window_commit_keys(table: DispatchTable, keys: Sequence[str]) -> list[str]:
    """The commit keys (both builds) that follow the verify keys in ``keys``, where the table
    tuned them or a shipped space holds them (e.g. the commit after 16 tokens, or after 3,
    before a table tunes it)."""
    arch = str(table.device.get("arch") or "")
    found = []
    for key in keys:
        fields = parse_contract_key(key)
        if fields.pop("kernel") != "verify":
            continue
        conv = fields.pop("conv", False)
        for name in ("conv_layout", "conv_weight_dtype"):
            fields.pop(name, None)
        # A tree with the conv commits its path with the conv history (the tree commit).
        fields["tree"] = bool(fields.get("tree")) and conv
        general = Variant(kernel="commit", **fields).contract_key
        for commit in (general, lean_commit_key(fields)):
            if commit in table.entries or commit in _shipped_points(arch):
                found.append(commit)
    return list(dict.fromkeys(found))


def _lean_commit_keys(table: DispatchTable, keys: Sequence[str]) -> list[str]:
    """The tuned builds without prefix caching of the general commit keys in ``keys``: the
    run-time sends a commit without block tables there, so a package with the general key
    needs them too."""
    lean = []
    for key in keys:
        fields = parse_contract_key(key)
        if fields.pop("kernel") == "commit" and fields.get("prefix_caching", True):
            sibling = lean_commit_key(fields)
            if sibling in table.entries:
                lean.append(sibling)
    return lean


def _refuse_foreign(package: Path) -> None:
    """Only an earlier emit of the package may be replaced, never another folder."""
    if package.exists() and not (package / "kernels" / "manifest.json").exists():
        raise EmitError(f"{package} exists and is not a package kdagen emitted; not replacing it")


def _write_kernels(package: Path, arch: str, objects: dict[str, tuple[Path, str]]) -> dict:
    """Copy the objects into ``kernels/<arch>/``; the manifest's ``kernels`` entries."""
    (package / "kernels" / arch).mkdir(parents=True)
    kernels = {}
    for variant, (obj, symbol) in objects.items():
        target = Path(arch) / f"{variant}.o"  # relative to kernels/, as bundle reads it
        shutil.copyfile(obj, package / "kernels" / target)
        kernels[variant] = {arch: {"object": target.as_posix(), "symbol": symbol}}
    return kernels


def _untuned_points(table: DispatchTable, key: str, arch: str) -> frozenset[str]:
    """Empty for a key of the space the table was tuned with; else (a shipped space the table
    was not tuned with, e.g. the commit after 16 tokens, conv trees) every variant the
    run-time's built-in choice can take for it at any batch, all packaged; each must be a
    point of the key's shipped space (checked on a GPU)."""
    contract = parse_contract_key(key)  # a malformed key: the parser's error
    kernel = contract.pop("kernel")
    if not table.untuned_space(kernel, key):
        return frozenset()
    points = _shipped_points(arch).get(key)
    if not points:
        raise EmitError(
            f"{key} is in no search space of this checkout for {arch}, so no variant of it "
            "was checked on a GPU; add it to a space, run `kdagen check` (and `kdagen tune`)"
        )
    from kdagen.serve.runtime import heuristic_variant

    sms = table.device.get("sms")
    reachable = {heuristic_variant(kernel, contract, b, arch, sms).name for b in SCANNED_BATCHES}
    unchecked = sorted(reachable - points)
    if unchecked:
        raise EmitError(f"{key}: the built-in choice {unchecked[0]} is not in its shipped "
                        "space, so it was never checked; not packaging it")  # fmt: skip
    return frozenset(reachable)


def _choices(table: DispatchTable, key: str, arch: str, untuned: frozenset[str]) -> dict[int, str]:
    """Bucket -> the variant the run-time's lookup picks for ``key`` there; for an untuned key
    (``untuned``: its shipped points) a choice outside them is refused (never checked)."""
    from kdagen.serve import dispatch
    from kdagen.serve.runtime import heuristic_variant

    contract = parse_contract_key(key)
    kernel = contract.pop("kernel")
    rows = table.entries.get(key) or table.defaults.get(kernel)
    if not rows:
        raise EmitError(f"the table has no entry for {key} and no per-GPU default for {kernel}")
    found = {}
    for batch in sorted({row.batch for row in rows}):
        base = heuristic_variant(kernel, contract, batch, arch, table.device.get("sms"))
        with warnings.catch_warnings():  # the fallbacks are the point here, not news
            warnings.simplefilter("ignore", dispatch.DispatchFallbackWarning)
            found[batch] = dispatch.resolve(table, kernel, base, batch).name
        if untuned and found[batch] not in untuned:
            raise EmitError(f"{key}: the built-in choice {found[batch]} is not in its shipped "
                            "space, so it was never checked; not packaging it")  # fmt: skip
    return found


@functools.cache
def _shipped_points(arch: str) -> dict[str, frozenset[str]]:
    """Contract key -> every variant of it in this checkout's shipped spaces for ``arch``
    (the spaces expanded once)."""
    from kdagen.space import default_variants

    points: dict[str, set[str]] = {}
    for v in default_variants():
        if arch in v.spec.archs:
            points.setdefault(v.contract_key, set()).add(v.name)
    return {key: frozenset(names) for key, names in points.items()}


def _compile(
    variants: list[Variant], arch: str, jobs: int, on_compiled: Callable[[object], None] | None
) -> dict[str, tuple[Path, str]]:
    """Compile (or reuse from the cache) each variant; its exported object and symbol."""
    from kdagen.compile import compile_many, export_symbol, object_path

    records = compile_many(variants, [arch], jobs=jobs, on_result=on_compiled)
    failed = [r for r in records if not r.ok]
    if failed:
        raise EmitError(
            f"{len(failed)} variant(s) did not compile for {arch}, e.g. {failed[0].variant}:\n"
            f"{failed[0].error}"
        )
    return {v.name: (object_path(v, arch), export_symbol(v)) for v in variants}


def _readme(manifest: dict) -> str:
    keys = "\n".join(f"    {key}" for key in manifest["keys"])
    return f"""# {manifest["package"]}

KDA speculative-decoding kernels for {manifest["fingerprint"]} ({manifest["arch"]}), emitted
by kdagen {manifest["kdagen"]} on {manifest["emitted"]} from the dispatch table tuned on
{manifest["table_created"]}. Needs torch and nvidia-cutlass-dsl=={manifest["dsl_version"]}.

{len(manifest["kernels"])} prebuilt kernels (`kernels/`) serve these contract keys (any batch):

{keys}

The API (`import {manifest["package"]}` registers the torch ops kdagen::verify,
kdagen::commit and kdagen::commit_layers):

    verify(qkv, raw_g, raw_beta, a_log, dt_bias, state, query_start, slots, out, corr, kg, ...)
    commit(state, corr, kg, a_log, dt_bias, slots, accepted, ...)
    ModelCommit(states, corrs, kgs, a_logs, dt_biases, ...).commit(slots, accepted, ...)
    kda_recoverssm_verify_records(q, ..., checkpoint_state, records, ...)  # vLLM 0.33's
    kda_recoverssm_verify(q, ..., checkpoint_state, correction_cache, kg_cache, ...)  # FlashInfer's
    KDARecoverSSMCommitContext.create(layers, spec_query_len=, max_num_reqs=).commit(...)

Arguments and layouts as in kdagen's README; bad input raises KdaInputError, and so does a
variant this package does not hold. The modules are kdagen's `kdagen/serve`, unchanged.
"""
