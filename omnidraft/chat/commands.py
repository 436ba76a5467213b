"""The chat's slash commands: parsing a prompt line, and what each command does to a session."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write_json

if TYPE_CHECKING:
    from omnidraft.chat.session import ChatSession

HELP = """\
Type a message and press Enter; the reply streams as the target accepts it.
  /help             this list
  /stats            session totals, models, n-gram cache, adapter, and the gain since the session began
  /target SPEC      switch the target (builtin:NAME, a folder or a hub id); the conversation carries over
  /reset            start a new conversation (the learned state stays)
  /save FILE        write the conversation and per-turn stats as JSON
  /quit             save state and leave (also /exit, Ctrl-D)
Ctrl-C stops a reply and keeps the session. A message starting with '/' is sent as '//...'."""


@dataclass(frozen=True)
class Command:
    """A slash command as typed: ``name`` without the slash, lower-cased; ``arg`` the rest, stripped."""

    name: str
    arg: str = ""


def parse_input(line: str) -> str | Command | None:
    """What a prompt line asks for: a message (str), a slash command, or None for a blank line.

    ``//text`` sends ``/text`` as a message, so a message may start with a slash.
    """
    text = line.strip()
    if not text:
        return None
    if text.startswith("//"):
        return text[1:]
    if text.startswith("/"):
        name, _, arg = text[1:].partition(" ")
        return Command(name.lower(), arg.strip())
    return text



class SlashCommands:
    """``/help``, ``/stats``, ``/target``, ``/reset``, ``/save``, ``/quit``: each a method, one table."""

    def __init__(self, session: ChatSession) -> None:
        self.s = session
        self.table: dict[str, Callable[[str], None]] = {
            "help": self.help, "?": self.help, "stats": self.stats, "target": self.target,
            "reset": self.reset, "save": self.save, "quit": self.quit, "exit": self.quit,
        }

    def run(self, command: Command) -> None:
        handler = self.table.get(command.name)
        if handler is None:
            raise OmnidraftError(f"unknown command /{command.name}; type /help for the list")
        handler(command.arg)

    def help(self, arg: str) -> None:
        self.s.write(HELP + "\n")

    def stats(self, arg: str) -> None:
        self.s.write(self.s.describe_state() + "\n")

    def target(self, arg: str) -> None:
        s = self.s
        if not arg:
            raise OmnidraftError(f"usage: /target SPEC (now {s.pipe.target_spec})")
        if arg == s.pipe.target_spec:
            s.notice(f"already chatting with {arg}")
            return
        s.switch_target(arg)
        gc.collect()  # the old models are large: free them now, not at some later collection

    def reset(self, arg: str) -> None:
        s = self.s
        s.messages, s.turns, s.context_start = [], [], 0
        s.notice("new conversation (the n-gram cache and session totals are kept)")

    def save(self, arg: str) -> None:
        if not arg:
            raise OmnidraftError("usage: /save FILE")
        path = atomic_write_json(arg, self.s.transcript(), indent=2)
        self.s.notice(f"saved {len(self.s.messages)} messages to {path}")

    def quit(self, arg: str) -> None:
        self.s.finished = True
