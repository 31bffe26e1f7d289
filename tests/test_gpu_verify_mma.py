"""The small-CTA Hopper verify (path sm90_mma, search_spaces/verify_mma_sm90.yaml, not yet
shipped) on a GPU: every case of ``kdagen check`` on representatives of its space (both
residencies, the three windows and head counts, both slot dtypes)."""

from __future__ import annotations

import random

import pytest
from gpu_marks import HOPPER

from kdagen.check_verify import check_verify
from kdagen.serve.variant import Variant

pytestmark = HOPPER

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q16-i32-sm90_mma-c528-pdl",
        "verify-h12-q16-i32-sm90_mma-c396-pdl",
        "verify-h32-q12-i64-sm90_mma-c528-pdl",
        "verify-h96-q9-i32-sm90_mma-c528-pdl",
    ],
)
def test_the_small_cta_verify_passes_the_check(name: str) -> None:
    for result in check_verify(Variant.parse(name), SEED):
        assert result.passed, f"seed {SEED}: {result.error or result.summary()}"
