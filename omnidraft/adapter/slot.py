"""The adapter the inference drafter uses, swapped only between requests.

:class:`AdapterSlot` is a decode observer: when a request starts it asks its ``source`` (the
background trainer, when one runs) for a newly published version and, if there is one, loads,
checks and applies it, so a request drafts with one version throughout. The drafter keeps
its KV cache across the trainer's versions: dropping it meant re-reading the whole context before
the next draft (a Chinese chat's turn re-read ~2,000 drafter tokens, 2.6 s), which the cost policy
priced out, while keys computed under the previous version of the same adapter are close enough
for a drafter whose output the verifier checks. Applying means the drafter backend's
``apply_adapter`` (a weight merge on torch, an adapter switch on onnxruntime) plus the adapter's
acceptance head, and the listeners (the draft policy, whose acceptance statistics described the old
weights) are told.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def use(self, loaded: store.LoadedAdapter | None, keep_cache: bool = False) -> None:
        """Apply ``loaded`` (None: back to the base weights); checked before anything changes.
        ``keep_cache``: the drafter keeps the keys it computed under the previous version (the
        trainer's next version: see ``DraftLM.apply_adapter``); otherwise its cache is dropped."""
        head = None
        if loaded is not None and loaded.head_state is not None:
            head = head_mod.from_state(loaded.head_state, self.drafter.lm.hidden_size)
        if loaded is None:
            self.drafter.lm.apply_adapter(None, keep_cache=keep_cache)
        else:
            self.drafter.lm.apply_adapter(loaded.state, loaded.scaling, keep_cache=keep_cache)
        self.current = loaded
        self.drafter.head = head
        if not keep_cache:
            self.drafter.reset()
        for listener in self.listeners:
            listener(self.weights)

    def on_start(self, prompt_ids: Sequence[int]) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Take the newest version the trainer published since the last look, if any."""
        if self.source is not None:
            published = self.source.poll()
            if published is not None:
                self.take(published.path)

    def take(self, path: Path) -> None:
        """Use the version at ``path`` (the trainer's next one: the drafter keeps its cache); a version
        that cannot be used keeps the previous one."""
        try:
            self.use(store.load(path, self.identity), keep_cache=True)
        except (store.AdapterProblem, ValueError) as exc:
            warn(f"trainer published an adapter that cannot be used ({exc}); keeping the previous one")

    @property
    def description(self) -> str:
        if self.current is None:
            return "none"
        meta = self.current.meta
        head = ", acceptance head" if self.drafter.head is not None else ""
        return f"{self.current.path} (update {meta.get('updates', 0)}, {meta.get('records_seen', 0)} records{head})"
