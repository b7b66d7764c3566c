"""Which keys a load fills, skips and refuses: the model's and the optimizer's against the checkpoint's.

A load computes each difference once, while every rank plans it (the engine ends that phase
on every rank together, so a refusal is raised everywhere). With ``strict=True`` any difference
is a :class:`~checkpointer.CheckpointMismatchError` that names the difference only (at most
:data:`SHOWN` keys of each side); with ``strict=False`` the keys both have load and the rest are
reported in :class:`~checkpointer.LoadResult`. Tied parameters (keys sharing memory in the
model) and aliases (keys saved once under another name) count once: a key is not missing when a
key tied to it loads, and not unexpected when a key of its alias group loads. A tied group is read
once, under the model's first name the checkpoint has; a checkpoint holding several of its names as
separate tensors gets a warning naming them.

An optimizer of another kind than the one saved is refused in both modes: by the class name a
save records (:data:`OPTIM_CLASS_KEY`), or, for checkpoints without it (OLMo-core's, older
ones), by the state keys (:func:`check_optim_kind`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..sharding import describe_state_dict
from ..errors import CheckpointMismatchError
from ..format.metadata import StorageMetadata
from ..sharding import local_data

__all__ = [
    "OPTIM_CLASS_KEY",
    "OPTIM_PREFIX",
    "SHOWN",
    "listing",
    "difference_message",
    "model_keys_to_load",
    "keys_to_load",
    "optim_class_name",
    "check_optim_kind",
]

OPTIM_CLASS_KEY = "optim_class"
"""The optimizer checkpoint's record of the optimizer's class name (builtins pickle of a ``str``;
OLMo-core 0.1.0 reads only the keys it knows, so it ignores this one)."""

OPTIM_PREFIX = "optim:"
"""How :class:`~checkpointer.LoadResult` names an optimizer's parameter: ``optim:head.weight``."""

SHOWN = 10
"""The most keys of one side of a difference an error message lists."""


def listing(keys: Sequence[str]) -> str:
    """``['a', 'b']``, or the first :data:`SHOWN` keys and ``... and N more``."""
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    more = f", ... and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"[{shown}{more}]"


def difference_message(what: str, where: str, missing: Sequence[str], unexpected: Sequence[str], *, noun: str) -> str:
    """A strict load's refusal: the keys of each side of the difference, never both full lists."""
    parts = []
    if missing:
        plural = "s" if len(missing) != 1 else ""
        parts.append(f"{len(missing)} {noun}{plural} the checkpoint lacks: {listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint {noun}{'s' if len(unexpected) != 1 else ''} the {what} lacks: "
                     f"{listing(unexpected)}")
    return (f"the {what} does not match the checkpoint at {where}: " + "; ".join(parts)
            + ". Pass strict=False to load what both have and leave the rest untouched.")


