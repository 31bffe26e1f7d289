"""The dispatch table: (contract key, batch bucket) -> tuning fields, per GPU fingerprint.

``generated/<fingerprint>/dispatch.json`` is written by ``kdagen tune`` and read by the
run-time API through ``choose``. JSON rather than YAML so a deployed package needs no YAML
parser. The table records the fingerprint, the nvidia-cutlass-dsl version, the template hash
of each kernel, the variants its studies measured with a hash of their content digests
(rendered source, device helpers, DSL version: ``kdagen.render.digest``), and its search
space. A table the kernel source (``kernel_source.current()``) finds stale is refused
(``StaleTableError``), never used: its winners were measured on other kernels. kdagen's
compile-on-first-use source judges it on the measured variants' renders (a template edit
that renders them identically keeps it; a table without render hashes on its template hash)
and the DSL version; an emitted package's prebuilt kernels on the DSL version alone.

Lookup for (kernel, contract, batch): the exact key and bucket, else the nearest bucket of
that key (log distance), else the per-GPU default of the kernel (the config that won the most
studies at the nearest bucket), else the caller's built-in heuristic. The choice then stays
inside the search space the table was tuned from (``space``: what `kdagen check` verified): a
default or heuristic config the space lacks for that key becomes the key's nearest point in
it. Each fallback warns once per (contract key, reason). Results are cached per process:
after the first call for a (contract, batch) a launch does no file I/O.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import bundle, kernel_source
from .resources import data_dir
from .variant import Variant, VariantError

TABLE_FILE = "dispatch.json"
FORMAT = 1


class StaleTableError(RuntimeError):
    """The table was made with other templates or another DSL version: refused, not used."""


class DispatchFallbackWarning(UserWarning):
    """The lookup used something other than the exact (contract key, batch bucket) entry."""


@dataclass(frozen=True)
class Entry:
    """One winner: tuning fields (``path`` included) for a batch bucket, with its evidence."""

    batch: int
    tuning: dict[str, Any]
    time_us: float | None = None
    margin_runner_up_pct: float | None = None
    margin_default_pct: float | None = None
    variant: str = ""
    note: str = ""


@dataclass
class DispatchTable:
    fingerprint: str
    dsl_version: str
    template_hashes: dict[str, str]
    created: str
    entries: dict[str, list[Entry]] = field(default_factory=dict)  # contract key -> by batch
    defaults: dict[str, list[Entry]] = field(default_factory=dict)  # kernel -> by batch
    device: dict[str, Any] = field(default_factory=dict)
    # kernel -> every variant its studies measured, and the hash of what those compile from
    # (kdagen.render.kernels_digest): what freshness is judged on when present.
    measured: dict[str, list[str]] = field(default_factory=dict)
    render_hashes: dict[str, str] = field(default_factory=dict)
    # kernel -> contract key -> every variant of the search spaces the table was tuned from
    # for this GPU's arch: what `kdagen check` verifies, so the lookup stays inside it.
    space: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # kernel -> a correctness change shipped ahead of its re-tune (``kdagen carry``): the
    # render hash the timings were measured on, why the kernels changed, and the A/B that
    # measured the change's cost. The choices stand; the timings are the old render's.
    carried: dict[str, dict[str, str]] = field(default_factory=dict)

    # ---- serialisation ----
    def to_json(self) -> str:
        data = asdict(self)
        data = {"format": FORMAT, **data}
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "dispatch table") -> DispatchTable:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise StaleTableError(
                f"{source}: format {data.get('format')!r}, this kdagen reads format {FORMAT}; "
                "re-run `kdagen tune`"
            )

        def entries(raw: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[Entry]]:
            return {
                k: sorted((Entry(**e) for e in v), key=lambda e: e.batch) for k, v in raw.items()
            }

        return cls(
            fingerprint=data["fingerprint"],
            dsl_version=data["dsl_version"],
            template_hashes=dict(data["template_hashes"]),
            created=data["created"],
            entries=entries(data.get("entries", {})),
            defaults=entries(data.get("defaults", {})),
            device=dict(data.get("device", {})),
            measured={k: list(v) for k, v in data.get("measured", {}).items()},
            render_hashes=dict(data.get("render_hashes", {})),
            space={
                kernel: {key: list(names) for key, names in keys.items()}
                for kernel, keys in data.get("space", {}).items()
            },
            carried={k: dict(v) for k, v in data.get("carried", {}).items()},
        )

    # ---- staleness and lookup ----
    def kernels(self) -> set[str]:
        """Kernels with entries or a per-GPU default: the only ones the table can refuse."""
        return {key.split("-", 1)[0] for key in self.entries} | set(self.defaults)

    def staleness(
        self, kernel: str, dsl_version: str, template_hash: str, render_hash: str | None = None
    ) -> str | None:
        """Why this table must not be used for ``kernel`` with the running code (None: fresh).
        ``render_hash``: ``kernels_digest`` of ``measured[kernel]`` now; where the table records
        one it decides, else the template hash does (tables made before render hashes)."""
        changed = []
        made = self.template_hashes.get(kernel)
        made_render = self.render_hashes.get(kernel)
        if made_render is not None and render_hash is not None:
            if made_render != render_hash:
                changed.append(
                    f"the {kernel} kernels it measured changed (table made with render hash "
                    f"{made_render}, they now render to {render_hash})"
                )
        elif made is None:
            changed.append(f"it has no template hash for kernel {kernel!r}")
        elif made != template_hash:
            changed.append(
                f"the {kernel} templates changed (table made with template hash {made}, "
                f"templates now hash to {template_hash})"
            )
        if self.dsl_version != dsl_version:
            changed.append(
                f"nvidia-cutlass-dsl changed (table made with {self.dsl_version}, "
                f"installed {dsl_version})"
            )
        return "; ".join(changed) or None

    def untuned_space(self, kernel: str, key: str) -> bool:
        """Whether ``key`` belongs to a space the table was not tuned with: its recorded space
        holds other keys of ``kernel`` but not this one (the run-time runs the built-in
        choice there)."""
        return bool(self.space.get(kernel)) and key not in self.space[kernel]

    def keeps(self, kernel: str, key: str, name: str) -> bool:
        """Whether the run-time keeps variant ``name`` of contract ``key`` (``inside_space``):
        the table's space holds it, or holds no point of its key."""
        points = self.space.get(kernel, {}).get(key)
        return not points or name in points

    def lookup(self, kernel: str, key: str, batch: int) -> tuple[Entry | None, str]:
        """The entry for (key, batch) and how it was found: ``exact``, ``nearest``,
        ``gpu-default`` or ``none``. Pure: no warnings, no I/O."""
        rows = self.entries.get(key)
        if rows:
            best = nearest(rows, batch)
            return best, "exact" if best.batch == batch else "nearest"
        rows = self.defaults.get(kernel)
        if rows:
            return nearest(rows, batch), "gpu-default"
        return None, "none"


