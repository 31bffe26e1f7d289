"""One launch of some check cases of each named verify variant, for compute-sanitizer: its
racecheck tool finds shared-memory hazards between a CTA's threads (what a kernel that reuses
its shared buffers across phases can get wrong), memcheck any access outside an allocation.

    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python scripts/sanitize_verify.py verify-h12-q16-i32-sm90_wgmma-t128-r1-c396-s1-pdl

(`scripts/gpu_session.sh` step `sanitize`, variants in SANITIZE_VARIANTS). The launches run
the same inputs as `kdagen check`'s cases (``kdagen.check_verify``); their outputs are not
compared here, only launched: `kdagen check` compares them.
"""

from __future__ import annotations

import argparse

import torch

from kdagen.check_verify import cases_for, prepared_case, run_kernel
from kdagen.serve.variant import Variant

CASES = "random,single,bounded-edge,saturated,rows-outside"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="verify variant names")
    parser.add_argument("--cases", default=CASES, help="check cases to launch (comma list)")
    args = parser.parse_args()
    wanted = set(args.cases.split(","))
    for name in args.variants:
        variant = Variant.parse(name)
        for seed, case in enumerate(cases_for(variant)):
            if case.name not in wanted:
                continue
            prepared = prepared_case(variant, case, seed)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            run_kernel(prepared.inputs, variant, counter)
            torch.cuda.synchronize()
            print(f"{name} {case.name}: launched, counter {int(counter.item())}")


if __name__ == "__main__":
    main()
