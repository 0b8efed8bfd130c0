"""The autograd references FPO is compared with: SFT-partial and full fine-tuning.

Paper: Patil, Dennis et al., arXiv 2608.14563 (FPO) compare with *SFT-partial* (autograd
restricted to the same target layers) and full fine-tuning. :class:`AutogradAdapter` is an
:class:`poetxq.adapt.fpo.FPOAdapter` whose gradients come from autograd of the same mean
cross-entropy instead of the forward-only signal, so the optimizer, fp32 masters, relative clip,
loop, evaluation and saving are the very same code: only the gradient differs.

* ``sft-partial``: the target MLP matrices only (the gradient still flows back through every
  block above them — that is the cost FPO avoids);
* ``full``: every parameter of the model (the targets keep their FPO keys; the rest are keyed
  ``(-1, parameter name)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from poetxq.adapt.fpo import FPOAdapter, StepStats
from poetxq.adapt.signal import IGNORE_INDEX


class AutogradAdapter(FPOAdapter):
    """SFT-partial (``mode="partial"``) or full fine-tuning (``mode="full"``) with FPO's update.

    Args:
        model, layers: as :class:`FPOAdapter` (``layers``: the targets of SFT-partial; for
            ``full`` they are adapted too, with every other parameter).
        mode: ``"partial"`` or ``"full"``.
        **kwargs: :class:`FPOAdapter`'s optimizer and clip settings.

    Raises:
        poetxq.adapt.fpo.FPOError: what :class:`FPOAdapter` raises.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[int],
        *,
        mode: Literal["partial", "full"] = "partial",
        **kwargs: Any,
    ) -> None:
        super().__init__(model, layers, **kwargs)
        self.mode = mode
        if mode == "full":
            taken = {id(p) for p in self.params.values()}
            for name, p in model.named_parameters():
                if id(p) not in taken:
                    self.params[-1, name] = p
                    self.masters[-1, name] = p.data if p.dtype == torch.float32 else p.data.float()
                    self.state[-1, name] = {}

    def pseudo_grads(
        self, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[dict[tuple[int, str], torch.Tensor], StepStats]:
        """The autograd gradient of the mean cross-entropy for every adapted tensor.

        Returns:
            ``({key: ∇W}, stats)``, ``∇W`` shaped like the weight, in its dtype.
        """
        keys = list(self.params)
        params = [self.params[k] for k in keys]
        with torch.enable_grad():
            for p in params:
                p.requires_grad_(True)
            try:
                logits = self.model(input_ids=input_ids, use_cache=False).logits
                wide = torch.promote_types(logits.dtype, torch.float32)
                loss = F.cross_entropy(logits.to(wide).flatten(0, 1), labels.flatten(),
                                       ignore_index=IGNORE_INDEX)  # fmt: skip
                grads = torch.autograd.grad(loss, params)
            finally:
                for p in params:
                    p.requires_grad_(False)
        n = int((labels != IGNORE_INDEX).sum())
        return dict(zip(keys, grads, strict=True)), StepStats(float(loss.detach()), n, 0)

    def target_numel(self) -> int:
        """Number of adapted weights."""
        return sum(p.numel() for p in self.params.values())

    def trained(self) -> str:
        """What this adapter trains, for the start line: the target layers' MLPs (``partial``)
        or every parameter of the model (``full``; all but the linears frozen in low bits)."""
        if self.mode == "partial":
            return super().trained()
        from poetxq.adapt.lowbit import FrozenLinear

        frozen = sum(isinstance(m, FrozenLinear) for m in self.model.modules())
        but = f" but the {frozen} linears frozen in low bits" if frozen else ""
        return (
            f"every parameter{but} (all {len(self.parts.layers)} layers, the embeddings and "
            "the LM head)"
        )
