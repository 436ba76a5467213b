"""Assemble a ready-to-run decoder from model specs: the glue the CLI, demos and benchmark share."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from omnidraft import models
from omnidraft.config import DEFAULT_DRAFTER_DTYPE
from omnidraft.decode import SpeculativeDecoder
from omnidraft.drafter import Drafter
from omnidraft.errors import OmnidraftError
from omnidraft.kv import output_vocab_size
from omnidraft.ngram.trie import NgramTrie
from omnidraft.target import LocalTarget
from omnidraft.vocab import VocabBridge


@dataclass
class Pipeline:
    decoder: SpeculativeDecoder
    target_spec: str
    drafter_spec: str | None
    target_model: torch.nn.Module
    drafter_model: torch.nn.Module | None
    adapter_slot: object | None = None  # omnidraft.train.online.AdapterSlot when a drafter is loaded

    @property
    def target_tokenizer(self):
        return self.decoder.target.tokenizer


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"omnidraft: {msg}", file=sys.stderr, flush=True)


def build_bridge(drafter_model, drafter_tokenizer, target_model, target_tokenizer) -> VocabBridge:
    return VocabBridge(drafter_tokenizer, target_tokenizer, output_vocab_size(drafter_model), output_vocab_size(target_model))


def make_drafter(drafter_model, bridge: VocabBridge, target: LocalTarget) -> Drafter:
    """A drafter that stops drafting after proposing the target's end-of-sequence token."""
    stop = [d for d, t in enumerate(bridge.d2t_list) if t in target.eos_ids]
    return Drafter(drafter_model, bridge, stop_ids=stop)


@dataclass
class CacheOptions:
    """How the persistent n-gram cache of the pair is used (see omnidraft/ngram/store.py)."""

    enabled: bool = True  # False: in-memory only, starts empty, nothing written
    max_entries: int | None = None  # None: no cap
    policy: str = "lru"
    frozen: bool = False


def open_ngram_cache(drafter_tok, target_tok, options: CacheOptions, home=None) -> NgramTrie:
    if not options.enabled:
        return NgramTrie()
    from omnidraft.ngram.store import open_pair_cache

    try:
        return open_pair_cache(drafter_tok, target_tok, home=home, max_entries=options.max_entries,
                               policy=options.policy, frozen=options.frozen)
    except ValueError as exc:
        raise OmnidraftError(f"bad n-gram cache option: {exc}") from None


DRAFTER_DTYPES = ("float32", "bfloat16", "int8")


