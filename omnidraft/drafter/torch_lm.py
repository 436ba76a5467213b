"""The eager torch drafter backend: a transformers model behind the shared KV-cache wrapper."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from omnidraft.adapter.merge import MergedLora
from omnidraft.config import DRAFTER_DTYPES, INT8_NO_ADAPTER
from omnidraft.kv import CachedLM, max_positions_of


def convert_drafter(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The drafter's speed/precision trade-off; the target's dtype never changes, so greedy output
    stays the target's own. int8 is torch's dynamic quantization of every Linear layer."""
    if dtype == "float32":
        return model
    if dtype == "bfloat16":
        return model.to(torch.bfloat16)
    if dtype == "int8":
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    raise ValueError(f"unknown drafter dtype {dtype!r}; choose one of {', '.join(DRAFTER_DTYPES)}")


class TorchDraftLM:
    """:class:`~omnidraft.drafter.base.DraftLM` over a torch model (already converted to ``dtype``)."""

    def __init__(self, model: torch.nn.Module, dtype: str = "float32") -> None:
        self.dtype = dtype
        self.cached = CachedLM(model, transposed_head=True)  # drafting decodes one row at a time
        self.model = model
        self.vocab_size = self.cached.vocab_size
        head = model.get_output_embeddings()
        weight = head.weight() if callable(head.weight) else head.weight  # int8 heads keep it behind a call
        self.hidden_size = int(weight.shape[1])
        self.max_positions = max_positions_of(model)
        self._hidden = torch.empty(0)
        self._merged: MergedLora | None = None
        head.register_forward_pre_hook(self._keep_hidden)

    def _keep_hidden(self, _module, args) -> None:
        self._hidden = args[0][0, -1]

    @property
    def last_hidden(self) -> torch.Tensor:
        return self._hidden

    @property
    def cached_ids(self) -> list[int]:
        return self.cached.cached_ids

    def logits_for(self, ids: Sequence[int]) -> torch.Tensor:
        return self.cached.logits_for(ids)[0]

    def step(self, token: int) -> torch.Tensor:
        return self.cached.step(token)

    def reset(self) -> None:
        self.cached.reset()

    def warm_up(self, max_rows: int, progress: bool = False) -> int:
        """Time the kernels of every read of 1..``max_rows`` rows and of the longer read classes now
        (``CachedLM.warm_up``): a draft's steps, a prompt's read, the appends after plain steps."""
        return self.cached.warm_up(max_rows, progress)

    @property
    def has_adapter(self) -> bool:
        """An adapter is merged into the weights now (a fork would copy it)."""
        return self._merged is not None and self._merged.active

    def fork(self) -> TorchDraftLM:
        """Another drafter with these weights and a KV cache of its own (one per concurrent session)."""
        return TorchDraftLM(copy.deepcopy(self.model), self.dtype)

    def apply_adapter(self, state: dict[str, torch.Tensor] | None, scaling: float = 1.0, keep_cache: bool = False) -> None:
        """Merge LoRA tensors into the weights (None: take the merged ones out). The cache is kept either
        way: whoever changes the weights resets it where the old keys must not be used."""
        if state is None:
            if self._merged is not None:
                self._merged.clear()
            return
        if self.dtype == "int8":
            raise ValueError(INT8_NO_ADAPTER)
        if self._merged is None:
            self._merged = MergedLora(self.model)
        self._merged.apply(state, scaling)
