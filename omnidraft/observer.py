"""What rides along decoding (recording for the trainer, publishing adapter weights, telling the
trainer to yield) hooks into the loop through :class:`DecodeObserver`. A leaf module, so the
packages that provide observers (``adapter``, ``train``) need not import the decoder."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnidraft.target.base import RowRequest


class DecodeObserver:
    """Hooks into the loop for what rides along decoding (recording for the trainer, publishing
    adapter weights, telling the trainer to yield). Every method is a no-op unless overridden."""

    row_request: RowRequest | None = None  # per-position target log-probs this observer wants (the trainer's records)

    def on_start(self, prompt_ids: Sequence[int]) -> None:
        """A request starts."""

    def before_step(self) -> None:
        """Between two steps: the only moment drafter weights may change."""

    def on_step(self, logits: torch.Tensor, emitted: Sequence[int]) -> None:
        """``logits[i]`` is the target's row that predicted ``emitted[i]``."""

    def on_finish(self) -> None:
        """The request ended (finished, cut at max_new_tokens, or interrupted)."""
