"""One update of cross-vocabulary distillation (OmniDraft Algorithm 2, line 8) on a LoRA drafter.

:class:`Distiller` owns the trainable copy of the drafter (fp32 + peft LoRA) and its AdamW state.
``update(examples)`` makes ``epochs`` passes (1 in Algorithm 2) over the buffer Q in batches of
``batch_size`` examples, one optimizer step per batch; each batch runs as micro-batches of at most ``micro_tokens`` tokens with
gradient accumulation, and calls ``pause()`` before every micro-batch: that is where a background
trainer yields the CPU to decoding.

With ``head`` on (the default), each update then fits the acceptance head of ``accept_head.py`` on
the buffer's emitted positions, labelled by the just-updated drafter: Algorithm 3's joint variant.

Logits are computed only where a label is (the hidden state before each labelled token through
the LM head), never for the whole sequence: 49k-wide rows for a thousand positions, not for all.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from omnidraft.adapter import head as head_mod
from omnidraft.train import accept_head, lora
from omnidraft.train.config import TrainConfig
from omnidraft.train.loss import (
    LossConfig,
    coarse_divergence,
    hybrid_loss_sum,
    intersection_log_probs,
    ngram_nll,
)
from omnidraft.train.records import Example


@dataclass
class UpdateMetrics:
    """What one update saw, measured on its own batches before each optimizer step."""

    examples: int = 0
    steps: int = 0
    dm_tokens: int = 0
    ngram_tokens: int = 0
    span_tokens: int = 0  # straddling drafter tokens trained on (only with span_weight > 0)
    loss: float = 0.0  # mean over the update's labelled tokens
    dm_kl: float = 0.0  # mean divergence at DM positions (reverse KL by default)
    ngram_nll: float = 0.0  # mean NLL of n-gram sub-tokens
    span_nll: float = 0.0  # mean NLL of straddling tokens (only with span_weight > 0)
    expected_acceptance: float = 0.0  # mean min(1, p(t)/q'(t)) at DM positions (Alg. 3, line 9)
    top1_agreement: float = 0.0  # share of DM positions where the drafter's argmax is the target's token
    head_positions: int = 0  # emitted positions the acceptance head saw
    accept_label_mean: float = 0.0  # share of them where the drafter's greedy token is the target's
    head_bce: float = 0.0  # mean BCE of the head on them (before its own update, so honest)
    head_auc: float = 0.0  # how well its score separates accepted from rejected (0.5 = chance)
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def resumed_config(config: TrainConfig, rank: int, scaling: float | None = None) -> TrainConfig:
    """``config`` at an existing adapter's rank, its LoRA scaling kept (``scaling``, default the config's)."""
    scaling = config.scaling if scaling is None else scaling
    if rank == config.rank and scaling == config.scaling:
        return config
    return replace(config, rank=rank, alpha=scaling * rank)


class Distiller:
    """The trainable LoRA drafter and its optimizer."""

    def __init__(self, model: torch.nn.Module, dm_mask: torch.Tensor, config: TrainConfig,
                 state: dict[str, torch.Tensor] | None = None, head_state: dict[str, torch.Tensor] | None = None,
                 scaling: float | None = None) -> None:
        """``state`` (with its ``scaling``, default the config's) resumes a published adapter: training
        goes on at that adapter's rank and scaling whatever the config says (a home's adapter may have
        been trained under an older default rank)."""
        if state is not None:
            config = resumed_config(config, lora.state_rank(state), scaling)
        config.validate()
        self.config = config
        self._loss_config = LossConfig(config.loss, config.ngram_weight, config.lam, config.span_weight)
        self.dm_mask = dm_mask.bool()
        self.model = lora.attach(model.float(), lora.lora_config(config.rank, config.alpha), state)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self._rng = random.Random(config.seed)
        self._inner = self.model.get_base_model().model  # the transformer body (LoRA layers inside)
        self._head = self.model.get_base_model().get_output_embeddings()
        self.accept_head: head_mod.AcceptHead | None = None
        if config.head:
            hidden_size = self._head.weight.shape[1]
            self.accept_head = (head_mod.from_state(head_state, hidden_size) if head_state is not None
                                else head_mod.AcceptHead(hidden_size))
            self.head_optimizer = torch.optim.AdamW(self.accept_head.parameters(), lr=config.head_lr,
                                                    weight_decay=config.weight_decay)
        self._head_memory: list[Example] = []  # R of Algorithm 4: the last ``head_replay`` prompts before Q

    def state(self) -> dict[str, torch.Tensor]:
        return lora.lora_state(self.model)

    def head_state(self) -> dict[str, torch.Tensor] | None:
        return accept_head.state_of(self.accept_head) if self.accept_head is not None else None

    def update(self, examples: Sequence[Example], pause: Callable[[], None] = lambda: None) -> UpdateMetrics:
        """``epochs`` passes over ``examples`` (the buffer Q), one AdamW step per batch of ``batch_size``;
        then the acceptance head on Q, labelled by the updated drafter (Algorithm 3, lines 8-10)."""
        order: list[Example] = []
        for _ in range(self.config.epochs):  # each pass in its own shuffled order
            one_pass = list(examples)
            self._rng.shuffle(one_pass)
            order += one_pass
        metrics = self._run(order, pause, train=True) if self.config.distill else UpdateMetrics(examples=len(order))
        if self.accept_head is not None:  # Algorithm 3, lines 9-10: labels from the updated drafter
            self._head_pass(list(examples), pause, metrics, train=True, replay=self._head_memory)
            if self.config.head_replay:
                self._head_memory = (self._head_memory + list(examples))[-self.config.head_replay:]
        return metrics

    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example]) -> UpdateMetrics:
        """The same metrics on ``examples`` with no optimizer step (held-out, teacher-forced)."""
        metrics = self._run(list(examples), lambda: None, train=False)
        if self.accept_head is not None:
            self._head_pass(list(examples), lambda: None, metrics, train=False)
        return metrics

    @torch.no_grad()
    def dm_agreement(self, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per DM position of ``examples``: whether the drafter's argmax over the intersection is the
        emitted target token, and the target's log p of that token (under greedy, its confidence in
        its own choice). Splits ``evaluate``'s top-1 agreement by how sure the target was."""
        agree, logp = [], []
        self.model.eval()
        for micro in _micro_batches([e for e in examples if len(e.dm_pos)], self.config.micro_tokens):
            hidden_dm, _, _ = self._hidden_before_labels(micro)
            logq_i = intersection_log_probs(self._head(hidden_dm), self.dm_mask)
            agree.append(logq_i.argmax(-1) == torch.cat([e.input_ids[e.dm_pos] for e in micro]))
            logp.append(torch.cat([e.dm_logp_emitted for e in micro]))
        if not agree:
            return torch.empty(0, dtype=torch.bool), torch.empty(0)
        return torch.cat(agree), torch.cat(logp)

    def _head_pass(self, examples: list[Example], pause: Callable[[], None], metrics: UpdateMetrics, train: bool,
                   replay: Sequence[Example] = ()) -> None:
        """Score the head on Q's emitted positions, then (``train``) fit it for ``head_epochs`` passes
        on them and on the ``replay`` prompts, all labelled by the current drafter."""
        start = time.perf_counter()
        feats, labels = self.head_data(examples, pause)
        if not len(labels):
            return
        with torch.no_grad():
            scores = self.accept_head(feats)
            metrics.head_bce = float(accept_head.weighted_bce(scores, labels)) / len(labels)
        metrics.head_positions = len(labels)
        metrics.accept_label_mean = float(labels.mean())
        metrics.head_auc = _auc(scores, labels)
        if train:
            if replay:
                old_feats, old_labels = self.head_data(replay, pause)
                feats, labels = torch.cat([feats, old_feats]), torch.cat([labels, old_labels])
            self._fit_head(feats, labels, pause)
        metrics.seconds += time.perf_counter() - start

    @torch.no_grad()
    def head_data(self, examples: Sequence[Example], pause: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and labels at every emitted position of ``examples`` under the current drafter:
        label 1 where the drafter's greedy token is the target's (the teacher-forced token)."""
        feats, labels = [], []
        self.model.eval()
        for micro in _micro_batches([e for e in examples if len(e.input_ids) > 1], self.config.micro_tokens):
            pause()
            hidden, tokens = self._hidden_at_emitted(micro)
            for chunk in range(0, len(tokens), 512):  # 49k-wide logits, a few hundred rows at a time
                h = hidden[chunk: chunk + 512]
                logits = self._head(h)
                feats.append(head_mod.features(h, logits))
                labels.append((logits.argmax(-1) == tokens[chunk: chunk + 512]).float())
        if not feats:
            return torch.empty(0), torch.empty(0)
        return torch.cat(feats), torch.cat(labels)

    def _fit_head(self, feats: torch.Tensor, labels: torch.Tensor, pause: Callable[[], None]) -> None:
        """L_adapt (weighted BCE) by AdamW, ``head_epochs`` shuffled passes in batches of 256 positions."""
        gen = torch.Generator().manual_seed(self._rng.randrange(2**31))
        self.accept_head.train()
        for _ in range(self.config.head_epochs):
            pause()
            for idx in torch.randperm(len(labels), generator=gen).split(256):
                self.head_optimizer.zero_grad(set_to_none=True)
                loss = accept_head.weighted_bce(self.accept_head(feats[idx]), labels[idx], self.config.head_reject_weight)
                (loss / len(idx)).backward()
                self.head_optimizer.step()
        self.accept_head.eval()

    def _run(self, order: list[Example], pause: Callable[[], None], train: bool) -> UpdateMetrics:
        start = time.perf_counter()
        sums = dict.fromkeys(("loss", "kl", "nll", "span_nll", "acc", "top1"), 0.0)
        metrics = UpdateMetrics(examples=len(order))
        self.model.train(train)
        for b in range(0, len(order), self.config.batch_size):
            batch = [e for e in order[b: b + self.config.batch_size] if e.labelled]
            count = sum(self._label_count(e) for e in batch)
            if not count:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            for micro in _micro_batches(batch, self.config.micro_tokens):
                pause()
                total, parts = self._loss(micro)
                if train:
                    (total / count).backward()
                for key in sums:
                    sums[key] += parts[key]
                metrics.dm_tokens += parts["dm"]
                metrics.ngram_tokens += parts["ng"]
                metrics.span_tokens += parts["span"]
            if train:
                torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
                self.optimizer.step()
                metrics.steps += 1
        self.model.eval()
        labelled = metrics.dm_tokens + (metrics.ngram_tokens if self.config.loss == "hybrid" else 0) + metrics.span_tokens
        metrics.loss = sums["loss"] / max(labelled, 1)
        metrics.dm_kl = sums["kl"] / max(metrics.dm_tokens, 1)
        metrics.ngram_nll = sums["nll"] / max(metrics.ngram_tokens, 1)
        metrics.span_nll = sums["span_nll"] / max(metrics.span_tokens, 1)
        metrics.expected_acceptance = sums["acc"] / max(metrics.dm_tokens, 1)
        metrics.top1_agreement = sums["top1"] / max(metrics.dm_tokens, 1)
        metrics.seconds = time.perf_counter() - start
        return metrics

    def _label_count(self, example: Example) -> int:
        return (len(example.dm_pos) + (len(example.ng_pos) if self.config.loss == "hybrid" else 0)
                + (len(example.span_pos) if self.config.span_weight > 0 else 0))

    def _loss(self, batch: list[Example]) -> tuple[torch.Tensor, dict]:
        """Summed loss of a micro-batch and its per-term sums (floats, for metrics)."""
        hidden_dm, hidden_ng, hidden_span = self._hidden_before_labels(batch, spans=self.config.span_weight > 0)
        cat = lambda name: torch.cat([getattr(e, name) for e in batch])
        logits_dm = self._head(hidden_dm)
        logq_i = intersection_log_probs(logits_dm, self.dm_mask)
        kl = coarse_divergence(logq_i, cat("dm_topk"), cat("dm_topk_logp"), cat("dm_log_mass"),
                                self.config.target_temperature, self.config.divergence)
        ng_tokens = torch.cat([e.input_ids[e.ng_pos] for e in batch])
        nll = ngram_nll(self._head(hidden_ng), ng_tokens) if len(ng_tokens) else kl.new_zeros(0)
        span_tokens = torch.cat([e.input_ids[e.span_pos] for e in batch]) if hidden_span is not None else None
        span_nll = ngram_nll(self._head(hidden_span), span_tokens) if span_tokens is not None and len(span_tokens) else None
        total, _ = hybrid_loss_sum(kl, nll, cat("ng_logp_target"), self._loss_config, span_nll)
        with torch.no_grad():
            dm_tokens = torch.cat([e.input_ids[e.dm_pos] for e in batch])
            logq_tok = logq_i.gather(1, dm_tokens[:, None]).squeeze(1)
            accept = torch.minimum(torch.ones_like(logq_tok), (cat("dm_logp_emitted") - logq_tok).exp())
            parts = {"loss": float(total), "kl": float(kl.sum()), "nll": float(nll.sum()),
                     "span_nll": float(span_nll.sum()) if span_nll is not None else 0.0,
                     "acc": float(accept.sum()), "top1": float((logq_i.argmax(-1) == dm_tokens).sum()),
                     "dm": len(dm_tokens), "ng": len(ng_tokens), "span": len(span_nll) if span_nll is not None else 0}
        return total, parts

    def _padded_hidden(self, batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer body's final hidden states over a right-padded batch, and its ids."""
        width = max(len(e.input_ids) for e in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, e in enumerate(batch):
            ids[row, : len(e.input_ids)] = e.input_ids
            mask[row, : len(e.input_ids)] = 1
        return self._inner(input_ids=ids, attention_mask=mask).last_hidden_state, ids

    def _hidden_before_labels(self, batch: list[Example], spans: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Final hidden states at the position before each DM / n-gram (/ straddling) label, right-padded batch."""
        hidden, _ = self._padded_hidden(batch)
        pick = lambda name: hidden[
            torch.cat([torch.full((len(getattr(e, name)),), r) for r, e in enumerate(batch)]).long(),
            torch.cat([getattr(e, name) - 1 for e in batch])]
        return pick("dm_pos"), pick("ng_pos"), pick("span_pos") if spans else None

    def _hidden_at_emitted(self, batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states before each emitted drafter token and those tokens (the head's positions)."""
        hidden, ids = self._padded_hidden(batch)
        rows, cols = [], []
        for r, e in enumerate(batch):
            pos = torch.arange(max(e.emitted_start, 1), len(e.input_ids))
            rows.append(torch.full((len(pos),), r))
            cols.append(pos)
        rows_t, cols_t = torch.cat(rows).long(), torch.cat(cols).long()
        return hidden[rows_t, cols_t - 1], ids[rows_t, cols_t]


def _micro_batches(batch: list[Example], max_tokens: int) -> list[list[Example]]:
    """Consecutive groups whose padded size (rows × longest) stays within ``max_tokens``."""
    groups: list[list[Example]] = []
    for e in sorted(batch, key=lambda e: len(e.input_ids)):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * max(len(e.input_ids), *(len(g.input_ids) for g in group)) <= max_tokens:
            group.append(e)
        else:
            groups.append([e])
    return groups


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum formula (0.5 when a class is missing)."""
    pos, neg = int(labels.sum()), int(len(labels) - labels.sum())
    if not pos or not neg:
        return 0.5
    ranks = torch.empty(len(scores))
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float)
    return float((ranks[labels > 0.5].sum() - pos * (pos + 1) / 2) / (pos * neg))


def learning_curve_point(metrics: UpdateMetrics) -> dict:
    """The numbers a progress bar or a metadata file keeps per update."""
    return {k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in metrics.as_dict().items() if k != "extra"}
