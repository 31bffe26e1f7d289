"""Variant -> CuTe-DSL module source, through the Jinja templates in ``templates/``."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import jinja2

from kdagen.serve.abi import params
from kdagen.serve.contract import MAX_LOG_DECAY
from kdagen.serve.fingerprint import dsl_version
from kdagen.serve.resources import data_dir
from kdagen.serve.variant import Variant

TEMPLATE_DIR = Path(os.environ.get("KDAGEN_TEMPLATES", data_dir("templates")))


@functools.cache
def environment() -> jinja2.Environment:
    """StrictUndefined: a template that reads a field the variant lacks fails to render."""
    if not TEMPLATE_DIR.is_dir():
        raise FileNotFoundError(
            f"kdagen templates not found at {TEMPLATE_DIR}; install kdagen from its checkout "
            "(pip install -e .) or set KDAGEN_TEMPLATES"
        )
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


# Per-CTA trace records (RenderOptions.trace_records): int64 records per CTA, of which the
# first TRACE_HEADER are per-CTA fields and the rest 4 per unit (scripts/trace_verify.py).
TRACE_SLOTS = 128
TRACE_HEADER = 12


def _sm90(variant: Variant) -> bool:
    return variant.kernel == "verify" and variant.path == "sm90_wgmma"


def three_ctas_wide(variant: Variant) -> bool:
    """Whether the Hopper verify ``variant`` is a bounded-gate chain or tree past 8 tokens
    built for three CTAs an SM (its grid bound 3 x 132, one warpgroup, whole items, one state
    buffer, conv off): one probe tile (a warp that rebases its couplings writes their probes
    there, runs its coupling MMAs and writes the state's probes over them) and the coupling
    partials after the warps' w rows in the projections' buffer, so 70 KiB of shared memory at
    Q = 16 instead of 94; at the 168 registers ptxas then allows, the look-ahead window holds
    a channel pair to a register (``kdagen.dsl.paired_window``). Not in a shipped space until
    the H200 has checked and timed it."""
    return (
        _sm90(variant)
        and variant.window > 8
        and variant.gate == "kda"
        and not variant.conv
        and variant.threads == 128
        and variant.row_split == 1
        and variant.stages == 1
        and variant.ctas == 3 * 132
    )


# Measurement bounds (RenderOptions.bound): builds with wrong outputs that time one part of
# the kernel alone; each with the variants its template expresses it for.
BOUNDS: dict[str, tuple[Callable[[Variant], bool], str]] = {
    # every unit's loads and, for a live unit, its stores (of the input registers): no math
    "loads-stores-only": (
        lambda v: _sm90(v) and v.threads == 128 and v.row_split == 1 and not three_ctas_wide(v),
        "an sm90_wgmma verify, one warpgroup, r1, its window a register per value",
    ),
    # every unit reads and writes request 0's rows, which stay in L2: (almost) no HBM traffic
    "l2-resident": (lambda v: _sm90(v) and v.row_split == 1, "an sm90_wgmma verify, r1"),
    # the math without the stores of kg, out and corr (behind a test that never holds)
    "no-stores": (_sm90, "an sm90_wgmma verify"),
    # the conv's loads and stores without its arithmetic (the raw window for its output)
    "conv-bytes-only": (lambda v: _sm90(v) and v.conv and v.threads == 128,
                        "an sm90_wgmma verify with the conv, one warpgroup"),
    # commit: the plan, copies and stores with no factors or update arithmetic
    "no-fold": (lambda v: v.kernel == "commit", "a commit variant"),
}  # fmt: skip


def _cuda_core_commit(variant: Variant) -> bool:
    """A commit that folds on the CUDA cores (paths bulk and bulk_ring)."""
    return variant.kernel == "commit" and variant.path in ("bulk", "bulk_ring")


@dataclass(frozen=True)
class RenderOptions:
    """Perf-work builds (scripts/trace_verify.py, scripts/sweep_model_commit.py); the
    defaults render the product's kernel. ``trace_records`` (sm90_wgmma verify kernels and the
    commit paths bulk and bulk_ring): the device address of the per-CTA trace records into
    which thread 0 of each CTA stores %globaltimer (0: none). ``bound``: a key of ``BOUNDS``,
    or None."""

    trace_records: int = 0
    bound: str | None = None

    def check(self, variant: Variant) -> None:
        """Raise ValueError where ``variant``'s template has no such build."""
        if self == RenderOptions():
            return
        if self.trace_records and not (_sm90(variant) or _cuda_core_commit(variant)):
            raise ValueError(f"trace records are built into sm90_wgmma verify kernels and the "
                             f"bulk and bulk_ring commits, not {variant.name}")  # fmt: skip
        if self.bound is None:
            return
        if self.bound not in BOUNDS:
            raise ValueError(f"unknown bound {self.bound!r} (bounds: {', '.join(BOUNDS)})")
        applies, needs = BOUNDS[self.bound]
        if not applies(variant):
            raise ValueError(f"bound {self.bound!r} needs {needs}, not {variant.name}")


