"""The Hopper tree verify (issue 31), checked on the CPU: its variants and their rules, the
run-time's checks of ``parents``, the built-in choice, renders that leave the chain kernels
alone, and GPU-less compiles without spills. ``kdagen check --space verify_tree_sm90.yaml``
runs them against the tree reference on a GPU (every run: docs/history/trees.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tree import oracle_walk, random_paths

from kdagen import compile as kcompile
from kdagen import reference
from kdagen.cases import CHECK_CASES, along_a_path, make_commit_inputs
from kdagen.check_verify import cases_for
from kdagen.render import render
from kdagen.serve.abi import params
from kdagen.serve.contract import check_verify
from kdagen.serve.runtime import check_path, default_verify_variant
from kdagen.serve.validate import KdaInputError
from kdagen.serve.variant import Variant, VariantError
from kdagen.space import Space
from kdagen.testing import (
    clone_inputs,
    commit_args,
    make_verify_inputs,
    path_records,
    verify_args,
)

TREE = Space.load("verify_tree_sm90.yaml").expand().variants
SM_SHARED, REGISTERS = 232448, 65536  # per H200 SM
COMPILED = [  # the window's extremes, both splits, both stage counts, both grid bounds
    "verify-h12-q8-tree-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
    "verify-h12-q8-tree-i32-sm90_wgmma-t128-r1-c528-s2-pdl",
    "verify-h32-q4-tree-i32-sm90_wgmma-t128-r2-c528-s1-pdl",
    "verify-h96-q3-tree-i64-sm90_wgmma-t128-r1-c396-s1-pdl",
    "verify-h32-q8-softplus-tree-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
]
CONV_TREE = Space.load("verify_tree_conv_sm90.yaml").expand().variants
CONV_COMPILED = [  # each token's conv over its root path: both tap dtypes and layouts
    "verify-h12-q8-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
    "verify-h16-q8-softplus-tree-conv-df-fp32-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
    "verify-h96-q3-tree-conv-tm-bf16-i64-sm90_wgmma-t128-r1-c396-s1-pdl",
]


def test_names_parse_back_and_the_space_is_one_warpgroup_without_conv() -> None:
    assert len(TREE) == 220 and set(COMPILED) <= {v.name for v in TREE}
    for v in TREE:
        assert Variant.parse(v.name) == v and "-tree-" in v.contract_key
        assert (v.threads, v.conv) == (128, False) and v.window >= 2
    assert {v.gate for v in TREE} == {"kda", "softplus"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"threads": 256, "ctas": 264}, "tree=True needs threads=128"),
        ({"window": 1}, "tree=True needs a window of at least 2 tokens"),
    ],
)
def test_tree_rules(fields: dict, message: str) -> None:
    base = dict(kernel="verify", heads=12, window=8, tree=True, path="sm90_wgmma", ctas=396)
    with pytest.raises(VariantError, match=message):
        Variant(**(base | fields))
    with pytest.raises(VariantError, match="tree=True needs a window of at least 2 tokens"):
        Variant(kernel="commit", heads=12, window=1, tree=True)
    # A conv tree and the commit that moves its history along the path are variants.
    assert Variant(**(base | {"conv": True})).contract_key == "verify-h12-q8-tree-conv-tm-bf16-i32"
    assert Variant(kernel="commit", heads=12, window=8, tree=True).contract_key == (
        "commit-h12-q8-tree-i32"
    )


def test_chain_renders_carry_no_tree_code() -> None:
    """No dead branches: a chain kernel neither takes ``parents`` nor mentions the tree; its
    tree twin takes ``parents`` after ``slots``."""
    chain_variant = Variant.parse("verify-h12-q8-i32-sm90_wgmma-t128-r1-c396-s1-pdl")
    chain = render(chain_variant)
    assert "parents" not in chain and "ancestors" not in chain and "tree" not in chain
    assert "parents" not in [p.name for p in params(chain_variant)]
    names = [p.name for p in params(Variant.parse(COMPILED[0]))]
    assert names[names.index("slots") + 1] == "parents"


def test_the_conv_tree_space() -> None:
    assert len(CONV_TREE) == 140 and set(CONV_COMPILED) <= {v.name for v in CONV_TREE}
    assert all(v.tree and v.conv and (v.threads, v.row_split) == (128, 1) for v in CONV_TREE)
    assert {v.gate for v in CONV_TREE} == {"kda", "softplus"}


@pytest.mark.parametrize("names", [COMPILED, CONV_COMPILED], ids=["trees", "conv-trees"])
def test_tree_kernels_compile_without_spills(cache: Path, names: list[str]) -> None:
    records = kcompile.compile_many([Variant.parse(n) for n in names], ["sm_90a"], jobs=2,
                                    root=cache)  # fmt: skip
    assert [r.variant for r in records if r.ok] == names, [r.error for r in records]
    for r in records:
        v = Variant.parse(r.variant)
        assert r.frame_bytes == 0, r.variant
        resident = min(REGISTERS // (128 * r.registers), SM_SHARED // (r.launch_smem_bytes + 1024))
        assert resident >= (v.ctas // 132 if v.stages == 1 else 2), (r.variant, resident)


SM100_COMPILED = [
    "verify-h12-q8-tree-i32-sm100_tcgen05-c740",
    "verify-h96-q3-tree-i64-sm100_tcgen05-c740",
    "verify-h32-q8-softplus-tree-i32-sm100_tcgen05-c740",
    "verify-h12-q8-tree-conv-tm-bf16-i32-sm100_tcgen05-c740",
    "verify-h16-q2-softplus-tree-conv-df-fp32-i32-sm100_tcgen05-c740",
]


def test_the_blackwell_tree_kernels_compile_without_spills(cache: Path) -> None:
    """The sm100 template's tree mode (compiled and inspected only, like every sm_100a
    build): the parent selects and the masked solve, and tcgen05 MMAs as in the chain."""
    space = {v.name for v in Space.load("verify_tree_sm100.yaml").expand().variants}
    assert len(space) == 154 and set(SM100_COMPILED) <= space
    records = kcompile.compile_many([Variant.parse(n) for n in SM100_COMPILED], ["sm_100a"],
                                    jobs=2, root=cache)  # fmt: skip
    assert [r.variant for r in records if r.ok] == SM100_COMPILED, [r.error for r in records]
    assert all(r.frame_bytes == 0 for r in records)
    chain = render(Variant.parse("verify-h12-q8-i32-sm100_tcgen05-c740"))
    assert "parents" not in chain and "ancestors" not in chain
    ptx = (kcompile.variant_dir(Variant.parse(SM100_COMPILED[0]), cache) / "sm_100a"
           / "kernel.ptx").read_text()  # fmt: skip
    assert "tcgen05.mma" in ptx


def _tree_args(**changes: object):
    inputs = make_verify_inputs(5, 2, 4, seed=3, tree=True)
    return verify_args(inputs).with_(**changes), inputs


def test_parents_select_the_tree_contract() -> None:
    args, inputs = _tree_args()
    assert inputs["parents"].shape == (int(inputs["query_start"][-1]),)
    checked = check_verify(args, require_cuda=False)
    assert checked.fields["tree"] is True
    chosen = default_verify_variant(2, 4, "int32", 5, arch="sm_90a", sms=132,
                                    **{k: v for k, v in checked.fields.items()
                                       if k not in ("heads", "window", "slot_dtype")})  # fmt: skip
    assert chosen.tree and chosen.threads == 128 and chosen.ctas == 396


def test_a_tree_with_conv_selects_the_conv_tree_kernel() -> None:
    inputs = make_verify_inputs(5, 2, 4, seed=3, tree=True, conv=True)
    checked = check_verify(verify_args(inputs), require_cuda=False)
    assert checked.fields["tree"] is True and checked.fields["conv"] is True
    chosen = default_verify_variant(2, 4, "int32", 5, arch="sm_90a", sms=132,
                                    **{k: v for k, v in checked.fields.items()
                                       if k not in ("heads", "window", "slot_dtype")})  # fmt: skip
    assert chosen.tree and chosen.conv and chosen.row_split == 1 and chosen.ctas == 396
    one = make_verify_inputs(5, 2, 1, seed=3, tree=True, conv=True)
    with pytest.raises(KdaInputError, match="needs a window"):
        check_verify(verify_args(one), require_cuda=False)


def test_the_softplus_gate_takes_trees() -> None:
    args, _ = _tree_args(lower_bound=None)
    checked = check_verify(args, require_cuda=False)
    assert checked.fields["tree"] is True and checked.fields["gate"] == "softplus"
    chosen = default_verify_variant(2, 4, "int32", 5, arch="sm_90a", sms=132,
                                    **{k: v for k, v in checked.fields.items()
                                       if k not in ("heads", "window", "slot_dtype")})  # fmt: skip
    assert "-softplus-tree-" in chosen.name and chosen.threads == 128


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"parents": torch.zeros(3, dtype=torch.int32)}, "`parents`"),
        ({"parents": "int64"}, "`parents`"),
    ],
)
def test_bad_parents_are_refused(changes: dict, message: str) -> None:
    args, inputs = _tree_args()
    if changes.get("parents") == "int64":
        changes = {"parents": inputs["parents"].long()}
    with pytest.raises(KdaInputError, match=message):
        check_verify(args.with_(**changes), require_cuda=False)


def test_a_path_commit_is_the_chain_commit_of_the_path_records() -> None:
    """``kdagen.commit(path=)`` folds the path's records moved to positions 0.. by the chain
    kernels: on the fp64 reference, that is the token-by-token recurrence over the accepted
    path (``test_tree.oracle_walk``, which shares no code with the records' gathering)."""
    f64 = torch.float64
    inp = make_verify_inputs(6, 2, 6, seed=5, tree=True, state_dtype=f64, out_dtype=f64,
                             corr_dtype=f64)  # fmt: skip
    reference.verify(verify_args(inp))  # a tree: the tree reference writes the records
    path, accepted = random_paths(inp, inp["parents"], torch.Generator().manual_seed(5))
    assert (accepted > 1).any() and (path[:, 1:] > torch.arange(1, 6)).any()  # real branches
    by_chain = clone_inputs(inp)
    reference.commit(path_records(commit_args(by_chain, accepted), path))
    starts = inp["query_start"].tolist()
    walked = 0
    for b, slot in enumerate(inp["slots"].tolist()):
        if slot <= inp["null_slot"] or accepted[b] == 0:
            continue
        parents = inp["parents"][starts[b] : starts[b + 1]].tolist()
        state, _ = oracle_walk(inp, b, parents, path[b, : int(accepted[b])].tolist(), None)
        torch.testing.assert_close(by_chain["state"][slot], state, rtol=1e-10, atol=1e-12)
        walked += 1
    assert walked >= 3


def test_a_path_must_be_int32_b_by_q() -> None:
    with pytest.raises(KdaInputError, match="`path`"):
        check_path("kdagen.commit", torch.zeros(3, 3, dtype=torch.int32), 3, 4, torch.device("cpu"))


def test_the_check_runs_a_chain_and_a_star_on_tree_variants_only() -> None:
    names = [c.name for c in cases_for(Variant.parse(COMPILED[0]))]
    assert {"tree-chain", "tree-star", "random", "single"} <= set(names)
    chain = Variant.parse("verify-h12-q8-i32-sm90_wgmma-t128-r1-c396-s1-pdl")
    assert not {c.name for c in cases_for(chain)} & {"tree-chain", "tree-star"}


def test_the_checks_tree_path_case_is_its_chain_commit() -> None:
    """``kdagen check``'s tree-path case scatters each request's records along a random root
    path (NaN elsewhere); gathered back, the fold is the chain commit bit for bit on the
    reference (the kernels read the scattered records in place: the GPU check)."""
    case = next(c for c in CHECK_CASES if c.tree)
    args = make_commit_inputs(case, 2, 8, device="cpu", seed=3)
    scattered, path = along_a_path(args, 3)
    assert (path[:, 1:] > torch.arange(1, 8)).any() and torch.isnan(scattered.corr).any()
    chain, tree_path = args.state.double(), args.state.double()
    reference.commit(args.with_(state=chain), compute_dtype=torch.float64)
    reference.commit(path_records(scattered.with_(state=tree_path), path),
                     compute_dtype=torch.float64)  # fmt: skip
    assert torch.equal(chain, tree_path) and not torch.equal(chain, args.state.double())


def test_the_all_layer_commit_says_what_a_path_needs() -> None:
    from test_model_commit_validation import model

    three, window = torch.tensor([1, 0, 5], dtype=torch.int32), 4
    path = torch.zeros(3, window, dtype=torch.int32)
    m = model()
    expected = "no prefix caching"
    align = {"block_table": torch.ones(3, 2, dtype=torch.int32), "num_computed": three,
             "block_size": 16}  # fmt: skip
    with pytest.raises(KdaInputError, match=expected):
        m.commit(three, torch.ones(3, dtype=torch.int32), path=path, **align)
