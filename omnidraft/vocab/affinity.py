"""Token-affinity kernel for RDK, out-of-vocabulary sampling (Redistributing Drafter Kernels).

TLI restricts the drafter to the vocabulary intersection I, so a target token the drafter cannot
say in one token is never proposed — SmolLM2 has '):' but not Qwen's '):\\n', so every code line
ends in a rejection. RDK (Algorithm 1) redistributes the TLI distribution q' with a row-stochastic
token-affinity matrix M: p' = Mᵀq', then runs plain speculative rejection sampling with p'.
Whatever M is, that is exactly lossless: p' is known before the target is consulted.

The prior, from the tokenizers alone (no data): **byte-prefix affinity**. A target token j outside
I is affine to each intersection token i whose bytes are a proper prefix of j's — the drafter
reaching for '):' is evidence that the target may write '):\\n'. eq. (2) gives the weights,

    M_ij = exp(Ω_ij / τ) / Σ_k exp(Ω_ik / τ)   over k ∈ {i} ∪ ext(i),

with Ω_ik = −log(1 + rank_k), rank_k = the position of the merge that makes token k in the target
tokenizer's BPE merge list (0 for a base piece): merges are learned most-frequent-first, so a
frequent extension gets more of i's mass than a rare one (Zipf), and the share i keeps grows as τ
falls (τ → 0 is TLI). No extension gets more weight than i itself (Ω_ij is capped at Ω_ii). M is sparse (each row holds i and its
extensions), so p' = Mᵀq' costs O(nnz(M)) per drafted position — linear in the vocabulary, like
the paper's first-order form, eq. (3), but exact. eq. (3) is ``taylor_redistribution`` below: it
spreads θ·p_j/(N + p_j) onto every token, which at N ≈ 10⁵ intersection tokens moves about θ/N of
the mass out of the intersection, i.e. nothing measurable (docs/sampling.md compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnidraft.vocab.bridge import VocabBridge

DEFAULT_TAU = 0.25  # chosen by the expected-acceptance study in docs/sampling.md


@dataclass
class AffinityKernel:
    """The sparse M of one pair: what each intersection token keeps, and its extensions' shares."""

    keep: torch.Tensor  # [target vocab] M_ii for i in I (1 for tokens with no extension)
    rows: torch.Tensor  # [nnz] i (target id in I)
    cols: torch.Tensor  # [nnz] j (target id outside I whose bytes extend i's)
    weights: torch.Tensor  # [nnz] M_ij
    tau: float

    @property
    def nnz(self) -> int:
        return len(self.rows)

    def redistribute(self, q_target: torch.Tensor) -> torch.Tensor:
        """p' = Mᵀq' (Algorithm 1, line 2) for q' over the target vocabulary (mass on I only)."""
        out = q_target * self.keep
        return out.index_add_(0, self.cols, q_target[self.rows] * self.weights)


def prefix_pairs(bridge: VocabBridge) -> tuple[list[int], list[int]]:
    """(i, j) for every target token j outside the intersection and every intersection token i
    whose bytes are a proper prefix of j's bytes."""
    in_intersection = bridge.t2d >= 0
    index = {data: tid for tid, data in enumerate(bridge.t.token_bytes)
             if data and tid < len(in_intersection) and bool(in_intersection[tid])}
    rows: list[int] = []
    cols: list[int] = []
    for j, data in enumerate(bridge.t.token_bytes[: bridge.target_vocab_size]):
        if not data or len(data) < 2 or bool(in_intersection[j]):
            continue
        for end in range(1, len(data)):
            i = index.get(data[:end])
            if i is not None:
                rows.append(i)
                cols.append(j)
    return rows, cols


def build_kernel(bridge: VocabBridge, tau: float = DEFAULT_TAU) -> AffinityKernel:
    """M of eq. (2) over the byte-prefix neighbourhoods, computed once per pair (``kernel_for``)."""
    if tau <= 0:
        raise ValueError("the affinity temperature tau must be > 0")
    rows_l, cols_l = prefix_pairs(bridge)
    rows = torch.tensor(rows_l, dtype=torch.long)
    cols = torch.tensor(cols_l, dtype=torch.long)
    n = bridge.target_vocab_size
    log_rank = torch.log(merge_ranks(bridge.target_tokenizer, n) + 1.0)
    # Row-wise softmax of -log(rank)/tau over {i} ∪ ext(i), computed relative to the self term
    # (exp((log rank_i - log rank_j)/tau)) so no row underflows.
    # An extension never outweighs i itself: ids follow frequency in a BPE vocabulary, not in every
    # SentencePiece one (Gemma's), and an extension that took most of i's mass would lose acceptance
    # wherever the target simply wants i.
    rel = torch.exp(((log_rank[rows] - log_rank[cols]) / tau).clamp_max(0.0))
    norm = torch.ones(n, dtype=torch.float64).index_add_(0, rows, rel)
    keep = (1.0 / norm).to(torch.float32)
    weights = (rel / norm[rows]).to(torch.float32)
    return AffinityKernel(keep, rows, cols, weights, tau)


def merge_ranks(tokenizer, vocab_size: int) -> torch.Tensor:
    """How late each token is made in the tokenizer's BPE merge list (0 for base pieces): merges are
    learned most-frequent-first, so this ranks tokens by corpus frequency from the tokenizer alone.
    Ids stand in where the tokenizer has no merge list (they follow merge order in most BPE files)."""
    import json

    ranks = torch.arange(vocab_size, dtype=torch.float64)
    try:
        model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
        vocab, merges = model["vocab"], model["merges"]
    except (AttributeError, KeyError, TypeError, ValueError):
        return ranks
    if not merges:
        return ranks
    ranks.fill_(0.0)
    seen: set[int] = set()
    for r, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        tid = vocab.get(left + right)
        if tid is not None and tid < vocab_size and tid not in seen:
            seen.add(tid)
            ranks[tid] = r + 1
    return ranks


_KERNELS: dict[tuple[int, float], AffinityKernel] = {}


def kernel_for(bridge: VocabBridge, tau: float = DEFAULT_TAU) -> AffinityKernel:
    """The pair's kernel, built on first use and kept as long as the process (like the bridge)."""
    key = (id(bridge), tau)
    if key not in _KERNELS:
        _KERNELS[key] = build_kernel(bridge, tau)
    return _KERNELS[key]


def taylor_redistribution(q_target: torch.Tensor, prior: torch.Tensor, intersection_size: int) -> torch.Tensor:
    """The paper's linear-time first-order form, eq. (3): p̃_i = (N q'_i + θ p_i) / (N + p_i), θ = pᵀq',
    normalised; ``prior`` plays p, N = |I|. Kept for the comparison with the exact sparse form."""
    n = float(intersection_size)
    theta = float(prior @ q_target)
    tilde = (n * q_target + theta * prior) / (n + prior)
    return tilde / tilde.sum()
