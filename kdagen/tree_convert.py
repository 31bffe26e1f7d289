"""Converters from other tree notations to a window's ``parents`` (``docs/tree-semantics.md``).

A request's ``parents`` is ``[Q]`` int32: -1 at position 0 (the root, the last accepted
token), else an earlier position. Per-request results are concatenated in token order for
``kdagen.tree.verify_tree``'s ``parents [T]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kdagen.serve.validate import KdaInputError
from kdagen.tree import MAX_TREE_WINDOW

TOKEN_TREE_OP = "kdagen.tree_convert.parents_from_token_tree"
MASK_OP = "kdagen.tree_convert.parents_from_mask"

__all__ = ["parents_from_mask", "parents_from_token_tree"]


def parents_from_token_tree(tree: Sequence[Sequence[int]]) -> Tensor:
    """``parents [len(tree) + 1]`` of vLLM's ``speculative_token_tree`` notation.

    Notation as read in vLLM's ``vllm/v1/attention/backends/tree_attn.py`` (the tree attention
    bias builder): each entry is one draft node, written as its path of child indices from the
    root, e.g. ``[(0,), (1,), (0, 0), (0, 1)]``; the root (the last accepted token) is not
    listed and sits at window position 0, entry i at position i + 1, and a node's parent is the
    entry equal to its path without the last index (the root for one-index paths). vLLM lists
    the entries by depth; here any order with every parent before its children is accepted.
    """
    position: dict[tuple[int, ...], int] = {(): 0}
    parents = [-1]
    for i, entry in enumerate(tree):
        node = _check_entry(i, entry)
        if node in position:
            raise KdaInputError(f"{TOKEN_TREE_OP}: `tree` entry {i} {node} is listed twice")
        parent = position.get(node[:-1])
        if parent is None:
            raise KdaInputError(
                f"{TOKEN_TREE_OP}: `tree` entry {i} {node} must come after its parent "
                f"{node[:-1]} (parents before children), which is not listed before it"
            )
        position[node] = i + 1
        parents.append(parent)
    _check_window(TOKEN_TREE_OP, "tree", len(parents), "entries + 1 (the root)")
    return torch.tensor(parents, dtype=torch.int32)


def _check_entry(i: int, entry: Sequence[int]) -> tuple[int, ...]:
    """One notation entry as a tuple of non-negative ints (a non-empty child-index path)."""
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence):
        raise KdaInputError(f"{TOKEN_TREE_OP}: `tree` entry {i} must be a tuple of child "
                            f"indices, got {entry!r}")  # fmt: skip
    node = tuple(entry)
    ok = bool(node) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                            for c in node)  # fmt: skip
    if not ok:
        raise KdaInputError(f"{TOKEN_TREE_OP}: `tree` entry {i} must be a non-empty path of "
                            f"non-negative child indices, got {entry!r}")  # fmt: skip
    return node


def _check_window(op: str, name: str, window: int, what: str) -> None:
    if not 1 <= window <= MAX_TREE_WINDOW:
        raise KdaInputError(
            f"{op}: `{name}` must give a window of 1..{MAX_TREE_WINDOW} tokens ({what}), got "
            f"{window}"
        )


def parents_from_mask(mask: Tensor) -> Tensor:
    """``parents [Q]`` of a request's tree attention mask ``[Q, Q]`` (bool, or nonzero = true):
    ``mask[i, j]`` says j is i or one of its ancestors.

    A node's parent is its deepest strict ancestor, the latest one since ancestors precede
    their descendants. The mask must be a tree's: the diagonal set, nothing after the diagonal,
    position 0 every node's ancestor, and each row its parent's row plus the node itself.
    """
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        shape = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise KdaInputError(f"{MASK_OP}: `mask` must have shape [Q, Q], got {shape}")
    window = mask.shape[0]
    _check_window(MASK_OP, "mask", window, "its side")
    seen = mask.bool().cpu()
    pos = torch.arange(window)
    eye = pos[:, None] == pos[None, :]
    _expect(bool(seen[eye].all()), "its diagonal set (each node attends to itself)", seen)
    _expect(not bool(seen[pos[:, None] < pos[None, :]].any()),
            "no entry after the diagonal (ancestors precede their descendants)", seen)  # fmt: skip
    _expect(bool(seen[:, 0].all()), "column 0 set (the root is every node's ancestor)", seen)
    strict = seen & ~eye
    latest = torch.where(strict, pos[None, :], -1).amax(dim=1)  # -1 for the root
    inherited = torch.where((latest >= 0)[:, None], seen[latest.clamp(min=0)], False) | eye
    bad = (inherited != seen).any(dim=1)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise KdaInputError(
            f"{MASK_OP}: `mask` must be a tree's (row i = its parent's row plus i); row {i} "
            f"(parent {int(latest[i])}) is {seen[i].int().tolist()}"
        )
    return latest.to(torch.int32)


def _expect(ok: bool, what: str, mask: Tensor) -> None:
    if not ok:
        raise KdaInputError(f"{MASK_OP}: `mask` must have {what}, got {mask.int().tolist()}")
