"""``omnidraft chat``: the pure parts on their own, then the real CLI driven with pexpect on the
real models (two sessions in one home: the second must start with what the first learned)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pexpect
import pytest
from conftest import DRAFTER, TEST_HOME
from test_cli import assert_one_line_error, omnidraft
from tiny import tiny_tokenizer

from omnidraft.chat import (
    DIM,
    PLAIN_TRANSCRIPT_STOPS,
    Command,
    ReplyAssembler,
    SigintFlag,
    StopScanner,
    fit_messages,
    format_status,
    gain_line,
    parse_input,
    render_conversation,
    stop_strings,
)
from omnidraft.decode import DecodeStats
from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write_json as write_json_atomic

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- pure parts


def test_parse_input_tells_messages_commands_and_blank_lines_apart():
    assert parse_input("") is None and parse_input("   \t") is None
    assert parse_input("/help") == Command("help")
    assert parse_input("  /Target   builtin:gemma3-270m  ") == Command("target", "builtin:gemma3-270m")
    assert parse_input("/save my chat.json") == Command("save", "my chat.json")
    assert parse_input("hello there ") == "hello there"
    assert parse_input("//etc/hosts is a file?") == "/etc/hosts is a file?"


def _msgs(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": text} for role, text in pairs]


def _render_len(messages) -> list[int]:
    """A render whose length is 5 (system prompt) + the characters of every message."""
    return [0] * (5 + sum(len(m["content"]) for m in messages))


def test_fit_messages_drops_oldest_turns_and_keeps_the_system_prompt():
    conv = _msgs(("user", "u" * 10), ("assistant", "a" * 10), ("user", "v" * 10), ("assistant", "b" * 10), ("user", "w" * 10))
    assert fit_messages(_render_len, conv, 55) == (0, [0] * 55)
    dropped, ids = fit_messages(_render_len, conv, 40)
    assert dropped == 2 and len(ids) == 35  # the first pair went, the system prompt (5) stayed
    assert fit_messages(_render_len, conv, 15)[0] == 4  # only the new message is left
    assert fit_messages(_render_len, conv, 14) is None  # not even the new message fits


def test_a_trim_frees_room_for_the_next_turns_where_the_last_message_allows():
    conv = _msgs(("user", "u" * 10), ("assistant", "a" * 10), ("user", "v" * 10), ("assistant", "b" * 10), ("user", "w" * 10))
    assert fit_messages(_render_len, conv, 55, room=30) == (0, [0] * 55)  # fits: nothing goes, room or not
    assert fit_messages(_render_len, conv, 50, room=0)[0] == 2
    assert fit_messages(_render_len, conv, 50, room=20)[0] == 4  # 35 tokens would leave 15 free: drop to 15
    assert fit_messages(_render_len, conv, 20, room=10)[0] == 4  # no start leaves 10 free: the last that fits
    assert fit_messages(_render_len, conv, 14, room=10) is None


def test_fit_messages_cuts_only_before_a_user_message():
    conv = _msgs(("assistant", "x" * 30), ("user", "u" * 5), ("assistant", "a" * 5), ("user", "w" * 5))
    assert fit_messages(_render_len, conv, 25)[0] == 1
    assert fit_messages(_render_len, conv, 12)[0] == 3


def test_a_model_without_template_gets_a_plain_transcript():
    tok = tiny_tokenizer(300)
    assert not getattr(tok, "chat_template", None)
    conv = _msgs(("user", "the cat sat"), ("assistant", "on the mat"), ("user", "and the dog"))
    ids = render_conversation(tok, "be brief", conv)
    assert tok.decode(ids) == "System: be brief\nUser: the cat sat\nAssistant: on the mat\nUser: and the dog\nAssistant:"
    assert stop_strings(tok) == PLAIN_TRANSCRIPT_STOPS


def test_a_model_with_a_template_renders_through_it_and_needs_no_stop_string():
    tok = tiny_tokenizer(300)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids = render_conversation(tok, None, _msgs(("user", "the cat")))
    assert tok.decode(ids) == "<user>the cat<assistant>"
    assert stop_strings(tok) == ()


def _scan(stops, pieces) -> tuple[str, StopScanner]:
    scanner = StopScanner(stops)
    shown = "".join(scanner.feed(p) for p in pieces)
    return shown + scanner.finish(), scanner


def test_stop_scanner_cuts_a_stop_string_split_across_pieces():
    shown, scanner = _scan(("\nUser:",), ["Paris is", " the capital.\nUs", "er: and Rome?"])
    assert shown == scanner.kept == "Paris is the capital." and scanner.stopped


def test_stop_scanner_releases_a_false_alarm():
    shown, scanner = _scan(("\nUser:",), ["a line\nU", "nicorns\nUse"])
    assert shown == scanner.kept == "a line\nUnicorns\nUse" and not scanner.stopped
    assert _scan((), ["x", "\nUser:", "y"])[0] == "x\nUser:y"


def test_reply_assembler_joins_split_utf8_and_cuts_ids_at_the_stop_string():
    table = [b"Hel", b"lo ", b"\xc3", b"\xa4", b"\nUs", b"er:", None]
    reply = ReplyAssembler(table, PLAIN_TRANSCRIPT_STOPS)
    assert reply.feed([0, 1]) == "Hello " and reply.feed([2]) == "" and reply.feed([3]) == "ä"
    assert reply.feed([4]) == ""  # '\nUs' may begin '\nUser:': held back
    assert reply.feed([5, 6]) == "" and reply.stopped and reply.finish() == ""
    assert reply.text == "Hello ä" and reply.ids == [0, 1, 2, 3]
    plain = ReplyAssembler(table, ())
    assert plain.feed([4, 5, 6]) + plain.finish() == "\nUser:" and plain.ids == [4, 5, 6]


def test_status_line_is_dim_only_when_asked():
    stats = DecodeStats(target_forwards=4, new_tokens=10, wall_s=2.0, ngram_hits_proposed=3, ngram_hits_accepted=2,
                        step_rates=[0.5, 1.0])
    plain = format_status(stats, speculative=True)
    assert plain == "[10 tokens · 5.0 tok/s · accept 0.75 · 2.5 tok/target fwd · n-gram hits 2/3]"
    assert format_status(stats, speculative=True, dim=True) == f"{DIM}{plain}\x1b[0m"
    one = DecodeStats(target_forwards=1, new_tokens=1, wall_s=1.0)
    assert format_status(one, speculative=False, interrupted=True).startswith("[1 token · 1.0 tok/s · accept –")
    assert format_status(one, speculative=False, interrupted=True).endswith("· interrupted]")
    copied = DecodeStats(target_forwards=4, new_tokens=10, wall_s=2.0, lookup_steps=2, lookup_proposed=9, lookup_accepted=7)
    assert format_status(copied, speculative=True).endswith("n-gram hits 0/0 · lookup 7/9]")


def test_write_json_atomic_writes_valid_json_or_one_clear_error(tmp_path):
    path = write_json_atomic(tmp_path / "t.json", {"messages": [{"role": "user", "content": "Käse"}]})
    assert json.loads(path.read_text(encoding="utf-8"))["messages"][0]["content"] == "Käse"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind
    with pytest.raises(OmnidraftError, match="cannot write"):
        write_json_atomic(tmp_path / "missing" / "t.json", {})


def test_sigint_flag_first_ctrl_c_only_flags_second_one_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with SigintFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert flag.raised
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before


def test_the_gain_line_compares_the_first_turns_with_the_last():
    slow = DecodeStats(target_forwards=10, new_tokens=10, wall_s=5.0, step_rates=[0.2])
    fast = DecodeStats(target_forwards=5, new_tokens=10, wall_s=2.0, step_rates=[0.6])
    assert gain_line([(None, slow)]) is None  # nothing to compare yet
    line = gain_line([(None, slow), (None, slow), (1, fast), (2, fast)])
    assert line == ("since the session began: adapter v0 → v2 · first 2 turns 2.0 tok/s, accept 0.20, 1.00 tok/target fwd → "
                    "last 2 turns 5.0 tok/s, accept 0.60, 2.00 tok/target fwd (2.00× tokens per target forward)")
    # a longer context slows every forward: fewer tok/s, yet the drafter saves more forwards
    later = DecodeStats(target_forwards=4, new_tokens=10, wall_s=6.0, step_rates=[0.7])
    assert gain_line([(None, slow), (1, later)]).endswith("accept 0.70, 2.50 tok/target fwd (2.50× tokens per target forward)")
    window = gain_line([(3, slow)] * 4 + [(3, fast)] * 6)  # three turns at each end, at most
    assert "adapter v3 → v3 · first 3 turns 2.0 tok/s" in window and "last 3 turns 5.0 tok/s" in window
    assert gain_line([(None, slow), (None, fast)]).startswith("since the session began: no adapter")


def test_chat_rejects_a_window_without_room_before_loading():
    assert_one_line_error(omnidraft("chat", "--context-window", "16", "--max-new-tokens", "16"), "--context-window")
    assert_one_line_error(omnidraft("chat", "--max-new-tokens", "0"), "--max-new-tokens")


# ---------------------------------------------------------------- the real CLI

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT = r"(?:^|\n)(?:\x1b\[[0-9;?]*[A-Za-z])*>>> "
STATUS = re.compile(r"\[(\d+) tokens? · ([\d.]+) tok/s · accept ([\d.]+) · ([\d.]+) tok/target fwd · n-gram hits (\d+)/(\d+)")
ENTRIES = re.compile(r"n-gram cache: pair (\S+) · (\d+) entr(?:y|ies)")
GERMAN = "Schreibe eine kurze Geschichte über einen Drachen, der Käse liebt."  # rich in 1->n token splits
LONG_CODE = "Write a Python merge sort with comments."
STORY = "Tell me a story about a small robot who lives in a lighthouse by the sea and learns to paint the waves at night."


def clean(text: str) -> str:
    return ANSI.sub("", text).replace("\r", "")


@dataclass
class Turn:
    reply: str
    status: str
    gap_s: float  # seconds from the reply's first character to its status line
    dim: bool  # the status line came wrapped in the terminal's dim attribute


class Chat:
    """``python -m omnidraft chat`` on a pseudo-terminal, as a person would run it."""

    def __init__(self, home: Path, *args: str, engine: str = "torch") -> None:
        """``engine`` torch (with the confidence stop, so the drafter always drafts) unless asked."""
        env = dict(os.environ, TERM="dumb", OMNIDRAFT_HOME=str(home))
        policy = ["--draft-stop", "confidence"] if engine == "torch" else []
        self.child = pexpect.spawn(sys.executable, ["-m", "omnidraft", "chat", "--home", str(home), "--drafter", DRAFTER,
                                                   "--engine", engine, *policy, *args],
                                   cwd=str(REPO), env=env, encoding="utf-8", timeout=180, dimensions=(40, 500))
        self.child.expect(PROMPT)
        self.banner = clean(self.child.before)

    def send(self, line: str) -> list[str]:
        """Send one line; return the non-empty output lines up to the next prompt (echo removed)."""
        self.child.sendline(line)
        self.child.expect(PROMPT)
        echo, _, rest = clean(self.child.before).partition("\n")
        assert echo.endswith(line), echo
        return [ln for ln in rest.split("\n") if ln.strip()]

    def one_error(self, line: str, *needles: str) -> str:
        """The line must answer with exactly one ``omnidraft: error:`` line and nothing else."""
        out = self.send(line)
        assert len(out) == 1 and out[0].startswith("omnidraft: error: "), out
        for needle in needles:
            assert needle in out[0], out
        return out[0]

    def turn(self, message: str, interrupt: bool = False) -> Turn:
        """One message, optionally Ctrl-C as soon as the reply starts; what the terminal showed."""
        self.child.sendline(message)
        self.child.expect_exact(message + "\r\n")
        self.child.expect(r"\S")
        first_seen, first_char = time.monotonic(), self.child.after
        if interrupt:
            self.child.send("\x03")
        self.child.expect(STATUS)
        gap = time.monotonic() - first_seen
        dim = self.child.before.endswith(DIM)
        reply, status = clean(first_char + self.child.before), clean(self.child.after)
        self.child.expect(PROMPT)
        status += clean(self.child.before).split("\n")[0]
        return Turn(reply, status, gap, dim)

    def exit_status(self) -> int:
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


@pytest.fixture(scope="module")
def chat_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("chat_home")
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)  # reuse dequantized models
    return home


@pytest.fixture(scope="module")
def first_session(chat_home, tmp_path_factory) -> dict:
    """Session 1 on Qwen2.5-Coder-0.5B: bad input, commands, a full turn, an interrupted turn, /save, /quit."""
    out: dict = {"save": tmp_path_factory.mktemp("saved") / "chat.json"}
    chat = Chat(chat_home, "--max-new-tokens", "48")
    out["banner"] = chat.banner
    chat.child.send("half a message")
    chat.child.send("\x03")  # Ctrl-C at the prompt drops the line
    chat.child.expect(PROMPT)
    out["empty"] = chat.one_error("", "empty")
    out["unknown"] = chat.one_error("/frobnicate", "/frobnicate", "/help")
    out["help"] = chat.send("/help")
    out["stats_before"] = chat.send("/stats")
    out["german"] = chat.turn(GERMAN)
    out["code"] = chat.turn(LONG_CODE, interrupt=True)
    out["stats_after"] = chat.send("/stats")
    out["saved"] = chat.send(f"/save {out['save']}")
    out["save_bad"] = chat.one_error(f"/save {out['save'].parent / 'no' / 'such' / 'dir.json'}", "cannot write")
    chat.child.sendline("/quit")
    out["exit"] = chat.exit_status()
    return out


@pytest.mark.real
def test_a_turn_streams_a_reply_then_a_dim_status_line(first_session):
    turn = first_session["german"]
    assert turn.reply.strip(), "the reply is empty"
    tokens, tok_s, accept, per_fwd, _, _ = STATUS.search(turn.status).groups()
    assert 0 < int(tokens) <= 48 and float(tok_s) > 0 and 0 < float(accept) <= 1 and float(per_fwd) >= 1
    assert "tok/s" in turn.status and "accept" in turn.status and turn.dim
    assert turn.gap_s > 0.3, "the whole reply arrived at once: it did not stream"
    assert "chat template" in first_session["banner"] and "0 entries" in first_session["banner"]


@pytest.mark.real
def test_slash_commands_and_bad_input_get_one_line_and_the_session_goes_on(first_session):
    assert any("/target SPEC" in ln for ln in first_session["help"])
    assert any("/save FILE" in ln for ln in first_session["help"])
    before = "\n".join(first_session["stats_before"])
    assert "session: 0 turns" in before, "the line cleared with Ctrl-C at the prompt was sent"
    assert "adapter: " in before and "target: builtin:qwen2.5-coder-0.5b" in before
    after = "\n".join(first_session["stats_after"])
    assert "session: 2 turns" in after and int(ENTRIES.search(after).group(2)) > 0
    assert re.search(r"since the session began: (no adapter|adapter v\d+ → v\d+) · first 1 turn [\d.]+ tok/s, "
                     r"accept \S+, [\d.]+ tok/target fwd → last 1 turn [\d.]+ tok/s, accept \S+, [\d.]+ tok/target fwd "
                     r"\([\d.]+× tokens per target forward\)", after), after


@pytest.mark.real
def test_ctrl_c_mid_reply_returns_to_the_prompt_and_keeps_the_partial_reply(first_session):
    status = first_session["code"].status
    assert "interrupted" in status
    assert int(STATUS.search(status).group(1)) < 48, "the reply ran to its token budget: Ctrl-C did not stop it"
    saved = json.loads(first_session["save"].read_text(encoding="utf-8"))
    assert saved["turns"][1]["interrupted"] is True
    assert all("adapter_version" in t for t in saved["turns"])
    assert saved["messages"][3]["role"] == "assistant" and saved["messages"][3]["content"]


@pytest.mark.real
def test_save_writes_the_conversation_as_json(first_session):
    saved = json.loads(first_session["save"].read_text(encoding="utf-8"))
    assert saved["target"] == "builtin:qwen2.5-coder-0.5b" and saved["drafter"] == DRAFTER
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][0]["content"] == GERMAN and saved["messages"][2]["content"] == LONG_CODE
    assert saved["messages"][1]["content"] in first_session["german"].reply
    assert len(saved["turns"]) == 2 and saved["turns"][0]["stats"]["new_tokens"] > 0
    assert "saved 4 messages" in first_session["saved"][0]


@pytest.mark.real
def test_quit_exits_0_and_leaves_history_and_cache_in_the_home(first_session, chat_home):
    assert first_session["exit"] == 0
    assert "/frobnicate" in (chat_home / "chat_history").read_text(encoding="utf-8")
    pair, entries = ENTRIES.search("\n".join(first_session["stats_after"])).groups()
    env = dict(os.environ, OMNIDRAFT_HOME=str(chat_home))
    proc = subprocess.run([sys.executable, "-m", "omnidraft", "cache", "stats", "--json", "--pair", pair],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["caches"][0]["entries"] == int(entries)
    # the trainer learned from both turns between them and the exit waited for its last update
    assert "adapter: none · training between turns" in first_session["banner"]
    proc = subprocess.run([sys.executable, "-m", "omnidraft", "adapters", "list", "--json"],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)
    (row,) = json.loads(proc.stdout)
    assert row["name"] == "smollm2-135m--qwen2.5-coder-0.5b" and row["status"] == "ok"
    assert row["updates"] == 2 and row["records_seen"] == 2


@pytest.mark.real
def test_second_session_starts_with_the_cache_and_survives_bad_targets_and_long_turns(first_session, chat_home):
    """Session 2 in the same home: the n-gram entries of session 1, a message too long for the
    window, a target that fails to load, a switch to the base model Gemma-3 (plain transcript),
    the oldest turn dropped from a full window, and Ctrl-D."""
    learned = int(ENTRIES.search("\n".join(first_session["stats_after"])).group(2))
    chat = Chat(chat_home, "--max-new-tokens", "16", "--context-window", "56")
    assert int(ENTRIES.search(chat.banner).group(2)) == learned
    assert re.search(r"adapter: \S+/v\d{6} \(update 2, 2 records, acceptance head\)", chat.banner), chat.banner  # its adapter and head
    chat.one_error(STORY, "too long", "56")  # 55 Qwen tokens + 16 > 56
    chat.one_error("/target builtin:nope", "unknown model spec")
    switched = chat.send("/target builtin:gemma3-270m")
    assert switched[-1].startswith("omnidraft: now chatting with builtin:gemma3-270m") and "plain" in switched[-1]
    turn = chat.turn("The capital of France is")
    assert turn.reply.strip() and "tok/s" in turn.status and "accept" in turn.status
    chat.child.sendline(STORY)  # 31 Gemma tokens alone; with the first turn over the 40-token budget
    chat.child.expect(r"dropped the (\d+) oldest turn")
    assert chat.child.match.group(1) == "1"
    chat.child.expect(STATUS)
    chat.child.expect(PROMPT)
    stats = "\n".join(chat.send("/stats"))
    assert "target: builtin:gemma3-270m" in stats and "(1 dropped)" in stats
    chat.child.sendeof()
    assert chat.exit_status() == 0


@pytest.mark.real
def test_chat_on_llama_cpp_streams_and_switches_target(tmp_path):
    """The default engine for the builtin targets: a turn streams, /target switches, /quit exits 0."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    chat = Chat(home, "--max-new-tokens", "24", "--no-train", engine="auto")
    assert "on llamacpp" in chat.banner, chat.banner
    turn = chat.turn("Name one prime number.")
    assert turn.reply.strip() and 0 < int(STATUS.search(turn.status).group(1)) <= 24
    assert any("now chatting with builtin:gemma3-270m" in line for line in chat.send("/target builtin:gemma3-270m"))
    assert chat.turn("The capital of France is").reply.strip()
    chat.child.sendline("/quit")
    assert chat.exit_status() == 0

