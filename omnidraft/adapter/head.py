"""The acceptance head: a tiny network that predicts whether the target will accept a drafted token
(OmniDraft §3.3, after SpecDec++), so drafting stops before the tokens that would be rejected.

eq. (5)  P(y_i accepted | y_<i accepted) = sigmoid(f_φ(e_i))
eq. (6)  P(∃ i ≤ k: y_i rejected) = 1 − Π_i P(y_i accepted | y_<i accepted)
eq. (7)  stop drafting once (6) exceeds γ

e_i here is the drafter's final hidden state at the position that proposed y_i (what its LM head
reads), plus two numbers the LM head gives for free: logit(max q) and the entropy of q. The head is
a logistic regression on those two plus a small MLP on the (layer-normed) hidden state, whose output
layer starts at zero; the regression starts at P(accept) = max q. So an untrained head is the plain
confidence rule under eq. (7), and the first updates, which have a few hundred labels, only have to
calibrate two weights; the MLP then learns *where* this drafter disagrees with this target (code
indentation, names, list markers) as labels accumulate. (Why it starts from max q: on the untrained
drafter max q alone already separates accepted from rejected tokens well, while a head over the
raw hidden state learns little from a few hundred labels; NOTES.md has the measurements.)

Labels (Algorithm 3, line 9) are min(1, p(y)/q(y)) for the drafter's own greedy proposal. Under
greedy verification p is one-hot on the target's token, so the label is 1 when the current drafter's
argmax equals the target's next token (teacher-forced on the target's output, which is exactly the
"previous tokens accepted" condition of eq. (5)) and 0 otherwise. The loss is weighted BCE: the
rejected class gets ``reject_weight`` (1 keeps the probabilities calibrated, so γ means what eq. (7)
says; a larger weight is the same as a stricter γ).
"""

from __future__ import annotations

import math

import torch

CONFIDENCE_FEATURES = 2  # log max q, entropy of q
_LEAST = torch.finfo(torch.float32).min  # what a -inf logit is taken as: exp gives 0, and 0 times it is 0
DEFAULT_WIDTH = 64


class AcceptHead(torch.nn.Module):
    """f_φ: [hidden, logit max q, entropy] -> acceptance logit (eq. 5)."""

    def __init__(self, hidden_size: int, width: int = DEFAULT_WIDTH) -> None:
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        self.confidence = torch.nn.Linear(CONFIDENCE_FEATURES, 1)
        self.norm = torch.nn.LayerNorm(hidden_size, elementwise_affine=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden_size, width), torch.nn.SiLU(), torch.nn.Linear(width, 1))
        with torch.no_grad():  # start as P(accept) = max q
            self.confidence.weight.copy_(torch.tensor([[1.0, 0.0]]))
            self.confidence.bias.zero_()
            self.mlp[2].weight.zero_()
            self.mlp[2].bias.zero_()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden, confidence = features[:, : self.hidden_size], features[:, self.hidden_size:]
        return (self.confidence(confidence) + self.mlp(self.norm(hidden))).squeeze(-1)

    @torch.no_grad()
    def accept_prob(self, hidden: torch.Tensor, logits: torch.Tensor) -> float:
        """P(accepted) for one drafted position: ``sigmoid(self(features(...)))`` for one row.

        This runs once per drafted token, so it takes the fewest passes over the vocabulary-wide row
        (max, exp, sum and one dot product: with d = l - max l and e = exp d, log max q = -log Σe and
        the entropy is log Σe - (e·d)/Σe) and calls the layers' functions directly; the module's
        per-call overhead and log_softmax's extra passes cost ~0.3 ms a token in the loop."""
        # -inf logits (tokens a pruned head leaves out) become the least float: e is 0 there, and e·d stays finite
        shifted = (logits.float() - logits.max()).clamp_(min=_LEAST)
        e = shifted.exp()
        total, dot = float(e.sum()), float(torch.dot(e, shifted))
        log_total = math.log(total)
        top = min(-log_total, -1e-6)  # log max q < 0, as in ``features``
        confidence = (self._conf[0] * (top - math.log(-math.expm1(top))) + self._conf[1] * (log_total - dot / total)
                      + self._conf[2])
        first, last = self.mlp[0], self.mlp[2]
        normed = torch.nn.functional.layer_norm(hidden.float(), (self.hidden_size,), eps=self.norm.eps)
        inner = torch.nn.functional.silu(torch.addmv(first.bias, first.weight, normed))
        z = confidence + float(torch.dot(last.weight[0], inner)) + float(last.bias[0])
        return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

    @property
    def _conf(self) -> tuple[float, float, float]:
        """The logistic regression's weights as floats: (logit max q, entropy, bias)."""
        w = self.confidence.weight[0]
        return float(w[0]), float(w[1]), float(self.confidence.bias[0])


def features(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[n, hidden + 2]: the hidden state (float32), logit(max q) and the entropy of q = softmax(logits)."""
    logq = torch.log_softmax(logits.float(), dim=-1).clamp_(min=_LEAST)  # -inf (a pruned head): q = 0 adds 0
    top = logq.max(dim=-1).values.clamp(max=-1e-6)  # log max q < 0, so logit(max q) stays finite
    logit_top = top - torch.log(-torch.expm1(top))  # log q − log(1 − q)
    entropy = -(logq.exp() * logq).sum(dim=-1)
    return torch.cat([hidden.float(), logit_top[:, None], entropy[:, None]], dim=-1)


def should_stop(accept_probs: list[float], gamma: float) -> bool:
    """eq. (6)/(7): stop once P(at least one of the drafted tokens is rejected) > γ."""
    return 1.0 - math.prod(accept_probs) > gamma


def from_state(state: dict[str, torch.Tensor], hidden_size: int) -> AcceptHead:
    """A head rebuilt from saved tensors; ValueError when they do not fit ``hidden_size``."""
    first = state.get("mlp.0.weight")
    if first is None or first.dim() != 2 or first.shape[1] != hidden_size:
        got = None if first is None else tuple(first.shape)
        raise ValueError(f"acceptance head does not fit this drafter (hidden layer {got}, drafter width {hidden_size})")
    if any(not torch.isfinite(t).all() for t in state.values()):
        raise ValueError("acceptance head holds non-finite weights")
    head = AcceptHead(hidden_size, int(first.shape[0]))
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:  # missing / unexpected / misshapen tensors
        raise ValueError(f"acceptance head does not fit this drafter ({str(exc).splitlines()[0][:120]})") from None
    return head.eval()