def nearest(rows: list[Entry], batch: int) -> Entry:
    """The entry whose bucket is closest to ``batch`` on a log scale (ties: the larger
    bucket, whose config keeps more of the GPU busy)."""
    b = math.log(max(batch, 1))
    return min(rows, key=lambda e: (abs(math.log(e.batch) - b), -e.batch))


def write_table(folder: Path, table: DispatchTable) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TABLE_FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(table.to_json())
    tmp.replace(path)
    return path


def load_table(folder: Path) -> DispatchTable | None:
    """The table in ``folder`` (None when there is none). Does not check staleness."""
    path = Path(folder) / TABLE_FILE
    if not path.exists():
        return None
    return DispatchTable.from_json(path.read_text(), str(path))


def check_fresh(
    table: DispatchTable,
    kernel: str,
    where: str,
    source: kernel_source.KernelSource | None = None,
) -> None:
    """Raise ``StaleTableError`` naming what changed when ``table`` may not choose among
    ``kernel``'s variants from ``source`` (default: where launches get kernels now,
    ``kernel_source.current()``)."""
    why = (source or kernel_source.current()).stale(table, kernel)
    if why:
        raise StaleTableError(
            f"kdagen: refusing the dispatch table {where} for kernel {kernel!r}: {why}."
        )


def generated_root() -> Path:
    """Where tables live: an emitted package's own ``generated/``; else
    ``$KDAGEN_GENERATED``, else the shipped tables (``generated/`` of the checkout, or of the
    installed package)."""
    if bundle.active():
        return bundle.table_root()
    return Path(os.environ.get("KDAGEN_GENERATED", data_dir("generated")))


# ---- the run-time entry point ----

_lock = threading.Lock()
_tables: dict[Path, DispatchTable | None] = {}
_fresh: set[tuple[Path, str]] = set()
_choices: dict[tuple[Any, ...], Variant] = {}
_tuned: dict[tuple[Any, ...], bool] = {}
_warned: set[tuple[str, str]] = set()
_fingerprints: dict[Any, str] = {}


def reset() -> None:
    """Forget loaded tables, choices and warnings (tests; after re-tuning in a process)."""
    with _lock:
        _tables.clear()
        _fresh.clear()
        _choices.clear()
        _tuned.clear()
        _warned.clear()
        _fingerprints.clear()


