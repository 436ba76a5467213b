"""The drafter on llama.cpp: the shipped GGUF in-process, nothing dequantized.

:class:`LlamaCppDraftLM` puts a :class:`~omnidraft.target.llamacpp.LlamaCppTarget` (one context,
KV rollback with ``llama_memory_seq_rm``) behind the :class:`~omnidraft.drafter.base.DraftLM`
interface. A drafter needs no batch invariance (the target verifies every token), so its weights may
be repacked into the CPU's fastest layout. The final hidden state (the acceptance head's input) is
kept for one-token evals only: with it on, llama.cpp outputs every row of a prompt read.

Adapters: the trainer publishes peft tensors on torch; :meth:`LlamaCppDraftLM.apply_adapter` writes
them as a GGUF LoRA (``omnidraft/adapter/gguf_lora.py``) to a temporary file, loads it against the
shared weights and sets it on this drafter's context, so the base GGUF is never rewritten and
switching adapters costs one small file (rank x (in + out) floats per Linear).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from omnidraft.adapter.gguf_lora import GgufShape, write_gguf_lora
from omnidraft.errors import OmnidraftError
from omnidraft.kv import common_prefix_len
from omnidraft.target.llamacpp import LlamaCppTarget

DEFAULT_N_CTX = 4096


class LlamaCppDraftLM:
    """:class:`~omnidraft.drafter.base.DraftLM` over a GGUF on llama.cpp."""

    def __init__(self, gguf: str | Path, tokenizer, *, n_ctx: int = DEFAULT_N_CTX, n_threads: int | None = None,
                 engine: LlamaCppTarget | None = None) -> None:
        self.engine = engine or LlamaCppTarget(gguf, tokenizer, n_ctx=n_ctx, n_threads=n_threads, batch_invariant=False)
        self.vocab_size, self.hidden_size = self.engine.vocab_size, self.engine.n_embd
        self.max_positions = self.engine.max_context
        self._hidden = torch.zeros(self.hidden_size)
        self._hidden_on = False
        self._adapter: tuple[dict[str, torch.Tensor], float] | None = None  # what a fork carries over

    @property
    def cached_ids(self) -> list[int]:
        return self.engine.cached_ids

    @property
    def gguf_path(self) -> Path:
        return Path(self.engine.path)

    @property
    def last_hidden(self) -> torch.Tensor:
        return self._hidden

    def logits_for(self, ids: Sequence[int]) -> torch.Tensor:
        ids = list(ids)
        if len(ids) - min(common_prefix_len(self.engine.cached_ids, ids), len(ids) - 1) > 1:
            self._hidden_state(False)  # read all but the last id as a prompt: no row but the last is output
            self.engine.score(ids[:-1], 0)
        self._hidden_state(True)
        row = self.engine.score(ids, 0)[0]
        self._hidden = self.engine.hidden_state()
        return row

    def step(self, token: int) -> torch.Tensor:
        self._hidden_state(True)
        row = self.engine.step(token)
        self._hidden = self.engine.hidden_state()
        return row

    def _hidden_state(self, on: bool) -> None:
        if on != self._hidden_on:
            self.engine.keep_hidden(on)
            self._hidden_on = on

    def reset(self) -> None:
        self.engine.reset()

    def drop(self, start: int, n: int) -> None:
        """Forget cached positions [start, start + n); the later ones move down (``LlamaCppTarget.drop``)."""
        self.engine.drop(start, n)

    def fork(self) -> LlamaCppDraftLM:
        """Another drafter over the same loaded weights with a KV cache of its own."""
        e = self.engine
        fork = LlamaCppDraftLM(e.path, e.tokenizer, engine=LlamaCppTarget(
            e.path, e.tokenizer, n_ctx=e.max_context, n_threads=e.n_threads, batch_invariant=False, model_from=e))
        if self._adapter is not None:
            fork.apply_adapter(*self._adapter)
        return fork

    def gguf_shape(self) -> GgufShape:
        return GgufShape(self.engine.architecture, *self.engine.attention_dims())

    def apply_adapter(self, state: dict[str, torch.Tensor] | None, scaling: float = 1.0, keep_cache: bool = False) -> None:
        """Use LoRA tensors (peft names) as a GGUF LoRA scaled by ``scaling``; None: the base weights.
        A state that does not fit these weights raises ValueError before anything changes. llama.cpp
        keeps its KV cache across an adapter change; whoever needs it dropped resets."""
        if state is None:
            self.engine.use_lora(None)
            self._adapter = None
            return
        with tempfile.TemporaryDirectory(prefix="omnidraft-lora-") as folder:  # llama.cpp copies it in
            path = Path(folder) / "adapter.gguf"
            write_gguf_lora(state, self.gguf_shape(), path)
            try:
                self.engine.use_lora(path, scaling)
            except OmnidraftError as exc:  # a shape llama.cpp refuses: the adapter is unusable here
                raise ValueError(str(exc)) from None
        self._adapter = (state, scaling)
