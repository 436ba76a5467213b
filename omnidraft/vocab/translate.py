"""Translators: drafted drafter tokens -> proposed target tokens, and emitted target tokens back.

Two strategies behind one interface (:class:`Translator`):

- :class:`TokenTranslator`, the paper's (OmniDraft §3.1, eq. (1)/(2)): each drafted token maps
  through the direct-mapping table, or a run of sub-tokens merges into one target token through
  the n-gram cache; the drafter may only propose tokens that can be carried that way. It knows q'
  in target space (eq. (2)), so the rejection-sampling rules use it.
- :class:`TextTranslator` (SLEM-style): the drafted *text* is re-tokenized with the target
  tokenizer after a short look-behind, so a drafter token that spans two target tokens (SmolLM2's
  '\\n' + indent against Qwen's '):\\n' then the indent) is still proposed. It has no per-token q',
  so it serves greedy verification.
- :class:`RedistributingTranslator` (RDK, ``affinity.py``): the drafter's intersection-restricted
  distribution is redistributed onto target tokens it cannot say (p' = Mᵀq'), and the draft is
  sampled in *target* ids; each one is fed back to the drafter as its drafter spelling.
- ``slrs.py``'s string translator (SLRS): the drafted string's first target token.

The token and RDK translators share :class:`DirectMapping` (the TLI restriction and q moved onto
target ids) as a part, not as a parent. Drafting and translating are separate objects: a translator
hands the drafter a :class:`~omnidraft.drafter.policy.DraftPolicy` (the sampler, constraint and stop
rule its translation can carry) and then only translates. What the verification rules see of a
translator is declared in ``omnidraft/verify/proposal.py`` (q' in target space). All keep the
drafter's context in step with what the target emitted (reverse translation, Algorithm 1 lines
17-19) and learn n-grams on the way when given a cache to learn into; the n-gram cache's verdicts
are noted by :func:`note_ngram_verdicts`, the same for every translator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from omnidraft.drafter.base import Draft
from omnidraft.drafter.policy import DraftPolicy, Sampler, StopRule
from omnidraft.kv import common_prefix_len
from omnidraft.ngram.trie import NgramCache, TrieNode
from omnidraft.verify.sampling import draw, probs_from_logits
from omnidraft.verify.tree import Branch
from omnidraft.vocab.affinity import DEFAULT_TAU, kernel_for
from omnidraft.vocab.bridge import Translation, VocabBridge
from omnidraft.vocab.healing import TokenHealing
from omnidraft.vocab.reverse import DrafterContext, drafted_inside


BRANCH_TOKENS = 2  # most target tokens of one runner-up branch (its text is one drafter token)


class Translator(Protocol):
    """Drafter tokens <-> target tokens for one kind of translation."""

    def draft_policy(self, base: Sampler, stop: StopRule, vocab_size: int) -> DraftPolicy:
        """How the drafter must draft so that this translation carries its tokens: ``base`` and
        ``stop`` as the request asks, changed only where the translation needs it."""

    def forward(self, context: Sequence[int], draft: Draft) -> Translation:
        """Target tokens for a draft, after the target-token ``context``."""

    def reverse(self, ctx: DrafterContext, draft: Draft, tr: Translation, emitted: list[int], accepted: int) -> None:
        """Append what the target emitted to the drafter's context."""

    def drafted_kept(self, draft: Draft, tr: Translation, accepted: int, proposed: list[int]) -> int:
        """How many drafted tokens the ``accepted`` first proposals cover (what the draft policy learns from)."""


@runtime_checkable
class BranchingTranslator(Translator, Protocol):
    """A translator that can also turn the drafter's runner-up tokens into branches of a draft's
    target ids (a token tree; greedy only)."""

    def branches(self, context: Sequence[int], draft: Draft, tr: Translation, rows: int) -> list[Branch]: ...


@runtime_checkable
class HealingTranslator(Translator, Protocol):
    """A translator that carries healed drafts (``vocab/healing.py``): the drafter drafts the context's
    last token again, and the translator drops its bytes from the draft's text (``Draft.overlap``)."""

    def heal(self, context: Sequence[int], vocab_size: int) -> tuple[bytes, torch.Tensor] | None:
        """For a draft after the drafter ids ``context``: the last token's bytes and the first drafted
        token's bias, or None where the draft continues all of ``context``."""


# ---------------------------------------------------------------- text


class FixedConstraint:
    """A constraint that is the same at every drafted position."""

    def __init__(self, bias: torch.Tensor) -> None:
        self._bias = bias

    def start(self) -> None:
        pass

    def bias(self) -> torch.Tensor:
        return self._bias

    def advance(self, token: int) -> None:
        pass