def model_keys_to_load(
    model_state: Mapping[str, Any], metadata: StorageMetadata
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The model keys to fill, the model keys the checkpoint lacks (in the model's order), and
    the checkpoint keys the model lacks (sorted). Tied keys and aliases count once."""
    return keys_to_load(model_state, metadata.tensors, metadata.aliases or {})


def keys_to_load(
    model_state: Mapping[str, Any], saved: Iterable[str], aliases: Mapping[str, str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """:func:`model_keys_to_load` for any checkpoint: ``saved`` its keys (by model name) and
    ``aliases`` its names saved once under another (``{alias: saved_key}``)."""
    in_checkpoint = set(saved) | set(aliases)
    _, tied = describe_state_dict(model_state, action="load")  # key -> the first key sharing its memory
    groups: dict[str, list[str]] = {}
    for key in model_state:
        groups.setdefault(tied.get(key, key), []).append(key)
    present = {root: [k for k in keys if k in in_checkpoint] for root, keys in groups.items()}
    loaded_groups = {root for root, keys in present.items() if keys}
    # One key of a tied group is read, the model's first that the checkpoint has: the others fill the same memory.
    read = {keys[0] for keys in present.values() if keys}
    to_load = {k: v for k, v in model_state.items() if k in read}
    for keys in present.values():
        if len({aliases.get(k, k) for k in keys}) > 1:
            warnings.warn(
                f"the checkpoint holds {', '.join(map(repr, keys))} as separate tensors, which this model ties: "
                f"{keys[0]!r} is loaded and the others are not read (their values are not in the model)",
                stacklevel=4,
            )
    missing = [k for k in model_state if tied.get(k, k) not in loaded_groups]
    loaded_saved = {aliases.get(k, k) for k in model_state if k in in_checkpoint}
    unexpected = sorted(k for k in in_checkpoint if k not in model_state and aliases.get(k, k) not in loaded_saved)
    return to_load, missing, unexpected


def optim_class_name(optim: torch.optim.Optimizer) -> str:
    """What a save records of the optimizer's kind: its class name (``"AdamW"``)."""
    return type(optim).__name__


def check_optim_kind(
    optim: torch.optim.Optimizer,
    saved_class: str | None,
    saved_state_keys: Iterable[str],
    saved_groups: Sequence[Mapping[str, Any]],
    where: str,
    held: Sequence[Sequence[Any]],
) -> None:
    """Refuse an optimizer of another kind than the checkpoint's.

    With the class name recorded, the names must be equal (a subclass is another kind: AdamW
    subclasses Adam in torch, yet their weight decay differs). Without it, the saved state keys
    must be the keys this optimizer would hold with the checkpoint's hyperparameters: those of a
    probe, a new optimizer of the same class over one small parameter per dimensionality of the
    parameters each saved group held (``held``: the given optimizer's parameters, one list per
    saved group, however they are grouped now), built with the checkpoint's param groups and
    stepped once (never the given optimizer). Where no probe can be made (the class needs other
    arguments, or a step without a closure fails), the given optimizer's own state keys are the
    measure when it has state; a checkpoint with no state, or neither measure, is not judged. Adam and AdamW hold
    the same keys, so only the record tells them apart.
    """
    given = optim_class_name(optim)
    if saved_class is not None:
        if saved_class != given:
            raise CheckpointMismatchError(
                f"the checkpoint at {where} holds the state of a {saved_class} optimizer, not of the given "
                f"optimizer's kind, {given}: build a {saved_class}, or load the model alone (optim=None)"
            )
        return
    saved = set(saved_state_keys)
    if not saved:
        return
    would = _probe_state_keys(optim, saved_groups, held)
    if would is None:
        would = {k for st in optim.state.values() for k in st}
        if not would:
            return
    if saved != would:
        raise CheckpointMismatchError(
            f"the checkpoint at {where} holds optimizer state {sorted(saved)}; the given {given} optimizer "
            f"holds {sorted(would)}: the checkpoint is of another kind of optimizer (it records no class name)"
        )


def _probe_state_keys(
    optim: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]], held: Sequence[Sequence[Any]]
) -> set[str] | None:
    probe_groups = []
    for group_params, saved in zip(held, saved_groups, strict=True):
        kinds = {(local_data(p).dim(), local_data(p).dtype, local_data(p).device) for p in group_params}
        if not kinds:
            continue
        dummies = [torch.nn.Parameter(torch.zeros((2,) * ndim, dtype=dtype, device=device))
                   for ndim, dtype, device in sorted(kinds, key=str)]
        for d in dummies:
            d.grad = torch.full_like(d, 0.5)
        hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names", "_param_names")}
        probe_groups.append({**hyper, "params": dummies})
    if not probe_groups:
        return None
    cls = type(optim)
    try:
        accepted = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        # ``defaults`` may hold what the constructor does not take (AdamW's ``decoupled_weight_decay``).
        kwargs = {k: v for k, v in optim.defaults.items() if takes_any or k in accepted}
        probe = cls(probe_groups, **kwargs)
        probe.step()
    except Exception:  # noqa: BLE001 - any failure of foreign code means: no probe, judge otherwise
        return None
    return {k for st in probe.state.values() for k in st}