# The one-warpgroup softplus chains of up to 8 tokens without a second coupling tile: a warp that
# needs the rebased probes writes them into the state's probe tile, runs its coupling MMAs and
# writes the state's probes over them (8 KiB less shared memory at Q = 8: 4 CTAs an SM, not 3).
# Off until `kdagen check` has run its renders on a GPU; switching it on also drops the space's
# 3-CTA constraint for the softplus gate at Q > 4 and the run-time heuristic's (runtime.py), and
# re-tunes the softplus chain studies. tests/test_compile.py compiles it.
SOFTPLUS_ONE_TILE = False

# The PDL commit kernels read their slot and the layer table before griddepcontrol.wait and
# fetch the slot's state into L2 there, under the kernel launched before them (the verify's
# first-state prefetch, for commit). Off until `kdagen check` and the model bench have run its
# renders on a GPU; switching it on re-renders every PDL commit kernel but the ring's (their
# studies re-timed) and adds the commit to README's rule on what the kernel before a PDL launch
# must not write.
COMMIT_STATE_PREFETCH = False

# The ring commit (path bulk_ring, one CTA a head, PDL) issues its first RING state pieces'
# copies before griddepcontrol.wait, under the kernel launched before, which must not write
# the state, the layer table or the slots (as for COMMIT_STATE_PREFETCH): at batch 1 the
# pieces follow the wait by two global round trips (the slot, then the copies' issue) and
# queue in HBM behind every CTA's. H100, with COMMIT_EARLY_READS: 0.98x at B = 1, 1.00x at
# B = 16; all 112 ring variants pass `kdagen check` with both. Off until the H200 commit studies
# are re-timed with it (docs/history/model-commit.md).
COMMIT_PIECES_EARLY = False

# The commit kernels that fold on the CUDA cores (paths bulk and bulk_ring) shorten the chain of
# reads before their factors, which at batch 1 (one wave) is the kernel's critical path: they
# read their gate weights (a_log, dt_bias: never written while serving) before
# griddepcontrol.wait, and the bulk path without prefix caching issues the records' copies
# before the state's (on an H100 at B = 1: ring 0.96-0.98x, bulk 0.93x). Every commit render
# passed `kdagen check` with it on (H100); off until the H200 commit studies are re-timed with
# it, since switching it on re-renders those kernels.
COMMIT_EARLY_READS = False

# Verify kernels that cut the rows named by device values to their tensors: each window to rows
# [0, T), the conv history's first row to [0, Q - 1] (kdagen/dsl/bounds.py). Without it a start
# past T writes `out` rows past the tensor and a bad accepted count reads conv rows outside the
# slot. Off until `kdagen check` (its `rows-outside` case included) has run every verify render
# on a GPU and the verify studies are re-timed: it re-renders every verify kernel.
VERIFY_ROW_BOUNDS = False

