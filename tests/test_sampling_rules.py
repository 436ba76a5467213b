"""Every exact sampling rule keeps the target's distribution, at the first *and* the second emitted
token (tiny models with different small vocabularies, many seeded runs, chi-square at α = 1e-3).

The second token's reference is the target's own two-step marginal, Σ_a p(a) p(· | a). The
sample size is chosen so that the same test rejects a distribution 2% away from the target's
(mass 0.02 moved between two of its tokens): ``test_the_test_catches_a_two_percent_shift``.
Special cases: a draft whose text crosses target-token boundaries (``text-sample``, SLRS) and a
prompt whose most likely target token is outside the vocabulary intersection (RDK's case).
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
from omnidraft.sources.policy import NoCostPolicy
from omnidraft.verify.sampling import probs_from_logits
from omnidraft.vocab.affinity import kernel_for
from omnidraft.vocab.reverse import DrafterContext
from omnidraft.vocab.slrs import first_target_token

SAMPLES = 5000
TEMPERATURE = 0.9
ALPHA = 1e-3
# (rule, lookahead of slrs)
RULES = [("tli", 1), ("text-sample", 1), ("rdk", 1), ("slrs", 1), ("slrs", 2)]


@pytest.fixture(scope="module")
def pair():
    d_model, target, bridge = tiny_pair()
    return SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge, NgramTrie())


def target_rows(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """p(first token) and the marginal of the second, Σ_a p(a) p(· | prompt + a), over first tokens
    that do not end the text (after one that does there is no second token)."""
    first = probs_from_logits(target.score(prompt, 0)[0], TEMPERATURE)
    second = torch.zeros_like(first)
    for a in torch.nonzero(first > 1e-6).flatten().tolist():
        if a in target.eos_ids:
            continue
        target.reset()
        second += first[a] * probs_from_logits(target.score(prompt + [a], 0)[0], TEMPERATURE)
    target.reset()
    return first, second / second.sum()


def pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    big = expected >= 5  # rare tokens pooled into one bin so the test is valid
    obs, exp = counts[big], expected[big]
    if float(expected[~big].sum()) > 0:
        obs = torch.cat([obs, counts[~big].sum(0, keepdim=True)])
        exp = torch.cat([exp, expected[~big].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def two_token_counts(decoder: SpeculativeDecoder, prompt: list[int], rule: str, lookahead: int
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Histograms of the first and second emitted token over seeded runs, and the proposals made."""
    vocab = decoder.target.vocab_size
    first, second, proposed = torch.zeros(vocab), torch.zeros(vocab), 0
    for seed in range(SAMPLES):
        cfg = DecodeConfig(max_new_tokens=2, verify=rule, draft_len=3, temperature=TEMPERATURE, seed=seed,
                           draft_stop="fixed", slrs_lookahead=lookahead, lookup=False)
        out = [t for chunk in decoder.stream_ids(prompt, cfg) for t in chunk]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        proposed += decoder.stats.proposed_tokens
    return first, second, proposed


def prompt_with_top_token_outside_intersection(decoder: SpeculativeDecoder) -> list[int]:
    """A prompt after which the target's most likely token is one the drafter cannot say in one token."""
    target, bridge = decoder.target, decoder.bridge
    outside = bridge.t2d < 0
    for text in ["the cat sat on", "def add(a", "numbers like", "speculative", "the dog", "drafts tokens and",
                 "the target", "return a", "on the", "12345 and"]:
        prompt = target.tokenizer.encode(text)
        target.reset()
        top = int(target.score(prompt, 0)[0].argmax())
        if bool(outside[top]):
            target.reset()
            return prompt
    pytest.fail("no test prompt has its top target token outside the intersection")


@pytest.mark.parametrize(("rule", "lookahead"), RULES, ids=[f"{r}-{n}" if r == "slrs" else r for r, n in RULES])
def test_first_and_second_token_follow_the_target(pair, rule, lookahead):
    prompt = pair.target.tokenizer.encode("def add(a")
    first, second, proposed = two_token_counts(pair, prompt, rule, lookahead)
    p_first, p_second = target_rows(pair.target, prompt)
    assert proposed > SAMPLES // 2 and first.sum() == SAMPLES and second.sum() > 0.9 * SAMPLES
    assert pvalue(first, p_first) > ALPHA
    assert pvalue(second, p_second) > ALPHA


def test_rdk_where_the_top_token_is_outside_the_intersection(pair):
    prompt = prompt_with_top_token_outside_intersection(pair)
    kernel = kernel_for(pair.bridge)
    assert kernel.nnz > 0  # the drafter's mass can reach tokens it cannot say
    first, second, _ = two_token_counts(pair, prompt, "rdk", 1)
    p_first, p_second = target_rows(pair.target, prompt)
    assert pvalue(first, p_first) > ALPHA and pvalue(second, p_second) > ALPHA


def test_the_test_catches_a_two_percent_shift(pair):
    """The same sample size and α reject a distribution 0.02 (total variation) from the target's."""
    prompt = pair.target.tokenizer.encode("def add(a")
    p_first, _ = target_rows(pair.target, prompt)
    order = p_first.argsort(descending=True)
    shifted = p_first.clone()
    shifted[order[0]] -= 0.02
    shifted[order[4]] += 0.02  # 2% of the mass moved from the top token to the fifth
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(shifted, SAMPLES, replacement=True, generator=gen),
                            minlength=len(p_first)).float()
    assert pvalue(counts, p_first) < ALPHA


@pytest.mark.parametrize("lookahead", [2, 3])
def test_slrs_psi_is_the_distribution_of_the_drafted_first_token(pair, lookahead):
    """ψ (Theorem 3.2's sum over the tree of drafter spellings) adds up to 1 over the target
    vocabulary, and it is the distribution of the first target token of the strings the drafter
    actually drafts under the lookahead rule."""
    prompt = pair.target.tokenizer.encode("def add(a")
    cfg = DecodeConfig(max_new_tokens=8, verify="slrs", draft_len=8, temperature=1.3, draft_stop="fixed",
                       slrs_lookahead=lookahead)
    plan = pair.source("drafter").plan(cfg, torch.Generator().manual_seed(0), NoCostPolicy())
    ctx = DrafterContext(pair.bridge, prompt)
    draft = pair.drafter.draft(ctx.ids, 8, plan.policy)
    psi = torch.tensor([plan.translator.psi(draft, t)[0] for t in range(pair.target.vocab_size)])
    assert abs(float(psi.sum()) - 1.0) < 1e-5
    counts = torch.zeros(pair.target.vocab_size)
    for _ in range(SAMPLES // 2):
        counts[first_target_token(plan.translator.index, pair.drafter.draft(ctx.ids, 8, plan.policy).tokens)] += 1
    assert pvalue(counts, psi) > ALPHA