def choose(
    kernel: str,
    contract: Mapping[str, Any],
    batch: int,
    heuristic: Callable[[], Variant],
    device: Any = None,
) -> Variant:
    """The variant to launch for ``kernel`` with ``contract`` at ``batch`` on ``device``.

    ``heuristic()`` returns the built-in choice for this (contract, batch); its contract
    fields define the key. ``device``: the tensors' device (None: the current one when first
    asked). Cached per (device, kernel, contract, batch); raises ``StaleTableError`` while
    the GPU's table is stale.
    """
    cache_key = (device, kernel, tuple(sorted(contract.items())), batch)
    found = _choices.get(cache_key)
    if found is not None:
        return found
    with _lock:
        found = _choose(kernel, batch, heuristic, device)
        _choices[cache_key] = found
    return found


def tuned(kernel: str, key: str, device: Any = None) -> bool:
    """Whether the table serving ``device`` has measured ``key`` (dispatch not switched off):
    what a contract with an optional faster build (the commit without prefix caching) asks
    before it prefers that build to the general one."""
    if os.environ.get("KDAGEN_DISPATCH", "").lower() in ("off", "0", "heuristic"):
        return False
    found = _tuned.get((device, kernel, key))
    if found is None:
        with _lock:
            folder = _table_folder(device)
            table = None if folder is None else _table(folder)
            found = table is not None and bool(table.entries.get(key))
            _tuned[(device, kernel, key)] = found
    return found


def _choose(kernel: str, batch: int, heuristic: Callable[[], Variant], device: Any) -> Variant:
    base = heuristic()
    key = base.contract_key
    if os.environ.get("KDAGEN_DISPATCH", "").lower() in ("off", "0", "heuristic"):
        _warn_once(key, "off", f"{key}: KDAGEN_DISPATCH=off, using the built-in heuristic")
        return base
    folder = _table_folder(device)
    if folder is None:
        _warn_once(key, "no-gpu", f"{key}: no CUDA device to key a dispatch table on; heuristic")
        return base
    table = _table(folder)
    if table is None:
        _warn_once(
            key, "no-table",
            f"{key}: no dispatch table for this GPU ({folder / TABLE_FILE} missing); "
            f"using the built-in heuristic ({base.name})",
        )  # fmt: skip
        return base
    if kernel not in table.kernels():
        _warn_once(
            key, "no-kernel",
            f"{key}: the dispatch table for {table.fingerprint} has no {kernel} entries; "
            f"using the built-in heuristic ({base.name})",
        )  # fmt: skip
        return base
    if (folder, kernel) not in _fresh:
        check_fresh(table, kernel, str(folder / TABLE_FILE))
        _fresh.add((folder, kernel))
        if kernel in table.carried:
            why = table.carried[kernel].get("reason", "")
            _warn_once(kernel, "carried", f"{kernel}: the table's timings were measured before "
                       f"{why}; its choices stand until this GPU is re-tuned")  # fmt: skip
    return resolve(table, kernel, base, batch)


def resolve(table: DispatchTable, kernel: str, base: Variant, batch: int) -> Variant:
    """Apply the table's entry for ``base``'s contract key at ``batch``; fall back to ``base``
    (the heuristic) when there is none or it does not fit this contract; then keep the choice
    inside the table's search space (``inside_space``). A key outside that space (a shipped
    space the table was not tuned with, e.g. windows past 8) takes ``base``: the per-GPU
    default was measured on other kernels' keys, and the built-in choice is the point the
    shipped spaces check. Warns once per (key, reason) on every fallback."""
    key = base.contract_key
    if table.untuned_space(kernel, key):
        _warn_once(
            key, "untuned-space",
            f"{key}: outside the search space the table was tuned with on {table.fingerprint}; "
            f"using the built-in heuristic ({base.name})",
        )  # fmt: skip
        return base
    return inside_space(table, kernel, _table_choice(table, kernel, base, batch))


def nearest_point(chosen: Variant, points: Collection[str]) -> Variant:
    """``chosen`` where ``points`` (variant names of its contract key) hold it, else the one
    of them sharing the most tuning fields with it (ties: the first by name)."""
    if chosen.name in points:
        return chosen
    wanted = chosen.tuning

    def shared(name: str) -> int:
        tuning = Variant.parse(name).tuning
        return sum(tuning.get(f) == value for f, value in wanted.items())

    return Variant.parse(min(sorted(points), key=lambda n: -shared(n)))


