"""Search spaces and workloads, read from YAML.

A space file names the kernel, value lists for contract and tuning fields, and constraints:
Python expressions over field names (``threads * vec <= 2048``) that a point must satisfy.
Expanding a space yields the valid variants plus, per constraint, how many points it removed;
points that ``Variant`` itself rejects are counted under the reason it gave.
"""

from __future__ import annotations

import ast
import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kdagen.serve.resources import data_dir
from kdagen.serve.variant import CONTRACT_FIELDS, TUNING_FIELDS, Variant, VariantError, check_field

SPACE_DIR = data_dir("search_spaces")
# The shipped spaces: what `kdagen check` verifies and the tuned tables choose from.
DEFAULT_SPACES = (
    "commit.yaml", "commit_ring.yaml", "commit_tree.yaml", "commit_wide.yaml",
    "commit_between.yaml", "verify_sm90.yaml", "verify_sm100.yaml", "verify_tree_sm90.yaml",
    "verify_tree_conv_sm90.yaml", "verify_tree_sm100.yaml", "verify_wide_sm90.yaml",
    "verify_wide_sm100.yaml",
)  # fmt: skip


class SpaceError(ValueError):
    """A malformed space or workloads file; the message names the file and the entry."""


@dataclass(frozen=True)
class Constraint:
    name: str
    expr: str
    _code: Any = field(repr=False, compare=False, default=None)

    @classmethod
    def parse(cls, entry: Any, source: str) -> Constraint:
        if isinstance(entry, str):
            entry = {"name": entry, "expr": entry}
        if not isinstance(entry, dict) or "expr" not in entry:
            raise SpaceError(
                f"{source}: a constraint needs 'expr' (and optionally 'name'): {entry!r}"
            )
        expr = str(entry["expr"])
        try:
            tree = ast.parse(expr, mode="eval")
        except SyntaxError as err:
            raise SpaceError(f"{source}: constraint {expr!r} is not an expression: {err}") from None
        known = set(CONTRACT_FIELDS) | set(TUNING_FIELDS) | {"K"}
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if names - known:
            raise SpaceError(
                f"{source}: constraint {expr!r} reads unknown name(s) {sorted(names - known)}; "
                f"known: {sorted(known)}"
            )
        code = compile(tree, f"<constraint {expr}>", "eval")
        return cls(str(entry.get("name", expr)), expr, code)

    def holds(self, point: dict[str, Any]) -> bool:
        try:
            return bool(eval(self._code, {"__builtins__": {}}, {"K": 128, **point}))  # noqa: S307
        except Exception as err:  # a constraint must decide, not fail: name it and the point
            shown = ", ".join(f"{k}={v!r}" for k, v in point.items() if k != "kernel")
            raise SpaceError(f"constraint {self.name!r} ({self.expr}) raised "
                             f"{type(err).__name__}: {err} at {shown}") from None  # fmt: skip


@dataclass
class Expansion:
    variants: list[Variant]
    points: int  # points of the cartesian product
    removed: Counter[str]  # constraint name or rejection reason -> count