class TextTranslator:
    """Re-tokenizes drafted text with the target tokenizer (greedy verification only)."""

    def __init__(self, bridge: VocabBridge, learn: NgramCache | None = None) -> None:
        self.bridge, self.learn = bridge, learn
        self._bias: dict[int, torch.Tensor] = {}
        self._healing: dict[int, TokenHealing] = {}

    def draft_policy(self, base: Sampler, stop: StopRule, vocab_size: int) -> DraftPolicy:
        return DraftPolicy(base, self.constraint(vocab_size), stop)

    def constraint(self, vocab_size: int) -> FixedConstraint:
        """Any drafter token with bytes may be proposed, and a special token with a target partner."""
        if vocab_size not in self._bias:
            d2t = self.bridge.d2t_list
            ok = [data is not None or d2t[i] >= 0 for i, data in enumerate(self.bridge.d.token_bytes[:vocab_size])]
            bias = torch.full((vocab_size,), float("-inf"))
            bias[: len(ok)] = torch.where(torch.tensor(ok), 0.0, float("-inf"))
            self._bias[vocab_size] = bias
        return FixedConstraint(self._bias[vocab_size])

    def heal(self, context: Sequence[int], vocab_size: int) -> tuple[bytes, torch.Tensor] | None:
        if len(context) < 2:  # the drafter reads at least one token before it drafts
            return None
        if vocab_size not in self._healing:
            self._healing[vocab_size] = TokenHealing(self.bridge.d.token_bytes, vocab_size)
        return self._healing[vocab_size].heal(context[-1])

    def forward(self, context: Sequence[int], draft: Draft) -> Translation:
        return self.bridge.forward_text(context, draft.tokens, overlap=draft.overlap)

    def reverse(self, ctx: DrafterContext, draft: Draft, tr: Translation, emitted: list[int], accepted: int) -> None:
        """Accepted text keeps the drafted tokens that lie wholly inside it; the rest is re-tokenized.
        A healed draft's first token spells the context's last token again: that token is taken off and
        its bytes lead the accepted text, so the drafter's spelling of the boundary is kept where accepted."""
        kept = min(accepted, len(emitted))
        accepted_bytes = draft.overlap + b"".join(self.bridge.target_bytes(t) or b"" for t in emitted[:kept])
        if draft.overlap:
            ctx.truncate(len(ctx.ids) - 1)
        leftover = ctx.extend_accepted_bytes(draft.tokens, accepted_bytes)
        for tok in emitted[kept:]:
            ctx.append_target(tok, self.learn, before=leftover)
            leftover = b""
        if leftover:
            ctx.append_bytes(leftover)

    def drafted_kept(self, draft: Draft, tr: Translation, accepted: int, proposed: list[int]) -> int:
        text = draft.overlap + b"".join(self.bridge.target_bytes(t) or b"" for t in proposed[:accepted])
        return drafted_inside(self.bridge, draft.tokens, text)[0]

    def branches(self, context: Sequence[int], draft: Draft, tr: Translation, rows: int) -> list[Branch]:
        """The draft's runner-up tokens as branches of its translation, at most ``rows`` target
        tokens in all, the earliest positions first (the likeliest to be reached).

        The runner-up at drafted position i makes the text drafted[:i] + runner-up; re-tokenized, it
        leaves the chain where their target ids first differ, which may be a token before i's
        (a drafter token inside a target token). Its tokens up to BRANCH_TOKENS from there are the
        branch; one that adds nothing, or starts like an earlier one, is dropped."""
        out: list[Branch] = []
        seen: set[tuple[int, int]] = set()
        for i, other in enumerate(draft.runners_up):
            if rows <= 0:
                break
            if other < 0:
                continue
            ids = self.bridge.forward_text(context, draft.tokens[:i] + [other], overlap=draft.overlap).target_ids
            depth = common_prefix_len(ids, tr.target_ids)
            if depth >= len(ids) or (depth, ids[depth]) in seen:
                continue
            tokens = tuple(ids[depth: depth + min(BRANCH_TOKENS, rows)])
            seen.add((depth, tokens[0]))
            out.append(Branch(depth, tokens))
            rows -= len(tokens)
        return out


# ---------------------------------------------------------------- tokens (eq. (1)/(2))


