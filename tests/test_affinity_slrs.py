"""The pieces behind the rdk and slrs rules on tiny tokenizers: the affinity kernel is
row-stochastic over byte-prefix neighbourhoods (Assumption 4.1 of the RDK paper), the SLRS
first-token rule and its index, and the lookahead refusal where ψ's tree blows up (§3.4)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_pair, tiny_tokenizer

from omnidraft.errors import OmnidraftError
from omnidraft.runtime import build_bridge
from omnidraft.vocab.affinity import (
    build_kernel,
    merge_ranks,
    prefix_pairs,
    taylor_redistribution,
)
from omnidraft.vocab.slrs import (
    MAX_FORWARDS,
    check_lookahead,
    first_target_token,
    index_for,
    psi_row,
    tree_sizes,
)


@pytest.fixture(scope="module")
def bridge():
    return tiny_pair()[2]


def test_kernel_rows_are_stochastic_and_follow_byte_prefixes(bridge):
    kernel = build_kernel(bridge, tau=0.5)
    assert kernel.nnz > 0
    rows = kernel.keep.double().clone()
    rows.index_add_(0, kernel.rows, kernel.weights.double())
    touched = torch.unique(kernel.rows)
    assert torch.allclose(rows[touched], torch.ones(len(touched), dtype=torch.float64), atol=1e-6)  # Σ_j M_ij = 1
    for i, j in zip(kernel.rows.tolist(), kernel.cols.tolist()):
        bi, bj = bridge.target_bytes(i), bridge.target_bytes(j)
        assert bj.startswith(bi) and len(bj) > len(bi)
        assert bridge.t2d[i] >= 0 > bridge.t2d[j]  # from the intersection to outside it
    assert sorted(zip(kernel.rows.tolist(), kernel.cols.tolist())) == sorted(zip(*prefix_pairs(bridge)))


def test_redistribution_keeps_the_mass_and_tau_sets_how_much_moves(bridge):
    q = torch.zeros(bridge.target_vocab_size)
    source = int(build_kernel(bridge).rows[0])
    q[source] = 1.0
    sharp, flat = build_kernel(bridge, tau=0.05).redistribute(q), build_kernel(bridge, tau=5.0).redistribute(q)
    assert abs(float(sharp.sum()) - 1) < 1e-6 and abs(float(flat.sum()) - 1) < 1e-6
    assert float(sharp[source]) > float(flat[source])  # a low τ keeps more on the token itself (τ -> 0: TLI)
    outside = bridge.t2d < 0
    assert float(flat[outside].sum()) > 0  # the drafter's mass reaches tokens it cannot say


def test_taylor_form_moves_about_theta_over_n(bridge):
    """eq. (3) with a flat prior spreads only ~θ/N of the mass outside the intersection."""
    q = torch.zeros(bridge.target_vocab_size)
    inside = torch.nonzero(bridge.t2d >= 0).flatten()
    q[inside] = 1.0 / len(inside)
    prior = torch.full_like(q, 1.0 / len(q))
    out = taylor_redistribution(q, prior, bridge.intersection_size)
    assert abs(float(out.sum()) - 1) < 1e-6
    assert 0 < float(out[bridge.t2d < 0].sum()) < 2.0 / bridge.intersection_size


def test_first_target_token_is_the_longest_target_prefix(bridge):
    index = index_for(bridge)
    for d, data in enumerate(bridge.d.token_bytes[: bridge.drafter_vocab_size]):
        if not data:
            continue
        t = first_target_token(index, [d])
        tb = bridge.target_bytes(t)
        assert data.startswith(tb)
        assert not any(data[:end] in index.target_ids for end in range(len(tb) + 1, len(data) + 1))
    q = torch.softmax(torch.randn(bridge.drafter_vocab_size), -1)
    q[index.first[: len(q)] < 0] = 0
    assert abs(float(psi_row(index, q / q.sum(), bridge.target_vocab_size).sum()) - 1) < 1e-5


def test_a_lookahead_whose_tree_blows_up_is_refused():
    """Lemma 3.3's case: a drafter that spells runs of 'a' in many ways against a target with long
    runs as single tokens; the tree of spellings outgrows MAX_FORWARDS as the lookahead grows."""
    runs = ["a" * n + " b" for n in range(1, 40)] * 20
    d_tok, t_tok = tiny_tokenizer(262, runs), tiny_tokenizer(300, runs)
    pair = build_bridge(tiny_model(len(d_tok), 1), d_tok, tiny_model(len(t_tok), 2), t_tok)
    index = index_for(pair)
    longest = max(((t, b) for b, t in index.target_ids.items()), key=lambda tb: len(tb[1]))
    sizes = [tree_sizes(index, n, [longest])[0] for n in (2, 4, 8)]
    assert sizes[0] <= MAX_FORWARDS < sizes[2] and sizes == sorted(sizes)
    check_lookahead(pair, 1)  # lookahead 1 never walks a tree
    with pytest.raises(OmnidraftError, match="lookahead 8 would need over"):
        check_lookahead(pair, 8)


def test_merge_ranks_order_tokens_by_when_bpe_made_them(bridge):
    """Base pieces rank 0; a merged token ranks after the tokens it is made of (merges are learned
    most-frequent-first) — the frequency prior of the affinity kernel, from the tokenizer alone."""
    tok = bridge.target_tokenizer
    ranks = merge_ranks(tok, bridge.target_vocab_size)
    vocab = tok.get_vocab()
    assert float(ranks[vocab["t"]]) == 0.0 < float(ranks[vocab["Ġt"]]) < float(ranks[vocab["Ġthe"]])
    assert int((ranks > 0).sum()) == len(vocab) - 257  # every token but the 256 bytes and <eos> is a merge
