"""Rejection-sampling verifiers keep the target's distribution (tiny models, different vocabularies).

The first emitted token of ``tli`` and ``omnidraft`` (no n-grams: q' is the intersection-restricted
drafter, exact) must be distributed as the target's p: chi-square over many seeded samples. With
n-grams, eq. (2) is approximate by design (the paper says so); the test bounds the distance.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from tiny import tiny_pair

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.ngram import NgramTrie
from omnidraft.runtime import make_drafter
from omnidraft.target import TorchTarget
from omnidraft.verify.sampling import probs_from_logits

SAMPLES = 2500
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def pair():
    d_model, target, bridge = tiny_pair()
    assert 256 < bridge.intersection_size < len(bridge.drafter_tokenizer)  # different vocabularies, shared bytes
    return d_model, target, bridge


def first_token_counts(decoder: SpeculativeDecoder, prompt: list[int], verify: str) -> tuple[torch.Tensor, int]:
    """Histogram of the first emitted token over seeded runs, and the n-gram proposals made."""
    counts, ngram_hits = torch.zeros(decoder.target.vocab_size), 0
    for seed in range(SAMPLES):
        cfg = DecodeConfig(max_new_tokens=4, verify=verify, draft_len=3, temperature=TEMPERATURE, seed=seed,
                          draft_stop="fixed")
        first = next(iter(decoder.stream_ids(prompt, cfg)))[0]
        counts[first] += 1
        ngram_hits += decoder.stats.ngram_hits_proposed
    return counts, ngram_hits


def target_p(target: TorchTarget, prompt: list[int]) -> torch.Tensor:
    return probs_from_logits(target.score(prompt, 0)[0], TEMPERATURE)


def chi_square_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    big = expected >= 5  # pool rare tokens into one bin so the test is valid
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("verify", ["tli", "omnidraft", "text-sample"])
def test_first_token_follows_target_distribution(pair, verify):
    d_model, target, bridge = pair
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge, NgramTrie())
    prompt = target.tokenizer.encode("the cat sat on")
    counts, _ = first_token_counts(decoder, prompt, verify)
    p = target_p(target, prompt)
    assert decoder.stats.proposed_tokens > 0
    assert chi_square_pvalue(counts, p) > 1e-3


def test_rejection_sampling_is_not_vacuous(pair):
    """Sampling straight from the drafter (no verification) must fail the same chi-square test."""
    d_model, target, bridge = pair
    prompt = target.tokenizer.encode("the cat sat on")
    drafter = make_drafter(d_model, bridge, target)
    d_ctx = bridge.target_to_drafter(prompt)
    q = probs_from_logits(drafter.lm.logits_for(d_ctx) + bridge.dm_bias, TEMPERATURE)
    q_t = torch.zeros(target.vocab_size).index_add_(0, bridge.d2t[bridge.dm_mask], q[bridge.dm_mask])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(q_t, SAMPLES, replacement=True, generator=gen), minlength=target.vocab_size).float()
    assert chi_square_pvalue(counts, target_p(target, prompt)) < 1e-3


def test_omnidraft_with_ngrams_stays_close(pair):
    d_model, target, bridge = pair
    ngrams = NgramTrie()
    for t_id, data in enumerate(bridge.t.token_bytes):  # every target token the drafter spells in >= 2
        if data and bridge.t2d[t_id] < 0:
            d_ids = bridge.drafter_encode(data)
            if len(d_ids) >= 2:
                ngrams.add(d_ids, t_id)
    assert len(ngrams) > 0
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge, ngrams)
    prompt = target.tokenizer.encode("the cat sat on")
    counts, ngram_hits = first_token_counts(decoder, prompt, "omnidraft")
    pvalue = chi_square_pvalue(counts, target_p(target, prompt))
    print(f"omnidraft with {len(ngrams)} n-grams: {ngram_hits} n-gram proposals, chi-square p {pvalue:.3g}")
    assert ngram_hits > 0
    assert pvalue > 1e-3  # eq. (2) is approximate, but not measurably so at this sample size


def test_text_sample_output_is_the_targets_own_sample_whatever_is_drafted(pair):
    """Sample-and-compare with per-position randomness: the tokens text-sample emits are the draws the
    target alone makes at those positions with the same seed, however the drafts split the steps (a
    fixed k of 2 and 5) and whether lookup or the drafter proposed them."""
    d_model, target, bridge = pair
    prompt = target.tokenizer.encode("the cat sat on the mat and the dog sat on the log")
    alone = SpeculativeDecoder(target)
    drafted = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge, NgramTrie(), lookup=True)
    proposed = 0
    references = set()
    for seed in range(4):
        base = DecodeConfig(max_new_tokens=24, temperature=TEMPERATURE, seed=seed, draft_stop="fixed")
        reference = alone.generate(prompt, base).token_ids
        references.add(tuple(reference))
        for k in (2, 5):
            out = drafted.generate(prompt, DecodeConfig(max_new_tokens=24, verify="text-sample", draft_len=k,
                                                        temperature=TEMPERATURE, seed=seed, draft_stop="fixed"))
            proposed += drafted.stats.proposed_tokens
            assert out.token_ids == reference, (seed, k)
    assert proposed > 40  # the steps really were split by drafts
    assert len(references) > 1  # and the seed really changes the sample