class DirectMapping:
    """The direct-mapping table of a pair as the drafter and the sampling rules use it: which
    drafter tokens it carries (TLI's restriction) and q moved onto their target partners."""

    def __init__(self, bridge: VocabBridge, target_vocab_size: int) -> None:
        self.bridge, self.target_vocab_size = bridge, target_vocab_size
        src = torch.nonzero(bridge.d2t >= 0).flatten()
        tgt = bridge.d2t[src]
        keep = tgt < target_vocab_size
        self._src, self._tgt = src[keep], tgt[keep]
        self._bias: torch.Tensor | None = None

    def bias(self, vocab_size: int) -> torch.Tensor:
        """0 on direct-mapped drafter tokens, -inf elsewhere (the TLI restriction)."""
        if self._bias is None or len(self._bias) != vocab_size:
            bias = torch.full((vocab_size,), float("-inf"))
            bias[: len(self.bridge.dm_bias)] = self.bridge.dm_bias[:vocab_size]
            self._bias = bias
        return self._bias

    def target_probs(self, row: torch.Tensor) -> torch.Tensor:
        """Drafter distribution moved onto the target vocabulary through the direct mapping."""
        q_t = torch.zeros(self.target_vocab_size, dtype=row.dtype)
        q_t.index_add_(0, self._tgt, row[self._src])
        return q_t


class _TokenConstraint:
    """Direct-mapped tokens, plus sub-tokens that start or extend an n-gram in the cache."""

    def __init__(self, translator: TokenTranslator, vocab_size: int) -> None:
        self.t = translator
        self.dm_bias = translator.dm_bias(vocab_size)
        self.active: list[TrieNode] = []

    def start(self) -> None:
        self.active = []

    def bias(self) -> torch.Tensor:
        ngrams = self.t.propose
        if ngrams is None or not len(ngrams):
            return self.dm_bias
        extra = [t for node in self.active for t in node.children]
        root = self.t.root_extras(len(self.dm_bias))
        if not extra and not len(root):
            return self.dm_bias
        bias = self.dm_bias.clone()
        bias[root] = 0.0
        if extra:
            bias[torch.tensor(extra, dtype=torch.long)] = 0.0
        return bias

    def advance(self, token: int) -> None:
        ngrams = self.t.propose
        if ngrams is not None and len(ngrams):
            self.active = [c for node in self.active + [ngrams.root] if (c := node.children.get(token)) is not None]


class TokenTranslator:
    """The paper's token-level translation; ``propose`` merges n-grams, ``learn`` learns them."""

    def __init__(self, bridge: VocabBridge, target_vocab_size: int, propose: NgramCache | None = None,
                 learn: NgramCache | None = None) -> None:
        self.bridge, self.propose, self.learn = bridge, propose, learn
        self.target_vocab_size = target_vocab_size
        self.dm = DirectMapping(bridge, target_vocab_size)
        # Memo of root_extras, keyed by the cache object *and* its version: one bridge serves
        # several caches (bench modes), whose versions can coincide while their keys differ.
        self._root_key: tuple[int, int] | None = None
        self._root_extra = torch.empty(0, dtype=torch.long)

    def dm_bias(self, vocab_size: int) -> torch.Tensor:
        return self.dm.bias(vocab_size)

    def dm_target_probs(self, row: torch.Tensor) -> torch.Tensor:
        return self.dm.target_probs(row)

    def draft_policy(self, base: Sampler, stop: StopRule, vocab_size: int) -> DraftPolicy:
        return DraftPolicy(base, _TokenConstraint(self, vocab_size), stop)

    def root_extras(self, vocab_size: int) -> torch.Tensor:
        """Non-direct-mapped first sub-tokens of cached n-grams (recomputed when the cache changes)."""
        key = (id(self.propose), self.propose.version)
        if self._root_key != key:
            d2t = self.bridge.d2t_list
            ids = [t for t in self.propose.root.children if t < vocab_size and (t >= len(d2t) or d2t[t] < 0)]
            self._root_extra = torch.tensor(ids, dtype=torch.long)
            self._root_key = key
        return self._root_extra

    def forward(self, context: Sequence[int], draft: Draft) -> Translation:
        return self.bridge.forward(draft.tokens, self.propose)

    def reverse(self, ctx: DrafterContext, draft: Draft, tr: Translation, emitted: list[int], accepted: int) -> None:
        """Accepted proposals go back as the drafter tokens that produced them; the rest re-tokenized."""
        kept = min(accepted, len(emitted))
        ctx.extend_accepted(draft.tokens, tr.spans[kept - 1][1] if kept else 0)
        for tok in emitted[kept:]:
            ctx.append_target(tok, self.learn)

    def drafted_kept(self, draft: Draft, tr: Translation, accepted: int, proposed: list[int]) -> int:
        return tr.spans[accepted - 1][1] if accepted else 0

    # ---- q' in target space, eq. (2) (the rejection-sampling rules)

    def draft_target_probs(self, draft: Draft, tr: Translation, i: int) -> torch.Tensor:
        """q' over the target vocabulary at proposal i, eq. (2).

        Direct-mapped mass moves to the partner token (several drafter tokens may share one);
        for an n-gram the product of its sub-token probabilities goes to the n-gram token and is
        taken from its first sub-token's partner.
        """
        start, end = tr.spans[i]
        q_t = self.dm_target_probs(draft.q[start])
        if tr.ngram[i]:
            prod = float(torch.prod(torch.stack([draft.q[j, draft.tokens[j]] for j in range(start, end)])))
            first = int(self.bridge.d2t[draft.tokens[start]])
            if first >= 0:
                q_t[first] = max(float(q_t[first]) - prod, 0.0)
            q_t[tr.target_ids[i]] += prod
        return q_t

    def null_proposal(self, draft: Draft, tr: Translation, proposed: int) -> torch.Tensor | None:
        """q' of the drafted position right after the last proposal when the draft stopped there
        on a token with no translation (the "null proposal" that ``sample_verify`` must reject)."""
        if proposed == len(tr.target_ids) and tr.drafted_used < len(draft.tokens):
            return self.dm_target_probs(draft.q[tr.drafted_used])
        return None


