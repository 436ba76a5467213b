"""The training process: ``python -m omnidraft.train.worker READ_FD WRITE_FD`` (started by
``background.BackgroundTrainer``; not meant to be run by hand).

A reader thread takes the parent's messages off the pipe at once, so "a request started decoding",
"pause" and "stop" reach the training loop even in the middle of an update; everything else is
queued for the main loop, which owns the trainable drafter and the buffer Q (Algorithm 2).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

_POLL_S = 0.02


class _Stop(Exception):
    """Raised inside an update when a stop is requested mid-way."""


class _Inbox:
    """The parent's messages: control flags set at once by a reader thread, the rest queued."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.decoding = threading.Event()
        self.paused = threading.Event()
        self.stopping = threading.Event()
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="omnidraft-trainer-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone: stop
                msg = ("stop",)
            kind = msg[0]
            if kind == "decoding":
                (self.decoding.set if msg[1] else self.decoding.clear)()
            elif kind == "pause":
                (self.paused.set if msg[1] else self.paused.clear)()
            else:
                if kind == "stop":
                    self.stopping.set()
                self.queue.put(msg)
                if kind == "stop":
                    return

    def wait_turn(self) -> None:
        """Before each micro-batch: wait while a request decodes or training is paused."""
        while self.decoding.is_set() or self.paused.is_set():
            if self.stopping.is_set():
                raise _Stop
            time.sleep(_POLL_S)
        if self.stopping.is_set():
            raise _Stop


class _Worker:
    """The trainable drafter, the buffer Q and the counters written into each adapter's metadata."""

    def __init__(self, setup, inbox: _Inbox, outbox: Connection) -> None:
        import torch

        from omnidraft import models
        from omnidraft.adapter import store
        from omnidraft.train.distill import Distiller

        self.setup, self.inbox, self.outbox = setup, inbox, outbox
        model, _ = models.load(setup.drafter_spec, home=setup.home, dtype="float32", progress=False)
        state = head_state = scaling = None
        if setup.resume_from:
            loaded = store.load(Path(setup.resume_from), None)
            if loaded:
                state, head_state, scaling = loaded.state, loaded.head_state, loaded.scaling
        torch.manual_seed(setup.config.seed)
        self.distiller = Distiller(model, torch.from_numpy(setup.dm_mask), setup.config, state, head_state, scaling)
        self.buffer: list = []
        self.meta = dict(setup.meta)
        for key in ("updates", "records_seen", "tokens_seen"):
            self.meta.setdefault(key, 0)
        self.meta.setdefault("history", [])

    def add(self, example) -> None:
        self.buffer.append(example)
        if len(self.buffer) >= self.setup.config.interval:
            self.train()

    def train(self) -> None:
        from omnidraft.train.distill import learning_curve_point
        from omnidraft.train.publish import save

        if not self.buffer:
            return
        batch, self.buffer = self.buffer, []
        metrics = self.distiller.update(batch, pause=self.inbox.wait_turn)
        point = learning_curve_point(metrics)
        self.meta["updates"] += 1
        self.meta["records_seen"] += len(batch)
        self.meta["tokens_seen"] += sum(e.emitted_tokens for e in batch)
        self.meta["history"] = (self.meta["history"] + [point])[-50:]
        self.meta["train_config"] = asdict(self.distiller.config)  # the rank a resumed adapter kept
        path = save(Path(self.setup.adapter_folder), self.distiller.model, self.meta,
                                  self.distiller.head_state())
        self.outbox.send(("published", str(path), self.meta["updates"], point))


def _report(outbox: Connection, folder: Path | None, text: str) -> None:
    """One line to the parent; the traceback to ``trainer.log`` in the adapter folder."""
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "trainer.log", "a") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n{traceback.format_exc()}\n")
        except OSError:
            pass
    try:
        outbox.send(("error", text))
    except OSError:
        pass


def main(read_fd: int, write_fd: int) -> int:
    from omnidraft.train.background import from_payload

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when training stops

    outbox = Connection(write_fd, readable=False)
    inbox = _Inbox(Connection(read_fd, writable=False))
    first = inbox.queue.get()
    if first[0] != "setup":
        return 2
    setup = first[1]
    folder = Path(setup.adapter_folder)
    try:
        os.nice(setup.nice)  # at 19, decoding wins every contested time slice
    except OSError:
        pass
    try:
        worker = _Worker(setup, inbox, outbox)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, never raised into decoding
        _report(outbox, folder, f"could not start ({exc.__class__.__name__}: {exc})")
        return 1
    while True:
        msg = inbox.queue.get()
        try:
            if msg[0] == "example":
                worker.add(from_payload(msg[1]))
            elif msg[0] == "flush":
                worker.train()
            elif msg[0] == "sync":
                outbox.send(("synced", msg[1]))
            elif msg[0] == "stop":
                return 0
        except _Stop:
            return 0
        except (BrokenPipeError, EOFError):
            return 0
        except Exception as exc:  # noqa: BLE001 - one bad update must not end the trainer
            worker.buffer.clear()
            _report(outbox, folder, f"update failed and was skipped ({exc.__class__.__name__}: {str(exc)[:200]})")


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
