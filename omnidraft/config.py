"""Decoding options as plain values (nanoGPT style), importable without torch so the CLI starts fast."""

from __future__ import annotations

from dataclasses import dataclass

from omnidraft.errors import OmnidraftError

VERIFIERS = ("greedy", "omnidraft", "tli")
TRANSLATIONS = ("auto", "text", "tokens")
DRAFT_STOPS = ("auto", "head", "confidence", "fixed")
DEFAULT_DRAFTER_DTYPE = "bfloat16"  # fastest drafter on CPU that `omnidraft bench` found (README, performance)


@dataclass
class DecodeConfig:
    max_new_tokens: int = 64
    verify: str = "greedy"
    draft_len: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    use_ngram: bool = True
    # Stop drafting once the drafter's probability for its own token falls below this (0: never).
    # A cheap stand-in for the learned acceptance head: a doubtful token is rarely accepted, and
    # every token drafted after it is wasted drafter time.
    draft_confidence: float = 0.6
    # When to stop drafting: "head" = the adapter's learned acceptance head with threshold
    # stop_gamma (OmniDraft §3.3, eq. (7)); "confidence" = the fixed threshold above; "fixed" =
    # always draft_len tokens; "auto" = the head when the adapter in use has one, else confidence.
    draft_stop: str = "auto"
    stop_gamma: float = 0.5
    # How drafted tokens become target tokens: "tokens" is the paper's direct mapping + n-gram
    # cache (eq. (1), needed by the sampling verifiers); "text" re-tokenizes the drafted text
    # with the target tokenizer (SLEM-style, greedy only); "auto" picks text for greedy.
    translate: str = "auto"

    @property
    def text_translation(self) -> bool:
        return self.translate == "text" or (self.translate == "auto" and self.verify == "greedy")

    def validate(self) -> None:
        if self.verify not in VERIFIERS:
            raise OmnidraftError(f"unknown verifier {self.verify!r}; choose one of {', '.join(VERIFIERS)}")
        if self.translate not in TRANSLATIONS:
            raise OmnidraftError(f"unknown translation {self.translate!r}; choose one of {', '.join(TRANSLATIONS)}")
        if self.translate == "text" and self.verify != "greedy":
            raise OmnidraftError("text translation has no per-token draft probabilities: use it with --verify greedy")
        if self.max_new_tokens < 1:
            raise OmnidraftError("--max-new-tokens must be at least 1")
        if self.draft_len < 1:
            raise OmnidraftError("--draft-len must be at least 1")
        if not 0 <= self.draft_confidence < 1:
            raise OmnidraftError("--draft-confidence must be in [0, 1)")
        if self.draft_stop not in DRAFT_STOPS:
            raise OmnidraftError(f"unknown draft stop {self.draft_stop!r}; choose one of {', '.join(DRAFT_STOPS)}")
        if not 0 < self.stop_gamma < 1:
            raise OmnidraftError("--stop-gamma must be in (0, 1)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise OmnidraftError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.verify == "greedy" and self.temperature > 0:
            raise OmnidraftError("greedy verification is deterministic: use --temperature 0, or --verify omnidraft|tli to sample")
