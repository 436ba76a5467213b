"""Training records: what one request teaches the drafter (OmniDraft §3.2, Algorithm 2 line 6).

Every verified step already computed the target's logits at each emitted position (accepted
proposals, the corrected token and the bonus token alike: all emitted tokens count, §4). The
:class:`Recorder` keeps them sparsely: the top-k target tokens over the vocabulary intersection
with their log-probs, the intersection's total mass, and the log-prob of the emitted token.
k = 64 by default, chosen by measurement on SmolLM2 -> Qwen2.5-Coder-0.5B: the top 64 hold nearly
all of p's intersection mass at a typical position, so the coarsened KL of ``loss.py`` stays close
to the exact one (the sweep over k is in the README, "Online distillation"). The cost is k
log-probs and ids per emitted token.

Under greedy verification the emitted tokens and these distributions do not depend on the
drafter at all (the output is the target's own greedy decode), so a record stays valid while the
drafter changes; the drafter-dependent parts (q', acceptance labels min(1, p/q')) are computed at
training time with the current drafter (Algorithm 3, line 9).

:func:`to_example` turns a record into drafter-space training tensors: the drafter context and the
drafter tokens of the emitted text (the canonical drafter tokenization, as reverse translation
produces it), aligned with the target tokens by bytes, with the DM and n-gram masks of eq. (4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from omnidraft.observer import DecodeObserver
from omnidraft.target.base import RowRequest, SparseRows
from omnidraft.vocab.bridge import VocabBridge

DEFAULT_MAX_LEN = 1024  # drafter tokens per training sequence; older context is cut on the left

# KIND_SPAN: a drafter token of the emitted text that straddles a target-token boundary (SmolLM2's
# '\n' + indent after Qwen's '):\n'). No target row lines up with it, so eq. (4) has no term for it,
# yet under text translation it is exactly what the drafter should propose there.
KIND_NONE, KIND_DM, KIND_NGRAM, KIND_SPAN = 0, 1, 2, 3


@dataclass
class Record:
    """One request: prompt and emitted target ids, and the target's sparse distribution at each
    emitted position (row i predicts ``emitted[i]``)."""

    prompt_ids: list[int]
    emitted_ids: list[int]
    topk_ids: torch.Tensor  # [n, k] int32 target ids (intersection tokens only)
    topk_logp: torch.Tensor  # [n, k] float32 log p over the full target vocabulary
    log_mass: torch.Tensor  # [n] float32 log p(intersection)
    logp_emitted: torch.Tensor  # [n] float32 log p(emitted token)

    def __len__(self) -> int:
        return len(self.emitted_ids)


class Recorder(DecodeObserver):
    """Collects a :class:`Record` per request from the decode loop's rows; hands it to ``sink``.

    A local target hands the loop logit rows and the recorder ranks them; a remote target ranks
    them where it runs (``row_request`` tells it the columns and k) and sends only the result."""

    def __init__(self, intersection: torch.Tensor, sink: Callable[[Record], None], top_k: int = 64) -> None:
        self.columns = torch.nonzero(intersection).flatten()  # target ids with a drafter partner
        self.top_k = min(top_k, len(self.columns))
        self.row_request = RowRequest(intersection.bool(), self.top_k)
        self.sink = sink
        self._prompt: list[int] = []
        self._rows: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_start(self, prompt_ids: Sequence[int]) -> None:
        self._prompt, self._rows = list(prompt_ids), []

    @torch.inference_mode()
    def on_step(self, logits: torch.Tensor | SparseRows, emitted: Sequence[int]) -> None:
        """``logits[i]`` is the target's row that predicted ``emitted[i]`` (one batched op per step)."""
        if not emitted:
            return
        n = len(emitted)
        if isinstance(logits, SparseRows):
            self._rows.append((list(emitted), logits.topk_ids[:n].to(torch.int32), logits.topk_logp[:n],
                               logits.log_mass[:n], logits.logp_emitted[:n]))
            return
        self._rows.append((list(emitted), *sparse_rows(logits[:n], emitted, self.columns, self.top_k)))

    def on_finish(self) -> None:
        self.finish()

    def finish(self) -> Record | None:
        """Close the request: the record goes to the sink (nothing when no token was emitted)."""
        rows, self._rows = self._rows, []
        if not rows:
            return None
        record = Record(self._prompt, [t for r in rows for t in r[0]], torch.cat([r[1] for r in rows]),
                        torch.cat([r[2] for r in rows]), torch.cat([r[3] for r in rows]), torch.cat([r[4] for r in rows]))
        self.sink(record)
        return record


