"""One point of the design space: what a kernel computes (contract) and how it runs (tuning).

A ``Variant`` is frozen and validates itself on construction, so every variant that exists
can be rendered. Its ``name`` is stable and readable and parses back with ``Variant.parse``;
its ``digest`` (see ``kdagen.render``) covers the rendered source and the DSL version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

K = 128  # head dim of every KDA model we serve (V = K)

CONTRACT_FIELDS = (
    "kernel",
    "heads",
    "window",
    "conv",
    "conv_layout",
    "conv_weight_dtype",
    "slot_dtype",
    "state_dtype",
    "gate",
    "tree",
    "prefix_caching",
)
TUNING_FIELDS = ("path", "threads", "vec", "row_split", "ctas", "stages", "pdl", "fold_paths")

# Allowed values per field; ints with a range are checked by ``_RANGES``.
_CHOICES: dict[str, tuple[Any, ...]] = {
    "kernel": ("verify", "commit"),
    "conv": (False, True),
    "conv_layout": ("token_major", "dim_first"),
    "conv_weight_dtype": ("bf16", "fp32"),
    "slot_dtype": ("int32", "int64"),
    "state_dtype": ("bf16",),
    # kda: Kimi-K3's bounded gate, lower_bound * sigmoid(...); softplus: Kimi-Linear's
    # unbounded -exp(a_log) * softplus(...) (the run-time's lower_bound=None).
    "gate": ("kda", "softplus"),
    # verify: a window may be a token tree (``parents``), each node's output along its root
    # path; commit: the conv history moved along the tree's accepted path (its rolled rows
    # are not contiguous)
    "tree": (False, True),
    # commit: whether the kernel takes vLLM's prefix caching (align mode: block tables, the
    # boundary state); without it the plan and the boundary fold are compiled out, which
    # frees registers (docs/history/model-commit.md). Verify never reads block tables.
    "prefix_caching": (True, False),
    "threads": (32, 64, 128, 256, 512),
    "vec": (4, 8),  # a state row then spans 32 or 16 threads (within a warp)
    "row_split": (1, 2, 4, 8),
    "stages": (1, 2),  # state buffers in shared memory: 2 loads the next item's state earlier
    "pdl": (False, True),
    # commit: unrolled update paths; path p folds up to (p + 1) Q / fold_paths tokens, so a
    # CTA runs the FMAs of its accepted count's path instead of the whole window's
    "fold_paths": (1, 2, 4, 8),
}
MAX_HEADS = 256
_RANGES: dict[str, tuple[int, int]] = {
    "heads": (1, MAX_HEADS), "window": (1, 16), "ctas": (1, 1 << 16)
}  # fmt: skip
# The widest window each kernel path computes (its coupling tiles and the range of its factors).
_MAX_WINDOW = {"sm90_wgmma": 16, "sm100_tcgen05": 16}


@dataclass(frozen=True)
class PathSpec:
    """An architecture path of a kernel: its template, targets and the tuning fields it reads."""

    template: str
    class_name: str  # the kernel class the template defines
    archs: tuple[str, ...]
    tuning: tuple[str, ...]


# kernel -> path -> spec. A path that is not listed has no template yet.
PATHS: dict[str, dict[str, PathSpec]] = {
    "commit": {
        # State rows staged in shared memory by one bulk async copy (cp.async.bulk).
        "bulk": PathSpec(
            template="commit/bulk.py.j2",
            class_name="KdaCommit",
            archs=("sm_90a", "sm_100a"),
            tuning=("threads", "vec", "row_split", "pdl", "fold_paths"),
        ),
        # The bulk path's update with its rows staged through a ring of half its pieces (4 of
        # 8, or 2 of 4): half the shared memory, so more CTAs fit an SM.
        "bulk_ring": PathSpec(
            template="commit/bulk.py.j2",
            class_name="KdaCommit",
            archs=("sm_90a", "sm_100a"),
            tuning=("threads", "vec", "row_split", "pdl", "fold_paths"),
        ),
        # The same staging with the update on the tensor cores (mma.sync, bf16 hi + lo
        # operands): a few instructions per state element instead of one FMA per token.
        "bulk_mma": PathSpec(
            template="commit/bulk.py.j2",
            class_name="KdaCommit",
            archs=("sm_90a", "sm_100a"),
            tuning=("threads", "row_split", "pdl"),
        ),
    },
    "verify": {
        # The seed: tcgen05 MMAs into TMEM, persistent grid with a work counter (sm_100a).
        "sm100_tcgen05": PathSpec(
            template="verify/sm100_tcgen05.py.j2",
            class_name="KdaTcVerify",
            archs=("sm_100a",),
            tuning=("ctas",),
        ),
        # Hopper: the seed's design with warpgroup MMAs (wgmma) from shared memory into
        # registers; a (request, head) may be split over CTAs by state rows, or its tokens
        # over two warpgroups of one CTA (threads = 256).
        "sm90_wgmma": PathSpec(
            template="verify/sm90_wgmma.py.j2",
            class_name="KdaWgmmaVerify",
            archs=("sm_90a",),
            tuning=("threads", "row_split", "ctas", "stages", "pdl"),
        ),
    },
}

_SHORT = {"token_major": "tm", "dim_first": "df", "int32": "i32", "int64": "i64"}
_LONG = {v: k for k, v in _SHORT.items()}
# Name tokens of the tuning fields, in name order.
_TUNING_TOKENS = (
    ("threads", "t"),
    ("vec", "v"),
    ("row_split", "r"),
    ("ctas", "c"),
    ("stages", "s"),
    ("fold_paths", "f"),
)
# Fields added after the first tuned tables: left out of a name at this value, so the names
# of the kernels those tables hold stay valid.
_NAMELESS_DEFAULTS = {"fold_paths": 1}


class VariantError(ValueError):
    """A variant field has a value the kernels do not support; the message names the field."""


@dataclass(frozen=True)
class Variant:
    """A kernel variant. Contract fields are dispatch keys; tuning fields change only speed."""

    # ---- contract ----
    kernel: str
    heads: int
    window: int
    conv: bool = False
    conv_layout: str = "token_major"
    conv_weight_dtype: str = "bf16"
    slot_dtype: str = "int32"
    state_dtype: str = "bf16"
    gate: str = "kda"
    tree: bool = False
    prefix_caching: bool = True
    # ---- tuning ----
    path: str = ""  # "": the kernel's first path in PATHS
    threads: int = 128
    vec: int = 8
    row_split: int = 1
    ctas: int = 740  # persistent grid bound: resident CTAs per SM x SMs (B200: 5 x 148)
    stages: int = 1
    pdl: bool = True
    fold_paths: int = 1

    def __post_init__(self) -> None:
        if self.path == "" and self.kernel in PATHS and PATHS[self.kernel]:
            object.__setattr__(self, "path", next(iter(PATHS[self.kernel])))
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))
        paths = PATHS[self.kernel]
        if self.path not in paths:
            raise VariantError(
                f"path={self.path!r} has no template for kernel {self.kernel!r}; "
                f"allowed: {sorted(paths) or 'none yet'}"
            )
        _check_path_rules(self)

    # ---- identity ----
    @property
    def spec(self) -> PathSpec:
        return PATHS[self.kernel][self.path]

    @property
    def contract(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in CONTRACT_FIELDS}

    @property
    def tuning(self) -> dict[str, Any]:
        """The tuning fields this variant's path reads (the others are unused defaults)."""
        return {"path": self.path} | {name: getattr(self, name) for name in self.spec.tuning}

    @property
    def contract_key(self) -> str:
        """The dispatch key: the name's contract part."""
        parts = [self.kernel, f"h{self.heads}", f"q{self.window}"]
        if self.gate != "kda":
            parts.append(self.gate)
        if self.tree:
            parts.append("tree")
        if not self.prefix_caching:
            parts.append("noprefix")
        if self.conv:
            parts += ["conv", _SHORT[self.conv_layout], self.conv_weight_dtype]
        parts.append(_SHORT[self.slot_dtype])
        return "-".join(parts)

    @property
    def name(self) -> str:
        parts = [self.contract_key, self.path]
        for field_name, token in _TUNING_TOKENS:
            value = getattr(self, field_name)
            if field_name in self.spec.tuning and _NAMELESS_DEFAULTS.get(field_name) != value:
                parts.append(f"{token}{value}")
        if "pdl" in self.spec.tuning:
            parts.append("pdl" if self.pdl else "nopdl")
        return "-".join(parts)

    @property
    def contract_summary(self) -> str:
        """The contract fields that mean something for this kernel (conv settings only with
        conv, and never for commit, which does not read the conv state; tree only when set,
        prefix caching only when left out)."""
        unused = {"kernel"} | ({"conv"} if self.kernel == "commit" else set())
        if not self.conv:
            unused |= {"conv_layout", "conv_weight_dtype"}
        if not self.tree:
            unused |= {"tree"}
        if self.prefix_caching:
            unused |= {"prefix_caching"}
        return ", ".join(f"{k}={v}" for k, v in self.contract.items() if k not in unused)

    @property
    def tuning_summary(self) -> str:
        """The tuning fields as the name shows them (a nameless default left out)."""
        shown = {k: v for k, v in self.tuning.items() if _NAMELESS_DEFAULTS.get(k) != v}
        return ", ".join(f"{k}={v}" for k, v in shown.items())

    def replace(self, **changes: Any) -> Variant:
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, name: str) -> Variant:
        """The inverse of ``name``: ``commit-h12-q8-i32-bulk-t128-v8-r1-pdl``."""
        tokens = name.split("-")
        try:
            values = _pop_contract(tokens)
            if not tokens:
                raise ValueError(
                    "it is a contract key, not a variant name: a path and tuning values follow "
                    f"it (`kdagen variants --match {name}` lists its variants)"
                )
            values["path"] = tokens.pop(0)
            by_token = {token: field_name for field_name, token in _TUNING_TOKENS}
            for token in tokens:
                if token in ("pdl", "nopdl"):
                    values["pdl"] = token == "pdl"
                    continue
                prefix = token.rstrip("0123456789")
                if prefix not in by_token or prefix == token:
                    raise ValueError(
                        f"{token!r} is not a tuning token (a letter of "
                        f"{''.join(sorted(by_token))} and a number, or pdl / nopdl)"
                    )
                values[by_token[prefix]] = int(token[len(prefix) :])
        except ValueError as err:
            raise VariantError(
                f"cannot parse variant name {name!r} (expected e.g. "
                f"'commit-h12-q8-i32-bulk-t128-v8-r1-pdl'): {err}"
            ) from None
        variant = cls(**values)
        if variant.name != name:  # a missing, extra or misplaced field: not this variant's name
            raise VariantError(
                f"{name!r} is not a complete variant name: path {variant.path!r} names "
                f"{variant.spec.tuning} in that order, e.g. {variant.name!r}"
            )
        return variant

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Variant:
        """Build from a mapping (a YAML space point), rejecting unknown field names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise VariantError(f"unknown variant field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def lean_commit_key(contract: Mapping[str, Any]) -> str:
    """The contract key of the commit build without prefix caching for a commit's contract
    fields: where the run-time sends a commit without block tables once the table tuned it."""
    return Variant(kernel="commit", **{**contract, "prefix_caching": False}).contract_key


def parse_contract_key(key: str) -> dict[str, Any]:
    """The contract fields of a dispatch key (``Variant.contract_key``), e.g.
    ``verify-h12-q8-conv-tm-bf16-i32`` -> kernel, heads, window, conv settings, slot dtype."""
    tokens = key.split("-")
    try:
        values = _pop_contract(tokens)
        if tokens:
            raise ValueError(f"unexpected {'-'.join(tokens)!r} after the slot dtype")
    except ValueError as err:
        raise VariantError(
            f"cannot parse contract key {key!r} (expected e.g. 'verify-h12-q8-i32' or "
            f"'verify-h12-q8-conv-tm-bf16-i32'): {err}"
        ) from None
    return values


# The contract part of a name or key, as the errors of its parsers spell it.
_CONTRACT_FORM = "KERNEL-hH-qQ[-softplus][-tree][-noprefix][-conv-tm|df-bf16|fp32]-i32|i64"


def _pop_contract(tokens: list[str]) -> dict[str, Any]:
    """Consume the contract tokens at the front of a split name or key; a ValueError says
    which token is wrong (or missing) and what was expected."""
    values: dict[str, Any] = {"kernel": _take(tokens, "the kernel")}
    values["heads"] = _number(_take(tokens, "the head count"), "h")
    values["window"] = _number(_take(tokens, "the window"), "q")
    if tokens and tokens[0] == "softplus":
        values["gate"] = tokens.pop(0)
    if tokens and tokens[0] == "tree":
        values["tree"] = tokens.pop(0) == "tree"
    if tokens and tokens[0] == "noprefix":
        tokens.pop(0)
        values["prefix_caching"] = False
    if tokens and tokens[0] == "conv":
        tokens.pop(0)
        values["conv"] = True
        values["conv_layout"] = _long(_take(tokens, "the conv layout"), ("tm", "df"))
        values["conv_weight_dtype"] = _take(tokens, "the conv taps' dtype")
    values["slot_dtype"] = _long(_take(tokens, "the slot dtype"), ("i32", "i64"))
    return values


def _take(tokens: list[str], what: str) -> str:
    if not tokens:
        raise ValueError(f"it ends before {what} (contract: {_CONTRACT_FORM})")
    return tokens.pop(0)


def _number(token: str, prefix: str) -> int:
    digits = token[len(prefix) :]
    if not token.startswith(prefix) or not digits.isdigit():
        raise ValueError(f"expected {prefix} and a number, got {token!r} "
                         f"(contract: {_CONTRACT_FORM})")  # fmt: skip
    return int(digits)


def _long(token: str, allowed: tuple[str, ...]) -> str:
    if token not in allowed:
        raise ValueError(f"expected one of {', '.join(allowed)}, got {token!r} "
                         f"(contract: {_CONTRACT_FORM})")  # fmt: skip
    return _LONG[token]


def check_field(name: str, value: Any) -> None:
    """Raise VariantError unless ``value`` is allowed for field ``name``."""
    if name in _CHOICES:
        allowed = _CHOICES[name]
        # bool is an int subclass: keep True from passing as 1 and 1 as True.
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise VariantError(f"{name}={value!r} is not allowed; allowed values: {list(allowed)}")
    elif name in _RANGES:
        low, high = _RANGES[name]
        if type(value) is not int or not low <= value <= high:
            raise VariantError(
                f"{name}={value!r} is not allowed; expected an int in [{low}, {high}]"
            )
    elif name in ("path",) and not isinstance(value, str):
        raise VariantError(f"path={value!r} must be a string")


def _check_path_rules(v: Variant) -> None:
    """Cross-field rules of each kernel path (what its template can express)."""
    if not v.conv and (v.conv_layout, v.conv_weight_dtype) != ("token_major", "bf16"):
        raise VariantError(
            f"conv_layout={v.conv_layout!r}, conv_weight_dtype={v.conv_weight_dtype!r} only "
            "apply with conv=True; without conv leave them at 'token_major', 'bf16'"
        )
    if v.kernel == "commit" and v.conv:
        raise VariantError(
            "conv=True is not allowed for kernel 'commit': the conv state is rolled by verify, "
            "commit never reads it; allowed values: [False]"
        )
    if v.tree and v.window < 2:
        raise VariantError(f"tree=True needs a window of at least 2 tokens; got window={v.window}")
    if v.kernel == "verify" and not v.prefix_caching:
        raise VariantError(
            "prefix_caching=False is not allowed for kernel 'verify': only commit reads "
            "block tables; allowed values: [True]"
        )
    most = _MAX_WINDOW.get(v.path, 8)
    if v.kernel == "verify" and v.window > most:
        raise VariantError(
            f"window={v.window} is not allowed for path {v.path!r}: its kernels compute "
            f"windows of 1..{most} tokens"
        )
    if v.kernel != "commit" and v.fold_paths != 1:
        raise VariantError(
            f"fold_paths={v.fold_paths} is not allowed for kernel {v.kernel!r}: only commit "
            "folds accepted tokens; allowed values: [1]"
        )
    if v.kernel == "commit":
        _check_commit_rules(v)
    if v.path == "sm90_wgmma":
        _check_sm90_verify_rules(v)


def _check_commit_rules(v: Variant) -> None:
    """The bulk path spreads a CTA's rows over whole row groups of K / vec threads."""
    group = K // v.vec  # threads covering one state row
    rows = K // v.row_split
    if (rows * group) % v.threads or rows * group < v.threads:
        raise VariantError(
            f"threads={v.threads} does not divide the {rows * group} chunks of "
            f"row_split={v.row_split} evenly"
        )
    if v.path == "bulk_mma":
        _check_commit_mma_rules(v)
    if v.path == "bulk_ring":
        _check_commit_ring_rules(v, rows * group // v.threads)
    if v.window % v.fold_paths:
        raise VariantError(
            f"fold_paths={v.fold_paths} does not divide window={v.window}: each update path "
            "folds a whole number of tokens more than the one before it"
        )


def _check_commit_ring_rules(v: Variant, chunks: int) -> None:
    """Path bulk_ring: at least four pieces, half of them staged at a time (so at least four
    chunks a thread); one fold a launch (prefix caching's boundary fold would read the rows
    twice)."""
    if chunks < 4:
        raise VariantError(
            f"threads={v.threads}, vec={v.vec}, row_split={v.row_split} give {chunks} update "
            "chunks a thread; path 'bulk_ring' streams at least four pieces and needs at least 4"
        )
    if v.prefix_caching:
        raise VariantError(
            "prefix_caching=True is not allowed for path 'bulk_ring': the boundary state would "
            "read the staged rows a second time; allowed values: [False]"
        )


def _check_commit_mma_rules(v: Variant) -> None:
    """Path bulk_mma: whole warps per 32-column group (4 or 8 warps), whole 16-row tiles per
    warp; one update path (vec and fold_paths, which it does not read, at their defaults)."""
    if v.threads not in (128, 256):
        raise VariantError(
            f"threads={v.threads} is not allowed for path 'bulk_mma' (4 or 8 warps, one or "
            "two per 32-column group); allowed values: [128, 256]"
        )
    tiles = K // v.row_split // 16
    if tiles % (v.threads // 128):
        raise VariantError(
            f"row_split={v.row_split} leaves {tiles} 16-row tiles, which threads={v.threads} "
            "cannot share evenly between its warps of a column group"
        )
    if v.vec != 8 or v.fold_paths != 1:
        raise VariantError(
            f"vec={v.vec}, fold_paths={v.fold_paths}: path 'bulk_mma' reads neither; they "
            "stay at their defaults (vec=8, fold_paths=1) so a name means one variant"
        )


def _check_sm90_verify_rules(v: Variant) -> None:
    """A wgmma tile has at least 64 rows; the conv state is rolled in place by the CTA that
    reads it, so a convolving item cannot be split over CTAs; two warpgroups (256 threads)
    split one CTA's tokens and its 128 rows."""
    if v.threads not in (128, 256):
        raise VariantError(
            f"threads={v.threads} is not allowed for path 'sm90_wgmma' (one or two "
            "warpgroups); allowed values: [128, 256]"
        )
    if v.threads == 256 and (v.row_split != 1 or v.conv or not 2 <= v.window <= 8):
        raise VariantError(
            f"threads=256 needs row_split=1 (each warpgroup multiplies 64 of the 128 rows), "
            f"conv=False (the two-warpgroup kernel has no conv) and a window of 2..8 (each "
            f"warpgroup takes half the tokens, one coupling tile); got row_split="
            f"{v.row_split}, conv={v.conv}, window={v.window}"
        )
    if v.row_split not in (1, 2):
        raise VariantError(
            f"row_split={v.row_split} is not allowed for path 'sm90_wgmma' (a CTA needs at "
            "least the 64 state rows of one wgmma tile); allowed values: [1, 2]"
        )
    if v.conv and v.row_split != 1:
        raise VariantError(
            f"row_split={v.row_split} is not allowed with conv=True: every CTA of a split item "
            "would read the conv history that another CTA rolls in place; allowed values: [1]"
        )
    if v.tree and v.threads != 128:
        raise VariantError(
            f"tree=True needs threads=128 on path 'sm90_wgmma' (the one-warpgroup kernel); "
            f"got threads={v.threads}"
        )