# PDL verify kernels that fetch their first state only into L2 before griddepcontrol.wait and
# copy it into shared memory after the wait. A commit launched right before a verify lets it
# start while the commit still writes the states, and only the wait makes those writes visible
# (L2 is the point of coherence, so the prefetched line is updated; a TMA load into shared
# memory before the wait can read the old state). Off, and switched on with VERIFY_ROW_BOUNDS
# (the same re-render, check and re-tune); until then README says not to launch commit right
# before verify.
VERIFY_STATE_AFTER_WAIT = False
# One-warpgroup chains and trees without the conv of at least STAGED_WINDOW_FROM tokens stage
# the next unit's window in shared memory by cp.async (kdagen/dsl/staged_window.py) instead of
# loading it into registers: 4 ceil(Q / 8) 16-byte copies a thread instead of 4 Q two-byte loads
# and their 64-bit addresses, 4 Q K 2 bytes more shared memory. From 9 tokens (the wide kernels)
# all 146 passed `kdagen check` on an H100 and H 12 Q 16 chains ran 0.87-0.93x the look-ahead's
# time from B = 64 (docs/history/trees.md). 5 also stages windows of 5-8 tokens at up to three
# CTAs an SM (compiled only: 3-8 % fewer instructions, still three CTAs an SM); 17 renders the
# register look-ahead everywhere, for an A/B.
STAGED_WINDOW_FROM = 9
# The wide conv kernels (9-16 tokens) stage their window too: 0.89-0.97x the instructions, never
# more registers, most stack frames gone (all 386 of the default spaces, compiled for sm_90a);
# the largest, the conv tree of 16 tokens, launches with 112,852 bytes of dynamic shared memory
# (SHARED_BYTES counts up to 2 KiB more for alignment), so two CTAs still fit an SM. On the H200
# H 12 Q 12 and Q 16 conv chains and trees ran 0.93-0.96x the look-ahead's time from B = 64, flat
# at B = 1 (docs/history/trees.md). All 386 passed `kdagen check` at the render the H200 table
# lands with (on an H100); off until that table, tuned with it on, lands.
STAGED_WINDOW_CONV = False


def rebase_on_demand(variant: Variant) -> bool:
    """Whether the Hopper verify ``variant`` writes its second coupling tile only in warps whose
    windows leave the range of the bounded gate's 8 tokens: softplus chains of up to 8 tokens
    (factors relative to the middle token) and the bounded gate past 8 tokens (relative to
    -NEAR_SHIFT)."""
    if variant.kernel != "verify" or variant.path != "sm90_wgmma":
        return False
    if variant.window > 8:
        return variant.gate == "kda"
    return variant.gate == "softplus" and not variant.tree


# The one-warpgroup Hopper verify kernels of 13-16 tokens (64 probe columns) write their probe
# and w tiles a channel row at a time (kdagen/dsl/probe_rows.py): 16-byte stores instead of
# two-byte ones, the coupling MMAs reading them transposed, fewer instructions. The bounded
# gate's 177 passed `kdagen check` at the render the H200 table lands with (H100) and ran
# 0.95-0.97x at B = 1 there, within 1-3 % from B = 64 (docs/history/trees.md). Off until the
# H200 verify studies are re-timed with it: it re-renders those kernels.
PROBE_ROWS = False


def probe_rows(variant: Variant) -> bool:
    """Whether the Hopper verify ``variant`` writes its probe and w tiles a channel row at a
    time (PROBE_ROWS): 64 probe columns (13-16 tokens), one warpgroup, whole items, not the
    three-CTA build."""
    return (
        PROBE_ROWS
        and _sm90(variant)
        and 13 <= variant.window <= 16
        and variant.threads == 128
        and variant.row_split == 1
        and not three_ctas_wide(variant)
    )


