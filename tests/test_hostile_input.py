"""Hostile input against the whole CLI: a generated table of bad options, paths and text for every
subcommand, and every file omnidraft writes damaged in turn.

Every case states the exit status it expects; each one checks that stderr carries no traceback,
that an error is exactly one ``omnidraft: error:`` line, and (for the cases that must not write)
that nothing in the home changed. The table is generated from the real argument parser: every
option whose value is a checked number gets the bad numbers its check must refuse (negative, zero,
NaN, inf, huge, not a number), every text option text that is not UTF-8, every path option the
paths a user gets wrong. Cases run in-process (``omnidraft.cli.main``); the few that load models
share one set of loaded models.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import DRAFTER, TEST_HOME, shared_drafter_choice
from tiny_export import TAMPERS

from omnidraft.cli import build_parser, main

SEED = 20261124
BAD_NUMBERS = ["-1", "0", "nan", "inf", "-inf", "1e400", "9" * 30, "abc", "", "1,5"]
# Subnormal and underflowing floats: a temperature of 1e-45 made logits / T overflow (issue 29 #2).
SUBNORMALS = ["1e-45", "5e-324", "-5e-324", "1e-310", "4e-320"]
# Names that would leave their folder if joined onto a path unchecked (issue 29).
TRAVERSING = ["../escape", "../../../../tmp/x", "/etc", "/tmp/abs--pair", "..", ".", "a/../../b", "x--y/../../z",
              ".hidden--pair", "pair--x\\..\\..", "..--..", "pair\x00--x"]
NOT_UTF8 = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
TARGET = "builtin:qwen2.5-coder-0.5b"
PAIR_FOLDER = "smollm2-135m--qwen2.5-coder-0.5b"


@dataclass
class Case:
    argv: list[str]
    code: int
    needle: str = ""  # must appear in the error line
    writes: bool = False  # the command may change the home (else: nothing may change)
    setup: Callable[[Path], None] | None = None
    stdin: str | None = None

    @property
    def id(self) -> str:
        return " ".join(a if len(a) < 30 else a[:27] + "…" for a in self.argv).encode("ascii", "backslashreplace").decode()


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    changed: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- running one case


def snapshot(home: Path) -> dict[str, str]:
    """path -> content hash of every file under the home (symlinked models are not followed).

    sqlite's shared-memory index (``-shm``) is skipped: it holds no data, and sqlite removes it
    when the last connection closes, which may race with the walk."""
    out = {}
    for path in sorted(home.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.name.endswith("-shm"):
            continue
        out[str(path.relative_to(home))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class _NoTTY(io.StringIO):
    def isatty(self) -> bool:
        return False


def run(argv: list[str], home: Path, stdin: str | None = None) -> Outcome:
    """``omnidraft ARGV`` in this process with ``home`` as $OMNIDRAFT_HOME."""
    before = snapshot(home)
    out, err = io.StringIO(), io.StringIO()
    old_env, old_stdin, old_cwd = os.environ.get("OMNIDRAFT_HOME"), sys.stdin, os.getcwd()
    os.environ["OMNIDRAFT_HOME"] = str(home)
    sys.stdin = _NoTTY(stdin or "")
    os.chdir(home)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's own exit (--help, bad options)
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(old_cwd)
        sys.stdin = old_stdin
        if old_env is None:
            os.environ.pop("OMNIDRAFT_HOME", None)
        else:
            os.environ["OMNIDRAFT_HOME"] = old_env
    after = snapshot(home)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return Outcome(code, out.getvalue(), err.getvalue(), changed)


def check(case: Case, outcome: Outcome) -> None:
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    assert outcome.code == case.code, f"exit {outcome.code}, expected {case.code}: {outcome.stderr[-1500:]}"
    if case.code == 2:
        lines = outcome.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("omnidraft: error: "), outcome.stderr
        assert case.needle in lines[0], (case.needle, lines[0])
    if not case.writes:
        assert outcome.changed == [], outcome.changed


# ---------------------------------------------------------------- the generated table


def subcommands() -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """(command words, parser) for every leaf subcommand, found by walking the real parser."""
    def walk(words: list[str], parser: argparse.ArgumentParser):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield words, parser
            return
        for name, sub in subs[0].choices.items():
            yield from walk(words + [name], sub)
    yield from walk([], build_parser())


# What each subcommand needs besides the option under test, so that the option is what fails.
REQUIRED = {
    "generate": ["--prompt", "hi"], "adapt": ["--stream", "p.jsonl"], "adapters show": ["x--y"],
    "adapters remove": ["x--y"], "cache export": ["out.jsonl"], "models path": ["builtin:smollm2-135m"],
    "models install": ["builtin:nope"],
}


def number_cases() -> Iterator[Case]:
    """Every checked numeric option of every subcommand with each bad number its check refuses."""
    for words, parser in subcommands():
        required = REQUIRED.get(" ".join(words), [])
        for action in parser._actions:
            kind = getattr(action.type, "__name__", "")
            if not action.option_strings or kind not in ("integer", "number"):
                continue
            for value in BAD_NUMBERS + (SUBNORMALS if kind == "number" else []):
                try:
                    action.type(value)
                    continue  # a valid value: not this table's business
                except argparse.ArgumentTypeError:
                    pass
                yield Case([*words, *required, f"{action.option_strings[0]}={value}"], 2, action.option_strings[0])


def choice_and_text_cases() -> Iterator[Case]:
    """Every choice option with a value outside its choices; every text option with text that is not UTF-8."""
    rng = random.Random(SEED)
    for words, parser in subcommands():
        required = REQUIRED.get(" ".join(words), [])
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            flag = action.option_strings[0]
            if action.choices:
                junk = "".join(rng.choice("abcxyz-_") for _ in range(6))
                yield Case([*words, *required, f"{flag}={junk}"], 2, flag)
            elif getattr(action.type, "__name__", "") == "text":
                yield Case([*words, *required, f"{flag}={NOT_UTF8}"], 2, "UTF-8")


def semantic_cases() -> Iterator[Case]:
    """Values every check accepts alone but the command must refuse, found by hand."""
    yield Case([], 2, "COMMAND")
    yield Case(["generate"], 2, "--prompt")
    yield Case(["generate", "--prompt", ""], 2, "prompt is empty")
    yield Case(["generate", "--prompt", "   "], 2, "prompt is empty")
    yield Case(["generate", "--prompt", "hi", "--temperature", "0.7", "--verify", "greedy"], 2, "deterministic")
    yield Case(["generate", "--prompt", "hi", "--verify", "tli"], 2, "temperature above 0")
    yield Case(["generate", "--prompt", "hi", "--translate", "text", "--verify", "tli", "--temperature", "1"], 2, "--translate")
    yield Case(["generate", "--prompt", "hi", "--drafter-dtype", "int8", "--adapter", "some/folder"], 2, "int8")
    yield Case(["generate", "--prompt", "hi", "--cache-policy", "lfu"], 2, "--cache-size")
    yield Case(["generate", "--prompt", "hi", "--adapter", "no/such/adapter"], 2, "--adapter")
    yield Case(["chat", "--context-window", "16", "--max-new-tokens", "32"], 2, "--context-window")
    yield Case(["chat", "--drafter-dtype", "int8"], 2, "int8")
    yield Case(["adapt", "--stream", "p.jsonl", "--drafter", "none"], 2, "drafter")
    yield Case(["bench", "--modes", "greedy,warp"], 2, "--modes")
    yield Case(["bench", "--modes", ","], 2, "--modes")
    yield Case(["bench", "--freeze-cache"], 2, "--ngram-cache home")
    yield Case(["bench", "--max-new-tokens", "1"], 2, "--max-new-tokens")
    yield Case(["experiment", "online", "--losses", "dm,magic"], 2, "--losses")
    yield Case(["experiment", "online", "--checkpoints", "500", "--stream-n", "4"], 2, "--checkpoints")
    yield Case(["experiment", "cache", "--drafter", "none"], 2, "drafter")
    yield Case(["cache", "stats", "--pair", "../../etc/passwd"], 2, "pair id")
    yield Case(["cache", "stats", "--pair", "nosuchpair"], 2, "no n-gram cache")
    yield Case(["models", "path", "builtin:nope"], 2, "unknown model spec")
    yield Case(["models", "install", "no/such/folder"], 2, "builtin")
    # issue 29 #2, as reported: exit 0 with 16 copies of the last token id
    yield Case(["generate", "--target", "builtin:gemma3-270m", "--drafter", "none", "--prompt", "Once upon a time",
                "--max-new-tokens", "16", "--temperature", "1e-45", "--json"], 2, "too small a temperature")
    yield Case(["generate", "--prompt", "hi", "--temperature", "0.00009999"], 2, "too small a temperature")


def spec_cases() -> Iterator[Case]:
    """Model specs that cannot be models: refused before anything loads."""
    for flag in ("--target", "--drafter"):
        for spec, needle in (("", "empty"), ("builtin:nope", "unknown model spec"), ("/no/such/model", "no model folder"),
                             ("p.jsonl", "is a file"), ("a/b/c/d", "no model folder"), ("org/model with spaces", "no model folder")):
            yield Case(["generate", "--prompt", "hi", flag, spec], 2, needle)
    yield Case(["generate", "--prompt", "hi", "--json", "--drafter", "none", "--target", "someorg/some-model-that-is-not-here"],
               2, "hub is unreachable")


def path_cases() -> Iterator[Case]:
    """Paths a user gets wrong: missing, a folder, a file where a folder goes, unreadable, not UTF-8, a symlink loop."""
    for name, needle in (("missing.txt", "--prompt-file"), ("a_folder", "--prompt-file"), ("loop", "--prompt-file"),
                         ("latin1.txt", "not UTF-8"), ("empty.txt", "prompt is empty")):
        yield Case(["generate", "--prompt-file", name], 2, needle)
    for command in (["bench", "--prompts"], ["adapt", "--stream"], ["experiment", "cache", "--prompts"]):
        for name, needle in (("missing.jsonl", "does not exist"), ("a_folder", "not a file"), ("garbage.jsonl", "not valid JSON"),
                             ("empty.txt", "no prompt records"), ("latin1.txt", "cannot read"), ("loop", "cannot read"),
                             ("noprompt.jsonl", "'prompt'"), ("nosuchset", "unknown prompt set")):
            yield Case([*command, name], 2, needle)
    yield Case(["bench", "--prompts", "p.jsonl", "--out", "p.jsonl"], 2, "cannot use p.jsonl")
    yield Case(["experiment", "cache", "--prompts", "p.jsonl", "--stream-n", "2", "--n", "9"], 2, "--stream-n")
    yield Case(["adapt", "--stream", "p.jsonl", "--save-to", "p.jsonl"], 2, "is a file")
    yield Case(["adapt", "--stream", "p.jsonl", "--save-to", "mynotes"], 2, "did not write")
    yield Case(["cache", "export", "a_folder"], 2, "directory")
    yield Case(["cache", "export", "no/such/folder/out.jsonl"], 2, "does not exist")
    yield Case(["adapters", "show", "nope"], 2, "no adapter named")
    yield Case(["adapters", "show", "p.jsonl"], 2, "no adapter named")
    yield Case(["--home", "p.jsonl", "cache", "stats"], 2, "is a file")
    yield Case(["--home", "/sys/omnidraft-read-only", "generate", "--prompt", "hi", "--json"], 2, "cannot use /sys/omnidraft-read-only")


def naming_cases() -> Iterator[Case]:
    """Names from users that must never escape their folder: `export --adapter NAME` joins NAME onto
    the adapters folder and the export's adapters/ folder (issue 29); a symlinked pair folder is
    no adapter of this home either. Refused before anything is locked or written."""
    for name in TRAVERSING:
        yield Case(["export", "--adapter", name], 2, "not a plain name")
        yield Case(["export", "--adapter", name, "--out", "a_folder"], 2, "not a plain name")
    yield Case(["export", "--adapter", "linked--pair"], 2, "symbolic link")
    yield Case(["export", "--adapter", PAIR_FOLDER], 2, "no export at")
    yield Case(["export", "--adapter", "all"], 2, "no export at")


def removal_cases() -> Iterator[Case]:
    """`adapters remove` and `cache clear` only ever touch what omnidraft made under the home."""
    for name in (".", "..", "/", "mynotes", "./mynotes", "../", "adapters", "linked--pair", "userfiles--pair", "nope--nope",
                 "/tmp"):
        yield Case(["adapters", "remove", name, "--yes"], 2)
    yield Case(["adapters", "remove", PAIR_FOLDER], 2, "without --yes")  # stdin is no terminal: never guess yes
    yield Case(["cache", "clear"], 2, "without --yes")
    yield Case(["cache", "clear", "--pair", "../mynotes", "--yes"], 2, "pair id")


ALL_CASES = [*number_cases(), *choice_and_text_cases(), *semantic_cases(), *spec_cases(), *path_cases(), *naming_cases(),
             *removal_cases()]


# ---------------------------------------------------------------- the home every case runs in


def _publish_tiny_adapter(folder: Path) -> None:
    from tiny import tiny_model

    from omnidraft.train import lora
    from omnidraft.train.publish import save

    model = lora.attach(tiny_model(64, 0), lora.lora_config(rank=2, alpha=2))
    save(folder, model, {"identity": {"drafter_vocab": "d", "target_vocab": "t", "drafter_arch": "a"}, "updates": 1})


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home with state of every kind, user files beside it, and the bad paths the cases name."""
    from omnidraft.ngram.store import PersistentNgramCache

    home = tmp_path_factory.mktemp("hostile")
    (home / "p.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "Hello"}\n')
    (home / "garbage.jsonl").write_text("{not json\n")
    (home / "noprompt.jsonl").write_text('{"text": "no prompt field"}\n')
    (home / "empty.txt").write_text("")
    (home / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (home / "a_folder").mkdir()
    (home / "loop").symlink_to(home / "loop")  # reading it fails: an unreadable path, even for root
    (home / "mynotes").mkdir()
    (home / "mynotes" / "todo.txt").write_text("my own notes")
    _publish_tiny_adapter(home / "adapters" / PAIR_FOLDER)
    (home / "adapters" / "linked--pair").symlink_to(home / "mynotes", target_is_directory=True)
    (home / "adapters" / "userfiles--pair").mkdir()
    (home / "adapters" / "userfiles--pair" / "thesis.tex").write_text("years of work")
    with PersistentNgramCache(home / "cache_store" / "aaaa1111-bbbb2222.sqlite", "aaaa1111-bbbb2222") as cache:
        cache.add([1, 2], 3)
    return home


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_bad_input_is_one_line_and_changes_nothing(case: Case, home: Path):
    outcome = run(case.argv, home, case.stdin)
    check(case, outcome)
    assert (home / "mynotes" / "todo.txt").read_text() == "my own notes"
    assert (home / "adapters" / "userfiles--pair" / "thesis.tex").is_file()
    assert (home / "adapters" / PAIR_FOLDER / "CURRENT").is_file()


def test_the_table_covers_every_subcommand_and_kind():
    """The generated table is not vacuous: every subcommand with a value to get wrong is in it."""
    def has_values(parser: argparse.ArgumentParser) -> bool:
        return any(a.option_strings and (a.choices or getattr(a.type, "__name__", "") in ("integer", "number", "text"))
                   for a in parser._actions)

    expected = {" ".join(words) for words, parser in subcommands() if has_values(parser)}
    covered = {" ".join(words) for words, _ in subcommands() for c in ALL_CASES if c.argv[:len(words)] == words}
    assert expected <= covered, expected - covered
    assert {"generate", "chat", "bench", "adapt", "experiment cache", "experiment online", "cache stats"} <= expected
    kinds = {v for c in ALL_CASES for v in ("nan", "inf", "=-1", "=0", "9" * 30, NOT_UTF8) if any(v in a for a in c.argv)}
    assert len(kinds) == 6 and len(ALL_CASES) > 300
    subnormal = {a.split("=")[0] for c in ALL_CASES for a in c.argv if a.endswith(("=1e-45", "=5e-324", "=4e-320"))}
    assert {"--temperature", "--target-temperature"} <= subnormal  # refused, not overflowed
    named = {c.argv[2] for c in ALL_CASES if c.argv[:2] == ["export", "--adapter"]}
    assert set(TRAVERSING) <= named
    print(f"{len(ALL_CASES)} hostile-input cases")


def test_remove_of_the_pairs_folder_removes_only_it(home: Path, tmp_path: Path):
    scratch = tmp_path / "home"
    _publish_tiny_adapter(scratch / "adapters" / PAIR_FOLDER)
    (scratch / "mynotes").mkdir()
    outcome = run(["adapters", "remove", PAIR_FOLDER, "--yes"], scratch)
    assert outcome.code == 0 and not (scratch / "adapters" / PAIR_FOLDER).exists() and (scratch / "mynotes").is_dir()
    assert outcome.stderr == ""


# ---------------------------------------------------------------- writers of one adapter


def test_a_second_trainer_of_one_adapter_is_refused_in_one_line(home: Path):
    from omnidraft.adapter import store

    folder = home / "adapters" / PAIR_FOLDER
    with store.writer_lock(folder):  # as a running `adapt` holds it
        outcome = run(["adapt", "--stream", "p.jsonl", "--drafter", DRAFTER, "--target", TARGET], home)
    check(Case([], 2, f"process {os.getpid()}", writes=True), outcome)
    assert "in use by" in outcome.stderr


def test_a_killed_trainer_leaves_no_stale_lock(tmp_path: Path):
    import subprocess

    from omnidraft.adapter import store
    from omnidraft.fsutil import LockHeld

    folder = tmp_path / "pair--x"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from omnidraft.adapter import store\n"
                               f"store.writer_lock(Path({str(folder)!r})).acquire()\nprint('held', flush=True)\ntime.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(LockHeld, match=f"process {holder.pid}"):
        store.writer_lock(folder).acquire()
    holder.kill()
    holder.wait(30)
    store.writer_lock(folder).acquire().release()  # the kernel dropped the dead owner's lock


def test_online_learning_on_a_locked_folder_starts_no_trainer(tmp_path: Path):
    """A chat training the pair while `adapt` runs: the learner is refused before any process starts."""
    from types import SimpleNamespace

    from tiny import tiny_pair

    from omnidraft.adapter import store
    from omnidraft.adapter.slot import AdapterSlot
    from omnidraft.errors import OmnidraftError
    from omnidraft.runtime import make_drafter
    from omnidraft.train.config import TrainConfig
    from omnidraft.train.online import OnlineLearning

    d_model, target, bridge = tiny_pair()
    drafter = make_drafter(d_model, bridge, target)
    slot = AdapterSlot(drafter, store.Identity("d", "t", "a"), tmp_path / "pair--x")
    pipe = SimpleNamespace(adapter_slot=slot, decoder=SimpleNamespace(bridge=bridge, observers=[]),
                           drafter_spec="d", target_spec="t")
    before = threading.active_count()
    with store.writer_lock(slot.folder):
        with pytest.raises(OmnidraftError, match="in use by"):
            OnlineLearning(pipe, TrainConfig())
    assert pipe.decoder.observers == [] and threading.active_count() == before


# ---------------------------------------------------------------- damaged state, with real models


@pytest.fixture(scope="module")
def shared_models(real_models):
    """Model loads in this module come from models loaded once: the session's target, and a fresh
    copy of a pristine drafter for every pipeline (a pipeline converts it and may merge an adapter);
    the pipelines of that pair share one vocabulary bridge."""
    from omnidraft import models, runtime

    original = models.load
    pristine, drafter_tok = original(DRAFTER, home=TEST_HOME, progress=False)
    targets = {TARGET: real_models(TARGET)}  # loaded before the patch: real_models calls models.load

    def load(spec, home=None, dtype="float32", progress=True):
        if spec == DRAFTER:
            return copy.deepcopy(pristine), drafter_tok
        if spec in targets:
            return targets[spec]
        return original(spec, home=home, dtype=dtype, progress=progress)  # tests of this module on tiny models

    original_gguf = models.gguf_of

    def gguf_of(spec, home=None, progress=True):  # the test home's assembled builtin GGUF, not a 0.5 GB copy per home
        return original_gguf(spec, TEST_HOME if models.builtin(spec) else home, progress=False)

    original_bridge, bridges = runtime.VocabBridge, {}

    def bridge(d_tok, t_tok, d_vocab, t_vocab):  # one bridge per pair of lasting tokenizers (a pure function of them)
        lasting = t_tok is targets[TARGET][1] or any(t_tok is t for t in models._TOKENIZERS.values())  # llama.cpp's
        if d_tok is not drafter_tok or not lasting:
            return original_bridge(d_tok, t_tok, d_vocab, t_vocab)
        key = (id(t_tok), d_vocab, t_vocab)
        if key not in bridges:
            bridges[key] = original_bridge(d_tok, t_tok, d_vocab, t_vocab)
        return bridges[key]

    models.load, models.gguf_of, runtime.VocabBridge = load, gguf_of, bridge
    with shared_drafter_choice():
        yield
    models.load, models.gguf_of, runtime.VocabBridge = original, original_gguf, original_bridge


def _real_adapter(real_models, folder: Path) -> None:
    """A valid adapter for the real pair (random small LoRA weights), as `adapt` would publish it."""
    from omnidraft.adapter.store import identity_of
    from omnidraft.train import lora
    from omnidraft.train.publish import save

    d_model, d_tok = real_models(DRAFTER)
    _, t_tok = real_models(TARGET)
    identity = identity_of(d_tok, t_tok, d_model)
    peft = lora.attach(copy.deepcopy(d_model), lora.lora_config(rank=2, alpha=2))
    save(folder, peft, {"identity": vars(identity), "updates": 1, "drafter": DRAFTER, "target": TARGET})


def _damage(path: Path, how: str, rng: random.Random) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "random":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(max(len(data), 64))))
    elif how == "wrong-types":  # JSON that parses, with fields of the wrong type
        doc = json.loads(data)
        for key in list(doc)[:4]:
            doc[key] = [doc[key]] if not isinstance(doc[key], list) else "x"
        path.write_text(json.dumps(doc))


