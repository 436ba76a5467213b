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

import pytest
from conftest import DRAFTER, TEST_HOME

from omnidraft.cli import build_parser, main

SEED = 20261124
BAD_NUMBERS = ["-1", "0", "nan", "inf", "-inf", "1e400", "9" * 30, "abc", "", "1,5"]
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
    """path -> content hash of every file under the home (symlinked models are not followed)."""
    out = {}
    for path in sorted(home.rglob("*")):
        if path.is_symlink() or not path.is_file():
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
            for value in BAD_NUMBERS:
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


def removal_cases() -> Iterator[Case]:
    """`adapters remove` and `cache clear` only ever touch what omnidraft made under the home."""
    for name in (".", "..", "/", "mynotes", "./mynotes", "../", "adapters", "linked--pair", "userfiles--pair", "nope--nope",
                 "/tmp"):
        yield Case(["adapters", "remove", name, "--yes"], 2)
    yield Case(["adapters", "remove", PAIR_FOLDER], 2, "without --yes")  # stdin is no terminal: never guess yes
    yield Case(["cache", "clear"], 2, "without --yes")
    yield Case(["cache", "clear", "--pair", "../mynotes", "--yes"], 2, "pair id")


ALL_CASES = [*number_cases(), *choice_and_text_cases(), *semantic_cases(), *spec_cases(), *path_cases(), *removal_cases()]


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
    copy of a pristine drafter for every pipeline (a pipeline converts it and may merge an adapter)."""
    from omnidraft import models

    original = models.load
    pristine, drafter_tok = original(DRAFTER, home=TEST_HOME, progress=False)
    targets = {TARGET: real_models(TARGET)}  # loaded before the patch: real_models calls models.load

    def load(spec, home=None, dtype="float32", progress=True):
        if spec == DRAFTER:
            return copy.deepcopy(pristine), drafter_tok
        return targets[spec]

    original_gguf = models.gguf_of

    def gguf_of(spec, home=None, progress=True):  # the test home's assembled builtin GGUF, not a 0.5 GB copy per home
        return original_gguf(spec, TEST_HOME if models.builtin(spec) else home, progress=False)

    models.load, models.gguf_of = load, gguf_of
    yield
    models.load, models.gguf_of = original, original_gguf


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
def test_prompts_past_the_targets_context_fail_before_any_forward(shared_models, tmp_path):
    home = tmp_path / "home"
    (home / "long.txt").parent.mkdir(parents=True, exist_ok=True)
    (home / "long.txt").write_text("word " * 40_000)  # ~40k tokens against Qwen's 32,768
    start = time.monotonic()
    outcome = run(["generate", "--prompt-file", "long.txt", "--json"], home)
    check(Case([], 2, "context", writes=True), outcome)
    assert time.monotonic() - start < 120  # it used to run for minutes: no forward pass happened
    huge = run(["generate", "--prompt", "hi", "--max-new-tokens", str(10**9), "--json"], home)
    check(Case([], 2, "context", writes=True), huge)


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
