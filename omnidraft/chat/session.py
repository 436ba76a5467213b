"""``omnidraft chat``: an interactive session over the speculative decoder.

The session owns the conversation and everything a user sees: the ``>>> `` prompt, replies that
stream as the target accepts them, one status line per reply, slash commands, context-window
trimming and the state kept in the home between sessions (the pair's n-gram cache, readline
history). What it shows is ``display.py``, the slash commands ``commands.py``; the argparse glue
is ``omnidraft/cli/chat.py``.

The target's chat template renders the whole conversation into target token ids; the decoder
turns those same ids into the drafter's context, so the drafter sees exactly the same text in
its own tokens. A base model without a template gets a plain ``User:``/``Assistant:`` transcript
(``runtime.encode_messages``) and its reply is cut where it starts writing the next ``User:`` turn.

Learning: unless ``--no-train``, the active pipeline gets an :class:`~omnidraft.train.online.OnlineLearning`:
every reply is recorded as it streams and handed to the background trainer when it ends, so the
pair's LoRA adapter is updated between turns, while the user reads and types (the trainer process
waits whenever a reply is being decoded). New adapter versions are merged into the drafter between
decoding steps. ``/target`` switches adapter, cache and template together; on exit the session
waits for the update in flight, so the adapter on disk includes the last turn.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from omnidraft.chat.commands import Command, SlashCommands, parse_input
from omnidraft.chat.display import ReplyAssembler, format_status, gain_line, plural, session_line
from omnidraft.config import DecodeConfig
from omnidraft.decode import DecodeStats
from omnidraft.errors import OmnidraftError

PROMPT = ">>> "
DEFAULT_CONTEXT_WINDOW = 4096  # tokens; a CPU re-reads the whole prompt after a trim, keep it modest
TRIM_ROOM = 4  # a trim frees a 1/TRIM_ROOM of the window for the turns after it (fit_messages)
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000
KEEP_UP_PIECE = 64  # drafter tokens per read while the user types: a message that arrives waits for one piece
PLAIN_TRANSCRIPT_STOPS = ("\nUser:",)  # a base model continues the transcript with the user's next turn
TRANSCRIPT_FORMAT = "omnidraft-chat-transcript"

# ---------------------------------------------------------------- pure parts (unit-tested)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_conversation(tokenizer: Any, system: str | None, messages: Sequence[dict]) -> list[int]:
    """Target token ids of the conversation, ending with the assistant's turn about to begin."""
    from omnidraft.runtime import encode_messages

    head = [{"role": "system", "content": system}] if system else []
    return encode_messages(tokenizer, head + list(messages))


def stop_strings(tokenizer: Any) -> tuple[str, ...]:
    """Text that ends a reply early: only a plain transcript needs any (templates end with EOS)."""
    return () if has_chat_template(tokenizer) else PLAIN_TRANSCRIPT_STOPS


def fit_messages(render: Callable[[Sequence[dict]], list[int]], messages: Sequence[dict],
                 budget: int, room: int = 0) -> tuple[int, list[int]] | None:
    """Drop the oldest turns until the rendered conversation is at most ``budget`` tokens.

    Returns (how many leading messages to drop, the rendered ids), or None when even the last
    message alone does not fit. Cuts only before a user message, so a kept assistant reply always
    has its question; ``render`` adds the system prompt, which is never dropped.

    Once turns must go, enough go to leave ``room`` tokens free besides (where the last message
    allows): a drop changes the prompt's start, so the target reads the whole conversation again,
    and dropping one turn at a time would make every later turn pay that read. With room, the next
    turns extend the same prompt and the KV cache is reused (llama.cpp's context shift likewise
    discards half the window at once).
    """
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"] or [0]
    fallback = None
    for start in starts:
        ids = render(messages[start:])
        if len(ids) <= budget and (start == starts[0] or len(ids) <= budget - room):
            return start, ids
        if fallback is None and len(ids) <= budget:
            fallback = (start, ids)
    return fallback


@dataclass
class TurnRecord:
    """One finished turn: what the trainer hook receives and what ``/save`` writes."""

    user: str
    reply: str
    prompt_ids: list[int]  # target ids of the rendered conversation the reply continued
    reply_ids: list[int]  # target ids the target emitted for the shown reply (EOS included)
    stats: Any  # omnidraft.decode.DecodeStats of this reply
    target_spec: str
    interrupted: bool = False
    adapter_version: int | None = None  # the drafter's adapter when the reply began (None: none)

    def as_json(self) -> dict:
        return {"target": self.target_spec, "user": self.user, "reply": self.reply,
                "interrupted": self.interrupted, "adapter_version": self.adapter_version,
                "prompt_tokens": len(self.prompt_ids),
                "reply_tokens": len(self.reply_ids), "stats": self.stats.as_dict()}


