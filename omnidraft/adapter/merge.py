"""Merging a LoRA adapter into the inference drafter's weights (what decoding needs of an adapter).

Inference never runs peft's extra matmuls: a published adapter is merged into the drafter's
weights, W = W0 + (α/r)·B·A, computed from a saved copy of W0, so drafting costs exactly what it
cost without an adapter, and switching adapters is a re-merge. Training (peft) is in
``omnidraft.train.lora``.
"""

from __future__ import annotations

import torch


def lora_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path (as in the plain model) -> (A, B) from peft's saved keys
    ``base_model.model.<path>.lora_A.weight`` / ``.lora_B.weight``."""
    pairs: dict[str, list] = {}
    for key, tensor in state.items():
        for which, slot in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if key.endswith(which):
                path = key[: -len(which)].removeprefix("base_model.model.")
                pairs.setdefault(path, [None, None])[slot] = tensor
    broken = [p for p, ab in pairs.items() if ab[0] is None or ab[1] is None]
    if broken or not pairs:
        raise ValueError(f"adapter tensors incomplete ({len(broken)} modules lack A or B)" if broken else "adapter has no LoRA tensors")
    return {p: (a, b) for p, (a, b) in pairs.items()}


class MergedLora:
    """Merges LoRA deltas into a plain model's Linear weights in place, from saved base weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._modules = dict(model.named_modules())
        self._base: dict[str, torch.Tensor] = {}
        self.active = False

    def check(self, state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The (A, B) pairs if every one fits a Linear of this model, else ValueError."""
        pairs = lora_pairs(state)
        for path, (a, b) in pairs.items():
            module = self._modules.get(path)
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise ValueError(f"adapter module {path!r} is not a linear layer of this drafter")
            if tuple(weight.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter module {path!r} has shape {tuple(b.shape[:1]) + tuple(a.shape[1:])}, "
                                 f"the drafter's is {tuple(weight.shape)}")
        return pairs

    @torch.no_grad()
    def apply(self, state: dict[str, torch.Tensor], scaling: float) -> None:
        """W = W0 + scaling·B·A for every adapted module (W0 from the first apply)."""
        pairs = self.check(state)
        self.clear()
        for path, (a, b) in pairs.items():
            weight = self._modules[path].weight
            base = self._base.setdefault(path, weight.detach().clone())
            weight.copy_((base.float() + scaling * (b.float() @ a.float())).to(weight.dtype))
        self.active = True

    @torch.no_grad()
    def clear(self) -> None:
        """Back to the base weights."""
        for path, base in self._base.items():
            self._modules[path].weight.copy_(base)
        self.active = False
