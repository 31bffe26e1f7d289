"""The check's host-side planning (CPU): shards of whole contracts."""

from __future__ import annotations

import pytest

from kdagen.check import shard_by_contract
from kdagen.space import Space


@pytest.mark.parametrize("count", [1, 4, 14])
def test_shards_split_whole_contracts_evenly_and_keep_them_together(count: int) -> None:
    variants = Space.load("verify_sm90.yaml").expand().variants
    shards = [shard_by_contract(variants, i, count) for i in range(count)]
    names = [v.name for s in shards for v in s]
    assert sorted(names) == sorted(v.name for v in variants)  # each variant once
    owners = {v.contract_key: i for i, s in enumerate(shards) for v in s}
    assert all(owners[v.contract_key] == i for i, s in enumerate(shards) for v in s)
    for s in shards:  # a contract's tuning points back to back: the case cache holds one
        keys = [v.contract_key for v in s]
        assert keys == sorted(keys)
    biggest = max(sum(v.contract_key == k for v in variants) for k in owners)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= biggest
