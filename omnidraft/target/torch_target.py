"""A transformers causal LM on this machine as the target (Algorithm 1, lines 10-11)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnidraft.console import warn
from omnidraft.errors import OmnidraftError
from omnidraft.kv import CachedLM, common_prefix_len, max_positions_of
from omnidraft.target import static
from omnidraft.target.base import eos_ids_of
from omnidraft.verify.tree import Branch


class TorchTarget:
    """:class:`~omnidraft.target.base.Target` over a torch model with a KV cache: the eager engine
    (``kv.CachedLM``), or the static-shape engine with CUDA graphs on a GPU (``static.StaticLM``).

    A server that batches holds a target over a ``static.SessionPool``: it is no session itself, only
    the maker of sessions (``session``) whose forwards can be shared (``score_many``)."""

    def __init__(self, model: torch.nn.Module, tokenizer,
                 lm: CachedLM | static.StaticLM | static.SessionPool | None = None) -> None:
        self.lm = lm if lm is not None else CachedLM(model)
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = self.lm.vocab_size
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.max_context = getattr(self.lm, "max_context", None) or max_positions_of(model)

    def score(self, ids: Sequence[int], num_proposed: int, branches: Sequence[Branch] = ()) -> torch.Tensor:
        if branches:
            return self.lm.logits_for(ids, num_proposed + 1, branches)
        return self.lm.logits_for(ids, keep=num_proposed + 1)

    @property
    def trees(self) -> bool:
        """Whether ``score`` takes branches: the eager engine on a model whose attention a mask decides."""
        return getattr(self.lm, "trees", False)

    @property
    def batch_sessions(self) -> int:
        """How many sessions one forward can serve (``score_many``): the pool's size, else 1."""
        return self.lm.sessions if isinstance(self.lm, static.SessionPool) else 1

    @property
    def cost_by_rows(self) -> bool:
        """Whether a shared forward costs in proportion to its rows (a CPU pool: unpadded,
        compute-bound), so each session's share of its time is its share of the rows; on a GPU pool
        the padded forward costs the same whatever a session reads."""
        return isinstance(self.lm, static.SessionPool) and not self.lm.padded

    def rows_to_read(self, ids: Sequence[int], num_proposed: int) -> int:
        """Rows this session's next ``score(ids, num_proposed)`` reads (what its cache lacks)."""
        return max(len(ids) - common_prefix_len(self.lm.cached_ids, ids), num_proposed + 1)

    def score_many(self, requests: Sequence[tuple[TorchTarget, Sequence[int], int]],
                   to_host: bool = True) -> list[torch.Tensor]:
        """``score`` of several of this target's sessions, (session, ids, num_proposed) each: on a
        session pool in shared forwards, else one after another. ``to_host`` False: a GPU pool's
        rows stay on the GPU (``static.logits_together``)."""
        if self.batch_sessions > 1:
            return static.logits_together([(t.lm, ids, k + 1) for t, ids, k in requests], to_host)
        return [t.score(ids, k) for t, ids, k in requests]

    def session(self) -> TorchTarget:
        """Another target over the same weights with a KV cache of its own (the gRPC server's sessions)."""
        return TorchTarget(self.model, self.tokenizer, self.lm.session())

    def reset(self) -> None:
        self.lm.reset()

    def trim(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (``base.settle_cache``): on the static engine the
        last token of a request must be read again by the next, in the class the target alone reads it."""
        self.lm.crop(length)

    def warm_up(self, max_proposals: int, progress: bool = False) -> int:
        """Prepare the kernels of every draft length up to ``max_proposals`` before requests arrive:
        on the CPU's eager engine, returns how many kernel choices were timed (``progress``: with a
        bar); a GPU engine captures its graphs instead (0)."""
        if isinstance(self.lm, CachedLM):
            return self.lm.warm_up(max_proposals + 1, progress)
        self.lm.warm_up(max_proposals + 1)
        return 0


def torch_target(model: torch.nn.Module, tokenizer, device: str = "cpu",
                 context: int = static.DEFAULT_CONTEXT, batch: int = 1) -> TorchTarget:
    """The target on ``device``: on a GPU the static engine when the architecture allows it (else the
    eager model moved there), on the CPU the eager engine with its measured kernels. ``batch`` > 1:
    a server's target whose sessions (at most ``batch``) share every decode forward: the static
    engine's session pool, padded classes and CUDA graphs on a GPU, unpadded rows on a CPU."""
    if batch > 1:
        reason = static.unsupported_reason(model)
        if reason is not None:
            raise OmnidraftError(f"batching runs on the static engine, which cannot run this model: {reason}")
        dtype = next(model.parameters()).dtype
        if device != "cuda" and dtype != torch.float32:
            raise OmnidraftError("batching on a CPU runs float32 (its native kernel's); drop --dtype")
        weights = static.extract(model, device, dtype)
        try:
            pool = static.SessionPool(weights, batch, context, padded=device == "cuda")
        except ValueError as exc:
            raise OmnidraftError(str(exc)) from None
        return TorchTarget(model, tokenizer, pool)
    if device != "cuda":
        return TorchTarget(model, tokenizer)
    reason = static.unsupported_reason(model)
    if reason is None:
        weights = static.extract(model, "cuda", next(model.parameters()).dtype)
        return TorchTarget(model, tokenizer, static.StaticLM(weights, context))
    warn(f"the GPU engine does not run this model ({reason}): running it eagerly on the GPU, without CUDA graphs")
    return TorchTarget(model.to("cuda"), tokenizer)
