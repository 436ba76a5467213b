"""Online adaptation wired into a pipeline (OmniDraft Algorithm 2): record, train beside, publish.

``AdapterSlot`` holds the adapter the inference drafter uses and swaps in what the trainer
publishes, between decoding steps only. ``OnlineLearning`` attaches a :class:`Recorder` and a
:class:`BackgroundTrainer` to a loaded pipeline: each finished request becomes a training example
(prompt + emitted tokens + the target's sparse distributions), the trainer updates the pair's
LoRA adapter every ``interval`` prompts and saves it under ``adapters/<drafter>--<target>/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omnidraft.decode import DecodeObserver
from omnidraft.drafter import Drafter
from omnidraft.train import accept_head, adapter_store
from omnidraft.train.background import BackgroundTrainer, Published, TrainerSetup
from omnidraft.train.distill import TrainConfig
from omnidraft.train.lora import MergedLora
from omnidraft.train.records import (
    DEFAULT_TOP_K,
    Record,
    Recorder,
    preimage_table,
    to_example,
)


def warn(text: str) -> None:
    print(f"omnidraft: {text}", file=sys.stderr, flush=True)


class AdapterSlot(DecodeObserver):
    """The inference drafter's adapter: merged into its weights, swapped only between steps."""

    def __init__(self, drafter: Drafter, identity: adapter_store.Identity, folder: Path) -> None:
        self.drafter = drafter
        self.identity = identity
        self.folder = folder  # where this pair's adapter lives (and where training publishes)
        self.merged = MergedLora(drafter.lm.model)
        self.current: adapter_store.LoadedAdapter | None = None
        self.trainer: BackgroundTrainer | None = None

    def use(self, loaded: adapter_store.LoadedAdapter | None) -> None:
        """Merge ``loaded`` into the drafter (None: back to the base weights); the drafter's KV
        cache was computed with the old weights, so it is dropped and rebuilt on the next draft."""
        head = None
        if loaded is not None and loaded.head_state is not None:  # checked before anything changes
            hidden_size = self.drafter.lm.model.get_output_embeddings().weight.shape[1]
            head = accept_head.from_state(loaded.head_state, hidden_size)
        if loaded is None:
            self.merged.clear()
        else:
            self.merged.apply(loaded.state, loaded.scaling)
        self.current = loaded
        self.drafter.head = head
        self.drafter.reset()

    def before_step(self) -> None:
        if self.trainer is not None:
            published = self.trainer.poll()
            if published is not None:
                self.take(published)

    def take(self, published: Published) -> None:
        try:
            self.use(adapter_store.load(published.path, self.identity))
        except (adapter_store.AdapterProblem, ValueError) as exc:
            warn(f"trainer published an adapter that cannot be used ({exc}); keeping the previous one")

    @property
    def description(self) -> str:
        if self.current is None:
            return "none"
        meta = self.current.meta
        head = ", acceptance head" if self.drafter.head is not None else ""
        return f"{self.current.path} (update {meta.get('updates', 0)}, {meta.get('records_seen', 0)} records{head})"


class TrainingSignal(DecodeObserver):
    """Tells the trainer a request is being decoded, so it waits (yields the CPU) until it ends."""

    def __init__(self, trainer: BackgroundTrainer) -> None:
        self.trainer = trainer

    def on_start(self, prompt_ids) -> None:
        self.trainer.set_decoding(True)

    def on_finish(self) -> None:
        self.trainer.set_decoding(False)


class OnlineLearning:
    """Attach recording + background training to a pipeline that has a drafter and an AdapterSlot."""

    def __init__(self, pipe, config: TrainConfig, interval: int, top_k: int = DEFAULT_TOP_K,
                 home: str | None = None, save_to: Path | None = None, nice: int = 19) -> None:
        if pipe.adapter_slot is None:
            raise ValueError("online learning needs a drafter with adapters enabled")
        self.pipe = pipe
        bridge = pipe.decoder.bridge
        self.bridge = bridge
        self.preimages, _ = preimage_table(bridge)
        slot = pipe.adapter_slot
        self.folder = save_to or slot.folder
        current = slot.current
        meta = {"drafter": pipe.drafter_spec, "target": pipe.target_spec, "identity": vars(slot.identity)}
        if current is not None:  # continue the adapter in use: its counters and its weights
            meta.update({k: current.meta[k] for k in ("updates", "records_seen", "tokens_seen", "history") if k in current.meta})
        self.trainer = BackgroundTrainer(TrainerSetup(
            drafter_spec=pipe.drafter_spec, home=home, adapter_folder=str(self.folder),
            dm_mask=bridge.dm_mask.numpy(), config=config, interval=interval,
            resume_from=str(current.path) if current is not None else None, meta=meta, nice=nice))
        self.recorder = Recorder(bridge.t2d >= 0, sink=self._submit, top_k=top_k)
        self._observers = [TrainingSignal(self.trainer), self.recorder]
        pipe.decoder.observers.extend(self._observers)
        slot.trainer = self.trainer
        self.records = 0

    def _submit(self, record: Record) -> None:
        example = to_example(record, self.bridge, self.preimages)
        self.records += 1
        if example is not None:
            self.trainer.submit(example)

    def wait(self, timeout: float | None = None) -> None:
        """Let the trainer catch up with every submitted prompt, then publish its newest adapter."""
        published = self.trainer.wait(timeout)
        if published is not None:
            self.pipe.adapter_slot.take(published)

    def close(self, train_pending: bool = True, timeout: float = 600.0) -> None:
        """Stop the trainer (by default after an update on the partial buffer) and detach."""
        published = self.trainer.stop(train_pending=train_pending, timeout=timeout)
        if published is not None:
            self.pipe.adapter_slot.take(published)
        for obs in self._observers:
            if obs in self.pipe.decoder.observers:
                self.pipe.decoder.observers.remove(obs)
        self.pipe.adapter_slot.trainer = None
