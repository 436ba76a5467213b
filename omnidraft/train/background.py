"""The background trainer: Algorithm 2 beside decoding, never in its way.

Training runs in a child process (``python -m omnidraft.train.worker``) at the lowest CPU
priority (nice 19): on a 2-core laptop the decoder's threads win every contested time slice, a
crash or an out-of-memory in training cannot take generation down, and the two never share a GIL.
On top of that the child *waits* while a request is being decoded: it checks before every
micro-batch. The child is a plain subprocess talking over two pipes (pickled messages through
``multiprocessing.connection``), so it works the same from the CLI, a script or a notebook: unlike
``multiprocessing``'s spawn, it never re-imports the caller's ``__main__``.

Parent -> child: the setup, then examples (the buffer Q fills; every ``interval`` prompts an
update runs), flush, sync, decoding on/off, pause/resume, stop. Child -> parent: "published" with
the new adapter version's folder (saved atomically by ``adapter_store.save``), "error" lines (also
appended to ``trainer.log`` in the adapter folder), "synced". The parent applies a published
adapter between decoding steps (``online.AdapterSlot``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from omnidraft.train.config import TrainConfig
from omnidraft.train.records import Example

log = logging.getLogger("omnidraft.trainer")


@dataclass
class TrainerSetup:
    """Everything the child needs to rebuild the trainable drafter (plain, picklable values)."""

    drafter_spec: str
    home: str | None
    adapter_folder: str
    dm_mask: np.ndarray
    config: TrainConfig
    resume_from: str | None = None  # a version folder to continue training from
    meta: dict = field(default_factory=dict)  # identity, specs, counters carried over
    # CPU priority of the child: 19 (the lowest) beside interactive decoding; a batch job that
    # waits for its updates anyway (``omnidraft adapt``) runs it at 0 so other load cannot starve it.
    nice: int = 19


@dataclass
class Published:
    path: Path
    version: int
    metrics: dict


def to_payload(example: Example) -> dict:
    """An example as numpy arrays: pickles compactly and needs no torch shared memory."""
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in vars(example).items()}


def from_payload(payload: dict) -> Example:
    return Example(**{k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in payload.items()})


class BackgroundTrainer:
    """Parent-side handle of the training process."""

    def __init__(self, setup: TrainerSetup, keep_fds: tuple[int, ...] = ()) -> None:
        """``keep_fds``: descriptors the child inherits and holds until it exits (the writer lock)."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # Idle OpenMP threads sleep instead of spinning: spinning trainer threads would steal the
        # cores the decoder needs the moment a request arrives.
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        folder = Path(setup.adapter_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "trainer.log"
        with open(self.log_path, "ab") as log_file:  # the child's own output never reaches the user's terminal
            # A session of its own: Ctrl-C in a terminal (SIGINT to the foreground process group)
            # stops a chat reply, never the trainer; the trainer ends when its pipe closes.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "omnidraft.train.worker", str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w, *keep_fds), stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                env=env, close_fds=True, start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._to_child = Connection(to_child_w, readable=False)
        self._from_child = Connection(from_child_r, writable=False)
        self.setup = setup
        self.submitted = 0
        self.errors: list[str] = []
        self.published: list[Published] = []
        self._sync_token = 0
        self._stopping = False
        self._reported_death = False
        self._paused = False
        self._send(("setup", setup))

    # ---- feeding --------------------------------------------------------------------------------
    def submit(self, example: Example) -> None:
        self.submitted += 1
        self._send(("example", to_payload(example)))

    def flush(self) -> None:
        """Train on what the buffer holds now, even if fewer than ``interval`` prompts."""
        self._send(("flush",))

    # ---- cooperation ----------------------------------------------------------------------------
    def set_decoding(self, active: bool) -> None:
        """While a request decodes, the child does not start another micro-batch."""
        self._send(("decoding", active))

    def pause(self) -> None:
        self._paused = True
        self._send(("pause", True))

    def resume(self) -> None:
        self._paused = False
        self._send(("pause", False))

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    # ---- results --------------------------------------------------------------------------------
    def poll(self) -> Published | None:
        """Read the child's messages without blocking; the newest published adapter, if any."""
        newest = None
        while self._readable(0):
            msg = self._recv()
            if msg is None:
                break
            newest = self._handle(msg) or newest
        self._check_alive()
        return newest

    def wait(self, timeout: float | None = None) -> Published | None:
        """Block until the child has handled everything submitted so far (training included)."""
        self._sync_token += 1
        token = self._sync_token
        self._send(("sync", token))
        deadline = None if timeout is None else time.monotonic() + timeout
        newest = None
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("the trainer did not catch up in time")
            if not self._readable(0.5 if remaining is None else min(0.5, remaining)):
                if not self.alive:
                    self._check_alive()
                    return newest
                continue
            msg = self._recv()
            if msg is None:
                self._check_alive()
                return newest
            if msg[0] == "synced" and msg[1] == token:
                return newest
            newest = self._handle(msg) or newest

    def stop(self, train_pending: bool = False, timeout: float = 60.0) -> Published | None:
        """Stop the child cleanly (optionally after training the partial buffer); kill it if stuck."""
        newest = None
        if self.alive and train_pending:
            self.flush()
            try:
                newest = self.wait(timeout)
            except TimeoutError:
                self._error("the trainer did not finish its last update in time; it was stopped")
        self._stopping = True
        self._send(("stop",))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)
        while self._readable(0):
            msg = self._recv()
            if msg is None:
                break
            newest = self._handle(msg) or newest
        self._to_child.close()
        self._from_child.close()
        return newest

    # ---- plumbing -------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._to_child.closed:
            return
        try:
            self._to_child.send(msg)
        except (BrokenPipeError, OSError):  # the child is gone; poll() reports it once
            pass

    def _readable(self, timeout: float) -> bool:
        try:
            return not self._from_child.closed and self._from_child.poll(timeout)
        except (OSError, EOFError):
            return False

    def _recv(self) -> tuple | None:
        try:
            return self._from_child.recv()
        except (EOFError, OSError):
            return None

    def _check_alive(self) -> None:
        if not self.alive and not self._stopping and not self._reported_death:
            self._reported_death = True
            self._error(f"trainer process exited unexpectedly (exit code {self._process.returncode}); "
                        "decoding goes on without training")

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
