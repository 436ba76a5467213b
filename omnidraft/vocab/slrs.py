"""String-level rejection sampling, SLRS (Timor et al., Algorithm 3; Theorem 3.2; §3.4).

Algorithm 3 drafts *text*: it samples drafter tokens d_1, d_2, … from q until a lookahead rule
S_1 says stop, takes the first target token t of the drafted string, and verifies t against the
target's p with the string-level proposal probability

    ψ(t) = Σ_{d_1..d_i : first target token of d_1⊕…⊕d_i = t} Π_j q(d_j)        (Theorem 3.2)

accept t if p(t) ≥ ψ(t), else with probability p(t)/ψ(t); on rejection sample
norm(p − min(p, ψ)). Losslessness (Theorem 3.2's proof) holds for *any* deterministic rule that
turns a drafted string into its first target token, as long as ψ is computed for that same rule,
so we use a rule whose ψ can be computed:

- the first target token of a string s is its **longest target-token prefix** LP(s) (every
  single byte is a target token for byte-level and byte-fallback vocabularies, so it exists);
- S_1 stops once LP(s) can no longer change — s is not a proper prefix of any target token — or
  after ``lookahead`` drafter tokens, or at a special token (which stands for itself first, and
  ends the string after text).

**Cost (§3.4).** ψ(t) sums over every drafter spelling of t's prefixes, and each internal node of
that tree needs a drafter forward (Lemma 3.3: 2^(m−1) spellings of an m-byte token in a complete
vocabulary). With ``lookahead`` 1 the tree is one level deep: ψ is q pushed through a fixed map
drafter id -> LP(bytes), one scatter over the vocabulary, for every t at once, and no extra drafter
forward. Each drafted token is then a target token, fed back to the drafter as its spelling, so a
draft proposes several target tokens at once — ordinary speculative rejection sampling with ψ in
place of q'. A longer lookahead needs the tree: :func:`psi` walks it for one t (forwards
included), verification takes one string per step, and the residual is sampled by rejection
(draw c ~ p, keep it with probability 1 − min(p, ψ)(c)/p(c)), which needs ψ only for the
candidates drawn. :func:`tree_sizes` counts the forwards per token for a pair (Appendix D's
experiment): where that count explodes, ``slrs`` refuses the lookahead up front.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from omnidraft.drafter.base import Draft
from omnidraft.drafter.policy import DraftPolicy, Sampler, StopRule
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.trie import NgramCache
from omnidraft.verify.sampling import draw, probs_from_logits
from omnidraft.vocab.bridge import Translation, VocabBridge
from omnidraft.vocab.reverse import DrafterContext
from omnidraft.vocab.translate import FixedConstraint

if TYPE_CHECKING:
    from omnidraft.drafter import Drafter

MAX_FORWARDS = 64  # most drafter forwards one ψ(t) may need before a lookahead is refused


@dataclass
class StringIndex:
    """Byte-string facts of one pair that ψ and the first-token rule need."""

    target_ids: dict[bytes, int]  # bytes -> target id (real pieces preferred over byte fallback)
    target_sorted: list[bytes]  # every target token's bytes, sorted (proper-prefix queries)
    drafter_sorted: list[bytes]  # every drafter token's bytes, sorted (extension queries)
    drafter_ids: dict[bytes, list[int]]  # bytes -> drafter ids spelling exactly that
    specials: torch.Tensor  # drafter ids with no bytes but a target partner (allowed, end a string)
    partner: dict[int, int]  # such a drafter id -> its target id
    first: torch.Tensor  # [drafter vocab] LP(bytes(d)), the partner of a special, -1 if disallowed
    drafter_bytes: list[bytes | None]  # drafter id -> its bytes

    def longest_prefix(self, s: bytes) -> int:
        """LP(s): the longest target token that s starts with (-1 for an empty string)."""
        for end in range(len(s), 0, -1):
            tid = self.target_ids.get(s[:end])
            if tid is not None:
                return tid
        return -1

    def open(self, s: bytes) -> bool:
        """Whether s is a proper prefix of some target token (LP could still grow)."""
        i = bisect.bisect_right(self.target_sorted, s)
        return i < len(self.target_sorted) and self.target_sorted[i].startswith(s)

    def drafter_extensions(self, r: bytes) -> list[bytes]:
        """Drafter byte strings that strictly extend r."""
        out, i = [], bisect.bisect_right(self.drafter_sorted, r)
        while i < len(self.drafter_sorted) and self.drafter_sorted[i].startswith(r):
            out.append(self.drafter_sorted[i])
            i += 1
        return out

    def target_extensions(self, s: bytes) -> list[bytes]:
        """Target byte strings that strictly extend s."""
        out, i = [], bisect.bisect_right(self.target_sorted, s)
        while i < len(self.target_sorted) and self.target_sorted[i].startswith(s):
            out.append(self.target_sorted[i])
            i += 1
        return out


def build_index(bridge: VocabBridge) -> StringIndex:
    target_ids = bridge._bytes_index(bridge.t)
    d_bytes = bridge.d.token_bytes[: bridge.drafter_vocab_size]
    drafter_ids: dict[bytes, list[int]] = {}
    for d, data in enumerate(d_bytes):
        if data:
            drafter_ids.setdefault(data, []).append(d)
    partner = {d: bridge.d2t_list[d] for d, data in enumerate(d_bytes) if not data and bridge.d2t_list[d] >= 0}
    index = StringIndex(target_ids, sorted(target_ids), sorted(drafter_ids), drafter_ids,
                        torch.tensor(sorted(partner), dtype=torch.long), partner, torch.empty(0, dtype=torch.long), d_bytes)
    first = [partner.get(d, -1) if not data else index.longest_prefix(data) for d, data in enumerate(d_bytes)]
    index.first = torch.tensor(first, dtype=torch.long)
    return index


_INDEXES: dict[int, StringIndex] = {}


def index_for(bridge: VocabBridge) -> StringIndex:
    """The pair's index, built on first use and kept for the process (like the bridge)."""
    if id(bridge) not in _INDEXES:
        _INDEXES[id(bridge)] = build_index(bridge)
    return _INDEXES[id(bridge)]