def sparse_rows(logits: torch.Tensor, emitted: Sequence[int], columns: torch.Tensor, k: int):
    """(top-k column ids int32, their log p, log mass of the columns, log p of each emitted token)."""
    logp = logits.float().log_softmax(-1)
    inter = logp[:, columns]
    top_logp, top_pos = inter.topk(k, dim=-1)
    emitted_t = torch.tensor(list(emitted), dtype=torch.long)
    return (columns[top_pos].to(torch.int32), top_logp, inter.logsumexp(-1),
            logp.gather(1, emitted_t[:, None]).squeeze(1))


@dataclass
class Example:
    """Drafter-space tensors for the loss; positions index ``input_ids`` (the token predicted)."""

    input_ids: torch.Tensor  # [L] drafter ids: context + emitted text
    dm_pos: torch.Tensor  # [N_dm] positions of direct-mapped drafter tokens
    dm_topk: torch.Tensor  # [N_dm, k, M] drafter preimages of the target's top-k tokens (-1 pads)
    dm_topk_logp: torch.Tensor  # [N_dm, k]
    dm_log_mass: torch.Tensor  # [N_dm]
    dm_logp_emitted: torch.Tensor  # [N_dm] log p of the emitted (= aligned) target token
    ng_pos: torch.Tensor  # [N_ng] positions of n-gram sub-tokens
    ng_logp_target: torch.Tensor  # [N_ng] log p of the n-gram's target token (the per-token weight)
    emitted_tokens: int  # target tokens the record covered
    emitted_start: int = 0  # index in ``input_ids`` of the first drafter token of the emitted text
    span_pos: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # KIND_SPAN positions

    @property
    def labelled(self) -> int:
        return len(self.dm_pos) + len(self.ng_pos) + len(self.span_pos)