class KeepUp:
    """While the user types, the drafter reads the conversation so far (the next prompt's prefix).

    The cost policy prices the read a drafter must do before it drafts. After a few turns in which it
    sat out, a drafter had the whole conversation to read (thousands of byte tokens in Chinese), so it
    was not tried again, not even once the trainer had improved its adapter. Read in the user's idle
    time, through the drafter source (whose context the next turn's prompt continues), the next turn's
    catch-up is the new message only.
    """

    def __init__(self, source: Any, draft_len: int) -> None:
        self.source, self.k = source, draft_len
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, conversation: list[int]) -> None:
        """Read ``conversation`` (target ids) in the background until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, args=(conversation,), name="omnidraft-keep-up", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the piece being read (a message waits for one piece at most)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, conversation: list[int]) -> None:
        try:
            left = True
            while left and not self._stop.is_set():  # one piece per call: a message waits for one piece at most
                # uncapped: the user's idle time is free, and the next turn's catch-up caps itself
                left = self.source.read(conversation, self.k, KEEP_UP_PIECE, cap=False) > 0
        except Exception:  # noqa: BLE001 - never the chat's failure: the next turn reads what is missing itself
            self.source.drafter.reset()


class SigintFlag:
    """While a reply streams, Ctrl-C only raises a flag the loop checks after each decoding step,
    so the decoder is never cut mid-forward (its KV caches stay consistent and its ``finally``
    flushes the n-gram cache). A second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigintFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


# ---------------------------------------------------------------- the session


