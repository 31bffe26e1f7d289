"""Stamp the machine code of a tuned folder's fresh studies (no GPU: compile only).

Studies tuned before kdagen recorded machine code (``kdagen.machine_code``), or under an
older digest, carry no or another ``machine_hash``; a later template refactor would then
measure them all again. This compiles each fresh study's candidates as this checkout renders
them (the renders the studies were measured on: fresh means unchanged) and records the hash,
then packs the folder's database.

    python scripts/stamp_machine_code.py generated/nvidia-h200-sm90-132sm [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kdagen.compile import CompilePool
from kdagen.serve.variant import PATHS, Variant
from kdagen.storage import folder_url, open_storage, pack_folder
from kdagen.studies import folder_lock, fresh_studies, make_stamp
from kdagen.tune import stamp_machine_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    table = json.loads((args.folder / "dispatch.json").read_text())
    arch = table["device"]["arch"]
    with folder_lock(args.folder):
        storage = open_storage(folder_url(args.folder))
        stamp = make_stamp(table["fingerprint"], list(PATHS))
        studies = fresh_studies(storage, stamp)
        print(f"{len(studies)} fresh studies; compiling their candidates")
        stamped = 0
        with CompilePool(arch, args.jobs) as pool:
            for names in {tuple(s.user_attrs["candidate_names"]) for s in studies}:
                for name in names:
                    pool.submit(Variant.parse(name))
            for study in studies:
                if stamp_machine_code(study, pool, list(study.user_attrs["candidate_names"])):
                    stamped += 1
                else:
                    print(f"{study.study_name}: a candidate did not compile; left unstamped")
        pack_folder(args.folder)
    print(f"stamped {stamped} of {len(studies)}")


if __name__ == "__main__":
    main()
