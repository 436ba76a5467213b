"""The background trainer: Algorithm 2 beside decoding, never in its way.

Training runs in a child process at the lowest CPU priority (nice 19), so on a 2-core laptop the
decoder's threads win every contested time slice, a crash or an out-of-memory in training cannot
take generation down, and the two never share a GIL. On top of that the child *waits* while a
request is being decoded (an event the decoder sets): it checks before every micro-batch.

Parent -> child: examples (the buffer Q fills; every ``interval`` prompts an update runs), flush,
sync, stop. Child -> parent: "published" with the new adapter version's folder (saved atomically
by ``adapter_store.save``), "error" lines (also written to ``trainer.log`` in the adapter folder).
The parent applies a published adapter between decoding steps (``AdapterSlot.refresh``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from omnidraft.train.distill import TrainConfig
from omnidraft.train.records import Example

log = logging.getLogger("omnidraft.trainer")
_POLL_S = 0.02


@dataclass
class TrainerSetup:
    """Everything the child needs to rebuild the trainable drafter (plain, picklable values)."""

    drafter_spec: str
    home: str | None
    adapter_folder: str
    dm_mask: np.ndarray
    config: TrainConfig
    interval: int
    resume_from: str | None = None  # a version folder to continue training from
    meta: dict = field(default_factory=dict)  # identity, specs, counters carried over


@dataclass
class Published:
    path: Path
    version: int
    metrics: dict


def _to_payload(example: Example) -> dict:
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in vars(example).items()}


def _from_payload(payload: dict) -> Example:
    return Example(**{k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in payload.items()})


class BackgroundTrainer:
    """Parent-side handle of the training process."""

    def __init__(self, setup: TrainerSetup) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that runs torch threads
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self._decoding = ctx.Event()
        self._paused = ctx.Event()
        self._stopping = ctx.Event()
        self._process = ctx.Process(target=_child_main, name="omnidraft-trainer", daemon=True,
                                    args=(setup, self._inbox, self._outbox, self._decoding, self._paused, self._stopping))
        self._process.start()
        self.setup = setup
        self.submitted = 0
        self.errors: list[str] = []
        self.published: list[Published] = []
        self._sync_token = 0
        self._reported_death = False

    # ---- feeding --------------------------------------------------------------------------------
    def submit(self, example: Example) -> None:
        self.submitted += 1
        self._inbox.put(("example", _to_payload(example)))

    def flush(self) -> None:
        """Train on what the buffer holds now, even if fewer than ``interval`` prompts."""
        self._inbox.put(("flush",))

    # ---- cooperation ----------------------------------------------------------------------------
    def set_decoding(self, active: bool) -> None:
        """While a request decodes, the child does not start another micro-batch."""
        if active:
            self._decoding.set()
        else:
            self._decoding.clear()

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    # ---- results --------------------------------------------------------------------------------
    def poll(self) -> Published | None:
        """Drain the child's messages without blocking; the newest published adapter, if any."""
        newest = None
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                break
            newest = self._handle(msg) or newest
        if not self.alive and not self._stopping.is_set() and not self._reported_death:
            self._reported_death = True
            self._error(f"trainer process exited unexpectedly (exit code {self._process.exitcode}); decoding goes on without training")
        return newest

    def wait(self, timeout: float | None = None) -> Published | None:
        """Block until the child has handled everything submitted so far (training included)."""
        self._sync_token += 1
        token = self._sync_token
        self._inbox.put(("sync", token))
        deadline = None if timeout is None else time.monotonic() + timeout
        newest = None
        while True:
            if not self.alive:
                return self.poll() or newest
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("the trainer did not catch up in time")
            try:
                msg = self._outbox.get(timeout=min(0.5, remaining) if remaining is not None else 0.5)
            except queue.Empty:
                continue
            if msg[0] == "synced" and msg[1] == token:
                return newest
            newest = self._handle(msg) or newest

    def stop(self, train_pending: bool = False, timeout: float = 60.0) -> Published | None:
        """Stop the child cleanly (optionally after training the partial buffer); kill it if stuck."""
        newest = None
        if self.alive:
            if train_pending:
                self.flush()
                try:
                    newest = self.wait(timeout)
                except TimeoutError:
                    pass
            self._stopping.set()
            self._inbox.put(("stop",))
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
        newest = self.poll() or newest
        return newest

    def _handle(self, msg: tuple) -> Published | None:
        kind = msg[0]
        if kind == "published":
            item = Published(Path(msg[1]), msg[2], msg[3])
            self.published.append(item)
            return item
        if kind == "error":
            self._error(msg[1])
        return None

    def _error(self, text: str) -> None:
        self.errors.append(text)
        log.warning("omnidraft: trainer: %s", text)


