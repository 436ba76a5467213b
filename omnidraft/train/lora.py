"""LoRA on the drafter for training, with peft.

Training wraps an fp32 copy of the drafter with peft's LoRA on every linear projection of its
attention and MLP blocks ("all-linear": the LM head and embeddings stay frozen), at ``TrainConfig``'s
rank (16 by default; the paper's Appendix B.5 uses 32). Inference merges a published adapter instead
(``omnidraft.adapter.merge``).
"""

from __future__ import annotations

import torch
from peft import (
    LoraConfig,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)

from omnidraft.train.config import TrainConfig

DEFAULT_RANK = TrainConfig.rank
DEFAULT_ALPHA = TrainConfig.alpha


def lora_config(rank: int = DEFAULT_RANK, alpha: float = DEFAULT_ALPHA) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0, bias="none")


def attach(model: torch.nn.Module, config: LoraConfig, state: dict[str, torch.Tensor] | None = None):
    """``model`` wrapped by peft (its base weights frozen), optionally loaded with ``state``."""
    peft_model = get_peft_model(model, config)
    if state is not None:
        result = set_peft_model_state_dict(peft_model, state)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if getattr(result, "unexpected_keys", None) or missing:
            raise ValueError(f"adapter does not fit this drafter: {len(missing)} missing and "
                             f"{len(result.unexpected_keys or [])} unexpected LoRA tensors")
    return peft_model


def lora_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors in peft's saved naming, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(peft_model).items()}


def state_rank(state: dict[str, torch.Tensor]) -> int:
    """The rank of a saved adapter (its lora_A tensors are [rank, in])."""
    ranks = {int(v.shape[0]) for k, v in state.items() if "lora_A" in k}
    if len(ranks) != 1:
        raise ValueError(f"adapter has LoRA tensors of ranks {sorted(ranks)}; one rank expected")
    return ranks.pop()

