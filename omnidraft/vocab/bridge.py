"""Vocabulary bridge between a drafter and a target tokenizer (OmniDraft §3.1, Algorithm 1).

* The direct-mapping (DM) table pairs a drafter token with the target token that decodes to the
  same bytes; special tokens pair by literal text.
* Forward translation (eq. (1)) turns drafted tokens d_1..d_k into target tokens t_1..t_m,
  merging the longest n-gram cache hit, and records which drafted tokens each t_i came from.
* ``drafter_encode`` turns bytes into drafter tokens for reverse translation: valid UTF-8 goes
  through the drafter's tokenizer, a trailing incomplete character through single-byte tokens so
  the drafter never waits for text the target has already emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from omnidraft.ngram.trie import NgramTrie
from omnidraft.vocab.token_bytes import TokenTable, build_token_table


@dataclass
class Translation:
    """Result of forward translation: m target tokens and, for each, its drafted span."""

    target_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) into the drafted list
    ngram: list[bool] = field(default_factory=list)  # True where t_i came from the n-gram cache

    @property
    def drafted_used(self) -> int:
        return self.spans[-1][1] if self.spans else 0


class VocabBridge:
    """Direct mapping, forward translation and byte-exact drafter encoding for one model pair."""

    def __init__(self, drafter_tokenizer, target_tokenizer, drafter_vocab_size: int, target_vocab_size: int) -> None:
        self.drafter_tokenizer = drafter_tokenizer
        self.target_tokenizer = target_tokenizer
        self.d = build_token_table(drafter_tokenizer, drafter_vocab_size)
        self.t = build_token_table(target_tokenizer, target_vocab_size)
        self.drafter_vocab_size = drafter_vocab_size
        self.target_vocab_size = target_vocab_size
        d2t, t2d = self._direct_mapping()
        self.d2t = torch.tensor(d2t[:drafter_vocab_size], dtype=torch.long)
        self.t2d = torch.tensor(t2d[:target_vocab_size], dtype=torch.long)
        self.d2t_list = d2t
        self.dm_mask = self.d2t >= 0
        # Additive logit bias: 0 on translatable drafter tokens, -inf elsewhere (TLI restriction).
        self.dm_bias = torch.where(self.dm_mask, 0.0, float("-inf"))
        self._spellings: dict[int, list[int]] = {}

    # ---- direct mapping -------------------------------------------------------------------------
    @staticmethod
    def _bytes_index(table: TokenTable) -> dict[bytes, int]:
        """bytes -> token id, preferring ordinary pieces over SentencePiece byte-fallback pieces."""
        index: dict[bytes, int] = {}
        for idx, data in enumerate(table.token_bytes):
            if not data:
                continue
            current = index.get(data)
            if current is None or (current in table.byte_fallback_ids and idx not in table.byte_fallback_ids):
                index[data] = idx
        return index

    def _direct_mapping(self) -> tuple[list[int], list[int]]:
        target_index = self._bytes_index(self.t)
        drafter_index = self._bytes_index(self.d)
        d2t = [-1] * len(self.d.token_bytes)
        t2d = [-1] * len(self.t.token_bytes)
        for idx, data in enumerate(self.d.token_bytes):
            if data and data in target_index:
                d2t[idx] = target_index[data]
        for data, idx in target_index.items():
            if data in drafter_index:
                t2d[idx] = drafter_index[data]
        target_special = {text: idx for idx, text in self.t.special_text.items()}
        for d_idx, text in self.d.special_text.items():
            if text in target_special:
                d2t[d_idx] = target_special[text]
                t2d[target_special[text]] = d_idx
        return d2t, t2d

    @property
    def intersection_size(self) -> int:
        """Number of drafter tokens with a direct-mapping partner (Table 8 of the paper)."""
        return int(self.dm_mask.sum())

    # ---- forward translation, eq. (1) -----------------------------------------------------------
    def forward(self, drafted: Sequence[int], ngrams: NgramTrie | None) -> Translation:
        """Map drafted tokens to target tokens; the longest n-gram hit wins over a direct mapping.

        Stops at the first drafted token that is neither direct-mapped nor part of an n-gram: what
        follows it cannot be verified by the target.
        """
        out = Translation()
        i, k = 0, len(drafted)
        while i < k:
            hit = ngrams.longest_match(drafted, i) if ngrams is not None and len(ngrams) else None
            if hit is not None:
                length, target_id = hit
                out.target_ids.append(target_id)
                out.spans.append((i, i + length))
                out.ngram.append(True)
                i += length
                continue
            target_id = self.d2t_list[drafted[i]]
            if target_id < 0:
                break
            out.target_ids.append(target_id)
            out.spans.append((i, i + 1))
            out.ngram.append(False)
            i += 1
        return out

    # ---- forward translation through text (SLEM-style, greedy only) ----------------------------
    def forward_text(self, context: Sequence[int], drafted: Sequence[int], look_behind: int = 3,
                     overlap: bytes = b"") -> Translation:
        """Re-tokenize the drafted *text* with the target tokenizer, after a look-behind of context.

        Token-level mapping cannot express a drafter token that spans two target tokens: SmolLM2
        spells a new code line as '\n' + indent in one token, Qwen as '):\n' then the indent, so
        every line break of code would be rejected. Re-tokenizing the text (what SLEM does) aligns
        any split. Greedy verification stays lossless whatever is proposed; the sampling verifiers
        need per-token q and use :meth:`forward`. ``spans`` are left empty: the mapping from target
        to drafted tokens is by bytes (see ``DrafterContext.extend_accepted_bytes``). ``overlap``: the
        drafted text's first bytes, which the context already ends with (a healed draft: ``Draft.overlap``).
        """
        out = Translation()
        text, tail_special = bytearray(), None
        for tok in drafted:
            data = self.d.token_bytes[tok]
            if data is None:  # a special token ends the text; keep it if the target has it
                mapped = self.d2t_list[tok]
                tail_special = mapped if mapped >= 0 else None
                break
            text += data
        if overlap:
            if not text.startswith(overlap):
                raise ValueError("a healed draft must begin with the bytes it heals")
            del text[:len(overlap)]
        start = len(context)
        while start > 0 and len(context) - start < look_behind and self.t.token_bytes[context[start - 1]] is not None:
            start -= 1
        behind = b"".join(self.t.token_bytes[t] for t in context[start:])
        full = (behind + bytes(text)).decode("utf-8", errors="ignore").encode("utf-8")  # drop a cut character
        if len(full) > len(behind):
            ids = self.target_tokenizer.encode(full.decode("utf-8"), add_special_tokens=False)
            out.target_ids = self._after_boundary(ids, len(behind))
        if tail_special is not None and len(full) == len(behind) + len(text):
            out.target_ids.append(tail_special)
        out.ngram = [False] * len(out.target_ids)
        return out

    def _after_boundary(self, ids: list[int], boundary: int) -> list[int]:
        """The tokens after byte offset ``boundary``, if a token boundary falls there; else none."""
        offset = 0
        for i, tok in enumerate(ids):
            if offset == boundary:
                return ids[i:]
            data = self.t.token_bytes[tok]
            if data is None:
                return []
            offset += len(data)
        return []

    # ---- bytes -> drafter tokens (reverse translation) ------------------------------------------
    def drafter_encode(self, data: bytes) -> list[int]:
        """Drafter tokens whose bytes are exactly ``data`` (no BOS/EOS added).

        Exact whenever the drafter can spell every byte of ``data``; see ``representable``.
        """
        ids: list[int] = []
        while data:
            try:
                text, bad, rest = data.decode("utf-8"), b"", b""
            except UnicodeDecodeError as err:  # an incomplete or invalid character: byte tokens
                text = data[: err.start].decode("utf-8")
                bad, rest = data[err.start : err.end], data[err.end :]
            if text:
                ids += self.drafter_tokenizer.encode(text, add_special_tokens=False)
            # A byte the drafter's vocabulary lacks (SmolLM2 has no 0xF1, say) is left out: the
            # drafter only guesses, so a gap in its context costs acceptance, never correctness.
            ids += [tok for tok in (self.d.byte_token[b] for b in bad) if tok is not None]
            data = rest
        return ids

    def representable(self, data: bytes) -> bool:
        """Whether the drafter vocabulary has every byte of ``data`` (byte-level BPEs may lack a few)."""
        return all(self.d.byte_token[b] is not None for b in set(data))

    def target_bytes(self, target_id: int) -> bytes | None:
        """Bytes of a target token, None for a special token."""
        return self.t.token_bytes[target_id]

    def drafter_bytes(self, drafter_id: int) -> bytes | None:
        return self.d.token_bytes[drafter_id]

    def spelling(self, target_id: int) -> list[int]:
        """The drafter tokens that carry one target token into the drafter's context: its direct
        partner, else its bytes re-tokenized (memoised; the samplers that draft in target ids feed it)."""
        found = self._spellings.get(target_id)
        if found is None:
            mapped = int(self.t2d[target_id]) if target_id < len(self.t2d) else -1
            data = self.target_bytes(target_id)
            found = self._spellings[target_id] = [mapped] if mapped >= 0 else (self.drafter_encode(data) if data else [])
        return found

    def target_to_drafter(self, target_ids: Sequence[int]) -> list[int]:
        """Translate a whole target token sequence (a prompt) into drafter tokens, text-exactly.

        Runs of ordinary tokens are re-tokenized as one text; special tokens map by literal text
        or, without a drafter counterpart (a target's BOS, say), are dropped.
        """
        out: list[int] = []
        run = bytearray()
        for tid in target_ids:
            data = self.t.token_bytes[tid]
            if data is not None:
                run += data
                continue
            if run:
                out += self.drafter_encode(bytes(run))
                run.clear()
            mapped = int(self.t2d[tid]) if tid < len(self.t2d) else -1
            if mapped >= 0:
                out.append(mapped)
        if run:
            out += self.drafter_encode(bytes(run))
        return out
