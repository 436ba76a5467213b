"""The adapter the inference drafter uses, swapped only between requests.

:class:`AdapterSlot` is a decode observer: when a request starts it asks its ``source`` (the
background trainer, when one runs) for a newly published version and, if there is one, loads,
checks and applies it; whoever holds the drafter idle may ask too (:meth:`AdapterSlot.refresh`: the
chat, while the user types). Not between a request's steps: a swap drops the drafter's KV cache, and
re-reading the whole context mid-request cost more than the newer version won in the rest of it (a
Chinese chat's turn re-read ~2,000 drafter tokens, 2.6 s, after a version published mid-turn). Applying means the drafter backend's ``apply_adapter`` (a weight merge on torch, an
adapter switch on onnxruntime) plus the adapter's acceptance head; the drafter's KV cache was
computed with the old weights, so it is dropped and rebuilt on the next draft, and the listeners
(the draft policy, whose acceptance statistics described the old weights) are told.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from omnidraft.adapter import head as head_mod
from omnidraft.adapter import store
from omnidraft.console import warn
from omnidraft.observer import DecodeObserver

if TYPE_CHECKING:
    from omnidraft.drafter import Drafter


class Publisher(Protocol):
    def poll(self):
        """The newest published version since the last poll (has ``.path``), or None."""


class AdapterSlot(DecodeObserver):
    def __init__(self, drafter: Drafter, identity: store.Identity, folder: Path) -> None:
        self.drafter = drafter
        self.identity = identity
        self.folder = folder  # where this pair's adapter lives (and where training publishes)
        self.current: store.LoadedAdapter | None = None
        self.source: Publisher | None = None
        self.listeners: list[Callable[[str], None]] = []  # told ``weights`` after every change

    @property
    def weights(self) -> str:
        """Which weights the drafter runs: the adapter version's folder, or "none"."""
        return str(self.current.path) if self.current is not None else "none"

    def use(self, loaded: store.LoadedAdapter | None) -> None:
        """Apply ``loaded`` (None: back to the base weights); checked before anything changes."""
        head = None
        if loaded is not None and loaded.head_state is not None:
            head = head_mod.from_state(loaded.head_state, self.drafter.lm.hidden_size)
        if loaded is None:
            self.drafter.lm.apply_adapter(None)
        else:
            self.drafter.lm.apply_adapter(loaded.state, loaded.scaling)
        self.current = loaded
        self.drafter.head = head
        self.drafter.reset()
        for listener in self.listeners:
            listener(self.weights)

    def on_start(self, prompt_ids) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Take the newest version the trainer published since the last look, if any."""
        if self.source is not None:
            published = self.source.poll()
            if published is not None:
                self.take(published.path)

    def take(self, path: Path) -> None:
        """Use the version at ``path``; a version that cannot be used keeps the previous one."""
        try:
            self.use(store.load(path, self.identity))
        except (store.AdapterProblem, ValueError) as exc:
            warn(f"trainer published an adapter that cannot be used ({exc}); keeping the previous one")

    @property
    def description(self) -> str:
        if self.current is None:
            return "none"
        meta = self.current.meta
        head = ", acceptance head" if self.drafter.head is not None else ""
        return f"{self.current.path} (update {meta.get('updates', 0)}, {meta.get('records_seen', 0)} records{head})"
