"""Training options as plain values (no torch), so the CLI builds its options from them and starts fast."""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_KINDS = ("dm", "hybrid")
NGRAM_WEIGHTS = ("const", "target-prob")
DIVERGENCES = ("reverse-kl", "forward-kl", "tvd")


@dataclass
class TrainConfig:
    """Hyper-parameters: OmniDraft Appendix A.2 (Table 10), except the learning rate, λ and the LoRA
    rank, which docs/online-distillation.md measured on short on-device streams: the paper's lr 1e-4
    barely moves in 100 prompts; a new domain the drafter spells in byte tokens (Japanese, Chinese)
    is mostly n-gram sub-tokens, which λ weighs; and rank 16 learns about what the paper's 32
    (Appendix B.5) learns there while every drafted token reads half the adapter."""

    interval: int = 8  # prompts per update, I (Algorithm 2); `omnidraft chat` counts turns and uses 1
    top_k: int = 64  # target log-probs kept per emitted position (records.py says why 64)
    loss: str = "hybrid"
    ngram_weight: str = "const"
    lam: float = 1.0  # eq. (4)'s λ on n-gram sub-tokens (the paper: 0.2)
    span_weight: float = 0.0  # NLL weight on drafter tokens straddling a target boundary (0: eq. (4) as written)
    lr: float = 1e-3  # the paper: 1e-4
    weight_decay: float = 0.01
    batch_size: int = 8
    target_temperature: float = 1.0  # distil towards p^(1/T): the target at its decoding temperature
    epochs: int = 1  # passes over the buffer Q per update (Alg. 2 line 8 makes one)
    rank: int = 16  # LoRA rank (the paper's Appendix B.5: 32)
    alpha: float = 16  # scaling α/r = 1
    divergence: str = "reverse-kl"  # at DM positions: eq. (4)'s KL(q' ‖ p), or forward-kl / tvd
    micro_tokens: int = 2048  # tokens per forward/backward between two yield points
    max_grad_norm: float = 1.0
    seed: int = 0
    distill: bool = True  # False: the drafter stays frozen and only the head learns (Table 2's "Adapt Only")
    # The acceptance head (§3.3), trained jointly after each distillation update (Algorithm 3).
    head: bool = True
    head_lr: float = 1e-3
    head_epochs: int = 4  # passes over Q's positions per update: the head is tiny, its passes cheap
    head_reject_weight: float = 1.0  # BCE weight of rejected tokens (1: calibrated, see accept_head)
    # Algorithm 4's larger head buffer R: the head also re-fits on the previous N prompts, relabelled
    # by the updated drafter (0: Algorithm 3, the buffer Q only). Folded into the update, so the
    # published head always matches the published drafter.
    head_replay: int = 0

    def validate(self) -> None:
        """Every field in range; NaN and inf are refused (they pass a plain `<= 0` check)."""
        for name, value in vars(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, not {value}")
        if self.interval < 1 or self.top_k < 1:
            raise ValueError("--interval and --top-k must be at least 1")
        if self.loss not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSS_KINDS)}")
        if self.ngram_weight not in NGRAM_WEIGHTS:
            raise ValueError(f"unknown n-gram weight {self.ngram_weight!r}; choose one of {', '.join(NGRAM_WEIGHTS)}")
        if self.lr <= 0 or self.batch_size < 1 or self.rank < 1 or self.alpha <= 0 or self.lam < 0 or self.epochs < 1 \
                or self.target_temperature <= 0 or self.span_weight < 0:
            raise ValueError("lr, alpha, target temperature must be > 0, batch size, epochs and rank >= 1, "
                             "λ and span weight >= 0")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"unknown divergence {self.divergence!r}; choose one of {', '.join(DIVERGENCES)}")
        if self.head_lr <= 0 or self.head_epochs < 1 or self.head_reject_weight <= 0 or self.head_replay < 0:
            raise ValueError("head lr and reject weight must be > 0, head epochs >= 1, head replay >= 0")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
