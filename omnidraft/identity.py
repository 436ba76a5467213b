"""Who is who: stable fingerprints of tokenizers, and the ids of drafter–target pairs.

A persistent n-gram cache and a LoRA adapter are only valid for the pair of vocabularies they
were learned on, so both are named and stamped with these ids and refuse any other pair.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

_PAIR_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of a tokenizer's vocabulary plus its special/added tokens (memoised on it).

    Sorted by id then token, so dict order does not matter; any change of a token, an id or a
    special token changes the fingerprint, which is what makes a cache or adapter safe to reuse.
    """
    cached = getattr(tokenizer, "_omnidraft_vocab_fingerprint", None)
    if cached is None:
        cached = _fingerprint(tokenizer)
        try:
            tokenizer._omnidraft_vocab_fingerprint = cached  # a loaded tokenizer's vocabulary never changes
        except AttributeError:
            pass
    return cached


def _fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for token, idx in sorted(vocab.items(), key=lambda kv: (int(kv[1]), kv[0])):
        h.update(f"{int(idx)}\t{token}\n".encode("utf-8", "surrogatepass"))
    specials = sorted(set(getattr(tokenizer, "all_special_tokens", None) or []))
    get_added = getattr(tokenizer, "get_added_vocab", None)
    added = sorted((str(k), int(v)) for k, v in get_added().items()) if callable(get_added) else []
    h.update(json.dumps({"special": specials, "added": added}, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def pair_id(drafter_tokenizer: Any, target_tokenizer: Any) -> str:
    """Stable id of a (drafter, target) tokenizer pair: ``<drafter 12 hex>-<target 12 hex>``.

    Order matters: the cache maps drafter sequences to target tokens, not the other way round.
    """
    return f"{vocab_fingerprint(drafter_tokenizer)[:12]}-{vocab_fingerprint(target_tokenizer)[:12]}"


def check_pair_id(value: str) -> str:
    """Return ``value`` if it is usable as a file name (no path, no dot-dot), else ValueError."""
    if not _PAIR_ID_RE.match(value) or ".." in value:
        raise ValueError(f"invalid pair id {value!r}: use letters, digits, '-', '_' or '.'")
    return value


def spec_slug(spec: str) -> str:
    """A folder-safe name for a model spec: ``builtin:smollm2-135m`` -> ``smollm2-135m``;
    a path or hub id keeps its readable tail plus a short hash of the whole spec."""
    if spec.startswith("builtin:"):
        return spec[len("builtin:"):]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.rstrip("/").split("/")[-1])[:40].strip(".") or "model"
    return f"{tail}-{hashlib.sha256(spec.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def pair_slug(drafter_spec: str, target_spec: str) -> str:
    """The adapter folder name of a (drafter, target) pair of specs."""
    return f"{spec_slug(drafter_spec)}--{spec_slug(target_spec)}"
