"""The target half of the loop: what every target backend provides.

A local engine provides ``score(ids, m)``: the target's logits predicting the token after each of
the last m+1 ids (after the context and after each of the m proposals), from one forward over what
is not cached yet. The engine keeps its own KV cache and crops it to the common prefix with
``ids``, so a rejection costs nothing extra. Engines: eager torch (``torch_target.py``) and
llama.cpp (``llamacpp.py``).

The decoder talks to a :class:`Verifier`: score *and* verify, so that verification runs where the
target runs. :class:`LocalVerifier` wraps a local engine; the gRPC client (``omnidraft.rpc``) is a
verifier whose target is on a server, and only token ids cross the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from omnidraft.verify import get_rule
from omnidraft.verify.greedy import argmax_rows
from omnidraft.verify.proposal import Proposal, SamplingConfig
from omnidraft.verify.sampling import draw, probs_from_logits, step_generator
from omnidraft.verify.tree import walk


class Target(Protocol):
    tokenizer: Any  # the target's transformers tokenizer
    vocab_size: int  # width of a logit row
    eos_ids: frozenset[int]  # ids that end generation
    max_context: int  # positions the target can hold

    def score(self, ids: Sequence[int], num_proposed: int) -> torch.Tensor:
        """float32 [num_proposed + 1, vocab_size] logits. An engine whose ``trees`` is True also takes
        ``branches`` (``verify.tree``): their rows follow the chain's, one per branch token."""

    def reset(self) -> None:
        """Forget the KV cache."""


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end generation: the generation config's, as transformers' generate uses."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


@dataclass
class SparseRows:
    """What the trainer records of the target at each emitted position, computed where the target
    runs (a remote target sends these, never logit rows): the top-k ids among a set of columns (the
    vocabulary intersection) with their log-probs, the columns' total log-mass, the emitted token's
    log-prob."""

    topk_ids: torch.Tensor  # [n, k] int32
    topk_logp: torch.Tensor  # [n, k] float32
    log_mass: torch.Tensor  # [n]
    logp_emitted: torch.Tensor  # [n]


@dataclass
class RowRequest:
    """An observer's wish for per-position target log-probs (the online trainer's records)."""

    columns: torch.Tensor  # [vocab] bool: the target ids to rank
    k: int


@dataclass
class Verdict:
    accepted: int  # proposals kept
    next_token: int  # the corrected or bonus token
    rows: torch.Tensor | SparseRows | None  # row i is the target's view before emitted token i
    path: list[int] | None = None  # the proposals kept when a branch of the proposal won (else its chain's)
    branch_kept: int = 0  # of those, the branch's


@runtime_checkable
class Verifier(Protocol):
    """Scores a context plus proposals and applies the verification rule (config.verify)."""

    tokenizer: Any
    vocab_size: int
    eos_ids: frozenset[int]
    max_context: int
    rules: tuple[str, ...] | None  # the rules it can run (None: every rule)

    def verify(self, ids: Sequence[int], proposal: Proposal | None, config: SamplingConfig,
               rows: RowRequest | None) -> Verdict: ...

    def settle(self, ids: Sequence[int]) -> None:
        """A request ended with ``ids`` (prompt and output): let the target keep only what it would
        hold had it decoded them alone."""

    def reset(self) -> None: ...


class LocalVerifier:
    """A local engine as a :class:`Verifier`: one ``score``, then the rule on its rows."""

    rules = None

    def __init__(self, target: Target) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:  # tokenizer, vocab_size, eos_ids, max_context
        return getattr(self.target, name)

    @property
    def trees(self) -> bool:
        """Whether the engine scores token trees (a proposal's branches) in one forward."""
        return getattr(self.target, "trees", False)

    def verify(self, ids: Sequence[int], proposal: Proposal | None, config: SamplingConfig,
               rows: RowRequest | None) -> Verdict:
        proposed = list(proposal.proposed) if proposal is not None else []
        if proposal is not None and proposal.branches and config.verify == "greedy" and self.trees:
            return self._verify_tree(list(ids) + proposed, proposal)
        logits = self.target.score(list(ids) + proposed, len(proposed))
        accepted, nxt = decide(logits, proposal, config, step_generator(config.seed, len(ids)))
        return Verdict(accepted, nxt, logits)

    def _verify_tree(self, ids: list[int], proposal: Proposal) -> Verdict:
        """The chain and its branches in one forward, and the greedy walk through them."""
        logits = self.target.score(ids, len(proposal.proposed), proposal.branches)
        found = walk(argmax_rows(logits), proposal.proposed, proposal.branches)
        path = found.path if found.branch_kept else None
        return Verdict(len(found.path), found.next_token, logits[found.rows], path, found.branch_kept)

    def settle(self, ids: Sequence[int]) -> None:
        settle_cache(self.target, ids)

    def reset(self) -> None:
        self.target.reset()


def settle_cache(target: Target, ids: Sequence[int]) -> None:
    """After a request that ended with ``ids``, keep in an engine's cache only what the target decoding
    alone would hold: all but the last token, which it never evaluates. Only engines whose prompt reads
    depend on what is cached (llama.cpp) have ``trim``; for the rest there is nothing to do."""
    trim = getattr(target, "trim", None)
    if trim is not None:
        trim(len(ids) - 1)


def cut(emitted: list[int], eos_ids: frozenset[int], remaining: int) -> tuple[list[int], bool]:
    """A step's tokens cut at the first end-of-sequence token and after ``remaining`` tokens, and
    whether the request ends with them."""
    for j, tok in enumerate(emitted):
        if tok in eos_ids:
            return emitted[: j + 1][:remaining], True
    return emitted[:remaining], len(emitted) >= remaining


def decide(logits: torch.Tensor, proposal: Proposal | None, config: SamplingConfig,
           generator: torch.Generator) -> tuple[int, int]:
    """(accepted, next token) from the target's rows: a plain step without a proposal, else the rule."""
    if proposal is None:
        if config.temperature <= 0:
            return 0, argmax_rows(logits[:1])[0]
        return 0, draw(probs_from_logits(logits[0], config.temperature, config.top_p), generator)
    return get_rule(config.verify).verify(logits, proposal, config, generator)