def align(bridge: VocabBridge, emitted: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Drafter tokens of the emitted text, with each one's kind (none/DM/n-gram/span) and target row.

    Runs of ordinary text are re-tokenized as a whole by the drafter's tokenizer (what reverse
    translation converges to); a special target token maps by literal text. Then by bytes: a
    drafter token whose span equals one target token's span is DM; drafter tokens that exactly
    tile one target token, n >= 2 of them, are that n-gram's sub-tokens; anything else is a drafter token
    straddling a target boundary (KIND_SPAN) or, where the drafter cannot spell the run's bytes,
    carries no label (KIND_NONE).
    """
    tokens: list[int] = []
    kinds: list[int] = []
    rows: list[int] = []
    run_start = 0
    for i in range(len(emitted) + 1):
        if i < len(emitted) and bridge.target_bytes(emitted[i]) is not None:
            continue
        _align_run(bridge, emitted, run_start, i, tokens, kinds, rows)
        if i < len(emitted):  # a special token: its literal-text partner, DM-aligned, or nothing
            mapped = int(bridge.t2d[emitted[i]]) if emitted[i] < len(bridge.t2d) else -1
            if mapped >= 0:
                tokens.append(mapped)
                kinds.append(KIND_DM)
                rows.append(i)
        run_start = i + 1
    return tokens, kinds, rows


def _align_run(bridge: VocabBridge, emitted: Sequence[int], lo: int, hi: int,
               tokens: list[int], kinds: list[int], rows: list[int]) -> None:
    """Align the ordinary-text target tokens emitted[lo:hi] with their drafter re-tokenization."""
    if lo >= hi:
        return
    target_at: dict[int, tuple[int, int]] = {}  # byte start -> (byte end, row) of a target token
    text = bytearray()
    for row in range(lo, hi):
        data = bridge.target_bytes(emitted[row])
        target_at[len(text)] = (len(text) + len(data), row)
        text += data
    drafted = bridge.drafter_encode(bytes(text))
    ends, offset = [], 0
    for tok in drafted:
        offset += len(bridge.drafter_bytes(tok) or b"")
        ends.append(offset)
    labels = [(KIND_NONE, -1)] * len(drafted)
    if offset == len(text):  # else the drafter cannot spell some byte: no reliable alignment
        j, start = 0, 0
        while j < len(drafted):
            end_t, row = target_at.get(start, (-1, -1))
            last = j  # the drafter token that ends where the target token ends, if any
            while last < len(drafted) and ends[last] < end_t:
                last += 1
            if row >= 0 and last < len(drafted) and ends[last] == end_t:
                kind = KIND_DM if last == j else KIND_NGRAM
                labels[j:last + 1] = [(kind, row)] * (last + 1 - j)
                j = last + 1
            else:  # straddles a target boundary
                labels[j] = (KIND_SPAN, -1)
                j += 1
            start = ends[j - 1]
    tokens.extend(drafted)
    kinds.extend(k for k, _ in labels)
    rows.extend(r for _, r in labels)


def preimage_table(bridge: VocabBridge) -> tuple[torch.Tensor, int]:
    """[target vocab, M] drafter ids mapping to each target token (-1 pads), and M."""
    groups: dict[int, list[int]] = {}
    for d, t in enumerate(bridge.d2t.tolist()):
        if t >= 0:
            groups.setdefault(t, []).append(d)
    width = max((len(g) for g in groups.values()), default=1)
    table = torch.full((bridge.target_vocab_size, width), -1, dtype=torch.long)
    for t, g in groups.items():
        if t < bridge.target_vocab_size:
            table[t, : len(g)] = torch.tensor(g)
    return table, width


def to_example(record: Record, bridge: VocabBridge, preimages: torch.Tensor,
               max_len: int = DEFAULT_MAX_LEN) -> Example | None:
    """Drafter-space training tensors of one record (None when it has no labelled token)."""
    context = bridge.target_to_drafter(record.prompt_ids)
    tokens, kinds, rows = align(bridge, record.emitted_ids)
    ids = context + tokens
    cut = max(0, len(ids) - max_len)
    ids = ids[cut:]
    base = len(context) - cut  # index of the first emitted drafter token in ``ids``
    dm = [(base + j, rows[j]) for j, kind in enumerate(kinds) if kind == KIND_DM and base + j >= 1]
    ng = [(base + j, rows[j]) for j, kind in enumerate(kinds) if kind == KIND_NGRAM and base + j >= 1]
    span = [base + j for j, kind in enumerate(kinds) if kind == KIND_SPAN and base + j >= 1]
    if not dm and not ng and not span:
        return None
    dm_rows = torch.tensor([r for _, r in dm], dtype=torch.long)
    ng_rows = torch.tensor([r for _, r in ng], dtype=torch.long)
    return Example(
        input_ids=torch.tensor(ids, dtype=torch.long),
        dm_pos=torch.tensor([p for p, _ in dm], dtype=torch.long),
        dm_topk=preimages[record.topk_ids[dm_rows].long()],
        dm_topk_logp=record.topk_logp[dm_rows],
        dm_log_mass=record.log_mass[dm_rows],
        dm_logp_emitted=record.logp_emitted[dm_rows],
        ng_pos=torch.tensor([p for p, _ in ng], dtype=torch.long),
        ng_logp_target=record.logp_emitted[ng_rows],
        emitted_tokens=len(record),
        emitted_start=max(base, 0),
        span_pos=torch.tensor(span, dtype=torch.long),
    )