# ---- the child -------------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised inside an update when a stop is requested mid-way."""


def _child_main(setup: TrainerSetup, inbox, outbox, decoding, paused, stopping) -> None:
    try:
        os.nice(19)  # decoding wins every contested time slice
    except OSError:
        pass
    folder = Path(setup.adapter_folder)
    try:
        worker = _Worker(setup, outbox, decoding, paused, stopping)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, never raised into decoding
        _report(outbox, folder, f"could not start ({exc.__class__.__name__}: {exc})")
        return
    while True:
        msg = inbox.get()
        try:
            if msg[0] == "example":
                worker.add(_from_payload(msg[1]))
            elif msg[0] == "flush":
                worker.train()
            elif msg[0] == "sync":
                outbox.put(("synced", msg[1]))
            elif msg[0] == "stop":
                return
        except _Stop:
            return
        except Exception as exc:  # noqa: BLE001 - one bad update must not end the trainer
            worker.buffer.clear()
            _report(outbox, folder, f"update failed and was skipped ({exc.__class__.__name__}: {str(exc)[:200]})")


def _report(outbox, folder: Path, text: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "trainer.log", "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n{traceback.format_exc()}\n")
    except OSError:
        pass
    outbox.put(("error", text))


class _Worker:
    """The child's state: the trainable drafter, the buffer Q and the counters in the metadata."""

    def __init__(self, setup: TrainerSetup, outbox, decoding, paused, stopping) -> None:
        from omnidraft import models
        from omnidraft.train import adapter_store
        from omnidraft.train.distill import Distiller

        self.setup, self.outbox = setup, outbox
        self.decoding, self.paused, self.stopping = decoding, paused, stopping
        model, _ = models.load(setup.drafter_spec, home=setup.home, dtype="float32", progress=False)
        state = None
        if setup.resume_from:
            loaded = adapter_store.load(Path(setup.resume_from), None)
            state = loaded.state if loaded else None
        torch.manual_seed(setup.config.seed)
        self.distiller = Distiller(model, torch.from_numpy(setup.dm_mask), setup.config, state)
        self.buffer: list[Example] = []
        self.meta = dict(setup.meta)
        self.meta.setdefault("updates", 0)
        self.meta.setdefault("records_seen", 0)
        self.meta.setdefault("tokens_seen", 0)
        self.meta.setdefault("history", [])

    def add(self, example: Example) -> None:
        self.buffer.append(example)
        if len(self.buffer) >= self.setup.interval:
            self.train()

    def _yield(self) -> None:
        """Before each micro-batch: wait while a request decodes or training is paused."""
        while self.decoding.is_set() or self.paused.is_set():
            if self.stopping.is_set():
                raise _Stop
            time.sleep(_POLL_S)
        if self.stopping.is_set():
            raise _Stop

    def train(self) -> None:
        from omnidraft.train import adapter_store
        from omnidraft.train.distill import learning_curve_point

        if not self.buffer:
            return
        batch, self.buffer = self.buffer, []
        metrics = self.distiller.update(batch, pause=self._yield)
        point = learning_curve_point(metrics)
        self.meta["updates"] += 1
        self.meta["records_seen"] += len(batch)
        self.meta["tokens_seen"] += sum(e.emitted_tokens for e in batch)
        self.meta["history"] = (self.meta["history"] + [point])[-50:]
        self.meta["train_config"] = asdict(self.setup.config)
        path = adapter_store.save(Path(self.setup.adapter_folder), self.distiller.model, self.meta)
        self.outbox.put(("published", str(path), self.meta["updates"], point))