# ---------------------------------------------------------------- RDK (out-of-vocabulary sampling)


class RedistributingSampler(Sampler):
    """RDK's drafting step (Algorithm 1): q over the intersection (TLI, after temperature and
    top-p), moved to target ids, redistributed by the affinity kernel (p' = Mᵀq'); the drafted
    token is a *target* id t ~ p', and p' is what the verifier compares p with."""

    def __init__(self, base: Sampler, translator: RedistributingTranslator) -> None:
        super().__init__(base.temperature, base.top_p, True, base.generator)
        self.translator = translator

    def choose(self, masked: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = probs_from_logits(masked, self.temperature, self.top_p)
        p_prime = self.translator.kernel.redistribute(self.translator.dm.target_probs(q))
        return draw(p_prime, self.generator), p_prime

    def feed(self, token: int) -> list[int]:
        return self.translator.bridge.spelling(token)


class RedistributingTranslator:
    """The ``rdk`` rule's translation: drafts are target ids already (see RedistributingSampler)."""

    def __init__(self, bridge: VocabBridge, target_vocab_size: int, learn: NgramCache | None = None,
                 tau: float | None = None) -> None:
        self.bridge, self.learn = bridge, learn
        self.dm = DirectMapping(bridge, target_vocab_size)
        self.kernel = kernel_for(bridge, DEFAULT_TAU if tau is None else tau)

    def draft_policy(self, base: Sampler, stop: StopRule, vocab_size: int) -> DraftPolicy:
        """Drafts in target ids from the direct-mapped drafter tokens (the intersection q is
        restricted to before redistribution)."""
        return DraftPolicy(RedistributingSampler(base, self), FixedConstraint(self.dm.bias(vocab_size)), stop)

    def forward(self, context: Sequence[int], draft: Draft) -> Translation:
        k = len(draft.tokens)
        return Translation(list(draft.tokens), [(i, i + 1) for i in range(k)], [False] * k)

    def reverse(self, ctx: DrafterContext, draft: Draft, tr: Translation, emitted: list[int], accepted: int) -> None:
        """Every emitted token goes back as its bytes (re-tokenized with a look-behind)."""
        for tok in emitted:
            ctx.append_target(tok, self.learn)

    def drafted_kept(self, draft: Draft, tr: Translation, accepted: int, proposed: list[int]) -> int:
        return accepted

    def draft_target_probs(self, draft: Draft, tr: Translation, i: int) -> torch.Tensor:
        return draft.q[i]  # p' of Algorithm 1, over the target vocabulary

    def null_proposal(self, draft: Draft, tr: Translation, proposed: int) -> torch.Tensor | None:
        return None  # every drafted token is a target token: nothing is left unproposed


# ---------------------------------------------------------------- the n-gram cache's verdicts


def note_ngram_verdicts(cache: NgramCache | None, draft: Draft, tr: Translation, proposed: int,
                        accepted: int) -> tuple[int, int]:
    """Note in ``cache`` which of the first ``proposed`` proposals it merged and which of those the
    target accepted (what its LRU/LFU eviction ranks by); returns (merged, of which accepted)."""
    hits = hits_accepted = 0
    for i in range(min(proposed, len(tr.ngram))):
        if tr.ngram[i]:
            key = draft.tokens[tr.spans[i][0]: tr.spans[i][1]]
            hits += 1
            cache.note_proposed(key)
            if i < accepted:
                hits_accepted += 1
                cache.note_accepted(key)
    return hits, hits_accepted
