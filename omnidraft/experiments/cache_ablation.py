"""N-gram cache ablation: ``omnidraft bench --ablation cache`` (OmniDraft App. D.4-D.5).

The paper asks two questions of the cross-vocabulary n-gram cache (§3.1): how fast does it grow
with the tokens processed (Figure 9: growth rate = cache size / tokens, sub-linear), and how much
of its benefit survives a memory budget (Table 14: ¼ and ½ of the full final size under LRU or
LFU eviction, against no cache and the full cache). This module answers both in three phases:

1. **Stream.** S prompts decoded with a fresh, uncapped cache that learns online. After every
   prompt the cache size and the cumulative tokens decoded are recorded: the growth curve. The
   final size is F, the "full" cache.
2. **Capped streams.** The same S prompts again, each configuration with its own fresh cache
   capped at round(F·¼) or round(F·½) under LRU or LFU, so eviction acts *while* the cache
   learns, as on a device with that budget. (Replaying the full stream's insertions into a
   capped store would not do: what is learned depends on what was proposed, and eviction depends
   on hits.) The four streams run interleaved per prompt.
3. **Held-out evaluation.** A disjoint slice (after the stream) decoded by the target alone (the
   speed baseline), the drafter without a cache, the four capped caches and the full one, every
   cache frozen so all configurations are judged on what they learned in the stream, interleaved
   per prompt after a warm-up (:func:`omnidraft.bench.runner.run_bench`).

The caches are real sqlite stores (:class:`PersistentNgramCache`) in a folder the caller owns
(the bench's ``--out``), never the user's ``cache_store/``. Proposals use the n-gram cache only
under token translation (``translate="tokens"``), so that is what the ablation decodes with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

from omnidraft.bench.runner import (
    ModeFn,
    PromptRun,
    interleave,
    our_mode,
    run_bench,
    summarize,
)
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.files import bytes_on_disk
from omnidraft.ngram.store import PersistentNgramCache, fresh_store
from omnidraft.ngram.trie import NgramTrie
from omnidraft.identity import pair_id

TARGET = "target"
NO_CACHE = "no cache"
FULL = "full"
# Table 14's budgets: a quarter and a half of the full cache's final size, under each policy.
FRACTIONS = (Fraction(1, 4), Fraction(1, 2))
POLICIES = ("lru", "lfu")
ABLATION_VERIFIERS = ("greedy", "omnidraft")


@dataclass(frozen=True)
class CappedConfig:
    """One bounded cache of the ablation: a fraction of the full size under one eviction policy."""

    fraction: Fraction
    policy: str
    max_entries: int

    @property
    def name(self) -> str:
        """Row label as in Table 14, e.g. ``1/4 LRU``."""
        return f"{self.fraction} {self.policy.upper()}"

    @property
    def slug(self) -> str:
        """File-name form, e.g. ``1-4-lru``."""
        return f"{self.fraction.numerator}-{self.fraction.denominator}-{self.policy}"


def cap_size(full_entries: int, fraction: Fraction) -> int:
    """max_entries for ``fraction`` of the full size: rounded half up (not Python's banker's
    rounding, so ½ of 5 is 3), and at least 1, the smallest cap a store accepts."""
    return max(1, math.floor(full_entries * fraction + Fraction(1, 2)))


def capped_configs(full_entries: int) -> list[CappedConfig]:
    """Table 14's bounded rows in its order: ¼ LRU, ¼ LFU, ½ LRU, ½ LFU."""
    return [CappedConfig(f, p, cap_size(full_entries, f)) for f in FRACTIONS for p in POLICIES]


def config_names(configs: Sequence[CappedConfig]) -> list[str]:
    """Every row of the evaluation, baseline first, in Table 14's order."""
    return [TARGET, NO_CACHE, *(c.name for c in configs), FULL]


# ---- growth bookkeeping (Figure 9) -----------------------------------------------------------------
@dataclass(frozen=True)
class GrowthPoint:
    """The cache after ``prompts`` stream prompts: its size against the tokens decoded so far.

    Tokens are the *decoded* (target) tokens: n-grams are learned only from emitted text, by
    reverse translation, never from the prompt (the paper's "training tokens").
    """

    prompts: int
    tokens: int
    entries: int
    evictions: int = 0

    @property
    def growth_rate(self) -> float:
        """Figure 9's growth_rate = cache_size / training_tokens."""
        return self.entries / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        return {"prompts": self.prompts, "tokens": self.tokens, "entries": self.entries,
                "evictions": self.evictions, "growth_rate": self.growth_rate}


