"""What bytes does each token decode to? The ground truth the vocabulary bridge is built on.

Raw vocab strings are not comparable across tokenizers: GPT-2-style byte-level BPE spells bytes
with a printable-unicode alphabet ('Ġ' is a space), SentencePiece writes a space as '▁' and keeps
unknown bytes as '<0x0A>'-style pieces. Decoding every token to bytes puts both in one space.
Special tokens have no bytes of their own here; they are matched by their literal text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> raw byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    byte_values, codepoints, extra = printable[:], printable[:], 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, codepoints)}


@dataclass
class TokenTable:
    """Per-token facts of one tokenizer, indexed by token id (model vocab size, may exceed len(tokenizer))."""

    token_bytes: list[bytes | None]  # None: special token or unused id
    special_text: dict[int, str]  # special token id -> literal text
    byte_token: list[int | None]  # raw byte value -> the id of the single-byte token, if any
    byte_fallback_ids: frozenset[int]  # SentencePiece '<0xNN>' pieces (tie-break: prefer real pieces)
    kind: str  # "byte-level" | "sentencepiece" | "plain"


def _component(backend, name: str) -> dict:
    """One part of a fast tokenizer's definition as JSON: each part serializes alone, so the model's
    vocabulary and merges (megabytes for Qwen's) are not serialized and parsed to read its decoder."""
    part = getattr(backend, name, None)
    return json.loads(part.__getstate__()) if part is not None else {}


def _decoder_kind(tokenizer) -> str:
    """Classify how the tokenizer spells bytes, from its backend decoder definition."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "plain"
    text = json.dumps(_component(backend, "decoder")) + json.dumps(_component(backend, "pre_tokenizer"))
    if '"ByteLevel"' in text:
        return "byte-level"
    if "ByteFallback" in text or "\u2581" in text or "Metaspace" in text or getattr(backend.model, "byte_fallback", False):
        return "sentencepiece"
    return "plain"


def _piece_bytes(piece: str, kind: str) -> bytes | None:
    if kind == "byte-level":
        table = gpt2_unicode_to_byte()
        try:
            return bytes(table[ch] for ch in piece)
        except KeyError:
            return piece.encode("utf-8")  # a piece outside the byte alphabet is literal text
    if kind == "sentencepiece":
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
    return piece.encode("utf-8")


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of ``tokenizer``'s special tokens: chat-template markers, end of sequence and the like
    (the added tokens marked special, which have no text of their own)."""
    added = {idx for idx, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    return frozenset(added | set(getattr(tokenizer, "all_special_ids", ())))


def build_token_table(tokenizer, vocab_size: int) -> TokenTable:
    """Decode every token id of ``tokenizer`` to bytes (see module docstring)."""
    kind = _decoder_kind(tokenizer)
    size = max(vocab_size, len(tokenizer))
    token_bytes: list[bytes | None] = [None] * size
    byte_fallback: set[int] = set()
    for piece, idx in tokenizer.get_vocab().items():
        if idx >= size:
            continue
        token_bytes[idx] = _piece_bytes(piece, kind)
        if kind == "sentencepiece" and _BYTE_PIECE.match(piece):
            byte_fallback.add(idx)
    special_text: dict[int, str] = {}
    for idx, added in tokenizer.added_tokens_decoder.items():
        if idx >= size:
            continue
        if added.special:
            special_text[idx] = added.content
            token_bytes[idx] = None
        else:  # a non-special added token matches its literal text, as the tokenizer does
            token_bytes[idx] = added.content.encode("utf-8")
    byte_token: list[int | None] = [None] * 256
    for idx, data in enumerate(token_bytes):
        if data is not None and len(data) == 1:
            current = byte_token[data[0]]
            if current is None or (current in byte_fallback and idx not in byte_fallback):
                byte_token[data[0]] = idx
    return TokenTable(token_bytes, special_text, byte_token, frozenset(byte_fallback), kind)