def convert_drafter(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The drafter's speed/precision trade-off; the target's dtype never changes, so greedy output
    stays the target's own. int8 is torch's dynamic quantization of every Linear layer."""
    if dtype == "float32":
        return model
    if dtype == "bfloat16":
        return model.to(torch.bfloat16)
    if dtype == "int8":
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    raise OmnidraftError(f"unknown drafter dtype {dtype!r}; choose one of {', '.join(DRAFTER_DTYPES)}")


def load_pipeline(target_spec: str, drafter_spec: str | None, *, home=None, dtype: str = "float32",
                  drafter_dtype: str = DEFAULT_DRAFTER_DTYPE, cache: CacheOptions | None = None, quiet: bool = False,
                  adapter: str = "auto") -> Pipeline:
    """Load target (and drafter unless None/'none') and wire bridge, n-gram cache, drafter, decoder.

    ``adapter``: "auto" uses the pair's LoRA adapter under ``<home>/adapters/`` if one was
    trained, "none" runs the base drafter, anything else is the path of an adapter folder.
    """
    for spec in (target_spec, drafter_spec):
        if spec not in (None, "none"):
            models.builtin(spec)  # an unknown builtin fails here, before minutes of loading
    if drafter_spec not in (None, "none") and adapter not in ("auto", "none"):
        precheck_adapter(adapter)  # a bad path fails now, not after a minute of loading
    if drafter_dtype not in DRAFTER_DTYPES:
        raise OmnidraftError(f"unknown drafter dtype {drafter_dtype!r}; choose one of {', '.join(DRAFTER_DTYPES)}")
    _log(f"loading target {target_spec}", quiet)
    target_model, target_tok = models.load(target_spec, home=home, dtype=dtype, progress=not quiet)
    target = LocalTarget(target_model, target_tok)
    if drafter_spec in (None, "none"):
        return Pipeline(SpeculativeDecoder(target), target_spec, None, target_model, None)
    _log(f"loading drafter {drafter_spec}", quiet)
    drafter_model, drafter_tok = models.load(drafter_spec, home=home, dtype="float32", progress=not quiet)
    bridge = build_bridge(drafter_model, drafter_tok, target_model, target_tok)
    identity = adapter_identity(drafter_tok, target_tok, drafter_model)  # before int8 hides the weights
    drafter_model = convert_drafter(drafter_model, drafter_dtype)
    if bridge.intersection_size == 0:
        raise OmnidraftError(f"{drafter_spec} and {target_spec} share no token: nothing can be drafted")
    ngrams = open_ngram_cache(drafter_tok, target_tok, cache or CacheOptions(), home)
    drafter = make_drafter(drafter_model, bridge, target)
    decoder = SpeculativeDecoder(target, drafter, bridge, ngrams)
    slot = adapter_slot(drafter, identity, drafter_spec, target_spec, home)
    decoder.observers.append(slot)
    use_adapter(slot, adapter, drafter_dtype, quiet)
    return Pipeline(decoder, target_spec, drafter_spec, target_model, drafter_model, slot)


def adapter_identity(drafter_tok, target_tok, drafter_model):
    from omnidraft.train import adapter_store

    return adapter_store.identity_of(drafter_tok, target_tok, drafter_model)


def adapter_slot(drafter: Drafter, identity, drafter_spec: str, target_spec: str, home=None):
    """The pair's adapter slot: what an adapter must match, and the folder it lives in."""
    from omnidraft.train import adapter_store
    from omnidraft.train.online import AdapterSlot

    return AdapterSlot(drafter, identity, adapter_store.pair_dir(drafter_spec, target_spec, home))


def precheck_adapter(adapter: str) -> None:
    """What can be checked of an explicit adapter folder before any model is loaded."""
    from omnidraft.train import adapter_store

    folder = Path(adapter).expanduser()
    try:
        if not folder.is_dir():
            raise adapter_store.AdapterProblem(f"no adapter folder at {folder}")
        version_dir = adapter_store.current_version_dir(folder)
        if version_dir is None:
            raise adapter_store.AdapterProblem(f"{folder} holds no published adapter")
        adapter_store.read_meta(version_dir)
    except adapter_store.AdapterProblem as exc:
        raise OmnidraftError(f"--adapter {adapter}: {exc}") from None


def use_adapter(slot, adapter: str, drafter_dtype: str, quiet: bool = False) -> None:
    """Load the adapter ``adapter`` names into ``slot`` (see :func:`load_pipeline`).

    An explicit path that is missing, corrupt or made for another pair is an error; with "auto"
    such an adapter is reported in one line and not used.
    """
    from omnidraft.train import adapter_store

    if adapter == "none":
        return
    explicit = adapter != "auto"
    folder = Path(adapter).expanduser() if explicit else slot.folder
    try:
        if explicit and not folder.is_dir():
            raise adapter_store.AdapterProblem(f"no adapter folder at {folder}")
        loaded = adapter_store.load(folder, slot.identity)
        if loaded is None:
            if explicit:
                raise adapter_store.AdapterProblem(f"{folder} holds no published adapter")
            return
        if drafter_dtype == "int8":
            raise adapter_store.AdapterProblem("an int8 drafter cannot take a LoRA adapter; use --drafter-dtype bfloat16 or float32")
        slot.use(loaded)
    except (adapter_store.AdapterProblem, ValueError) as exc:
        if explicit:
            raise OmnidraftError(f"--adapter {adapter}: {exc}") from None
        print(f"omnidraft: warning: {exc}; running without an adapter (--adapter none hides this)", file=sys.stderr)
        return
    _log(f"adapter {slot.description}", quiet)


def encode_prompt(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Target token ids for a prompt: as is (with the tokenizer's BOS rule), or chat-templated.

    A model without a chat template (a base model) gets a plain User:/Assistant: transcript.
    """
    if not chat:
        return list(tokenizer(text)["input_ids"])
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return list(tokenizer("\n".join(lines) + "\nAssistant:")["input_ids"])