def next_point(curve: Sequence[GrowthPoint], new_tokens: int, entries: int, evictions: int) -> GrowthPoint:
    """The point after one more prompt of ``new_tokens`` decoded tokens."""
    last = curve[-1] if curve else GrowthPoint(0, 0, 0)
    return GrowthPoint(last.prompts + 1, last.tokens + new_tokens, entries, evictions)


def curve_at(curve: Sequence[GrowthPoint], fraction: float) -> GrowthPoint:
    """The first point at or after ``fraction`` of the stream's tokens (for the summary)."""
    if not curve:
        raise ValueError("empty growth curve")
    goal = fraction * curve[-1].tokens
    return next(p for p in curve if p.tokens >= goal)


# ---- streams ---------------------------------------------------------------------------------------
@dataclass
class Stream:
    """One cache learning over the stream: the mode that decodes with it and what it recorded."""

    cache: NgramTrie
    run: ModeFn
    growth: list[GrowthPoint] = field(default_factory=list)
    runs: list[PromptRun] = field(default_factory=list)


def run_streams(streams: dict[str, Stream], prompts: Sequence[list[int]], progress: bool = True,
                desc: str = "stream") -> None:
    """Decode every prompt with every stream, interleaved per prompt; record growth after each."""
    from tqdm.auto import tqdm

    order = interleave(len(prompts), list(streams))
    bar = tqdm(order, desc=desc, disable=not progress, unit="run")
    for p, name in bar:
        stream = streams[name]
        run = stream.run(prompts[p])
        stream.runs.append(run)
        evictions = getattr(stream.cache, "evictions", 0)
        stream.growth.append(next_point(stream.growth, len(run.token_ids), len(stream.cache), evictions))
        bar.set_postfix_str(f"prompt {p + 1}/{len(prompts)} {name}: {len(stream.cache)} n-grams")


# ---- stores ----------------------------------------------------------------------------------------
def reopen_frozen(store: PersistentNgramCache) -> PersistentNgramCache:
    """Close a learning store (writing its last batch) and open it read-only with the same cap
    and policy: evaluation must not change what the stream learned, nor write to the file."""
    store.close()
    return PersistentNgramCache(store.path, store.pair_id, max_entries=store.max_entries,
                                policy=store.policy, frozen=True)


def footprint(store: PersistentNgramCache) -> dict:
    """Entries and memory of one cache (Table 4: the cache is small next to the models)."""
    return {"entries": len(store), "max_entries": store.max_entries, "policy": store.policy,
            "bytes_in_memory": store.memory_bytes(), "bytes_on_disk": bytes_on_disk(store.path)}


# ---- the ablation ------------------------------------------------------------------------------------
def speculative_config(base: DecodeConfig, verify: str, temperature: float) -> DecodeConfig:
    """The decoding every cache configuration uses: the paper's token mapping (the only path that
    proposes n-grams), greedy (lossless, deterministic acceptance) or omnidraft sampling."""
    if verify not in ABLATION_VERIFIERS:
        raise OmnidraftError(f"the cache ablation verifies with {' or '.join(ABLATION_VERIFIERS)}, not {verify!r}")
    # the cost-aware policy may decide not to draft at all (a slow drafter, a busy machine): then no
    # n-gram is ever learned, so the ablation always drafts, stopping on the drafter's confidence
    stop = "confidence" if base.draft_stop == "auto" else base.draft_stop
    config = replace(base, verify=verify, translate="tokens", use_ngram=True, lookup=False, draft_stop=stop,
                     temperature=0.0 if verify == "greedy" else temperature)
    config.validate()
    return config


@dataclass
class AblationResult:
    """Everything the report needs: caps, growth curves, stream and held-out summaries."""

    full_entries: int
    configs: list[CappedConfig]
    growth: dict[str, list[GrowthPoint]]
    stream_summary: dict[str, dict]
    summary: dict[str, dict]
    footprints: dict[str, dict]

    def as_dict(self) -> dict:
        return {
            "full_entries": self.full_entries,
            "caps": {c.name: {"fraction": str(c.fraction), "policy": c.policy, "max_entries": c.max_entries}
                     for c in self.configs},
            "growth": {name: [p.as_dict() for p in curve] for name, curve in self.growth.items()},
            "stream": self.stream_summary,
            "configs": self.summary,
            "footprints": self.footprints,
        }


