"""kdagen's kernels as torch.library custom ops in the ``kdagen`` namespace.

``torch.compile`` (fullgraph) and CUDA-graph capture see each launch as one opaque op with
exact mutations, and fake implementations give its (empty) outputs without a GPU:

- ``kdagen::verify``: mutates ``out``, ``corr``, ``kg`` and ``conv_state`` (``parents``: a
  token tree, as ``kdagen.verify`` takes it);
- ``kdagen::commit``: mutates ``state`` (``path``: an accepted tree path);
- ``kdagen::commit_layers``: one ``ModelCommit``'s launch (by the handle ``register``
  returns), mutates its layers' ``states`` and ``conv_states``.

Importing this module registers them (once per process: an emitted package and kdagen
loaded side by side share the first registration).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .validate import KdaInputError

_MODELS: dict[int, Any] = {}  # handle -> ModelCommit


def _defined(name: str) -> bool:
    return hasattr(torch.ops.kdagen, name)


def register(model: Any) -> int:
    """A handle for ``model`` (a ``ModelCommit``) that ``kdagen::commit_layers`` takes; the
    model stays alive as long as the process (its tensors are its layers' pools)."""
    handle = id(model)
    _MODELS[handle] = model
    return handle


def commit_model(model: Any, slots: Tensor, accepted: Tensor, **step: Any) -> None:
    """``model.commit(slots, accepted, **step)`` through ``kdagen::commit_layers``."""
    torch.ops.kdagen.commit_layers(
        register(model), list(model.states), list(model.conv_states), slots, accepted,
        step.get("query_start"), step.get("request_index"), step.get("block_table"),
        step.get("num_computed"), int(step.get("block_size", 0)), step.get("path"),
    )  # fmt: skip


def _verify(
    qkv: Tensor,
    raw_g: Tensor,
    raw_beta: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    query_start: Tensor,
    slots: Tensor,
    out: Tensor,
    corr: Tensor,
    kg: Tensor,
    conv_state: Tensor | None,
    conv_w: Tensor | None,
    accepted: Tensor | None,
    lower_bound: float | None,
    null_slot: int,
    conv_dim_first: bool,
    parents: Tensor | None = None,
) -> None:
    from .runtime import verify

    verify(qkv, raw_g, raw_beta, a_log, dt_bias, state, query_start, slots, out, corr, kg,
           lower_bound=lower_bound, null_slot=int(null_slot), conv_state=conv_state,
           conv_w=conv_w, accepted=accepted, conv_dim_first=bool(conv_dim_first),
           parents=parents)  # fmt: skip


def _commit(
    state: Tensor,
    corr: Tensor,
    kg: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    slots: Tensor,
    accepted: Tensor,
    lower_bound: float | None,
    null_slot: int,
    path: Tensor | None = None,
) -> None:
    from .runtime import commit

    commit(state, corr, kg, a_log, dt_bias, slots, accepted, lower_bound=lower_bound,
           null_slot=int(null_slot), path=path)  # fmt: skip


def _commit_layers(
    model: int,
    states: list[Tensor],
    conv_states: list[Tensor],
    slots: Tensor,
    accepted: Tensor,
    query_start: Tensor | None,
    request_index: Tensor | None,
    block_table: Tensor | None,
    num_computed: Tensor | None,
    block_size: int,
    path: Tensor | None = None,
) -> None:
    found = _MODELS.get(int(model))
    if found is None:
        raise KdaInputError(
            f"kdagen::commit_layers: `model` must be a handle {__package__}.ops.register gave"
        )
    if _addresses(states) + _addresses(conv_states) != _addresses(found.states) + _addresses(
        found.conv_states
    ):  # copies (functionalization, opcheck): the same commit over them, tabled anew
        found = found.over(states, conv_states)
    found.commit(slots, accepted, query_start=query_start, request_index=request_index,
                 block_table=block_table, num_computed=num_computed,
                 block_size=int(block_size), path=path)  # fmt: skip


def _addresses(tensors: list[Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


def _nothing(*args: Any) -> None:
    """The fake implementation: every op only writes into tensors it was given."""


_OPS = {
    "verify": (_verify, ("out", "corr", "kg", "conv_state")),
    "commit": (_commit, ("state",)),
    "commit_layers": (_commit_layers, ("states", "conv_states")),
}
for _name, (_fn, _mutates) in _OPS.items():
    if not _defined(_name):
        _op = torch.library.custom_op(f"kdagen::{_name}", mutates_args=_mutates)(_fn)
        _op.register_fake(_nothing)