ADAPTER_FILES = ["CURRENT", "v000001/omnidraft-adapter.json", "v000001/adapter_model.safetensors",
                 "v000001/adapter_config.json"]
DAMAGE = ["truncated", "empty", "random"]
GENERATE = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "4", "--json"]


@pytest.mark.real
@pytest.mark.parametrize("name", ADAPTER_FILES + ["v000001/omnidraft-adapter.json:wrong-types"])
def test_a_damaged_adapter_is_reported_never_used(name, real_models, shared_models, tmp_path):
    home = tmp_path / "home"
    folder = home / "adapters" / PAIR_FOLDER
    _real_adapter(real_models, folder)
    plain = run([*GENERATE, "--adapter", "none"], home)
    assert plain.code == 0, plain.stderr
    expected = json.loads(plain.stdout)["token_ids"]
    rng = random.Random(SEED)
    for how in (["wrong-types"] if name.endswith(":wrong-types") else DAMAGE):
        target = folder / name.split(":")[0]
        original = target.read_bytes()
        _damage(target, how, rng)
        listed = run(["adapters", "list", "--json"], home)
        check(Case([], 0), listed)
        (row,) = json.loads(listed.stdout)
        assert row["status"].startswith("unusable"), (name, how, row)
        shown = run(["adapters", "show", PAIR_FOLDER], home)
        check(Case([], 0), shown)
        assert "unusable" in shown.stdout
        auto = run(GENERATE, home)  # --adapter auto: one warning line, then the base drafter
        check(Case([], 0, writes=True), auto)
        assert [ln for ln in auto.stderr.splitlines() if ln] and all(
            ln.startswith("omnidraft: warning:") for ln in auto.stderr.splitlines() if ln), auto.stderr
        assert json.loads(auto.stdout)["token_ids"] == expected
        explicit = run([*GENERATE, "--adapter", str(folder)], home)
        check(Case([], 2, "--adapter", writes=True), explicit)
        target.write_bytes(original)
    assert run(["adapters", "list", "--json"], home).stdout.count('"ok"') == 1  # repaired: usable again