def run_cache_ablation(pipe, stream_prompts: Sequence[list[int]], heldout_prompts: Sequence[list[int]],
                       config: DecodeConfig, store_dir: Path, warmup: list[int] | None = None,
                       progress: bool = True) -> AblationResult:
    """The three phases of the module docstring on a loaded pipeline; ``config`` comes from
    :func:`speculative_config`. Stores are written under ``store_dir`` and left there."""
    decoder = pipe.decoder
    if decoder.drafter is None:
        raise OmnidraftError("the cache ablation needs a drafter (not --drafter none)")
    pair = pair_id(decoder.bridge.drafter_tokenizer, decoder.target.tokenizer)

    def mode(cache: NgramTrie, cfg: DecodeConfig = config) -> ModeFn:
        return our_mode(SpeculativeDecoder(decoder.target, decoder.drafter, decoder.bridge, cache), cfg)

    streams = learn_full(mode, stream_prompts, store_dir, pair, progress)
    full_entries = len(streams[FULL].cache)
    configs = capped_configs(full_entries)
    streams |= learn_capped(mode, configs, stream_prompts, store_dir, pair, progress)
    frozen = {name: reopen_frozen(s.cache) for name, s in streams.items()}
    caches = {c.name: frozen[c.name] for c in configs} | {FULL: frozen[FULL]}
    modes = {TARGET: our_mode(SpeculativeDecoder(decoder.target), replace(config, verify="greedy", temperature=0.0)),
             NO_CACHE: mode(NgramTrie(), replace(config, use_ngram=False))}
    modes.update({name: mode(cache) for name, cache in caches.items()})
    runs = run_bench(modes, list(heldout_prompts), warmup=warmup, progress=progress)
    footprints = {name: footprint(cache) for name, cache in caches.items()}
    return AblationResult(full_entries, configs, {name: s.growth for name, s in streams.items()},
                          stream_report(streams), evaluation_report(runs, footprints, config.verify == "greedy"),
                          footprints)


def learn_full(mode: Callable[[NgramTrie], ModeFn], prompts: Sequence[list[int]], store_dir: Path, pair: str,
               progress: bool) -> dict[str, Stream]:
    """Phase 1: the uncapped cache learning over the stream; its final size is F."""
    full = fresh_store(store_dir, FULL, pair)
    streams = {FULL: Stream(full, mode(full))}
    run_streams(streams, prompts, progress, desc="stream (full cache)")
    if len(full) == 0:
        raise OmnidraftError("the stream learned no n-grams, so there is nothing to ablate: "
                             "use more --stream-n prompts or --max-new-tokens")
    return streams


def learn_capped(mode: Callable[[NgramTrie], ModeFn], configs: Sequence[CappedConfig], prompts: Sequence[list[int]],
                 store_dir: Path, pair: str, progress: bool) -> dict[str, Stream]:
    """Phase 2: each capped cache learning over the same stream, evicting as it goes."""
    streams = {}
    for c in configs:
        cache = fresh_store(store_dir, c.slug, pair, max_entries=c.max_entries, policy=c.policy)
        streams[c.name] = Stream(cache, mode(cache))
    run_streams(streams, prompts, progress, desc="stream (capped caches)")
    return streams


def evaluation_report(runs: dict[str, list[PromptRun]], footprints: dict[str, dict], greedy: bool) -> dict[str, dict]:
    """Phase 3's rows: the bench summary against the target, plus each cache's size and cap."""
    # Greedy is lossless: every configuration must reproduce the target's output.
    summary = summarize(runs, baseline=TARGET, compare=list(runs) if greedy else [TARGET])
    for name, row in summary.items():
        row["cache"] = footprints.get(name, {"entries": 0, "max_entries": None})  # target, no cache
    return summary


def stream_report(streams: dict[str, Stream]) -> dict[str, dict]:
    """What each cache did while learning (not timed against the target: no speedups)."""
    summary = summarize({name: s.runs for name, s in streams.items()}, baseline=None, compare=())
    for name, s in streams.items():
        last = s.growth[-1]
        summary[name].update(entries=last.entries, evictions=last.evictions,
                             max_entries=getattr(s.cache, "max_entries", None))
    return summary
