"""Converters to ``parents``: vLLM's speculative_token_tree notation and tree attention masks."""

from __future__ import annotations

import pytest
import torch

from kdagen.serve.validate import KdaInputError
from kdagen.tree import ancestor_table
from kdagen.tree_convert import parents_from_mask, parents_from_token_tree


def notation_of(parents: list[int]) -> list[tuple[int, ...]]:
    """A tree's child-index paths (node i + 1 -> entry i), numbering children in order."""
    paths: list[tuple[int, ...]] = [()]
    children = [0] * len(parents)
    for p in parents[1:]:
        paths.append((*paths[p], children[p]))
        children[p] += 1
    return paths[1:]


def random_tree(size: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, size)]


def test_vllm_example() -> None:
    tree = [(0,), (1,), (0, 0), (0, 1)]
    assert parents_from_token_tree(tree).tolist() == [-1, 0, 0, 1, 1]
    chain = [(0,), (0, 0), (0, 0, 0)]
    assert parents_from_token_tree(chain).tolist() == [-1, 0, 1, 2]
    assert parents_from_token_tree([]).tolist() == [-1]
    assert parents_from_token_tree(tree).dtype == torch.int32


@pytest.mark.parametrize("seed", range(6))
def test_round_trips(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    parents = random_tree(int(torch.randint(1, 17, (1,), generator=gen)), gen)
    assert parents_from_token_tree(notation_of(parents)).tolist() == parents
    mask = ancestor_table(torch.tensor(parents))
    assert parents_from_mask(mask).tolist() == parents
    assert parents_from_mask(mask.float()).tolist() == parents  # nonzero = attends


def test_a_mask_built_from_the_notation() -> None:
    """The mask vLLM's tree attention uses (each node attends to its path's prefixes and
    itself, everyone to the root) gives the notation's parents."""
    tree = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]
    nodes = [(), *tree]
    mask = torch.tensor([[b == a[: len(b)] for b in nodes] for a in nodes])
    assert parents_from_mask(mask).tolist() == parents_from_token_tree(tree).tolist()


@pytest.mark.parametrize(
    "tree, pattern",
    [
        ([(0,), (0, 0), (0,)], "listed twice"),
        ([(0, 0), (0,)], "after its parent"),
        ([(0,), ()], "non-empty path"),
        ([(0,), (-1,)], "non-negative"),
        ([(0,), "01"], "tuple of child"),
        ([(i,) for i in range(16)], "window of 1..16"),
    ],
)
def test_bad_notation_is_refused(tree: list, pattern: str) -> None:
    with pytest.raises(KdaInputError, match=pattern):
        parents_from_token_tree(tree)


def test_bad_masks_are_refused() -> None:
    good = ancestor_table(torch.tensor([-1, 0, 1, 1]))
    cases = []
    no_diagonal = good.clone()
    no_diagonal[2, 2] = False
    cases.append((no_diagonal, "diagonal"))
    later = good.clone()
    later[1, 3] = True
    cases.append((later, "after the diagonal"))
    rootless = torch.eye(3, dtype=torch.bool)
    cases.append((rootless, "column 0"))
    skipped = ancestor_table(torch.tensor([-1, 0, 1, 2]))
    skipped[3, 1] = False  # 3's grandparent 1 is missing from its row, its parent 2 is there
    cases.append((skipped, "a tree's"))
    cases.append((torch.ones(2, 3, dtype=torch.bool), r"\[Q, Q\]"))
    cases.append((torch.ones(17, 17, dtype=torch.bool).tril(), "1..16"))
    for mask, pattern in cases:
        with pytest.raises(KdaInputError, match=pattern):
            parents_from_mask(mask)