def staged_window(variant: Variant) -> bool:
    """Whether the Hopper verify ``variant`` stages its next window in shared memory
    (STAGED_WINDOW_FROM): one warpgroup, whole items, conv off (or STAGED_WINDOW_CONV), and at
    most three CTAs an SM of a 132-SM GPU (at four the staged tile and its registers no longer
    fit; the three-CTA wide build keeps its paired register window, its shared memory is full)."""
    return (
        _sm90(variant)
        and not three_ctas_wide(variant)
        and variant.window >= STAGED_WINDOW_FROM
        and (not variant.conv or (STAGED_WINDOW_CONV and variant.window > 8))
        and variant.threads == 128
        and variant.row_split == 1
        and variant.ctas <= 3 * 132
    )


def _context(variant: Variant, options: RenderOptions) -> dict[str, object]:
    """Values the templates read besides the variant itself, derived once here."""
    context: dict[str, object] = {
        "variant": variant,
        "template_path": variant.spec.template,
        "softplus": variant.gate == "softplus",
        "trace": options.trace_records,
        "trace_slots": TRACE_SLOTS,
        "trace_header": TRACE_HEADER,
        "bound": options.bound,
        "params": params(variant),  # the host call's signature
        # verify: a token tree's window; commit: the conv history along a tree's accepted path
        "tree": variant.tree,
    }
    if variant.kernel == "commit":
        # Not the ring: it measured 7 % slower at B = 1 and 15 % at B = 16 with the prefetch
        # (H100, 2026-12-07; docs/history/model-commit.md).
        context["prefetch_state"] = (
            COMMIT_STATE_PREFETCH and variant.pdl and variant.path != "bulk_ring"
        )
        context["pieces_early"] = (
            COMMIT_PIECES_EARLY and variant.pdl and variant.path == "bulk_ring"
        )
        context["gates_early"] = COMMIT_EARLY_READS and _cuda_core_commit(variant)
        # Not the ring: there the records-first order lost the gate weights' gain at B = 1,
        # while the bulk path gained 6 % with it (H100; docs/history/model-commit.md).
        context["records_first"] = (
            context["gates_early"] and variant.path == "bulk" and not variant.prefix_caching
        )
    if variant.kernel == "verify":
        context["row_bounds"] = VERIFY_ROW_BOUNDS
        context["state_after_wait"] = VERIFY_STATE_AFTER_WAIT and variant.pdl
        context["split"] = variant.row_split
        context["stages"] = variant.stages
        context["pdl"] = variant.pdl
        context["conv"] = variant.conv
        # Past 8 tokens: a second coupling tile of tokens 8..15 (16 w rows per probe), and the
        # couplings' factors relative to a constant (``shifted``), as the softplus trees take
        # theirs; with the softplus gate two such constants, one per band of log decay
        # (``banded``, kdagen.dsl.bands).
        wide = variant.window > 8
        context["wide"] = wide
        context["banded"] = wide and variant.gate == "softplus"
        context["w_rows"] = 16 if wide else 8
        context["beta_slots"] = max(8, variant.window)
        context["couple"] = wide or variant.gate == "softplus"
        context["shifted"] = wide or (variant.tree and variant.gate == "softplus")
        on_demand = rebase_on_demand(variant)
        context["rebase_on_demand"] = on_demand
        # One warpgroup with the coupling before the projections: with SOFTPLUS_ONE_TILE the
        # softplus chains' rebased probes go into the state's probe tile and are written over,
        # as the three-CTA wide chains' do.
        three_ctas = three_ctas_wide(variant)
        context["three_ctas"] = three_ctas
        context["staged_window"] = staged_window(variant)
        context["one_tile"] = three_ctas or (
            SOFTPLUS_ONE_TILE and on_demand and not wide and variant.threads == 128
        )
        context["couple_tile"] = context["couple"] and not context["one_tile"]
        context["probe_rows"] = probe_rows(variant)
        context["max_log_decay"] = f"{MAX_LOG_DECAY:g}"
        context["bounded_decay"] = repr(math.exp(-MAX_LOG_DECAY))
        context["conv_dim_first"] = variant.conv and variant.conv_layout == "dim_first"
        # Hopper conv trees of 5 to 8 tokens load their lags from shared memory (a row of the
        # projections' buffer holds the 6 (Q + 3) bytes), kdagen/dsl/tree_conv_staged.py;
        # shorter windows keep the selects (fewer lags); longer ones (staging spills there)
        # load each lag of q, k and v from one record that names the next one's place
        # (kdagen/dsl/tree_conv_records.py).
        loaded_lags = variant.tree and variant.conv and variant.path == "sm90_wgmma"
        context["staged_conv"] = loaded_lags and 5 <= variant.window <= 8
        context["record_conv"] = loaded_lags and variant.window > 8
        context["conv_f32"] = variant.conv and variant.conv_weight_dtype == "fp32"
    return context


