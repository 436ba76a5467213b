"""``omnidraft chat``: the session (``session.py``), what it shows (``display.py``) and its slash
commands (``commands.py``)."""

from omnidraft.chat.commands import HELP, Command, parse_input
from omnidraft.chat.display import (
    DIM,
    ReplyAssembler,
    StopScanner,
    format_status,
    gain_line,
    plural,
)
from omnidraft.chat.session import (
    PLAIN_TRANSCRIPT_STOPS,
    ChatSession,
    SigintFlag,
    TurnRecord,
    fit_messages,
    render_conversation,
    stop_strings,
)

__all__ = ["DIM", "HELP", "PLAIN_TRANSCRIPT_STOPS", "ChatSession", "Command", "ReplyAssembler", "SigintFlag",
           "StopScanner", "TurnRecord", "fit_messages", "format_status", "gain_line", "parse_input", "plural",
           "render_conversation", "stop_strings"]
