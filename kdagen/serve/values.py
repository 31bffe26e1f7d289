"""Opt-in checks of the values in the index tensors, which the launch checks cannot read without
synchronising: ``query_start``, ``slots``, ``accepted``, ``parents``, and a commit's
``request_index`` and ``path``. A bad value there is not caught at launch and gives wrong
results silently. With ``KDAGEN_CHECK_VALUES=1`` in the environment, or after
``check_values(True)``, every launch reads them back to the host (a synchronisation: for
bringing up an integration, not for serving) and raises ``KdaInputError`` naming the tensor, the
request and the value. Launches captured in a CUDA graph skip the check: they cannot
synchronise."""

from __future__ import annotations

import os

import torch

from .validate import KdaInputError

_on = os.environ.get("KDAGEN_CHECK_VALUES", "").lower() in ("1", "true", "yes", "on")


def check_values(on: bool) -> None:
    """Turn the value checks on or off for this process (``KDAGEN_CHECK_VALUES`` sets the
    start)."""
    global _on
    _on = bool(on)


def wanted(device: torch.device) -> bool:
    """Whether a launch on ``device`` checks its values now: on, and not under capture."""
    if not _on:
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def _fail(op: str, name: str, text: str) -> None:
    raise KdaInputError(f"{op}: `{name}` {text}")


def _live(slots: list[int], null_slot: int, slot_count: int) -> list[bool]:
    """Whether each slot is one of the pool's (not the null slot, not past the pool)."""
    return [max(null_slot, -1) < s < slot_count for s in slots]


def _distinct(op: str, slots: list[int], written: list[bool], what: str) -> None:
    """No two requests that write through their slot share it."""
    first: dict[int, int] = {}
    for b, (slot, writes) in enumerate(zip(slots, written, strict=True)):
        if not writes:
            continue
        if slot in first:
            _fail(op, "slots", f"gives requests {first[slot]} and {b} the same slot {slot}, "
                               f"and {what}")  # fmt: skip
        first[slot] = b


def windows(
    op: str, query_start: torch.Tensor, window: int, tokens: int | None = None
) -> list[tuple[int, int]]:
    """Each request's (first row, token count) from ``query_start``, which must start at 0 or
    later, step by 0..``window`` tokens and end within the ``tokens`` rows (when given)."""
    starts = query_start.tolist()
    if starts and starts[0] < 0:
        _fail(op, "query_start", f"starts at row {starts[0]}; expected 0 or more")
    rows = []
    for b in range(len(starts) - 1):
        count = starts[b + 1] - starts[b]
        if not 0 <= count <= window:
            _fail(op, "query_start", f"gives request {b} {count} tokens (rows {starts[b]} to "
                                     f"{starts[b + 1]}); expected 0 to {window}")  # fmt: skip
        rows.append((starts[b], count))
    if starts and tokens is not None and starts[-1] > tokens:
        _fail(op, "query_start", f"ends at row {starts[-1]}, past the {tokens} rows of the "
                                 "activations")  # fmt: skip
    return rows


def check_verify_values(
    op: str,
    *,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    null_slot: int,
    slot_count: int,
    tokens: int,
    window: int,
    accepted: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
) -> None:
    """A verify's values: windows inside the rows and at most ``window`` long, live requests
    on distinct slots (verify writes their conv rows and, by slot, their records), accepted
    counts of 1..``window`` where the conv history is read, and each tree node's parent an
    earlier node of its window (-1 at the first)."""
    rows = windows(op, query_start, window, tokens)
    slot_list = slots.tolist()
    live = [ok and n > 0 for ok, (_, n) in zip(_live(slot_list, null_slot, slot_count), rows,
                                                  strict=True)]  # fmt: skip
    _distinct(op, slot_list, live, "both are live (verify writes through it)")
    if accepted is not None:
        for b, count in enumerate(accepted.tolist()):
            if live[b] and not 1 <= count <= window:
                _fail(op, "accepted", f"gives live request {b} {count} accepted tokens; "
                                      f"expected 1 to {window}")  # fmt: skip
    if parents is not None:
        links = parents.tolist()
        for b, (bos, count) in enumerate(rows):
            for t in range(count):
                parent = links[bos + t]
                if (t == 0 and parent != -1) or (t > 0 and not 0 <= parent < t):
                    expected = "-1 (the window's first token)" if t == 0 else f"0 to {t - 1}"
                    _fail(op, "parents", f"gives request {b}'s token {t} (row {bos + t}) the "
                                         f"parent {parent}; expected {expected}")  # fmt: skip


def check_commit_values(
    op: str,
    *,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    null_slot: int,
    slot_count: int,
    window: int,
    query_start: torch.Tensor | None = None,
    request_index: torch.Tensor | None = None,
    path: torch.Tensor | None = None,
) -> None:
    """A commit's values: ``request_index`` entries inside ``accepted``, requests that fold
    tokens on distinct slots, and each ``path`` a root path (0, then increasing positions).
    Accepted counts are clamped to 0..``window`` (and to the window's tokens with
    ``query_start``) by contract, so any count passes; the clamped one decides what folds."""
    counts = accepted.tolist()
    owners = list(range(len(slots)))
    if request_index is not None:
        owners = request_index.tolist()
        for b, owner in enumerate(owners):
            if not 0 <= owner < len(counts):
                _fail(op, "request_index", f"gives request {b} the entry {owner}; expected 0 "
                                           f"to {len(counts) - 1} (rows of `accepted`)")  # fmt: skip
    lengths = [window] * len(owners)
    if query_start is not None:
        lengths = [n for _, n in windows(op, query_start, window)]
    folded = [min(max(counts[owner], 0), n) for owner, n in zip(owners, lengths, strict=True)]
    slot_list = slots.tolist()
    writes = [ok and n > 0 for ok, n in zip(_live(slot_list, null_slot, slot_count), folded,
                                            strict=True)]  # fmt: skip
    _distinct(op, slot_list, writes, "both fold tokens into it")
    if path is not None:
        for b, (nodes, count) in enumerate(zip(path.tolist(), folded, strict=True)):
            taken = nodes[:count] if writes[b] else []
            increasing = taken == sorted(set(taken))
            if taken and (taken[0] != 0 or taken[-1] >= window or not increasing):
                _fail(op, "path", f"gives request {b} the nodes {taken}; expected a root path: "
                                  f"0 first, then increasing positions below {window}")  # fmt: skip