class ChatSession:
    """One interactive conversation over a loaded pipeline (target + drafter + n-gram cache).

    ``loader(spec)`` loads a pipeline for another target with the same drafter and options
    (``/target``). ``learner_factory(pipeline)`` starts online learning for a pipeline; it is not
    called when ``train`` is False (``--no-train``) or the pipeline has no drafter.
    """

    def __init__(self, pipeline: Any, loader: Callable[[str], Any], config: DecodeConfig, *,
                 system: str | None = None, context_window: int | None = None, train: bool = True,
                 learner_factory: Callable[[Any], Any] | None = None,
                 home: str | os.PathLike | None = None, out: TextIO | None = None, err: TextIO | None = None) -> None:
        from omnidraft.home import home_dir

        self.loader = loader
        self.config = config
        self.system = system or None
        self.requested_window = context_window
        self.train = train
        self.learner_factory = learner_factory
        self.learner: Any = None
        self._errors_seen = 0
        self.home = home_dir(home)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.messages: list[dict] = []  # the whole conversation, as the user saw it
        self.context_start = 0  # messages before this index were dropped from the model's context
        self.turns: list[TurnRecord] = []  # turns of the current conversation
        self.session_turns: list[tuple[int | None, Any]] = []  # (adapter version, stats) of every turn, /reset too
        self.totals = DecodeStats()  # every turn's stats added up
        self.turn_count = 0
        self.commands = SlashCommands(self)
        self.finished = False
        self._readline: Any = None
        self._state_saved = False
        self.pipe: Any = None
        self._activate(pipeline)

    # ---- the active target

    def _activate(self, pipeline: Any) -> None:
        """Make ``pipeline`` the active one: its template, stop strings, window, n-gram cache and
        adapter (loaded with the pipeline), and a trainer of its own."""
        self.context_window = self._effective_window(pipeline)
        self._stop_learning()
        self.pipe = pipeline
        self.stops = stop_strings(pipeline.target_tokenizer)
        self._entries_at_load = self._cache_entries()
        self._start_learning()

    def _start_learning(self) -> None:
        if not (self.train and self.learner_factory and getattr(self.pipe, "adapter_slot", None) is not None):
            return
        try:
            self.learner = self.learner_factory(self.pipe)
            self._errors_seen = 0
        except (OmnidraftError, ValueError, OSError) as exc:
            self.notice(f"warning: the drafter will not learn in this session ({exc})")

    def _stop_learning(self) -> None:
        """Let the update in flight finish and publish (the adapter on disk then has every turn)."""
        if self.learner is None:
            return
        learner, self.learner = self.learner, None
        try:
            learner.close(train_pending=True, timeout=300)
        except Exception as exc:  # noqa: BLE001 - state saving must not fail the exit
            self.notice(f"warning: the trainer did not stop cleanly ({exc.__class__.__name__}: {exc})")

    def _effective_window(self, pipeline: Any) -> int:
        """The requested (or default) window, capped by the target's context."""
        limit = pipeline.decoder.target.max_context
        window = self.requested_window or DEFAULT_CONTEXT_WINDOW
        if window > limit:
            if self.requested_window:
                self.notice(f"--context-window {window} exceeds what {pipeline.target_spec} supports; using {limit}")
            window = int(limit)
        if window <= self.config.max_new_tokens:
            raise OmnidraftError(f"a {window}-token context window leaves no room for a prompt with --max-new-tokens "
                                 f"{self.config.max_new_tokens}; lower --max-new-tokens or raise --context-window")
        return window

    @property
    def speculative(self) -> bool:
        return self.pipe.decoder.drafter is not None

    def _cache(self) -> Any:
        """The pair's n-gram cache when a persistent one is in use, else None."""
        ngrams = self.pipe.decoder.ngrams
        return ngrams if ngrams is not None and hasattr(ngrams, "pair_id") else None

    def _cache_entries(self) -> int:
        ngrams = self.pipe.decoder.ngrams
        return len(ngrams) if ngrams is not None else 0

    # ---- output

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def notice(self, message: str) -> None:
        """One line for the user about the session itself (not part of the conversation)."""
        self.out.flush()
        print(f"omnidraft: {message}", file=self.err, flush=True)

    def error(self, message: str) -> None:
        self.notice(f"error: {message}")

    # ---- the loop

    def run(self) -> int:
        """Read-eval-print until /quit or Ctrl-D; state is saved however the loop ends."""
        self._start_history()
        previous = _own_ctrl_c()
        try:
            self.banner()
            while not self.finished:
                keep_up = self.keep_up()
                try:
                    line = input(PROMPT)
                except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, prompt again
                    self.write("\n")
                    continue
                except EOFError:  # Ctrl-D
                    self.write("\n")
                    break
                finally:
                    if keep_up is not None:
                        keep_up.stop()
                self.handle_line(line)
        finally:
            self.save_state()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        return 0

    def keep_up(self) -> KeepUp | None:
        """The drafter reading the conversation while the user types (None: nothing to read)."""
        live = self.messages[self.context_start:]
        if not self.speculative or not live:
            return None
        keeper = KeepUp(self.pipe.decoder.source("drafter"), self.config.draft_len)
        keeper.start(self._render(live))
        return keeper

    def banner(self) -> None:
        drafter = self.pipe.drafter_spec or "none"
        template = "chat template" if has_chat_template(self.pipe.target_tokenizer) else "plain User:/Assistant: transcript"
        self.write(f"omnidraft chat · target {self.pipe.target_spec} on {getattr(self.pipe, 'engine', 'torch')} · drafter {drafter} · {self.config.verify} · "
                   f"{template} · context {self.context_window} tokens\n")
        self.write(f"{self.cache_description(brief=True)} · adapter: {self.adapter_description()}\n")
        self.write("Type /help for commands; Ctrl-C stops a reply; Ctrl-D or /quit leaves.\n")

    def handle_line(self, line: str) -> None:
        """One prompt line; any failure becomes one line and the session goes on."""
        parsed = parse_input(line)
        try:
            if parsed is None:
                self.error("empty message: type something to send, or /help")
            elif isinstance(parsed, Command):
                self.commands.run(parsed)
            else:
                self.chat_turn(parsed)
        except OmnidraftError as exc:
            self.error(str(exc))
        except KeyboardInterrupt:
            self.write("\n")
            self.notice(f"interrupted; still chatting with {self.pipe.target_spec}")
        except Exception as exc:  # noqa: BLE001 - a bug or an out-of-memory must not end the chat
            self._reset_engines()
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            self.error(f"{exc.__class__.__name__}: {first} (the session goes on)")

    # ---- one turn

    def chat_turn(self, text: str) -> TurnRecord | None:
        """Send a user message, stream the reply, record the turn and run the trainer hook."""
        user = {"role": "user", "content": text}
        fitted = self._fit_context([*self.messages[self.context_start:], user])
        if fitted is None:
            return None
        dropped, prompt_ids = fitted
        version = self.adapter_version()
        reply, reply_ids, stats, interrupted = self._stream_reply(prompt_ids)
        if interrupted and not reply:
            self.notice("interrupted before the reply began; the message was not kept")
            return None
        self.context_start += dropped
        self.messages += [user, {"role": "assistant", "content": reply}]
        record = TurnRecord(text, reply, prompt_ids, reply_ids, stats, self.pipe.target_spec, interrupted, version)
        self.turns.append(record)
        self.session_turns.append((version, stats))
        self.totals = self.totals + stats
        self.turn_count += 1
        self.learn_from_turn(record)
        return record

    def _render(self, messages: Sequence[dict]) -> list[int]:
        return render_conversation(self.pipe.target_tokenizer, self.system, messages)

    def _fit_context(self, live: list[dict]) -> tuple[int, list[int]] | None:
        """Prompt ids that leave room for the reply; drops the oldest turns (saying so) if needed."""
        budget = self.context_window - self.config.max_new_tokens
        fitted = fit_messages(self._render, live, budget, room=self.context_window // TRIM_ROOM)
        if fitted is None:
            alone = len(self._render(live[-1:]))
            self.error(f"message too long: {alone} prompt tokens + {self.config.max_new_tokens} for the reply exceed the "
                       f"{self.context_window}-token context window (see --context-window, --max-new-tokens)")
            return None
        dropped, ids = fitted
        if dropped:
            turns = sum(1 for m in live[:dropped] if m["role"] == "user")
            self.notice(f"conversation exceeds the {self.context_window}-token context window: dropped the "
                        f"{plural(turns, 'oldest turn')} from the model's context (/save keeps them)")
        return dropped, ids

    def _turn_config(self) -> DecodeConfig:
        """Sampling gets a fresh seed each turn (a repeated question need not get the same answer)."""
        return dataclasses.replace(self.config, seed=self.config.seed + self.turn_count)

    def _stream_reply(self, prompt_ids: list[int]) -> tuple[str, list[int], Any, bool]:
        """Stream the reply to the terminal; returns (text, emitted ids, stats, interrupted)."""
        decoder = self.pipe.decoder
        reply = ReplyAssembler(decoder.target_token_bytes(), self.stops)
        forced = False
        with SigintFlag() as flag:
            stream = decoder.stream_ids(prompt_ids, self._turn_config())
            try:
                for chunk in stream:
                    self.write(reply.feed(chunk))
                    if reply.stopped or flag.raised:
                        break
            except KeyboardInterrupt:  # a second Ctrl-C mid-forward: the KV caches may be torn
                forced = True
            finally:
                try:
                    stream.close()  # runs the decoder's finally: final wall time, n-gram flush
                except KeyboardInterrupt:
                    forced = True
        if forced:
            self._reset_engines()
        self.write(reply.finish())
        interrupted = flag.raised or forced
        self.write("" if reply.text.endswith("\n") else "\n")
        stats = decoder.stats
        self.write(format_status(stats, speculative=self.speculative, interrupted=interrupted, dim=self.out.isatty()) + "\n\n")
        return reply.text.strip(), reply.ids, stats, interrupted

    def _reset_engines(self) -> None:
        """Forget both KV caches (after a step was cut short); the next turn re-reads its prompt."""
        decoder = self.pipe.decoder
        decoder.target.reset()
        if decoder.drafter is not None:
            decoder.drafter.reset()

    # ---- trainer hook points

    def learn_from_turn(self, turn: TurnRecord) -> None:
        """After each turn: the recorder has already handed the reply to the trainer (it trains while
        the user types); report trainer failures here, one line each, and never stop the chat."""
        if self.learner is None:
            return
        published = self.learner.trainer.poll()  # a version this poll consumes is the slot's to take now
        if published is not None:
            self.pipe.adapter_slot.take(published.path)
        errors = self.learner.trainer.errors
        for text in errors[self._errors_seen:]:
            self.notice(f"warning: trainer: {text}")
        self._errors_seen = len(errors)

    def adapter_description(self) -> str:
        """The adapter line of /stats and the banner: the adapter in use and the trainer's state."""
        slot = getattr(self.pipe, "adapter_slot", None)
        if slot is None:
            return "none (no drafter)"
        used = slot.description
        policy = getattr(getattr(self.pipe, "decoder", None), "cost_policy", None)
        trials = policy.weights_choice.summary() if policy is not None else None
        if trials:
            used = f"{used}; {trials}"
        if self.learner is not None:
            state = "training between turns" if self.learner.trainer.alive else "trainer stopped"
            return f"{used} · {state} → {slot.folder}"
        return f"{used} · not training{' (--no-train)' if not self.train else ''}"

    def save_state(self) -> None:
        """Exit hook (Ctrl-D, /quit, or a crash of the loop): write what the session learned to the
        home: readline history, the pair's n-gram cache (closed here); the adapter belongs here too."""
        if self._state_saved:
            return
        self._state_saved = True
        self._save_history()
        if self.learner is not None:
            self.notice("saving the adapter (finishing the update in flight)…")
        self._stop_learning()
        try:
            self.pipe.close()
        except OmnidraftError as exc:
            self.error(str(exc))

    # ---- what /stats, /target and /save use

    def describe_state(self) -> str:
        """The /stats text: session totals, context in use, models, n-gram cache, adapter."""
        drafter = self.pipe.drafter_spec or "none (target alone)"
        used = len(self._render(self.messages[self.context_start:])) if self.messages else 0
        return "\n".join([
            session_line(self.turn_count, self.totals),
            f"target: {self.pipe.target_spec} · context {used}/{self.context_window} tokens · "
            f"{plural(len(self.messages) // 2, 'turn')} in the conversation ({self.context_start // 2} dropped)",
            f"drafter: {drafter} · verify {self.config.verify} · temperature {self.config.temperature:g}",
            self.cache_description(),
            f"adapter: {self.adapter_description()}",
            *filter(None, [gain_line(self.session_turns)]),
        ])

    def adapter_version(self) -> int | None:
        """The version of the adapter the drafter runs with now (None: no drafter or no adapter)."""
        slot = getattr(self.pipe, "adapter_slot", None)
        current = getattr(slot, "current", None)
        return None if current is None else current.version

    def cache_description(self, brief: bool = False) -> str:
        """The n-gram cache line: pair, entries (and what this session added), file."""
        if not self.speculative:
            return "n-gram cache: none (no drafter)"
        cache = self._cache()
        if cache is None:
            return "n-gram cache: off (--no-ngram), in memory only"
        mode = " · read-only" if cache.frozen else ""
        if brief:
            return f"n-gram cache: pair {cache.pair_id} · {plural(len(cache), 'entry', 'entries')}{mode}"
        learned = len(cache) - self._entries_at_load
        return (f"n-gram cache: pair {cache.pair_id} · {plural(len(cache), 'entry', 'entries')} (+{learned} since loaded){mode} · "
                f"{cache.path}")

    def switch_target(self, spec: str) -> None:
        """Load ``spec`` with the session's drafter and options; a failure leaves the old target in place."""
        new = self.loader(spec)  # a failure raises here and the old target stays
        old = self.pipe
        try:
            self._activate(new)
        except OmnidraftError:
            new.close()
            raise
        old.close()
        template = "its chat template" if has_chat_template(new.target_tokenizer) else "a plain User:/Assistant: transcript"
        self.notice(f"now chatting with {spec} ({template}); the conversation carries over")

    def transcript(self) -> dict:
        """What /save writes: models, system prompt, every message (dropped ones too), per-turn stats."""
        return {
            "format": TRANSCRIPT_FORMAT, "version": 1,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "target": self.pipe.target_spec, "drafter": self.pipe.drafter_spec, "system": self.system,
            "config": dataclasses.asdict(self.config), "context_window": self.context_window,
            "context_starts_at": self.context_start, "messages": self.messages,
            "turns": [t.as_json() for t in self.turns],
        }

    # ---- readline history under the home

    def _history_path(self) -> Path:
        return self.home / HISTORY_FILE

    def _start_history(self) -> None:
        """Line editing and history when a person types (a missing or unreadable file is fine)."""
        if not sys.stdin.isatty():
            return
        try:
            import readline
        except ImportError:  # e.g. a Python built without it: plain input() still works
            return
        self._readline = readline
        readline.set_history_length(HISTORY_LENGTH)
        try:
            readline.read_history_file(self._history_path())
        except OSError:
            pass

    def _save_history(self) -> None:
        if self._readline is None:
            return
        try:
            self._readline.write_history_file(self._history_path())
        except OSError as exc:
            self.notice(f"warning: could not write the history {self._history_path()}: {exc.strerror or exc}")


def _own_ctrl_c():
    """Make Ctrl-C raise KeyboardInterrupt for the session, even when the parent started us with
    SIGINT ignored (a shell's background job does that, and Python then keeps it ignored): the chat
    promises that Ctrl-C drops a line or stops a reply. Returns the handler to restore, or None
    off the main thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.default_int_handler)