@pytest.mark.real
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_cache_is_set_aside_and_generation_goes_on(how, real_models, shared_models, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    first = run(GENERATE + ["--adapter", "none"], home)
    assert first.code == 0, first.stderr
    (store,) = (home / "cache_store").glob("*.sqlite")
    _damage(store, how, random.Random(SEED))
    damaged = store.read_bytes()
    stats = run(["cache", "stats"], home)  # inspecting changes nothing
    check(Case([], 0), stats)
    if how != "empty":  # an empty file is a database with nothing in it yet, not damage
        assert "warning" in stats.stderr and store.read_bytes() == damaged
    again = run(GENERATE + ["--adapter", "none"], home)
    check(Case([], 0, writes=True), again)
    assert json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    if how != "empty":
        assert list((home / "cache_store").glob(f"{store.name}.corrupt-*"))  # set aside, not deleted


@pytest.mark.real
def test_prompts_past_the_targets_context_fail_before_any_forward(shared_models, tmp_path, monkeypatch):
    from omnidraft import runtime

    held, load = [], runtime.load_pipeline  # pipelines kept alive: closing them is the command's job, not the GC's
    monkeypatch.setattr(runtime, "load_pipeline", lambda *a, **k: held.append(load(*a, **k)) or held[-1])
    home = tmp_path / "home"
    (home / "long.txt").parent.mkdir(parents=True, exist_ok=True)
    (home / "long.txt").write_text("word " * 40_000)  # ~40k tokens against Qwen's 32,768
    start = time.monotonic()
    outcome = run(["generate", "--prompt-file", "long.txt", "--json"], home)
    check(Case([], 2, "context", writes=True), outcome)
    assert time.monotonic() - start < 120  # it used to run for minutes: no forward pass happened
    assert_store_closed(home)
    huge = run(["generate", "--prompt", "hi", "--max-new-tokens", str(10**9), "--json"], home)
    check(Case([], 2, "context", writes=True), huge)
    assert_store_closed(home)


def assert_store_closed(home: Path) -> None:
    """The pair's store was closed when the command returned, not later by whoever drops the
    pipeline (a garbage collector's close removed the -wal file while a snapshot of the home read it)."""
    assert list((home / "cache_store").glob("*.sqlite"))
    assert not list((home / "cache_store").glob("*.sqlite-wal"))


@pytest.mark.real
def test_a_prompt_with_nul_and_odd_text_decodes(shared_models, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "odd.txt").write_text("a\x00b \u202e right-to-left \U0001f600 \uf900 tab\t end", encoding="utf-8")
    outcome = run(["generate", "--prompt-file", "odd.txt", "--max-new-tokens", "6", "--json", "--adapter", "none"], home)
    check(Case([], 0, writes=True), outcome)
    assert len(json.loads(outcome.stdout)["token_ids"]) >= 1


# ---------------------------------------------------------------- long prompts and closed pipes


def test_a_prompt_past_the_drafters_positions_slides_its_window():
    """The drafter (256 positions) reads a sliding window of a 700-token context; the output is
    still the target's own, and the drafter never holds more positions than it has."""
    from tiny import DRAFTER_CORPUS, tiny_model, tiny_tokenizer

    from omnidraft.config import DecodeConfig
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.errors import OmnidraftError
    from omnidraft.runtime import build_bridge, make_drafter
    from omnidraft.target import TorchTarget

    d_tok, t_tok = tiny_tokenizer(330, DRAFTER_CORPUS), tiny_tokenizer(420)
    d_model, t_model = tiny_model(len(d_tok), seed=1), tiny_model(len(t_tok), seed=2, positions=2048)
    target = TorchTarget(t_model, t_tok)
    bridge = build_bridge(d_model, d_tok, t_model, t_tok)
    drafter = make_drafter(d_model, bridge, target)
    held: list[int] = []
    step = drafter.lm.step
    drafter.lm.step = lambda tok: (held.append(len(drafter.lm.cached_ids)), step(tok))[1]
    prompt = t_tok.encode("the cat sat on the mat and the dog sat on the log " * 40)
    assert len(bridge.target_to_drafter(prompt)) > 600
    config = DecodeConfig(max_new_tokens=48, draft_len=4, draft_stop="fixed")
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    decoder = SpeculativeDecoder(target, drafter, bridge)
    assert decoder.generate(prompt, config).token_ids == expected
    assert decoder.stats.drafted_tokens > 0 and held and max(held) < 256
    with pytest.raises(OmnidraftError, match="context of 2048 tokens"):
        decoder.generate(prompt * 5, config)


@pytest.mark.real
def test_output_into_a_closed_pipe_is_quiet(tmp_path):
    """`omnidraft cache export - | head -1`: no traceback, the status of a process whose reader left."""
    import subprocess

    from omnidraft.ngram.store import PersistentNgramCache

    with PersistentNgramCache(tmp_path / "cache_store" / "aaaa1111-bbbb2222.sqlite", "aaaa1111-bbbb2222") as cache:
        for i in range(30_000):
            cache.add([i, i + 1, 7], i)
    proc = subprocess.Popen([sys.executable, "-m", "omnidraft", "--home", str(tmp_path), "cache", "export", "-"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b'{"pair_id"')
    proc.stdout.close()  # the reader leaves after one line
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()[-2000:]
    assert proc.returncode == 141 and err == b""


# ---------------------------------------------------------------- exports: kills, tampered manifests (issue 29)

KILL_POINTS = 24  # SIGKILLs at distinct steps of one export over an existing one
ADAPTER_KILL_POINTS = 8
TINY_PAIR = "tiny--t"


def _spread(trace: list[str], count: int, must: list[int]) -> list[int]:
    """``count`` distinct steps (1-based) of ``trace``: the ``must`` ones, the rest evenly spread."""
    points = set(must)
    n = len(trace)
    rest = [s for s in range(1, n + 1) if s not in points]
    need = count - len(points)
    points |= {rest[round(i * (len(rest) - 1) / max(need - 1, 1))] for i in range(need)}
    assert len(points) == count, (n, count)
    return sorted(points)


def _publish_tiny_pair_adapter(home: Path) -> None:
    """A trained adapter of the tiny drafter under ``home/adapters/tiny--t``, as `adapt` leaves one."""
    from tiny import tiny_model

    from omnidraft.adapter.store import architecture_fingerprint
    from omnidraft.train import lora
    from omnidraft.train.publish import save

    model = tiny_model(330, 1)
    peft = lora.attach(model, lora.lora_config(rank=2, alpha=4))
    identity = {"drafter_vocab": "d", "target_vocab": "t", "drafter_arch": architecture_fingerprint(tiny_model(330, 1))}
    save(home / "adapters" / TINY_PAIR, peft, {"identity": identity, "updates": 1})


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory) -> dict:
    """Two tiny real exports (old, new) with their probe logits, a tiny target model folder, a
    trained adapter for the tiny drafter, and the step-by-step trace of one replace and one adapter write."""
    import shutil

    from tiny import tiny_model, tiny_tokenizer
    from tiny_export import adapter_state, build, copy_export, probe, run_writer, save_adapter

    root = tmp_path_factory.mktemp("tiny_world")
    old, new = build(root, 1), build(root, 2)
    target = root / "target"
    tok = tiny_tokenizer(420)
    tiny_model(len(tok), 2).save_pretrained(target)
    tok.save_pretrained(target)
    seed_home = root / "seed_home"
    _publish_tiny_pair_adapter(seed_home)
    scratch = copy_export(old, root / "scratch" / "export" / "d-fp32")
    dry = run_writer(new, scratch)
    assert dry.returncode == 0, dry.stderr
    trace = dry.stdout.splitlines()
    renames = [i + 1 for i, s in enumerate(trace) if s.startswith("rename")]
    assert len(renames) == 2  # old aside, new in
    manifest = json.loads((scratch / "manifest.json").read_text())
    adapter_base = copy_export(old, root / "adapter_base" / "d-fp32")
    from omnidraft.export.onnx_export import write_adapter

    arrays = dict(np.load(save_adapter(root / "v1.npz", manifest, 1, 1)))
    write_adapter(adapter_base, "d--t", 1, {k: v for k, v in arrays.items() if ":" not in k and k != "version"})
    v2 = save_adapter(root / "v2.npz", manifest, 2, 2)
    adapter_scratch = copy_export(adapter_base, root / "adapter_scratch" / "d-fp32")
    adry = run_writer(v2, adapter_scratch, mode="adapter")
    assert adry.returncode == 0, adry.stderr
    shas = {v: adapter_state(folder)["d--t"] for v, folder in (("v1", adapter_base), ("v2", adapter_scratch))}
    shutil.rmtree(root / "scratch")
    return {"old": old, "new": new, "logits": {"old": probe(old), "new": probe(new)}, "target": target,
            "seed_home": seed_home, "points": _spread(trace, KILL_POINTS, renames + [renames[1] + 1]),
            "adapter_base": adapter_base, "v2": v2, "shas": shas,
            "adapter_points": _spread(adry.stdout.splitlines(), ADAPTER_KILL_POINTS, [])}


def _which(folder: Path, world: dict) -> str:
    from tiny_export import probe

    got = probe(folder)
    return next((k for k, v in world["logits"].items() if np.array_equal(got, v)), "neither")


def _loadable_somewhere(out: Path) -> bool:
    """The export folder is complete, or a complete one waits beside it for the next command."""
    from omnidraft.export.folder import is_export, leftovers

    return is_export(out) or any(is_export(p) for p, _, _ in leftovers(out))


def _next_export(world: dict, out: Path) -> None:
    """What the next `omnidraft export` does after its graph export: install over what is there."""
    import shutil

    from omnidraft.export.folder import new_temp
    from omnidraft.export.onnx_export import install

    tmp = new_temp(out)
    shutil.copytree(world["new"], tmp, dirs_exist_ok=True)
    install(tmp, out)


@pytest.mark.parametrize("k", range(KILL_POINTS))
def test_a_kill_at_any_step_of_an_export_over_an_existing_one_leaves_a_loadable_export(k, tiny_world, tmp_path):
    """Issue 29 #1: SIGKILL at one of 24 distinct steps (writing the new folder, renaming the old
    aside, between the renames, removing the old) leaves the old export or the new one; the
    onnxruntime backend and the next `export` (graph or adapter) accept the home, and nothing is
    left beside the folder."""
    from tiny_export import adapter_state, copy_export, killed, run_writer, siblings

    from omnidraft.runtime import onnx_export_for

    home = tmp_path / "home"
    out = copy_export(tiny_world["old"], home / "export" / "smollm2-135m-fp32")
    proc = run_writer(tiny_world["new"], out, kill_at=tiny_world["points"][k])
    assert killed(proc), (proc.returncode, proc.stderr[-500:])
    assert _loadable_somewhere(out)
    if k % 2 == 0:  # a reader comes first: `generate` finds the export (no silent fall-back to torch)
        assert onnx_export_for(DRAFTER, "auto", home) == out
        assert _which(out, tiny_world) in ("old", "new")
    else:  # `export --adapter` comes first
        import shutil

        shutil.copytree(tiny_world["seed_home"] / "adapters", home / "adapters")
        outcome = run(["export", "--adapter", TINY_PAIR, "--out", str(out)], home)
        check(Case([], 0, writes=True), outcome)
        assert _which(out, tiny_world) in ("old", "new") and TINY_PAIR in adapter_state(out)
    assert siblings(out) == []
    _next_export(tiny_world, out)
    assert _which(out, tiny_world) == "new" and siblings(out) == []


@pytest.mark.parametrize("k", range(ADAPTER_KILL_POINTS))
def test_a_kill_during_an_adapter_export_leaves_manifest_and_files_agreeing(k, tiny_world, tmp_path):
    """Issue 29 #4's other half: the .onnx_adapter files and the manifest change together or not at all."""
    from tiny_export import adapter_state, copy_export, killed, run_writer

    from omnidraft.drafter.onnx_lm import OrtCausalLM
    from omnidraft.export.onnx_export import write_adapter

    out = copy_export(tiny_world["adapter_base"], tmp_path / "d-fp32")
    proc = run_writer(tiny_world["v2"], out, kill_at=tiny_world["adapter_points"][k], mode="adapter")
    assert killed(proc), (proc.returncode, proc.stderr[-500:])
    after = adapter_state(out)  # every file the manifest names is there, with the hash it records
    assert after["d--t"] in (tiny_world["shas"]["v1"], tiny_world["shas"]["v2"])
    OrtCausalLM(out, threads=1)
    arrays = dict(np.load(tiny_world["v2"]))
    write_adapter(out, "d--t", 3, {key: v * 2 for key, v in arrays.items() if ":" not in key and key != "version"})
    state = adapter_state(out)
    named = {Path(e["file"]).name for e in json.loads((out / "manifest.json").read_text())["adapters"].values()}
    assert {p.name for p in (out / "adapters").iterdir()} == named  # what the kill left is swept
    assert state["d--t"] not in tiny_world["shas"].values()


def _tampered_copy(world: dict, where: Path, how: str) -> Path:
    from tiny_export import copy_export, tamper

    folder = copy_export(world["old"], where)
    manifest = json.loads((folder / "manifest.json").read_text())
    tamper(manifest, how)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["generate", "export --adapter"])