@dataclass(frozen=True)
class Space:
    name: str
    kernel: str
    values: dict[str, list[Any]]
    constraints: tuple[Constraint, ...]

    @classmethod
    def load(cls, path: str | Path) -> Space:
        path = _resolve(path)
        data = _read_yaml(path)
        source = str(path)
        kernel = data.get("kernel")
        if kernel not in ("commit", "verify"):
            raise SpaceError(f"{source}: 'kernel' must be 'commit' or 'verify', got {kernel!r}")
        values: dict[str, list[Any]] = {}
        for section, allowed in (("contract", CONTRACT_FIELDS), ("tuning", TUNING_FIELDS)):
            for name, options in (data.get(section) or {}).items():
                if name not in allowed:
                    raise SpaceError(
                        f"{source}: {section}.{name} is not a {section} field; "
                        f"allowed: {list(allowed)}"
                    )
                values[name] = options if isinstance(options, list) else [options]
                if not values[name]:
                    raise SpaceError(f"{source}: {section}.{name} has no values")
                for value in values[name]:
                    try:
                        check_field(name, value)
                    except VariantError as err:
                        raise SpaceError(f"{source}: {section}.{name}: {err}") from None
        unknown = set(data) - {"kernel", "contract", "tuning", "constraints", "description"}
        if unknown:
            raise SpaceError(f"{source}: unknown top-level key(s) {sorted(unknown)}")
        constraints = tuple(Constraint.parse(c, source) for c in data.get("constraints") or [])
        return cls(path.stem, kernel, values, constraints)

    def expand(self) -> Expansion:
        names = list(self.values)
        removed: Counter[str] = Counter()
        variants: list[Variant] = []
        seen: set[Variant] = set()
        points = 0
        for combo in itertools.product(*(self.values[n] for n in names)):
            points += 1
            point = {"kernel": self.kernel, **dict(zip(names, combo, strict=True))}
            failed = next((c.name for c in self.constraints if not c.holds(point)), None)
            if failed:
                removed[failed] += 1
                continue
            try:
                variant = Variant.from_fields(point)
            except VariantError as err:
                removed[f"invalid: {err}"] += 1
                continue
            if variant not in seen:
                seen.add(variant)
                variants.append(variant)
        return Expansion(variants, points, removed)


@dataclass(frozen=True)
class Workload:
    """A contract to tune for and the batch sizes it serves."""

    name: str
    contract: dict[str, Any]
    batches: tuple[int, ...]


def load_workloads(path: str | Path = "workloads.yaml") -> list[Workload]:
    path = _resolve(path, "workloads file")
    data = _read_yaml(path)
    out = []
    for i, entry in enumerate(data.get("workloads") or []):
        source = f"{path}: workloads[{i}]"
        if not isinstance(entry, dict) or "name" not in entry or "batches" not in entry:
            raise SpaceError(f"{source} needs 'name', contract fields and 'batches'")
        contract = {k: v for k, v in entry.items() if k not in ("name", "batches")}
        bad = set(contract) - set(CONTRACT_FIELDS)  # `kernel`: a workload of one kernel
        if bad:
            raise SpaceError(f"{source}: unknown contract field(s) {sorted(bad)}")
        batches = tuple(int(b) for b in entry["batches"])
        if not batches or any(b < 1 for b in batches):
            raise SpaceError(f"{source}: batches must be positive integers, got {entry['batches']}")
        out.append(Workload(str(entry["name"]), contract, batches))
    return out


def _resolve(path: str | Path, what: str = "space file") -> Path:
    """A path as given, else a name in search_spaces/ (``.yaml`` may be left out)."""
    given = Path(path)
    tries = [given, SPACE_DIR / given]
    if not given.suffix:
        tries += [given.with_suffix(".yaml"), SPACE_DIR / given.with_suffix(".yaml")]
    found = next((p for p in tries if p.is_file()), None)
    if found is None:
        workloads = what.startswith("workloads")  # the folder holds both kinds of file
        names = ", ".join(sorted(p.name for p in SPACE_DIR.glob("*.yaml")
                                 if p.name.startswith("workloads") == workloads))  # fmt: skip
        raise SpaceError(f"{what} {given} not found (also looked in {SPACE_DIR}: {names})")
    return found


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpaceError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: expected a mapping at the top level")
    return data


def default_variants(spaces: tuple[str, ...] = DEFAULT_SPACES) -> list[Variant]:
    out: list[Variant] = []
    for name in spaces:
        out += Space.load(name).expand().variants
    return out


def name_matches(name: str, match: str | None) -> bool:
    """Whether ``name`` contains ``match``, or one of its comma-separated parts (the
    ``--match`` options: ``a,b`` selects what names either); None matches every name."""
    return match is None or any(part in name for part in match.split(",") if part)
