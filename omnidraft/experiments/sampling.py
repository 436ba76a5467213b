"""How much each exact sampling rule *could* accept on a real pair, and what SLRS costs.

Two measurements that need no timing (so they are stable on a shared machine):

- **Expected acceptance per position.** Along text the target itself samples at temperature T,
  at each position the drafter's distribution q (from the same text, re-tokenized for it) and the
  target's p give each rule's probability of accepting its proposal there: Σ_t min(p(t), q'(t))
  for a proposal distribution q' (speculative sampling's acceptance), with q' = TLI's q restricted
  to the intersection, RDK's Mᵀq' for each affinity temperature τ (and the paper's first-order
  eq. (3)), SLRS's ψ at lookahead 1; and p(argmax) for the deterministic text draft
  (``text-sample``, q = δ). This is how RDK's τ was chosen.
- **SLRS tree sizes** (Appendix D of the heterogeneous-vocabulary paper): drafter forwards a ψ(t)
  needs, per target token, at each lookahead — where the tree stays small and where it explodes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from omnidraft.verify.sampling import probs_from_logits
from omnidraft.vocab.affinity import build_kernel, taylor_redistribution
from omnidraft.vocab.slrs import MAX_FORWARDS, index_for, psi_row, tree_sizes


def expected_acceptance(pipe, prompts: Sequence[list[int]], temperature: float, new_tokens: int,
                        taus: Sequence[float], seed: int = 0) -> dict[str, float]:
    """Mean expected acceptance of the first proposal per position, per rule (see module doc)."""
    from omnidraft.config import DecodeConfig
    from omnidraft.decode import SpeculativeDecoder

    target, drafter, bridge = pipe.decoder.target, pipe.decoder.drafter, pipe.decoder.bridge
    kernels = {tau: build_kernel(bridge, tau) for tau in taus}
    index = index_for(bridge)
    drafting = pipe.decoder.source("drafter")
    dm = drafting.translator("tokens", False, False)
    text_rule = drafting.translator("text", False, False)
    prior = torch.full((target.vocab_size,), 1.0 / target.vocab_size)  # eq. (3)'s p: flat (no data)
    sums: dict[str, float] = {}
    count = 0
    plain = SpeculativeDecoder(target)
    for k, prompt in enumerate(prompts):
        target.reset()
        out = plain.generate(prompt, DecodeConfig(max_new_tokens=new_tokens, temperature=temperature, seed=seed + k,
                                                  lookup=False)).token_ids
        target.reset()
        rows = probs_from_logits(target.score(prompt + out, len(out)), temperature)  # p before each emitted token
        for i in range(len(out)):
            d_ctx = bridge.target_to_drafter(prompt + out[:i])
            logits = drafter.lm.logits_for(d_ctx)
            p = rows[i]
            q_any = probs_from_logits(logits + text_rule.constraint(len(logits)).bias(), temperature)
            q_tli = dm.dm_target_probs(probs_from_logits(logits + dm.dm_bias(len(logits)), temperature))
            values = {"tli": q_tli, "slrs (lookahead 1)": psi_row(index, q_any, target.vocab_size),
                      "rdk eq. (3)": taylor_redistribution(q_tli, prior, bridge.intersection_size)}
            values.update({f"rdk τ={tau:g}": kern.redistribute(q_tli) for tau, kern in kernels.items()})
            for name, q in values.items():
                sums[name] = sums.get(name, 0.0) + float(torch.minimum(p, q).sum())
            greedy = bridge.forward_text(prompt + out[:i], [int(logits.argmax())]).target_ids
            sums["text-sample (q = δ)"] = sums.get("text-sample (q = δ)", 0.0) + (float(p[greedy[0]]) if greedy else 0.0)
            count += 1
    drafter.reset()
    target.reset()
    return {name: total / count for name, total in sums.items()} | {"positions": count}


def slrs_cost(bridge, lookaheads: Sequence[int] = (2, 3, 4), sample: int = 4000, seed: int = 0) -> list[dict]:
    """Per lookahead: drafter forwards per ψ(t) over a random sample of target tokens (capped at
    MAX_FORWARDS + 1), and the share of tokens over the cap."""
    index = index_for(bridge)
    tokens = sorted((t, b) for b, t in index.target_ids.items())
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(tokens), generator=gen)[: min(sample, len(tokens))].tolist()
    chosen = [tokens[i] for i in pick]
    rows = [{"lookahead": 1, "median": 0, "p90": 0, "max": 0, "over_cap": 0.0}]
    for n in lookaheads:
        sizes = sorted(tree_sizes(index, n, chosen))
        rows.append({"lookahead": n, "median": statistics.median(sizes), "p90": sizes[int(0.9 * (len(sizes) - 1))],
                     "max": sizes[-1], "over_cap": sum(s > MAX_FORWARDS for s in sizes) / len(sizes)})
    return rows


def markdown(acceptance: dict[str, float], cost: list[dict], meta: str) -> str:
    lines = [f"# Exact sampling rules: expected acceptance and SLRS cost\n\n{meta}\n",
             f"Expected acceptance of the first proposal, mean over {acceptance['positions']} positions:\n",
             "| proposal | expected acceptance |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in acceptance.items() if name != "positions"]
    lines += ["", f"SLRS: drafter forwards per ψ(t), over sampled target tokens (capped at {MAX_FORWARDS + 1}):", "",
              "| lookahead | median | 90th percentile | max | over the cap |", "|---|---|---|---|---|"]
    lines += [f"| {r['lookahead']} | {r['median']} | {r['p90']} | {r['max']} | {100 * r['over_cap']:.1f}% |" for r in cost]
    return "\n".join(lines) + "\n"
