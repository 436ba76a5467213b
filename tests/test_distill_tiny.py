"""Distiller options on a tiny random drafter: which tokens each loss term trains on."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from omnidraft.train.distill import Distiller, TrainConfig
from omnidraft.train.records import Example

VOCAB = 64


def _example(seed: int, length: int = 24) -> Example:
    """DM labels from position 8 on, two n-gram sub-tokens and two straddling tokens before them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (length,), generator=g)
    pos = torch.arange(8, length)
    k = 4
    return Example(input_ids=ids, dm_pos=pos, dm_topk=torch.randint(1, VOCAB, (len(pos), k, 1), generator=g),
                   dm_topk_logp=torch.log(torch.full((len(pos), k), 0.2)), dm_log_mass=torch.zeros(len(pos)),
                   dm_logp_emitted=torch.full((len(pos),), -1.0), ng_pos=torch.tensor([4, 5]),
                   ng_logp_target=torch.tensor([-0.5, -0.5]), emitted_tokens=length - 4,
                   emitted_start=4, span_pos=torch.tensor([6, 7]))


def _distiller(**config) -> Distiller:
    torch.manual_seed(0)
    return Distiller(tiny_model(VOCAB, seed=3), torch.ones(VOCAB, dtype=torch.bool),
                     TrainConfig(lr=1e-2, rank=4, alpha=4, batch_size=2, head=False, **config))


def test_straddling_tokens_are_trained_only_with_a_span_weight():
    examples = [_example(s) for s in range(4)]
    assert _distiller().evaluate(examples).span_tokens == 0  # eq. (4) as written: no term for them
    distiller = _distiller(span_weight=1.0)
    before = distiller.evaluate(examples)
    assert before.span_tokens == 8 and before.span_nll > 0
    without = _distiller().evaluate(examples)
    # the mean loss now averages three kinds of labelled token: 16 DM + 2 n-gram + 2 span per example
    expected = (without.loss * 18 + before.span_nll * 2) / 20
    assert before.loss == pytest.approx(expected, rel=1e-5)
    for _ in range(5):
        distiller.update(examples)
    assert distiller.evaluate(examples).span_nll < before.span_nll


def test_span_weight_and_divergence_are_validated():
    with pytest.raises(ValueError, match="span weight"):
        TrainConfig(span_weight=-1).validate()
    with pytest.raises(ValueError, match="unknown divergence 'js'"):
        TrainConfig(divergence="js").validate()


def test_each_divergence_trains_the_drafter_towards_p():
    examples = [_example(s) for s in range(4)]
    for divergence in ("reverse-kl", "forward-kl", "tvd"):
        # the DM term alone: with λ = 1 the n-gram NLL's gradient can outweigh TVD's small one
        distiller = _distiller(divergence=divergence, loss="dm")
        before = distiller.evaluate(examples).dm_kl
        for _ in range(3):
            distiller.update(examples)
        assert distiller.evaluate(examples).dm_kl < before, divergence


def test_dm_agreement_splits_evaluates_top1_per_position():
    examples = [_example(s) for s in range(4)]
    distiller = _distiller()
    for _ in range(3):  # a drafter that agrees somewhere and not everywhere
        distiller.update(examples)
    for i, e in enumerate(examples):  # a distinct target confidence per position, to check the pairing
        e.dm_logp_emitted = -torch.arange(len(e.dm_pos), dtype=torch.float) / 10 - 2 * i
    agree, logp = distiller.dm_agreement(examples)
    assert len(agree) == len(logp) == sum(len(e.dm_pos) for e in examples)
    assert 0 < float(agree.float().mean()) < 1
    assert float(agree.float().mean()) == pytest.approx(distiller.evaluate(examples).top1_agreement)
    assert torch.equal(logp.sort().values, torch.cat([e.dm_logp_emitted for e in examples]).sort().values)
    # each flag belongs to its own position's confidence: the same split, example by example
    for e in examples:
        one_agree, one_logp = distiller.dm_agreement([e])
        picked = torch.isin(logp, one_logp)
        assert torch.equal(agree[picked][logp[picked].argsort()], one_agree[one_logp.argsort()])


def test_a_published_adapter_resumes_at_its_own_rank_and_scaling():
    """A home's adapter trained under another rank (an older default) goes on training at that rank,
    with the scaling it was published with, instead of failing to load or changing what it computes."""
    examples = [_example(s) for s in range(2)]
    trained = _distiller()  # rank 4, scaling 1
    trained.update(examples)
    state = trained.state()
    torch.manual_seed(0)
    resumed = Distiller(tiny_model(VOCAB, seed=3), torch.ones(VOCAB, dtype=torch.bool),
                        TrainConfig(lr=1e-2, rank=2, alpha=4, batch_size=2, head=False), state, scaling=1.0)
    assert (resumed.config.rank, resumed.config.scaling) == (4, 1.0)
    assert all(torch.equal(resumed.state()[k], v) for k, v in state.items())
    assert resumed.evaluate(examples).loss == pytest.approx(trained.evaluate(examples).loss, rel=1e-6)
    resumed.update(examples)  # and it trains
    assert any(not torch.equal(resumed.state()[k], v) for k, v in state.items())
