"""What omnidraft says on stderr, and text streamed from token bytes.

Every message to the user is one line that starts with ``omnidraft:`` (a warning with
``omnidraft: warning:``), whitespace folded, so scripts can grep it and a terminal never shows a
multi-line blob. :class:`Utf8Stream` turns token bytes into text as they arrive, holding back a
character split across tokens (emoji and CJK are often spelled by several byte tokens).
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import Iterable


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def notice(message: str) -> None:
    """An informational line for the user (loading, saving…)."""
    sys.stdout.flush()
    print(f"omnidraft: {_one_line(message)}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """Something went wrong but the command goes on."""
    notice(f"warning: {message}")


class Utf8Stream:
    """Incremental UTF-8 decoding of token bytes; None (a special token) shows nothing."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, pieces: Iterable[bytes | None]) -> str:
        return self._decoder.decode(b"".join(p or b"" for p in pieces))

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)
