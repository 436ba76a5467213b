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

The slot is also the cost policy's switch (``sources.policy.WeightsSwitch``): per request the policy
may run the base weights instead of the loaded adapter (``run``), where they are expected to draft
faster; the adapter stays loaded, and ``current`` still names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from omnidraft.adapter import head as head_mod
from omnidraft.adapter import store
from omnidraft.adapter.store import BASE_WEIGHTS
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
        self.on_base = False  # the adapter is loaded but this request drafts with the base weights (``run``)
        self._head = None  # the loaded adapter's acceptance head

    @property
    def adapter_weights(self) -> str | None:
        """The loaded adapter's weights key (its folder), whichever weights run now; None: no adapter."""
        return str(self.current.path) if self.current is not None else None

    @property
    def alternates(self) -> bool:
        """Whether a switch between the adapter and the base weights is a swap (``WeightsSwitch``): the
        backend sets the adapter aside instead of converting it again (the native and ONNX drafters)."""
        return bool(getattr(self.drafter.lm, "cheap_adapter_switch", False))

    @property
    def weights(self) -> str:
        """Which weights the drafter runs: the adapter version's folder, or "none"."""
        return self.adapter_weights if self.current is not None and not self.on_base else BASE_WEIGHTS

    def run(self, weights: str) -> None:
        """Draft with the loaded adapter (its ``adapter_weights``) or the base weights (BASE_WEIGHTS),
        keeping the drafter's cache: keys computed under the other weights are close enough for a
        drafter whose output the verifier checks, and a re-read of the context is not."""
        if weights not in (BASE_WEIGHTS, self.adapter_weights):
            raise ValueError(f"no weights {weights!r} in this slot")
        base = weights == BASE_WEIGHTS
        if self.current is None or base == self.on_base:
            return
        if base:
            self.drafter.lm.apply_adapter(None, keep_cache=True)
        else:
            self.drafter.lm.apply_adapter(self.current.state, self.current.scaling, keep_cache=True)
        self.drafter.head = None if base else self._head
        self.on_base = base
        for listener in self.listeners:
            listener(self.weights)

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
        self.current, self.on_base, self._head = loaded, False, head
        self.drafter.head = head
        if not keep_cache:
            self.drafter.reset()
        for listener in self.listeners:
            listener(self.weights)

    def on_start(self, prompt_ids: Sequence[int]) -> None:
        """A request starts (before its policy and sources plan it): take the trainer's newest version."""
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
        head = ", acceptance head" if self._head is not None else ""
        # where the weights alternate within a request (paired trials), being on the base weights says
        # nothing: the trials' verdict is the policy's (WeightsChoice.summary)
        on_base = self.on_base and not self.alternates
        base = "; the base weights draft faster here, the last request ran them" if on_base else ""
        return f"{self.current.path} (update {meta.get('updates', 0)}, {meta.get('records_seen', 0)} records{head}{base})"