def inside_space(table: DispatchTable, kernel: str, chosen: Variant) -> Variant:
    """``chosen``, or where the table's search space holds other variants of its contract key
    but not it (a per-GPU default or the heuristic applied to an untuned key), the one of
    those sharing the most tuning fields with it (ties: the first by name): what runs was
    verified by `kdagen check` on this GPU's space. Tables without a space keep ``chosen``."""
    key = chosen.contract_key
    if table.keeps(kernel, key, chosen.name):
        return chosen
    inside = nearest_point(chosen, table.space[kernel][key])
    _warn_once(
        key, "space",
        f"{key}: {chosen.name} is outside the search space the table was tuned and checked "
        f"with on {table.fingerprint}; using {inside.name}",
    )  # fmt: skip
    return inside


def _table_choice(table: DispatchTable, kernel: str, base: Variant, batch: int) -> Variant:
    """The table's entry applied to ``base``, or ``base`` where it has none that fits."""
    key = base.contract_key
    entry, how = table.lookup(kernel, key, batch)
    if entry is None:
        _warn_once(
            key, "heuristic",
            f"{key}: not in the dispatch table for {table.fingerprint} and no per-GPU default "
            f"for {kernel}; using the built-in heuristic ({base.name})",
        )  # fmt: skip
        return base
    try:
        chosen = base.replace(**entry.tuning)
    except (VariantError, TypeError) as err:
        _warn_once(
            key, "heuristic",
            f"{key}: the table's {how} entry {entry.tuning} does not fit this contract ({err}); "
            f"using the built-in heuristic ({base.name})",
        )  # fmt: skip
        return base
    if how == "nearest":
        _warn_once(
            key, how,
            f"{key}: batch {batch} is not a tuned bucket; using the nearest tuned bucket "
            f"({entry.batch}) of the dispatch table",
        )  # fmt: skip
    elif how == "gpu-default":
        _warn_once(
            key, how,
            f"{key}: not tuned on {table.fingerprint}; using the per-GPU default for {kernel} "
            f"at bucket {entry.batch} ({chosen.name})",
        )  # fmt: skip
    return chosen


def _warn_once(key: str, reason: str, message: str) -> None:
    if (key, reason) in _warned:
        return
    _warned.add((key, reason))
    warnings.warn(f"kdagen dispatch: {message}", DispatchFallbackWarning, stacklevel=4)


def _table(folder: Path) -> DispatchTable | None:
    if folder not in _tables:
        _tables[folder] = load_table(folder)
    return _tables[folder]


def _table_folder(device: Any) -> Path | None:
    """The folder whose table serves ``device`` (``table_folder_for``), warning once when it
    is another GPU's; ``$KDAGEN_FINGERPRINT`` overrides the fingerprint (a GPU-less test, or a
    table borrowed from a sibling SKU on purpose)."""
    fingerprint = os.environ.get("KDAGEN_FINGERPRINT") or _fingerprints.get(device)
    if not fingerprint:
        try:
            from .fingerprint import gpu_fingerprint

            fingerprint = gpu_fingerprint(device)
        except (AssertionError, RuntimeError, ImportError):  # no CUDA: torch raises these
            return None
        _fingerprints[device] = fingerprint
    folder, borrowed = table_folder_for(fingerprint)
    if borrowed:
        _warn_once(
            fingerprint, "borrowed",
            f"no dispatch table for {fingerprint}; using {borrowed}'s, a GPU of the same "
            f"architecture (run `kdagen tune` on this GPU for its own)",
        )  # fmt: skip
    return folder


_FINGERPRINT_TAIL = re.compile(r"-(sm\d+)-(\d+)sm$")


def table_folder_for(fingerprint: str, root: Path | None = None) -> tuple[Path, str | None]:
    """The folder whose table serves a GPU, and the fingerprint it was tuned on when that is
    another GPU: its own ``generated/<fingerprint>/`` when it holds a table; else a tuned
    GPU's of the same architecture (``-smXY-``), the closest SM count first (an H100 takes
    the H200's); else its own folder, which has none. ``root``: the tables' folder
    (default ``generated_root()``)."""
    root = root or generated_root()
    own = root / fingerprint
    mine = _FINGERPRINT_TAIL.search(fingerprint)
    if (own / TABLE_FILE).exists() or mine is None:
        return own, None
    siblings = [
        (abs(int(theirs.group(2)) - int(mine.group(2))), path.parent.name)
        for path in sorted(root.glob(f"*/{TABLE_FILE}"))
        if (theirs := _FINGERPRINT_TAIL.search(path.parent.name))
        and theirs.group(1) == mine.group(1)
    ]
    if not siblings:
        return own, None
    name = min(siblings)[1]
    return root / name, name