# ---------------------------------------------------------------- lookahead 1: ψ for every t at once


def psi_row(index: StringIndex, q: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """ψ over the target vocabulary for lookahead 1: q pushed through d -> LP(bytes(d))."""
    first = index.first[: len(q)]
    valid = first >= 0
    return torch.zeros(target_vocab_size, dtype=q.dtype).index_add_(0, first[valid], q[: len(first)][valid])


class StringSampler(Sampler):
    """Drafts in target ids: d ~ q (any drafter token with bytes), t = LP(bytes(d)), and ψ is the
    proposal the verifier compares p with; the drafter then reads t's own spelling."""

    def __init__(self, base: Sampler, translator: StringTranslator) -> None:
        super().__init__(base.temperature, base.top_p, True, base.generator)
        self.translator = translator

    def choose(self, masked: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = probs_from_logits(masked, self.temperature, self.top_p)
        d = draw(q, self.generator)
        return int(self.translator.index.first[d]), psi_row(self.translator.index, q, self.translator.target_vocab_size)

    def feed(self, token: int) -> list[int]:
        return self.translator.bridge.spelling(token)


# ---------------------------------------------------------------- longer lookahead: the tree


class Lookahead:
    """S_1 of Algorithm 3: stop once the first target token is settled, at a special token, or
    after ``n`` drafter tokens (the draft's k may cut earlier; ψ uses the same limit)."""

    def __init__(self, index: StringIndex, n: int) -> None:
        self.index, self.n = index, n
        self.text = b""
        self.count = 0

    def start(self) -> None:
        self.text, self.count = b"", 0

    def stop_after(self, token, masked, q, hidden, logits) -> bool:
        self.count += 1
        if token in self.index.partner:
            return True
        self.text += self.index.drafter_bytes[token]
        return self.count >= self.n or not self.index.open(self.text)


def first_target_token(index: StringIndex, drafted: Sequence[int]) -> int:
    """The first target token of a drafted string under the rule above (-1: none)."""
    text = b""
    for j, d in enumerate(drafted):
        if d in index.partner:
            return index.partner[d] if j == 0 else index.longest_prefix(text)
        text += index.drafter_bytes[d]
    return index.longest_prefix(text)


class TreeWalk:
    """ψ(t) by walking the tree of drafter spellings (Theorem 3.2's sum), and its size.

    A node is a drafted string s that can still end with first token t (bytes ``bt``): a proper
    prefix of bt, or an extension of bt with LP(s) = t. Its children are drafter tokens; a child
    string that is still open (LP could grow) and under the lookahead is an internal node — one
    drafter forward, ``q_at(path)`` — any other child is a leaf whose first token is LP(child).
    At a node that already spells t, the continuations are counted by complement: every drafter
    token except those that make a longer target token (found from t's target extensions)."""

    def __init__(self, index: StringIndex, limit: int) -> None:
        self.index, self.limit = index, limit

    def _split(self, s: bytes, bt: bytes, t: int) -> tuple[list[int], list[int], list[int]] | None:
        """Children of node s: (leaf ids ending in t, internal ids, ids that rule t out) — the
        last only at a node that spells t already (None there for the leaves: complement)."""
        index = self.index
        if len(s) < len(bt):
            r = bt[len(s):]
            datas = [r[:end] for end in range(1, len(r) + 1) if r[:end] in index.drafter_ids]
            datas += index.drafter_extensions(r)
            leaves, internal = [], []
            for data in datas:
                s2 = s + data
                deep = self.depth_ok and index.open(s2)
                if len(s2) < len(bt):
                    if deep:
                        internal += index.drafter_ids[data]
                    continue  # a leaf short of t ends on a shorter first token
                if index.longest_prefix(s2) == t:
                    (internal if deep else leaves).extend(index.drafter_ids[data])
            return leaves, internal, []
        # s spells t: a child keeps t unless it completes a longer target token w (u ⊑ data)
        tails = [w[len(s):] for w in index.target_extensions(s)]
        ruled_out: set[int] = set()
        for u in tails:
            for data in [u, *index.drafter_extensions(u)]:
                ruled_out.update(index.drafter_ids.get(data, ()))
        internal: set[int] = set()
        if self.depth_ok:
            for u in tails:  # open children: proper prefixes of a tail
                for end in range(1, len(u)):
                    internal.update(d for d in index.drafter_ids.get(u[:end], ()) if d not in ruled_out)
        return None, sorted(internal), sorted(ruled_out)

    def psi(self, t: int, bt: bytes | None, q_root: torch.Tensor, q_at) -> tuple[float, int]:
        """(ψ(t), drafter forwards used)."""
        index = self.index
        if bt is None:  # a special target token: only a partner drafted first spells it
            ids = [d for d, tid in index.partner.items() if tid == t]
            return (float(q_root[ids].sum()) if ids else 0.0), 0
        total, forwards = 0.0, 0
        stack: list[tuple[int, bytes, float, torch.Tensor, tuple[int, ...]]] = [(0, b"", 1.0, q_root, ())]
        while stack:
            depth, s, mass, q, path = stack.pop()
            self.depth_ok = depth + 1 < self.limit
            n = len(q)
            leaves, internal, ruled_out = self._split(s, bt, t)
            internal = [d for d in internal if d < n and float(q[d]) > 0.0]
            if leaves is None:  # s spells t: every allowed token but those ruling t out or going deeper
                # (a special token counts too: after text it ends the string at s, whose first token is t)
                kept = float(q.sum()) - float(q[[d for d in ruled_out if d < n]].sum()) - float(q[internal].sum())
                total += mass * kept
            else:
                total += mass * float(q[[d for d in leaves if d < n]].sum())
            for d in internal:
                forwards += 1
                stack.append((depth + 1, s + index.drafter_bytes[d], mass * float(q[d]), q_at(path + (d,)), path + (d,)))
        return total, forwards

    def size(self, t: int, bt: bytes, cap: int = MAX_FORWARDS + 1) -> int:
        """Drafter forwards ψ(t) may need (every drafter token assumed possible), up to ``cap``."""
        count, stack = 0, [(0, b"")]
        while stack and count < cap:
            depth, s = stack.pop()
            self.depth_ok = depth + 1 < self.limit
            if not self.depth_ok:
                continue
            _, internal, _ = self._split(s, bt, t)
            count += len(internal)
            stack.extend((depth + 1, s + self.index.drafter_bytes[d]) for d in internal)
        return min(count, cap)


def tree_sizes(index: StringIndex, limit: int, target_tokens: Sequence[tuple[int, bytes]], cap: int = MAX_FORWARDS + 1) -> list[int]:
    """Appendix D's count for a pair: drafter forwards per ψ(t), for each (t, bytes)."""
    walk = TreeWalk(index, limit)
    return [walk.size(t, bt, cap) for t, bt in target_tokens]


def check_lookahead(bridge: VocabBridge, limit: int) -> None:
    """Refuse a lookahead under which some ψ(t) of this pair needs more than MAX_FORWARDS drafter
    forwards (the blow-up of §3.4). Longest tokens first: they are where it explodes."""
    if limit <= 1:
        return
    index = index_for(bridge)
    tokens = sorted(((t, b) for b, t in index.target_ids.items()), key=lambda tb: -len(tb[1]))
    walk = TreeWalk(index, limit)
    for t, bt in tokens:
        n = walk.size(t, bt)
        if n > MAX_FORWARDS:
            shown = bt.decode("utf-8", "backslashreplace")
            raise OmnidraftError(f"--verify slrs with lookahead {limit} would need over {MAX_FORWARDS} drafter forwards "
                                 f"for one token of this pair (e.g. {shown!r}); use lookahead 1")


# ---------------------------------------------------------------- the translator


class StringTranslator:
    """The ``slrs`` rule's translation (see the module docstring)."""

    def __init__(self, bridge: VocabBridge, target_vocab_size: int, learn: NgramCache | None = None,
                 lookahead: int = 1, drafter: Drafter | None = None) -> None:
        if lookahead < 1:
            raise OmnidraftError("the SLRS lookahead must be at least 1")
        self.bridge, self.learn, self.lookahead, self.drafter = bridge, learn, lookahead, drafter
        self.target_vocab_size = target_vocab_size
        self.index = index_for(bridge)
        self._bias: torch.Tensor | None = None
        self._base: Sampler | None = None

    @property
    def whole_rows(self) -> bool:
        """Lookahead 1: ψ is known over the whole vocabulary (several tokens per draft)."""
        return self.lookahead == 1

    def draft_policy(self, base: Sampler, stop: StopRule, vocab_size: int) -> DraftPolicy:
        """Lookahead 1 drafts target ids (t = LP(bytes(d))); a longer lookahead drafts one string
        until its first target token is settled (Algorithm 3's S_1), keeping q for ψ."""
        self._base = base
        if self.whole_rows:
            return DraftPolicy(StringSampler(base, self), FixedConstraint(self._drafter_bias(vocab_size)), stop)
        return DraftPolicy(Sampler(base.temperature, base.top_p, True, base.generator),
                           FixedConstraint(self._drafter_bias(vocab_size)), Lookahead(self.index, self.lookahead))

    def _drafter_bias(self, vocab_size: int) -> torch.Tensor:
        """0 on drafter tokens with bytes (they have a first target token), -inf elsewhere."""
        if self._bias is None or len(self._bias) != vocab_size:
            ok = self.index.first[:vocab_size] >= 0
            bias = torch.full((vocab_size,), float("-inf"))
            bias[: len(ok)] = torch.where(ok, 0.0, float("-inf"))
            self._bias = bias
        return self._bias

    def forward(self, context: Sequence[int], draft: Draft) -> Translation:
        if self.whole_rows:
            k = len(draft.tokens)
            return Translation(list(draft.tokens), [(i, i + 1) for i in range(k)], [False] * k)
        t = first_target_token(self.index, draft.tokens)
        return Translation([t], [(0, len(draft.tokens))], [False]) if t >= 0 else Translation()

    def reverse(self, ctx: DrafterContext, draft: Draft, tr: Translation, emitted: list[int], accepted: int) -> None:
        for tok in emitted:
            ctx.append_target(tok, self.learn)

    def drafted_kept(self, draft: Draft, tr: Translation, accepted: int, proposed: list[int]) -> int:
        return tr.spans[accepted - 1][1] if accepted else 0

    def draft_target_probs(self, draft: Draft, tr: Translation, i: int) -> torch.Tensor:
        return draft.q[i]  # ψ over the target vocabulary (lookahead 1)

    def null_proposal(self, draft: Draft, tr: Translation, proposed: int) -> torch.Tensor | None:
        return None

    def psi(self, draft: Draft, t: int) -> tuple[float, int]:
        """(ψ(t), drafter forwards) for the string drafted in ``draft`` (longer lookahead), walking
        its tree with the drafter's model from the context the draft started from."""
        drafter = self.drafter
        limit = min(self.lookahead, draft.limit or self.lookahead)
        base = self._base
        bias = self._drafter_bias(len(draft.q[0]))
        drafted = list(draft.tokens)

        def q_at(path: tuple[int, ...]) -> torch.Tensor:
            if len(path) < len(drafted) and tuple(drafted[: len(path)]) == path:
                return draft.q[len(path)]  # on the drafted path: the row the sampler used
            logits = drafter.lm.logits_for(list(draft.context) + list(path))
            return probs_from_logits(logits + bias, base.temperature, base.top_p)

        return TreeWalk(self.index, limit).psi(t, self.bridge.target_bytes(t), draft.q[0], q_at)
