"""Muon on the hidden matrices, AdamW on the rest: one optimizer for the trainer's loop.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al.
2025, arXiv 2502.16982, "Muon is Scalable for LLM Training") orthogonalizes each 2-D weight's
Nesterov momentum with five quintic Newton–Schulz steps and applies it as the update. It is
meant for the hidden linears only; embeddings, ``lm_head`` and norms train with AdamW, as in both
papers. The update rule is ``torch.optim.Muon``'s (torch >= 2.9), with
``adjust_lr_fn="match_rms_adamw"``: the update of an ``A × B`` matrix is scaled by
``0.2·sqrt(max(A, B))`` so that its RMS matches a typical AdamW update's, which is what lets the
matrices share AdamW's learning rate and weight decay (torch's documentation and Liu et al.).

:class:`MuonAdamW` holds one ``torch.optim.Muon`` and one ``torch.optim.AdamW``; its
``param_groups`` are theirs (the same dicts), so an LR scheduler, gradient clipping and
``zero_grad`` act on both, and its ``state_dict`` holds both optimizers' states.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["MUON_MOMENTUM", "MuonAdamW"]

#: Muon's momentum (torch's default and both papers' value); Nesterov momentum is on
MUON_MOMENTUM = 0.95


class _JointState(Mapping):
    """The inner optimizers' states as one read-only mapping (parameter -> its state); unlike a
    ``ChainMap`` it never creates an entry in a ``defaultdict`` it looks into."""

    def __init__(self, states: list[Mapping]) -> None:
        self._states = states

    def __getitem__(self, p: Any) -> Any:
        for st in self._states:
            if p in st:
                return st[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator[Any]:
        for st in self._states:
            yield from st

    def __len__(self) -> int:
        return sum(len(st) for st in self._states)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked ``"algorithm": "muon"``, AdamW for the others.

    Args:
        params: param groups, each a dict with ``params`` and ``algorithm`` (``"muon"`` or
            ``"adamw"``) plus ``lr`` and ``weight_decay``; any other key (``name``,
            ``initial_lr``) is kept in the group.
        betas, eps: AdamW's (the ``"adamw"`` groups).
        momentum: Muon's momentum (Nesterov), default :data:`MUON_MOMENTUM`.

    A Muon group's parameters must be 2-D (``torch.optim.Muon`` raises ``ValueError``
    otherwise); the weight decay is decoupled in both, ``θ ← θ − lr·λ·θ`` (Muon's with the
    unadjusted lr).

    Raises:
        ValueError: a group without ``algorithm`` or with another value, or no groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        *,
        momentum: float = MUON_MOMENTUM,
    ) -> None:
        groups = [{**g, "params": list(g["params"])} for g in params]
        if not groups:
            raise ValueError("MuonAdamW needs at least one param group")
        bad = [g.get("algorithm") for g in groups if g.get("algorithm") not in ("muon", "adamw")]
        if bad:
            raise ValueError(f"param group algorithm {bad[0]!r}: use 'muon' or 'adamw'")
        muon = [g for g in groups if g["algorithm"] == "muon"]
        adamw = [g for g in groups if g["algorithm"] == "adamw"]
        self.muon = (
            torch.optim.Muon(muon, momentum=momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
            if muon
            else None
        )
        self.adamw = torch.optim.AdamW(adamw, betas=betas, eps=eps) if adamw else None
        # the inner optimizers' own group dicts: a scheduler's lr reaches the update
        super().__init__([g for o in self._inner.values() for g in o.param_groups], {})
        self._link()

    @property
    def _inner(self) -> dict[str, torch.optim.Optimizer]:
        return {k: o for k, o in (("muon", self.muon), ("adamw", self.adamw)) if o is not None}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every group (Muon's, then AdamW's); returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner.values():
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"muon": ..., "adamw": ...}``: each inner optimizer's ``state_dict``."""
        return {k: o.state_dict() for k, o in self._inner.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned.

        Raises:
            ValueError: the saved optimizers are not this one's (another method's checkpoint).
        """
        if set(state_dict) != set(self._inner):
            raise ValueError(
                f"optimizer state holds {sorted(state_dict)}, this Muon optimizer "
                f"{sorted(self._inner)}: the checkpoint is from another method or model"
            )
        for k, o in self._inner.items():
            o.load_state_dict(state_dict[k])
        # torch's load_state_dict gives each inner optimizer new group dicts and a new state:
        # point this optimizer's view at them again, or a scheduler would set stale lrs
        self._link()

    def _link(self) -> None:
        inner = list(self._inner.values())
        self.param_groups[:] = [g for o in inner for g in o.param_groups]
        self.state = _JointState([o.state for o in inner])  # type: ignore[assignment]
