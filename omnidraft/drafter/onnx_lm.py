"""The drafter on onnxruntime: an exported graph (``omnidraft export``) behind the DraftLM interface.

:class:`OrtCausalLM` is numpy only: the session, its KV cache as arrays that follow a token list
(keep the common prefix, feed the rest; a rewind is a shorter past), and the active adapter, fed
as the graph's LoRA inputs or activated from an ``.onnx_adapter`` file through ``RunOptions``.
:class:`OnnxDraftLM` is the thin torch-facing wrapper the drafting loop uses, so the loop and the
tests do not care which backend drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from omnidraft.errors import OmnidraftError
from omnidraft.export.folder import settle
from omnidraft.export.manifest import MODEL, check_graph, last_row, read_manifest, session_signature


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class OrtCausalLM:
    """An export folder's decoder with a KV cache that follows a token list (numpy in, numpy out)."""

    def __init__(self, folder: str | Path, threads: int = 2) -> None:
        import onnxruntime as ort

        self.folder = Path(folder)
        settle(self.folder)  # an export killed mid-replace left the old or the new one beside it
        self.manifest = read_manifest(self.folder)  # every field checked before any is used
        options = ort.SessionOptions()
        options.log_severity_level = 3  # the LoRA inputs' defaults are initializers on purpose: no warning per input
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # the drafter shares the cores with the target: workers that spin after a run (onnxruntime's
        # default) steal the target's next forward
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(self.folder / MODEL), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise OmnidraftError(f"onnxruntime cannot load the export in {self.folder} "
                                 f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:120]}); export again") from None
        m = self.manifest
        check_graph(m, self.folder, *session_signature(self.session))  # layers, heads, head_dim, LoRA inputs
        self.layers, self.vocab_size, self.hidden_size = m["layers"], m["vocab_size"], m["hidden_size"]
        self.max_positions = m["max_positions"]
        self._kv_names = [f"past_key_values.{i}.{w}" for i in range(self.layers) for w in ("key", "value")]
        self._empty = np.zeros((1, m["kv_heads"], 0, m["head_dim"]), dtype=np.float32)
        self._run_options = ort.RunOptions()
        self._lora: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        self.past = [self._empty] * len(self._kv_names)
        self.cached_ids: list[int] = []
        self.last_hidden = np.zeros(self.hidden_size, dtype=np.float32)

    # ---- adapters

    def set_lora(self, tensors: dict[str, np.ndarray] | None, keep_cache: bool = False) -> None:
        """Feed these LoRA inputs (peft module names; Aᵀ and Bᵀ, α/r folded into B); None: the base model.
        ``keep_cache``: keep the past computed with the previous inputs (``DraftLM.apply_adapter``)."""
        self._lora = dict(tensors or {})
        if not keep_cache:
            self.reset()  # the cache was computed with other weights

    def set_adapter_file(self, path: str | Path | None) -> None:
        """Activate an ``.onnx_adapter`` (``None``: none) for the following runs, without a new session."""
        import onnxruntime as ort

        self._run_options = ort.RunOptions()
        if path is not None:
            adapter = ort.LoraAdapter()
            try:
                adapter.Load(str(path))
            except Exception as exc:
                raise OmnidraftError(f"cannot load the adapter {path} ({exc.__class__.__name__})") from None
            self._run_options.add_active_adapter(adapter)
            self._adapter = adapter  # onnxruntime keeps a pointer: it must outlive the runs
        self.reset()

    # ---- the cache

    def logits_for(self, ids: Sequence[int]) -> np.ndarray:
        """[vocab] logits after the last id; the cache keeps the common prefix with ``ids``."""
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)
        if keep < len(self.cached_ids):
            self.past = [np.ascontiguousarray(p[:, :, :keep]) for p in self.past]
            del self.cached_ids[keep:]
        return self._run(list(ids[keep:]))

    def step(self, token: int) -> np.ndarray:
        return self._run([int(token)])

    def _run(self, new: list[int]) -> np.ndarray:
        feed = {"input_ids": np.asarray([new], dtype=np.int64), **dict(zip(self._kv_names, self.past)), **self._lora}
        outputs = self.session.run(None, feed, self._run_options)
        self.past = outputs[2:]
        self.cached_ids.extend(new)
        self.last_hidden = outputs[1][0]
        return last_row(outputs[0])


class OnnxDraftLM:
    """:class:`~omnidraft.drafter.base.DraftLM` over :class:`OrtCausalLM` (torch tensors out)."""

    def __init__(self, folder: str | Path, threads: int = 2) -> None:
        self.threads = threads
        self.ort = OrtCausalLM(folder, threads)
        self.vocab_size, self.hidden_size = self.ort.vocab_size, self.ort.hidden_size
        self.max_positions = self.ort.max_positions
        self.manifest = self.ort.manifest
        # the graph inputs made for the last adapter state (the object, as the adapter slot holds it) and
        # scaling: a switch back to it from the base weights feeds them again, converting nothing
        self._feeds: tuple[dict, float, dict[str, np.ndarray]] | None = None

    @property
    def cheap_adapter_switch(self) -> bool:
        """A switch between one adapter and the base weights is a change of graph inputs (the weights
        choice may alternate them draft by draft); an export with an adapter merged in has no other."""
        return not self.merged_adapter

    @property
    def merged_adapter(self) -> str | None:
        """The adapter an export has merged into its weights (it then takes no other), or None."""
        merged = self.manifest.get("merged_adapter")
        return str(merged.get("path")) if isinstance(merged, dict) else None

    @property
    def cached_ids(self) -> list[int]:
        return self.ort.cached_ids

    @property
    def last_hidden(self):
        import torch

        return torch.from_numpy(self.ort.last_hidden)

    def logits_for(self, ids: Sequence[int]):
        import torch

        return torch.from_numpy(self.ort.logits_for(ids))

    def step(self, token: int):
        import torch

        return torch.from_numpy(self.ort.step(token))

    def reset(self) -> None:
        self.ort.reset()

    def fork(self) -> OnnxDraftLM:
        """Another drafter on the same export with a KV cache of its own (one per concurrent session);
        the active adapter is not carried over."""
        return OnnxDraftLM(self.ort.folder, self.threads)

    def apply_adapter(self, state, scaling: float = 1.0, keep_cache: bool = False) -> None:
        """A trained adapter's peft tensors become the graph's LoRA inputs (α/r folded into B)."""
        if self.merged_adapter:  # no LoRA inputs: its weights are base + that adapter, and stay so
            if state is not None:
                raise ValueError(f"this export has the adapter {self.merged_adapter} merged into its weights; "
                                 f"it takes no other")
            return
        if state is None:
            self.ort.set_lora(None, keep_cache)
            return
        if self._feeds is not None and self._feeds[0] is state and self._feeds[1] == scaling:
            self.ort.set_lora(self._feeds[2], keep_cache)
            return
        from omnidraft.adapter.merge import lora_pairs

        feeds = {}
        for module, (a, b) in lora_pairs(state).items():
            shape = self.manifest["lora"].get(module)
            if shape is None or a.shape[1] != shape["in"] or b.shape[0] != shape["out"]:
                raise ValueError(f"adapter module {module!r} does not fit the exported drafter")
            feeds[f"{module}.lora_A.weight"] = a.float().t().contiguous().numpy()  # the graph takes Aᵀ and Bᵀ
            feeds[f"{module}.lora_B.weight"] = (b.float() * scaling).t().contiguous().numpy()
        self.ort.set_lora(feeds, keep_cache)  # modules the adapter leaves out keep their empty (rank-0) defaults
        self._feeds = (state, scaling, feeds)