@pytest.mark.parametrize("how", TAMPERS)
def test_a_tampered_manifest_is_one_line_and_exit_2(how, command, tiny_world, tmp_path):
    """Issue 29 #3 and #4 through the CLI: no onnxruntime error, KeyError, TypeError or list of
    input names; `export --adapter` changes no file of the export."""
    import shutil

    home = tmp_path / "home"
    shutil.copytree(tiny_world["seed_home"], home)
    folder = _tampered_copy(tiny_world, home / "export" / "d-fp32", how)
    before = _tree(folder)
    if command == "generate":
        argv = ["generate", "--prompt", "the cat", "--json", "--engine", "torch", "--target", str(tiny_world["target"]),
                "--drafter-backend", str(folder), "--adapter", "none", "--no-ngram"]
    else:
        argv = ["export", "--adapter", TINY_PAIR, "--out", str(folder)]
    outcome = run(argv, home)
    check(Case([], 2, "manifest", writes=True), outcome)
    assert _tree(folder) == before


def test_an_untampered_export_takes_the_adapter_through_the_cli(tiny_world, tmp_path):
    """The control for the cases above: the same command on the intact export succeeds."""
    import shutil

    from tiny_export import adapter_state, copy_export

    home = tmp_path / "home"
    shutil.copytree(tiny_world["seed_home"], home)
    folder = copy_export(tiny_world["old"], home / "export" / "d-fp32")
    outcome = run(["export", "--adapter", TINY_PAIR, "--out", str(folder)], home)
    check(Case([], 0, writes=True), outcome)
    assert list(adapter_state(folder)) == [TINY_PAIR]
    (tmp_path / "elsewhere--pair").mkdir()
    (home / "adapters" / "elsewhere--pair").symlink_to(tmp_path / "elsewhere--pair", target_is_directory=True)
    every = run(["export", "--adapter", "all", "--out", str(folder)], home)  # `all` skips the link, says so
    check(Case([], 0, writes=True), every)
    assert "skipping" in every.stderr and "elsewhere--pair" in every.stderr and list(adapter_state(folder)) == [TINY_PAIR]


