"""``kdagen doctor``: which dispatch table serves a GPU, and what would fall back and why.

For a GPU fingerprint (the visible GPU's, or one given): the table that serves it (its own,
or a tuned GPU's of the same architecture), whether each kernel's winners are fresh (the
kernels they measured still render the same, the same nvidia-cutlass-dsl), and for every
study of the shipped workloads whether the lookup finds its exact (contract key, batch
bucket) entry or falls back (nearest bucket, per-GPU default, built-in heuristic). The exit
code says what a CI job should do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kdagen.first_use import staleness
from kdagen.serve.dispatch import TABLE_FILE, load_table, table_folder_for
from kdagen.space import DEFAULT_SPACES

SERVED = 0  # the GPU's own table, fresh, every study tuned: nothing to do
FALLS_BACK = 1  # served, but from another GPU's table or with keys / buckets not tuned
UNSERVED = 3  # no table for this GPU or its architecture, or a stale one: re-tune

_ARCHS = {"sm90": "sm_90a", "sm100": "sm_100a"}


@dataclass
class Diagnosis:
    fingerprint: str
    folder: Path
    borrowed_from: str | None = None  # the fingerprint whose table serves another GPU
    created: str = ""
    dsl_version: str = ""
    stale: dict[str, str] = field(default_factory=dict)  # kernel -> why
    carried: dict[str, dict[str, str]] = field(default_factory=dict)  # kernel -> `kdagen carry`'s
    studies: int = 0
    fallbacks: list[tuple[str, int, str]] = field(default_factory=list)  # key, batch, how
    missing: bool = False

    @property
    def code(self) -> int:
        if self.missing or self.stale:
            return UNSERVED
        return FALLS_BACK if self.borrowed_from or self.fallbacks or self.carried else SERVED

    def lines(self, most: int = 20) -> list[str]:
        if self.missing:
            return [f"{self.fingerprint}: no dispatch table for this GPU or its architecture "
                    f"({self.folder / TABLE_FILE} missing): every key runs the built-in "
                    "heuristic; run `kdagen tune` on this GPU"]  # fmt: skip
        whose = f"borrowed from {self.borrowed_from} (same architecture)" if (
            self.borrowed_from) else "its own table"  # fmt: skip
        out = [f"{self.fingerprint}: served by {self.folder} ({whose}, made {self.created} "
               f"with nvidia-cutlass-dsl {self.dsl_version})"]  # fmt: skip
        out += [f"  {kernel}: STALE, refused at run time: {why}" for kernel, why in
                sorted(self.stale.items())]  # fmt: skip
        out += [f"  {kernel}: carried: timings measured before {c['reason']} (its cost: "
                f"{c['evidence']}); re-tune to re-time" for kernel, c in
                sorted(self.carried.items())]  # fmt: skip
        tuned = self.studies - len(self.fallbacks)
        out.append(f"  {self.studies} studies of the workloads: {tuned} tuned, "
                   f"{len(self.fallbacks)} fall back")  # fmt: skip
        for key, batch, how in self.fallbacks[:most]:
            out.append(f"    {key} b{batch}: {how}")
        if len(self.fallbacks) > most:
            out.append(f"    ... and {len(self.fallbacks) - most} more")
        verdict = {SERVED: "nothing to re-tune", FALLS_BACK: self._served_how(),
                   UNSERVED: "re-tune: `kdagen tune`"}  # fmt: skip
        if self.stale and not self.borrowed_from:  # this GPU's own studies can be re-timed
            verdict[UNSERVED] += (" (`--refresh`: each study whose kernels changed times "
                                  "again only its leaders)")  # fmt: skip
        out.append(f"exit {self.code}: {verdict[self.code]}")
        return out

    def _served_how(self) -> str:
        """Why a served GPU exits FALLS_BACK: each reason there is, with what to do."""
        reasons = []
        if self.borrowed_from:
            reasons.append("another GPU's table (`kdagen tune` on this GPU makes its own)")
        if self.fallbacks:
            reasons.append(f"{len(self.fallbacks)} studies fall back (tune them)")
        if self.carried:
            reasons.append(f"{', '.join(sorted(self.carried))} carried (a re-tune re-times it)")
        return "served, but: " + "; ".join(reasons)


def diagnose(
    fingerprint: str,
    workloads: str | Path = "workloads.yaml",
    spaces: Sequence[str] = DEFAULT_SPACES,
    root: Path | None = None,
) -> Diagnosis:
    """What the run-time lookup does for ``fingerprint`` at every study of ``workloads``, with
    the tables in ``root`` (default: where the run-time looks)."""
    from kdagen.tune import plan_studies

    folder, borrowed = table_folder_for(fingerprint, root)
    table = load_table(folder)
    if table is None:
        return Diagnosis(fingerprint, folder, missing=True)
    found = Diagnosis(fingerprint, folder, borrowed, table.created, table.dsl_version)
    for kernel in sorted(table.kernels()):
        why = staleness(table, kernel)  # what the run-time's check_fresh refuses
        if why:
            found.stale[kernel] = why
        elif kernel in table.carried:
            found.carried[kernel] = table.carried[kernel]
    arch = _ARCHS.get(fingerprint.rsplit("-", 2)[-2], "")
    plans, _ = plan_studies(spaces, workloads, arch) if arch else ([], [])
    for plan in plans:
        untuned_space = table.untuned_space(plan.kernel, plan.key)
        for batch in plan.batches:
            found.studies += 1
            entry, how = table.lookup(plan.kernel, plan.key, batch)
            if untuned_space:  # as dispatch.resolve: a space the table was not tuned with
                found.fallbacks.append((plan.key, batch, "the built-in choice (a key of a "
                                        "space the table was not tuned with)"))  # fmt: skip
            elif how == "nearest" and entry is not None:
                found.fallbacks.append((plan.key, batch, f"nearest tuned bucket {entry.batch}"))
            elif how == "gpu-default" and entry is not None:
                found.fallbacks.append((plan.key, batch, f"the per-GPU default for {plan.kernel} "
                                        f"(bucket {entry.batch})"))  # fmt: skip
            elif how == "none":
                found.fallbacks.append((plan.key, batch, "the built-in heuristic"))
            elif entry is not None and not table.keeps(plan.kernel, plan.key, entry.variant):
                found.fallbacks.append((plan.key, batch, f"a winner outside the table's space "
                                        f"({entry.variant}): the run-time refuses it"))  # fmt: skip
    return found