def test_while_the_user_types_the_drafter_reads_the_conversation_that_the_next_turn_continues():
    """``KeepUp``: the next turn's prompt continues the conversation so far, so the drafter reads it in
    the user's idle time, through the drafter source, and the turn's catch-up is the new message only
    (without it a drafter that sat out a few turns had the whole conversation to read, and the cost
    policy rightly kept it out for the rest of the chat)."""
    from tiny import tiny_pair

    from omnidraft.chat.session import KEEP_UP_PIECE, KeepUp
    from omnidraft.config import DecodeConfig
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.runtime import make_drafter
    from omnidraft.sources.policy import NoCostPolicy
    from omnidraft.vocab.reverse import DrafterContext

    d_model, target, bridge = tiny_pair()
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    source, lm = decoder.source("drafter"), decoder.drafter.lm
    conversation = target.tokenizer.encode("the cat sat on the mat and the dog ran " * 7)
    context = DrafterContext(bridge, conversation).ids
    assert len(context) > 2 * KEEP_UP_PIECE and decoder.drafter.window(context, 8) == context  # no slide here
    keeper = KeepUp(source, draft_len=8)
    keeper.start(conversation)
    keeper._thread.join(timeout=60)  # it ends by itself once the conversation is read
    keeper.stop()
    cached = list(lm.cached_ids)
    assert cached == context[: len(cached)] and len(cached) >= len(context) - KEEP_UP_PIECE  # the draft reads the rest
    message = target.tokenizer.encode(" and the bird sang")
    prompt = conversation + message
    source.begin(prompt, DecodeConfig(max_new_tokens=8, draft_len=4, draft_stop="fixed"), NoCostPolicy())
    assert 0 < source.offer(prompt, 8).unread <= len(context) - len(cached) + 3 * len(message)
