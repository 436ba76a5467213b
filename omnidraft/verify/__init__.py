"""Verifiers: decide how many proposed target tokens to keep and which token comes next.

All work on the same arrays: target logits at m+1 positions, the m proposed target ids, and for the
sampling verifiers the draft distribution q' in target space at each position.
"""

from omnidraft.verify.core import (
    VERIFIERS,
    greedy_verify,
    probs_from_logits,
    sample_verify,
)

__all__ = ["VERIFIERS", "greedy_verify", "probs_from_logits", "sample_verify"]
