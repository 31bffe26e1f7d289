"""Correctness on the GPU: every variant against the fp64 reference, edge cases included.

For commit: the kernel updates a bf16 pool in place; the reference folds the same inputs
into an fp64 copy. Touched (slot, head) blocks must match within bf16 rounding; every other
byte of the pool, the padding after each slot included, must be bit-identical to before.
Rows of corr/kg that the contract says are unwritten hold NaN, so reading them shows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kdagen import first_use, reference
from kdagen.cases import (
    CHECK_CASES,
    SOFTPLUS_CASES,
    CommitCase,
    along_a_path,
    make_commit_inputs,
    pool_of,
)
from kdagen.serve.contract import CommitArgs
from kdagen.serve.variant import Variant
from kdagen.testing import lower_bound_for

first_use.enable()  # the launches here compile their kernels on first use

# bf16 output: half an ulp is 2^-9 relative; allow a few ulps for fp32 math and fast exp.
COMMIT_MAX_REL = 8e-3  # max |kernel - ref| / (|ref| + 1e-2 * rms(ref)) over touched elements
COMMIT_REL_L2 = 3e-3  # ||kernel - ref|| / ||ref|| over touched elements


@dataclass
class CaseResult:
    variant: str
    case: str
    max_abs: float
    max_rel: float
    rel_l2: float
    untouched_ok: bool
    deterministic: bool
    error: str = ""

    @property
    def score(self) -> float:
        return self.max_rel / COMMIT_MAX_REL

    def summary(self) -> str:
        return (
            f"max_rel {self.max_rel:.2e} rel_l2 {self.rel_l2:.2e} max_abs {self.max_abs:.2e}"
            f" untouched {'ok' if self.untouched_ok else 'CHANGED'}"
            f" repeat {'same' if self.deterministic else 'DIFFERS'}"
        )

    @property
    def passed(self) -> bool:
        return (
            not self.error
            and self.untouched_ok
            and self.deterministic
            and self.max_rel <= COMMIT_MAX_REL
            and self.rel_l2 <= COMMIT_REL_L2
        )


def touched_mask(args: CommitArgs) -> torch.Tensor:
    """[slots] bool: slots the contract lets commit write (live request: a slot inside the
    pool above the null slot, accepted > 0)."""
    state = args.state
    plan = reference.commit_plan(args.slots, args.accepted, null_slot=args.null_slot,
                                 slot_count=state.shape[0], window=args.corr.shape[2],
                                 rows=args.corr.shape[0])  # fmt: skip
    mask = torch.zeros(state.shape[0], dtype=torch.bool, device=state.device)
    mask[plan.final[plan.live]] = True
    return mask


def run_commit_case(variant: Variant, case: CommitCase, seed: int) -> CaseResult:
    from kdagen.serve.runtime import run_commit

    slot_dtype = torch.int32 if variant.slot_dtype == "int32" else torch.int64
    args = make_commit_inputs(case, variant.heads, variant.window, slot_dtype, seed,
                              lower_bound=lower_bound_for(variant.gate))  # fmt: skip
    state = args.state
    before = pool_of(state).clone()
    expected = state.double()  # compact fp64 copy; the reference writes it in place
    reference.commit(args.with_(state=expected), compute_dtype=torch.float64)

    result = CaseResult(variant.name, case.name, 0.0, 0.0, 0.0, True, True)
    launched, path = along_a_path(args, seed) if case.tree else (args, None)
    try:
        run_commit(launched, path=path, variant=variant)
        torch.cuda.synchronize()
        first = pool_of(state).clone()
        pool_of(state).copy_(before)  # again from the same start: bit-identical?
        run_commit(launched, path=path, variant=variant)
        torch.cuda.synchronize()
    except Exception as err:  # a launch error is a failed check, not a crash of the run
        result.error = f"{type(err).__name__}: {err}"[:300]
        return result
    result.deterministic = bool(torch.equal(first.view(torch.int16),
                                            pool_of(state).view(torch.int16)))  # fmt: skip
    compare_commit(result, state, expected, before, touched_mask(args))
    return result


def compare_commit(result: CaseResult, state: torch.Tensor, expected: torch.Tensor,
                   before: torch.Tensor, touched: torch.Tensor) -> None:  # fmt: skip
    """The verdict's figures: ``state`` (the kernel's, in its padded pool) against the fp64
    ``expected`` on the ``touched`` slots; every other slot and the pool's padding bit for
    bit as ``before`` (the pool's pre-launch copy)."""
    after = pool_of(state)
    width = state.shape[1] * state.shape[2] * state.shape[3]
    result.untouched_ok = bool(
        torch.equal(after[~touched].view(torch.int16), before[~touched].view(torch.int16))
        and torch.equal(after[:, width:].view(torch.int16), before[:, width:].view(torch.int16))
    )
    if touched.any():
        got = state[touched].double()
        want = expected[touched]
        diff = (got - want).abs()
        scale = want.pow(2).mean().sqrt()
        result.max_abs = float(diff.max())
        result.max_rel = float((diff / (want.abs() + 1e-2 * scale)).max())
        result.rel_l2 = float(diff.norm() / want.norm())


def commit_cases(variant: Variant) -> tuple[CommitCase, ...]:
    """A commit variant's one-layer check cases."""
    return CHECK_CASES + (SOFTPLUS_CASES if variant.gate == "softplus" else ())


def check_commit(variant: Variant, seed: int = 0) -> list[CaseResult]:
    """All commit check cases, one layer's and a model's (``kdagen.check_model_commit``),
    each on fresh random inputs (the seed moves per case)."""
    from kdagen.check_model_commit import check_model_commit

    cases = commit_cases(variant)
    single = [run_commit_case(variant, case, seed + i) for i, case in enumerate(cases)]
    return single + check_model_commit(variant, seed)


STATIC_ONLY = (
    "sm_100a variants are statically verified (compiled and their PTX inspected, "
    "tests/test_sm100.py) untuned defaults"
)


def gpu_refusal(variant: Variant, arch: str) -> str | None:
    """Why ``variant`` cannot run on a GPU of ``arch`` (None when it can)."""
    if arch not in variant.spec.archs:
        return (
            f"{variant.name}: refused: path {variant.path!r} targets "
            f"{', '.join(variant.spec.archs)}, this GPU is {arch}; {STATIC_ONLY}"
        )
    return None


def check_variant(variant: Variant, seed: int = 0) -> list:
    """All GPU check cases of a runnable variant (see ``gpu_refusal``): a list of
    ``CaseResult`` (commit) or ``VerifyCaseResult`` (verify), each with ``passed``,
    ``score`` (worst first) and ``summary()``."""
    if variant.kernel == "verify":
        from kdagen.check_verify import check_verify

        return check_verify(variant, seed)
    return check_commit(variant, seed)


# Seconds a check case takes on the H200 with 12 check processes sharing its 16 cores
# (docs/bench/h200-2026-12-05-next-spaces/check_added.txt): a verify case about 0.5 s at
# H <= 8, 1-1.5 s at H 12-16, 2.3-4.7 s at H 32 and 96 (its inputs and reference grow with
# the heads); a commit case about 0.05 s whatever the heads.
COMMIT_CASE_S = 0.05


def verify_case_s(heads: int) -> float:
    """A verify case's estimated seconds at ``heads`` (flat past 48, as measured at 96)."""
    return 0.25 + min(heads, 48) / 12


def check_cost(variant: Variant) -> float:
    """Estimated seconds of ``variant``'s check (for balancing shards, not for reports)."""
    if variant.kernel == "verify":
        from kdagen.check_verify import cases_for

        return len(cases_for(variant)) * verify_case_s(variant.heads)
    return len(commit_cases(variant)) * COMMIT_CASE_S


def shard_by_contract(variants: list[Variant], index: int, count: int) -> list[Variant]:
    """Shard ``index`` of ``count``: whole contracts, the costliest first to the least loaded
    shard by ``check_cost`` (an H 96 verify costs several H 12 ones), each shard ordered by
    contract (its tuning points share a case's inputs and reference)."""
    groups: dict[str, list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.contract_key, []).append(v)
    cost = {key: sum(check_cost(v) for v in group) for key, group in groups.items()}
    loads = [0.0] * count
    mine: list[Variant] = []
    for key in sorted(groups, key=lambda k: (-cost[k], k)):
        lightest = loads.index(min(loads))
        loads[lightest] += cost[key]
        if lightest == index:
            mine += groups[key]
    return sorted(mine, key=lambda v: (v.contract_key, v.name))


def result_records(variant: Variant, digest: str, cases: list) -> list[dict]:
    """One JSON record per case: its fields, whether it passed and the digest of the kernel
    that ran (``render.digest``), so a later check can tell what it need not run again."""
    return [{**c.__dict__, "passed": c.passed, "digest": digest} for c in cases]


def passed_in_tune(folder: Path, fingerprint: str) -> set[str]:
    """Variants that passed ``check_variant`` in the tune of ``folder`` (a tuned folder: the
    tuner checks every candidate before timing it), in studies measured on the GPU
    ``fingerprint`` whose candidates still render to the kernels they checked and timed
    (``kdagen.studies.fresh_studies``)."""
    from kdagen.evaluate import Ledger
    from kdagen.serve.variant import PATHS
    from kdagen.storage import folder_url, open_storage
    from kdagen.studies import fresh_studies, make_stamp

    ledger = Ledger()  # what the tuner itself counts as checked
    for study in fresh_studies(
        open_storage(folder_url(folder)), make_stamp(fingerprint, list(PATHS))
    ):
        ledger.add_study(study)
    return ledger.checked


def check_verdicts(paths: Iterable[Path]) -> dict[tuple[str, str], bool]:
    """(variant, digest) -> whether every case passed, over earlier ``kdagen check --json``
    files (``digest``: the kernel that ran). Files from a check without digests give none."""
    verdicts: dict[tuple[str, str], bool] = {}
    for path in paths:
        for record in json.loads(Path(path).read_text()):
            if "digest" in record:
                key = (record["variant"], record["digest"])
                verdicts[key] = verdicts.get(key, True) and bool(record["passed"])
    return verdicts
