"""Online adaptation wired into a pipeline (OmniDraft Algorithm 2): record, train beside, publish.

``OnlineLearning`` attaches a :class:`Recorder` and a :class:`BackgroundTrainer` to a loaded
pipeline: each finished request becomes a training example (prompt + emitted tokens + the target's
sparse distributions), the trainer updates the pair's LoRA adapter every ``interval`` prompts and
publishes it under ``adapters/<drafter>--<target>/``; the pipeline's ``AdapterSlot`` picks each
version up between decoding steps. One writer per adapter folder: the pair folder's lock is held
from here, and by the trainer process, until both are done, so two ``adapt`` runs (or a chat and
an ``adapt``) can never drop each other's training.
"""

from __future__ import annotations

from pathlib import Path

from omnidraft.adapter import store
from omnidraft.observer import DecodeObserver
from omnidraft.errors import OmnidraftError
from omnidraft.train.background import BackgroundTrainer, TrainerSetup
from omnidraft.train.config import TrainConfig
from omnidraft.train.records import (
    Record,
    Recorder,
    preimage_table,
    to_example,
)


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

    def __init__(self, pipe, config: TrainConfig, home: str | None = None, save_to: Path | None = None, nice: int = 19) -> None:
        if pipe.adapter_slot is None:
            raise ValueError("online learning needs a drafter with adapters enabled")
        merged = getattr(pipe.adapter_slot.drafter.lm, "merged_adapter", None)
        if merged:
            raise OmnidraftError(f"cannot train adapters on a drafter export with {merged} merged into its weights "
                                 f"(use --no-train, or another --drafter-backend)")
        self.pipe = pipe
        bridge = pipe.decoder.bridge
        self.bridge = bridge
        self.preimages, _ = preimage_table(bridge)
        slot = pipe.adapter_slot
        self.folder = store.writable_pair_folder(save_to) if save_to is not None else slot.folder
        self.lock = store.writer_lock(self.folder).acquire()  # a second writer is refused here, in one line
        current = slot.current
        meta = {"drafter": pipe.drafter_spec, "target": pipe.target_spec, "identity": vars(slot.identity)}
        if current is not None:  # continue the adapter in use: its counters and its weights
            meta.update({k: current.meta[k] for k in ("updates", "records_seen", "tokens_seen", "history") if k in current.meta})
        try:
            self.trainer = BackgroundTrainer(TrainerSetup(
                drafter_spec=pipe.drafter_spec, home=home, adapter_folder=str(self.folder),
                dm_mask=bridge.dm_mask.numpy(), config=config,
                resume_from=str(current.path) if current is not None else None, meta=meta, nice=nice),
                keep_fds=(self.lock.fd,))  # the trainer holds the lock too, for as long as it may publish
        except BaseException:
            self.lock.release()
            raise
        self.recorder = Recorder(bridge.t2d >= 0, sink=self._submit, top_k=config.top_k)
        self._observers = [TrainingSignal(self.trainer), self.recorder]
        pipe.decoder.observers.extend(self._observers)
        slot.source = self.trainer
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
            self.pipe.adapter_slot.take(published.path)

    def close(self, train_pending: bool = True, timeout: float = 600.0) -> None:
        """Stop the trainer (by default after an update on the partial buffer), detach, unlock."""
        try:
            published = self.trainer.stop(train_pending=train_pending, timeout=timeout)
            if published is not None:
                self.pipe.adapter_slot.take(published.path)
        finally:
            for obs in self._observers:
                if obs in self.pipe.decoder.observers:
                    self.pipe.decoder.observers.remove(obs)
            self.pipe.adapter_slot.source = None
            self.lock.release()
