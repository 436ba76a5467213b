"""Decoding options as plain values (nanoGPT style), importable without torch so the CLI starts fast.

Each field's default here is the one default of its command-line option (``omnidraft/cli/options.py``
builds the options from these fields), so ``generate``, ``chat``, ``bench`` and ``adapt`` agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnidraft.errors import OmnidraftError
from omnidraft.verify import DEFAULT_SAMPLING_RULE, RULES, VERIFIERS, rule_info

TRANSLATIONS = ("auto", "text", "tokens")
DRAFT_STOPS = ("auto", "head", "confidence", "fixed")
ENGINES = ("auto", "torch", "llamacpp")  # auto: llama.cpp for GGUF targets when installed, else torch
DEVICES = ("auto", "cpu", "cuda")  # where a torch target runs; auto: the GPU when torch sees one
# (a grpc:// or grpcs:// target runs on a server: its engine is the server's)
DRAFTER_DTYPES = ("float32", "bfloat16", "int8")
DEFAULT_DRAFTER_DTYPE = "bfloat16"  # fastest eager drafter on CPU that `omnidraft bench` found (docs/performance.md)
INT8_NO_ADAPTER = "an int8 drafter cannot take a LoRA adapter (LoRA needs float weights); use --drafter-dtype bfloat16"


MAX_BRANCH_ROWS = 16  # a verify's rows beyond the chain's: past this the forward is no longer a few rows


@dataclass
class DecodeConfig:
    max_new_tokens: int = 256
    # None: greedy at temperature 0, else the fastest exact sampling rule (see ``default_rule``).
    verify: str | None = None
    draft_len: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    use_ngram: bool = True
    # Prompt lookup beside the drafter: copy the continuation of the longest earlier match of the
    # last tokens when the draft policy expects it to pay (greedy and text-sample rules).
    lookup: bool = True
    # Stop drafting once the drafter's probability for its own token falls below this (0: never).
    # A cheap stand-in for the learned acceptance head: a doubtful token is rarely accepted, and
    # every token drafted after it is wasted drafter time.
    draft_confidence: float = 0.6
    # When to stop drafting: "auto" = the cost-aware policy (drafts only while a token is expected
    # to raise tokens/s, from measured costs and acceptance; the head's estimates when the adapter
    # has one); "head" = the adapter's acceptance head with threshold stop_gamma (OmniDraft §3.3,
    # eq. (7)); "confidence" = the fixed threshold above; "fixed" = always draft_len tokens.
    draft_stop: str = "auto"
    stop_gamma: float = 0.5
    # Whether the adapter's acceptance head (when it has one) gives the stop rule its estimates;
    # False: the calibrated max q, as for a drafter without an adapter (the bench's greedy-nohead).
    use_head: bool = True
    # Token healing (text translation): a context that ends in a whitespace drafter token is drafted
    # from before it, the first token constrained to begin with its bytes (``vocab/healing.py``).
    # False: the bench's greedy-noheal, what healing gains or costs.
    heal: bool = True
    # How drafted tokens become target tokens: "tokens" is the paper's direct mapping + n-gram
    # cache (eq. (1), needed by the sampling rules); "text" re-tokenizes the drafted text with the
    # target tokenizer (SLEM-style, greedy only); "auto" picks the rule's first choice.
    translate: str = "auto"
    # SLRS (--verify slrs): drafter tokens per drafted string before its first target token is
    # taken (Algorithm 3's lookahead). 1 is one scatter per token; more walks a tree of drafter
    # spellings per verified token and is refused where that tree blows up.
    slrs_lookahead: int = 1
    # Branch rows per verify: the drafter's runner-up tokens, verified beside its chain in the same
    # forward (a token tree). -1: as many as the cost policy expects to pay (greedy, text
    # translation, a target that reads trees); 0: chains only; n: at most n.
    branch_rows: int = -1

    def __post_init__(self) -> None:
        if self.verify is None:
            self.verify = default_rule(self.temperature)

    def validate(self) -> None:
        """Every field in range; NaN and inf are refused (they pass a plain `< 0` check)."""
        info = rule_info(self.verify)
        if self.translate not in TRANSLATIONS:
            raise OmnidraftError(f"unknown translation {self.translate!r}; choose one of {', '.join(TRANSLATIONS)}")
        if self.translate != "auto" and self.translate not in info.translations:
            own = [t for t in info.translations if t in TRANSLATIONS]
            need = f"it needs {' or '.join(own)}" if own else "it translates its own way: leave --translate auto"
            raise OmnidraftError(f"--translate {self.translate} does not work with --verify {self.verify} ({need})")
        if self.max_new_tokens < 1:
            raise OmnidraftError("--max-new-tokens must be at least 1")
        if self.draft_len < 1:
            raise OmnidraftError("--draft-len must be at least 1")
        if not 1 <= self.slrs_lookahead <= 8:
            raise OmnidraftError("--slrs-lookahead must be in 1..8")
        if not -1 <= self.branch_rows <= MAX_BRANCH_ROWS:
            raise OmnidraftError(f"--branch-rows must be in -1..{MAX_BRANCH_ROWS} (-1: the cost policy decides)")
        for name, value in (("--temperature", self.temperature), ("--top-p", self.top_p),
                            ("--draft-confidence", self.draft_confidence), ("--stop-gamma", self.stop_gamma)):
            if not math.isfinite(value):
                raise OmnidraftError(f"{name} must be a finite number, not {value}")
        if not 0 <= self.draft_confidence < 1:
            raise OmnidraftError("--draft-confidence must be in [0, 1)")
        if self.draft_stop not in DRAFT_STOPS:
            raise OmnidraftError(f"unknown draft stop {self.draft_stop!r}; choose one of {', '.join(DRAFT_STOPS)}")
        if not 0 < self.stop_gamma < 1:
            raise OmnidraftError("--stop-gamma must be in (0, 1)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise OmnidraftError("--temperature must be >= 0 and --top-p in (0, 1]")
        if info.sampling and self.temperature == 0:
            raise OmnidraftError(f"--verify {self.verify} samples: give a --temperature above 0, or use --verify greedy")
        if not info.sampling and self.temperature > 0:
            raise OmnidraftError(f"--verify {self.verify} is deterministic: use --temperature 0, or a sampling rule "
                                 f"({', '.join(n for n, r in RULES.items() if r.sampling)})")


def default_rule(temperature: float) -> str:
    """Greedy at temperature 0; above it the fastest *exact* sampling rule by measurement (never an
    approximate one): ``DEFAULT_SAMPLING_RULE``."""
    if temperature <= 0:
        return "greedy"
    return DEFAULT_SAMPLING_RULE


__all__ = ["DEFAULT_DRAFTER_DTYPE", "DEVICES", "DRAFTER_DTYPES", "DRAFT_STOPS", "ENGINES", "INT8_NO_ADAPTER", "TRANSLATIONS", "VERIFIERS",
           "DecodeConfig", "default_rule"]
