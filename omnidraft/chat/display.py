"""What the chat shows: replies streamed from token ids, cut at stop strings, and status lines."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from operator import add
from typing import Any

from omnidraft.console import Utf8Stream

DIM, RESET = "\x1b[2m", "\x1b[0m"


class StopScanner:
    """Streams text through while watching for stop strings split across pieces.

    Text that could be the start of a stop string is held back until the next piece shows
    whether it is; ``kept`` is the reply text up to (not including) a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.kept = ""
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a piece; return the text that is now safe to show."""
        if self.stopped:
            return ""
        if not self.stops:
            self.kept += piece
            return piece
        self._pending += piece
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        hold = max((n for s in self.stops for n in range(1, len(s)) if self._pending.endswith(s[:n])), default=0)
        return self._release(len(self._pending) - hold)

    def finish(self) -> str:
        """End of the reply: what was held back is ordinary text after all."""
        return "" if self.stopped else self._release(len(self._pending))

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        if self.stopped:
            self._pending = ""
        self.kept += out
        return out


class ReplyAssembler:
    """Turns emitted target ids into the text to show, joining UTF-8 split across tokens and
    cutting at a stop string; ``ids`` are then the tokens whose text lies before the stop."""

    def __init__(self, token_bytes: Sequence[bytes | None], stops: Sequence[str]) -> None:
        self.table = token_bytes
        self.scanner = StopScanner(stops)
        self._utf8 = Utf8Stream()
        self._ids: list[int] = []
        self._ends: list[int] = []  # text length after each token
        self._length = 0

    @property
    def stopped(self) -> bool:
        return self.scanner.stopped

    def feed(self, ids: Sequence[int]) -> str:
        """Add one decoding step's tokens; return the text now safe to show."""
        shown = []
        for tok in ids:
            if self.stopped:
                break
            data = self.table[tok] if 0 <= tok < len(self.table) else None
            piece = self._utf8.feed([data])  # special tokens (EOS) show nothing
            self._ids.append(tok)
            self._length += len(piece)
            self._ends.append(self._length)
            shown.append(self.scanner.feed(piece))
        return "".join(shown)

    def finish(self) -> str:
        """The reply is over: what was held back (a partial UTF-8 sequence, a stop-string prefix)."""
        if self.stopped:
            return ""
        return self.scanner.feed(self._utf8.finish()) + self.scanner.finish()

    @property
    def text(self) -> str:
        return self.scanner.kept

    @property
    def ids(self) -> list[int]:
        if not self.stopped:
            return list(self._ids)
        return [t for t, end in zip(self._ids, self._ends) if end <= len(self.text)]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 token``, ``2 tokens``: status lines are read by people."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def format_status(stats: Any, *, speculative: bool, interrupted: bool = False, dim: bool = False) -> str:
    """The one line after each reply: tokens, tok/s, acceptance, tokens per target forward, n-gram hits."""
    accept = f"{stats.acceptance_rate:.2f}" if speculative else "– (no drafter)"
    text = (f"[{plural(stats.new_tokens, 'token')} · {stats.tokens_per_s:.1f} tok/s · accept {accept} · "
            f"{stats.tokens_per_target_forward:.1f} tok/target fwd · "
            f"n-gram hits {stats.ngram_hits_accepted}/{stats.ngram_hits_proposed}{_lookup(stats)}"
            f"{_measured(stats)}{' · interrupted' if interrupted else ''}]")
    return f"{DIM}{text}{RESET}" if dim else text


def _measured(stats: Any) -> str:
    """The cost policy's one-time measurement of this machine, when this reply paid for it."""
    seconds = getattr(stats, "measure_s", 0.0)
    return f" · measured this machine's costs once ({seconds:.1f} s, not in tok/s)" if seconds else ""


def session_line(turns: int, totals: Any) -> str:
    """The /stats line of the whole session (``totals`` is the sum of every turn's DecodeStats)."""
    acc = f"{totals.acceptance_rate:.2f}" if totals.step_rates else "–"
    return (f"session: {plural(turns, 'turn')} · {plural(totals.new_tokens, 'token')} · {totals.tokens_per_s:.1f} tok/s · "
            f"mean accept {acc} · {totals.tokens_per_target_forward:.2f} tok/target fwd · "
            f"n-gram hits {totals.ngram_hits_accepted}/{totals.ngram_hits_proposed}{_lookup(totals)}")


GAIN_WINDOW = 3  # turns averaged at each end of the session for the /stats gain line


def gain_line(turns: Sequence[tuple[int | None, Any]]) -> str | None:
    """The /stats line that shows whether the session got faster: the adapter version, speed,
    acceptance and tokens per target forward of its first turns against its last (``turns``:
    (adapter version or None, DecodeStats) per turn, oldest first). The gain is the ratio of tokens
    per target forward: tok/s also falls as the conversation grows, since every target forward then
    reads a longer context, so a drafter that improved could show a lower tok/s than in the first
    turns. None before there are two turns to compare."""
    if len(turns) < 2:
        return None
    n = min(GAIN_WINDOW, len(turns) // 2)
    first, last = reduce(add, (s for _, s in turns[:n])), reduce(add, (s for _, s in turns[-n:]))
    before, after = first.tokens_per_target_forward, last.tokens_per_target_forward
    gain = after / before if before > 0 else float("nan")
    versions = [v for v, _ in turns]
    adapter = ("no adapter" if versions[0] is None and versions[-1] is None
               else f"adapter v{versions[0] or 0} → v{versions[-1] or 0}")
    return (f"since the session began: {adapter} · first {plural(n, 'turn')} {first.tokens_per_s:.1f} tok/s, "
            f"accept {_acceptance(first)}, {before:.2f} tok/target fwd → last {plural(n, 'turn')} "
            f"{last.tokens_per_s:.1f} tok/s, accept {_acceptance(last)}, {after:.2f} tok/target fwd "
            f"({gain:.2f}× tokens per target forward)")


def _acceptance(stats: Any) -> str:
    return f"{stats.acceptance_rate:.2f}" if stats.step_rates else "–"


def _lookup(stats: Any) -> str:
    """Prompt-lookup tokens accepted/proposed, only when lookup drafted at all (most replies: never)."""
    steps = getattr(stats, "lookup_steps", 0)
    return f" · lookup {stats.lookup_accepted}/{stats.lookup_proposed}" if steps else ""