def template_flags(variant: Variant) -> dict[str, bool]:
    """The yes / no switches the variant's template and the device helpers it calls branch on:
    the render context's booleans (kdagen/coverage.py covers their pairs)."""
    return {k: v for k, v in _context(variant, RenderOptions()).items() if isinstance(v, bool)}


@functools.cache
def render(variant: Variant, options: RenderOptions = RenderOptions()) -> str:
    """The variant's kernel module as Python source (``options``: a perf-work build)."""
    options.check(variant)
    template = environment().get_template(variant.spec.template)
    return template.render(**_context(variant, options))


DSL_DIR = Path(__file__).resolve().parent / "dsl"
_DSL_IMPORT = re.compile(r"^from kdagen\.dsl\.(\w+) import", re.MULTILINE)


@functools.cache
def helpers_source() -> bytes:
    """Every device helper module (kdagen/dsl): part of each template digest."""
    return b"".join(path.read_bytes() for path in sorted(DSL_DIR.glob("*.py")))


@functools.cache
def helper_modules(source: str) -> tuple[str, ...]:
    """The kdagen/dsl modules ``source`` imports, directly or through each other."""
    found: set[str] = set()
    todo = _DSL_IMPORT.findall(source)
    while todo:
        module = todo.pop()
        if module not in found:
            found.add(module)
            todo += _DSL_IMPORT.findall((DSL_DIR / f"{module}.py").read_text())
    return tuple(sorted(found))


def digest(variant: Variant) -> str:
    """Content hash: the rendered source, the device helper modules it imports (so an edit
    of another kernel's helpers leaves it alone) and the DSL version that compiles it."""
    h = hashlib.sha256()
    source = render(variant)
    h.update(source.encode())
    for module in helper_modules(source):
        h.update(f"\0helpers {module}\0".encode() + (DSL_DIR / f"{module}.py").read_bytes())
    h.update(b"\0nvidia-cutlass-dsl=" + dsl_version().encode())
    return h.hexdigest()[:16]


def kernels_digest(names: Iterable[str]) -> str:
    """Hash of the content digests (``digest``) of a set of variants. A dispatch table records
    it for the variants it measured, so a template edit that renders those kernels
    identically leaves the table fresh."""
    h = hashlib.sha256()
    for name in sorted(set(names)):
        h.update(f"{name}\0{digest(Variant.parse(name))}\n".encode())
    return h.hexdigest()[:16]


def template_digest(kernel: str | None = None) -> str:
    """Hash of every template file (of one kernel, or all): dispatch tables record it."""
    h = hashlib.sha256()
    root = TEMPLATE_DIR
    for path in sorted(root.rglob("*.j2")):
        rel = path.relative_to(root).as_posix()
        if kernel is None or rel.startswith((f"{kernel}/", "common/")):
            h.update(rel.encode() + b"\0" + path.read_bytes())
    h.update(helpers_source())
    return h.hexdigest()[:16]