# ---------------------------------------------------------------- cache stats agrees with generate (issue 29 #5)


def _stats(home: Path) -> tuple[Outcome, Outcome]:
    return run(["cache", "stats", "--json"], home), run(["cache", "stats"], home)


@pytest.mark.parametrize("kind", ["symlink to a non-database", "directory"])
def test_cache_stats_reports_a_bad_store_as_generate_would_meet_it(kind, tmp_path):
    from omnidraft.errors import OmnidraftError
    from omnidraft.ngram.store import PersistentNgramCache

    home = tmp_path / "home"
    store = home / "cache_store" / "aaaa1111-bbbb2222.sqlite"
    store.parent.mkdir(parents=True)
    if kind == "directory":
        store.mkdir()
    else:
        (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        store.symlink_to(tmp_path / "passwd")
    as_json, as_text = _stats(home)
    for outcome in (as_json, as_text):
        check(Case([], 0), outcome)
    (problem,) = json.loads(as_json.stdout)["problems"]
    warned = [ln.removeprefix("omnidraft: warning: ") for ln in as_json.stderr.splitlines()]
    assert warned == [problem["problem"]] and as_text.stderr == as_json.stderr  # the same words, once
    assert "no usable n-gram caches" in as_text.stdout and "1 reported above" in as_text.stdout
    if kind == "directory":  # generate stops on it with this line
        with pytest.raises(OmnidraftError) as err:
            PersistentNgramCache(store, "aaaa1111-bbbb2222")
        assert problem["problem"].startswith(str(err.value))
    else:  # generate sets it aside as corrupt and starts empty: stats names that kind and that action
        assert "corrupt" in problem["problem"] and "moves it aside" in problem["problem"]
        with PersistentNgramCache(store, "aaaa1111-bbbb2222") as cache:
            assert cache.problem is not None and "corrupt" in cache.problem
        assert list(store.parent.glob("aaaa1111-bbbb2222.sqlite.corrupt-*")) and (tmp_path / "passwd").is_file()
