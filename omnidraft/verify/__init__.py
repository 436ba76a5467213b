"""Verification rules, looked up by name (Algorithm 1, lines 10-16).

Every rule works on the same arrays: the target's logits at the m+1 positions of one verify pass,
the m proposed target ids, and for the sampling rules the draft distribution q' in target space
(from the translator). This registry is what the CLI, the config checks and ``--help`` read, so it
imports no torch; a rule's code is loaded when it is first used. A new rule is one class and one
entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnidraft.verify.proposal import Rule


@dataclass(frozen=True)
class RuleInfo:
    name: str
    impl: str  # "module:Class"
    sampling: bool  # needs temperature > 0 (greedy needs 0)
    exact: bool  # the output distribution is exactly the target's (else labelled approximate)
    translations: tuple[str, ...]  # allowed translations; the first is what "auto" picks
    uses_ngrams: bool  # proposals may come through the n-gram cache
    keeps_q: bool  # the drafter must keep its per-token distribution q
    summary: str
    # It verifies a deterministic draft from its target ids alone (no q, no drafter tokens), so it
    # also verifies lookup drafts and runs on a remote target, which receives only ids.
    ids_only: bool = False

    @property
    def label(self) -> str:
        return self.summary + ("" if self.exact else " (approximately lossless)")


RULES: dict[str, RuleInfo] = {
    r.name: r
    for r in (
        RuleInfo("greedy", "omnidraft.verify.greedy:Greedy", sampling=False, exact=True, translations=("text", "tokens"),
                 uses_ngrams=True, keeps_q=False, summary="accept while the target's argmax agrees: its own greedy output",
                 ids_only=True),
        RuleInfo("omnidraft", "omnidraft.verify.rejection:RejectionSampling", sampling=True, exact=False,
                 translations=("tokens",), uses_ngrams=True, keeps_q=True,
                 summary="rejection sampling with q' of eq. (2), n-gram merges included"),
        RuleInfo("tli", "omnidraft.verify.rejection:RejectionSampling", sampling=True, exact=True, translations=("tokens",),
                 uses_ngrams=False, keeps_q=True, summary="token-level intersection: rejection sampling over shared tokens"),
        RuleInfo("rdk", "omnidraft.verify.rejection:RejectionSampling", sampling=True, exact=True, translations=("rdk",),
                 uses_ngrams=False, keeps_q=True,
                 summary="redistributing drafter kernels: the drafter's mass also reaches target tokens it cannot "
                         "say (byte-prefix affinity), rejection sampling with that proposal"),
        RuleInfo("slrs", "omnidraft.verify.rejection:StringRejectionSampling", sampling=True, exact=True,
                 translations=("strings",), uses_ngrams=False, keeps_q=True,
                 summary="string-level rejection sampling: a drafted string's first target token against ψ, its "
                         "probability summed over the drafter's spellings"),
        RuleInfo("text-sample", "omnidraft.verify.rejection:DeterministicDraftSampling", sampling=True, exact=True,
                 translations=("text", "tokens"), uses_ngrams=True, keeps_q=False,
                 summary="exact sampling of the drafter's greedy text draft (q = δ): any target token, ids only",
                 ids_only=True),
    )
}
VERIFIERS = tuple(RULES)
IDS_ONLY_RULES = tuple(name for name, r in RULES.items() if r.ids_only)  # lookup drafts, remote targets
# The rule at temperature > 0 unless one is named: the exact rule that measured fastest (docs/sampling.md
# has the comparison). It needs only token ids from the drafter, so it also runs against a remote
# target, and it takes lookup drafts.
DEFAULT_SAMPLING_RULE = "text-sample"
# The smallest temperature sampled with. Below it logits / T overflows (at subnormal T, to inf and
# NaN) while the distribution is already the argmax's to float precision: the CLI and the server
# refuse such a temperature in one line, and ``sampling.probs_from_logits`` treats it as greedy.
MIN_TEMPERATURE = 1e-4
# The same bound as a 32-bit float, what a gRPC request carries (1e-4 arrives as 9.9999997e-05): the
# server and the sampling compare with it, so a temperature the CLI accepts is sampled everywhere.
MIN_TEMPERATURE_F32 = 9.999999747378752e-05
_loaded: dict[str, Rule] = {}


def rule_info(name: str) -> RuleInfo:
    from omnidraft.errors import OmnidraftError

    if name not in RULES:
        raise OmnidraftError(f"unknown verification rule {name!r}; choose one of {', '.join(RULES)}")
    return RULES[name]


def get_rule(name: str) -> Rule:
    """The rule object (``verify(logits, proposal, config, generator) -> (accepted, next)``)."""
    info = rule_info(name)
    if name not in _loaded:
        module, _, cls = info.impl.partition(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def help_text() -> str:
    return "; ".join(f"{r.name}: {r.label}" for r in RULES.values())
