"""The n-gram cache ablation (OmniDraft Table 14, Figure 9): its pieces on tiny inputs, the CLI's
argument checks, and one short real run of ``omnidraft bench --ablation cache``."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from conftest import DRAFTER, TEST_HOME
from test_cli import assert_one_line_error, omnidraft
from tiny import DRAFTER_CORPUS, tiny_pair, tiny_tokenizer

from omnidraft.bench.runner import PromptRun, summarize
from omnidraft.config import DecodeConfig
from omnidraft.errors import OmnidraftError
from omnidraft.experiments.cache_ablation import (
    FULL,
    NO_CACHE,
    TARGET,
    AblationResult,
    GrowthPoint,
    Stream,
    cap_size,
    capped_configs,
    config_names,
    curve_at,
    next_point,
    reopen_frozen,
    run_streams,
    speculative_config,
)
from omnidraft.experiments.cache_report import (
    ablation_table,
    growth_summary,
    plot_growth,
    stream_table,
    write_ablation,
)
from omnidraft.ngram import NgramTrie
from omnidraft.ngram.store import fresh_store
from omnidraft.runtime import make_drafter
from omnidraft.vocab.translate import TokenTranslator

PAIR = "0123456789ab-ba9876543210"


# ---- caps ----------------------------------------------------------------------------------------
def test_cap_sizes_are_quarter_and_half_rounded_half_up_and_at_least_one():
    assert cap_size(100, Fraction(1, 4)) == 25 and cap_size(100, Fraction(1, 2)) == 50
    assert cap_size(5, Fraction(1, 2)) == 3  # 2.5 rounds up (Python's round() would give 2)
    assert cap_size(6, Fraction(1, 4)) == 2  # 1.5 -> 2
    assert cap_size(1, Fraction(1, 4)) == 1 and cap_size(0, Fraction(1, 2)) == 1  # a store needs a cap >= 1
    configs = capped_configs(10)
    assert [(c.name, c.max_entries, c.slug) for c in configs] == [
        ("1/4 LRU", 3, "1-4-lru"), ("1/4 LFU", 3, "1-4-lfu"), ("1/2 LRU", 5, "1-2-lru"), ("1/2 LFU", 5, "1-2-lfu")]
    assert config_names(configs) == [TARGET, NO_CACHE, "1/4 LRU", "1/4 LFU", "1/2 LRU", "1/2 LFU", FULL]


# ---- growth bookkeeping --------------------------------------------------------------------------
def test_growth_points_accumulate_tokens_and_give_the_growth_rate():
    curve: list[GrowthPoint] = []
    for tokens, entries in ((10, 5), (20, 8), (30, 9)):
        curve.append(next_point(curve, tokens, entries, evictions=0))
    assert [(p.prompts, p.tokens, p.entries) for p in curve] == [(1, 10, 5), (2, 30, 8), (3, 60, 9)]
    assert curve[0].growth_rate == 0.5 and curve[-1].growth_rate == 9 / 60
    assert curve_at(curve, 0.5) is curve[1]  # first point with >= 30 of 60 tokens
    assert curve_at(curve, 1.0) is curve[-1]
    assert GrowthPoint(0, 0, 0).growth_rate == 0.0
    assert curve[-1].as_dict()["growth_rate"] == 9 / 60


def learner(cache: NgramTrie, ngrams_per_prompt: int, counter: list[int]):
    """A fake mode that 'decodes' 10 tokens per prompt and learns fresh n-grams as it goes."""

    def run(prompt_ids: list[int]) -> PromptRun:
        for _ in range(ngrams_per_prompt):
            counter[0] += 1
            cache.add([counter[0], counter[0] + 1000], counter[0])
        return PromptRun(list(range(10)), 0.1, 5)

    return run


def test_run_streams_records_growth_per_prompt_interleaved_and_caps_hold(tmp_path):
    full = fresh_store(tmp_path, "full", PAIR)
    capped = fresh_store(tmp_path, "cap", PAIR, max_entries=4, policy="lfu")
    counter = [0]
    streams = {"full": Stream(full, learner(full, 3, counter)), "capped": Stream(capped, learner(capped, 3, counter))}
    run_streams(streams, [[1], [2], [3]], progress=False)
    assert [p.entries for p in streams["full"].growth] == [3, 6, 9]
    assert [p.tokens for p in streams["full"].growth] == [10, 20, 30]
    assert [p.entries for p in streams["capped"].growth] == [3, 4, 4]
    assert [p.evictions for p in streams["capped"].growth] == [0, 2, 5]
    assert len(streams["capped"].runs) == 3
    frozen = reopen_frozen(capped)
    assert frozen.frozen and frozen.max_entries == 4 and frozen.policy == "lfu" and len(frozen) == 4
    frozen.add([1, 2], 3)  # read-only: nothing learned, nothing written
    assert len(frozen) == 4 and len(reopen_frozen(fresh_store(tmp_path, "cap", PAIR))) == 0  # fresh_store wipes


def test_speculative_config_uses_token_translation():
    base = DecodeConfig(max_new_tokens=8)
    greedy = speculative_config(base, "greedy", 0.7)
    assert (greedy.verify, greedy.translate, greedy.temperature, greedy.use_ngram) == ("greedy", "tokens", 0.0, True)
    sampled = speculative_config(base, "omnidraft", 0.7)
    assert (sampled.verify, sampled.temperature) == ("omnidraft", 0.7)
    with pytest.raises(OmnidraftError, match="greedy or omnidraft"):
        speculative_config(base, "tli", 0.7)


# ---- report --------------------------------------------------------------------------------------
def run(ids, wall, forwards, rate=None, hits=(0, 0)):
    return PromptRun(list(ids), wall, forwards, acceptance_rate=rate, ngram_hits_proposed=hits[0],
                     ngram_hits_accepted=hits[1], split={"draft": wall / 2, "verify": wall / 2})


def fake_result() -> AblationResult:
    configs = capped_configs(8)
    runs = {TARGET: [run([1, 2, 3, 4], 4.0, 4)], NO_CACHE: [run([1, 2, 3, 4], 2.0, 2, 0.5)]}
    for c in configs:
        runs[c.name] = [run([1, 2, 3, 4], 2.0, 2, 0.6, (2, 1))]
    runs[FULL] = [run([1, 2, 3, 4], 1.0, 1, 0.75, (4, 3))]
    summary = summarize(runs, compare=list(runs))
    footprints = {c.name: {"entries": c.max_entries, "max_entries": c.max_entries, "policy": c.policy,
                           "bytes_in_memory": 900, "bytes_on_disk": 4096} for c in configs}
    footprints[FULL] = {"entries": 8, "max_entries": None, "policy": "lru", "bytes_in_memory": 2048, "bytes_on_disk": 8192}
    for name, row in summary.items():
        row["cache"] = footprints.get(name, {"entries": 0, "max_entries": None})
    full_curve = [GrowthPoint(1, 4, 4), GrowthPoint(2, 8, 6), GrowthPoint(3, 12, 7), GrowthPoint(4, 16, 8)]
    growth = {FULL: full_curve} | {c.name: [GrowthPoint(4, 16, c.max_entries, 3)] for c in configs}
    stream = summarize({name: [run([1] * 4, 1.0, 2, 0.5, (1, 1))] for name in growth}, baseline=None, compare=())
    for name, curve in growth.items():
        stream[name].update(entries=curve[-1].entries, evictions=curve[-1].evictions,
                            max_entries=footprints[name]["max_entries"])
    return AblationResult(8, configs, growth, stream, summary, footprints)


def test_tables_have_table14_rows_and_growth_summary():
    result = fake_result()
    table = ablation_table(result.summary)
    rows = [line for line in table.splitlines()[2:]]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == ["target", "no cache", "1/4", "1/4", "1/2", "1/2", "full"]
    assert "| 1/4 | LFU | 2 (cap 2) | 0.60 | 2.00 | 1/2 | 2.00× |" in table
    assert "| full | – | 8 | 0.75 | 4.00 | 3/4 | 4.00× | 4.00× | 4.00 | yes |" in table
    assert "| no cache | – | 0 | 0.50 |" in table and "| target | – | – | – |" in table
    streams = stream_table(result.stream_summary)
    assert "| 1/2 LRU | 4 | 4 | 3 | 0.50 |" in streams and "| full | – | 8 | 3 |" not in streams
    summary = growth_summary(result.growth[FULL], result.footprints[FULL])
    assert "4 prompts, 16 tokens decoded" in summary and "8 n-grams, 2.0 KiB in memory, 8.0 KiB on disk" in summary
    assert "0.750 after 50%" in summary and "0.500 after 100%" in summary


def test_write_ablation_files(tmp_path):
    meta = {"drafter": "d", "target": "t", "prompts": "p", "stream_n": 4, "stream_offset": 0, "n": 1,
            "heldout_offset": 4, "max_new_tokens": 4, "verify": "greedy", "temperature": 0.0, "draft_len": 8,
            "draft_confidence": 0.6, "drafter_dtype": "bfloat16", "threads": 2}
    result = fake_result()
    assert plot_growth(result)[:8] == b"\x89PNG\r\n\x1a\n"
    files = write_ablation(tmp_path, meta, result)
    assert {f.name for f in files} == {"results.json", "results.md", "cache_growth.png", "speedup.png", "time_split.png"}
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data["configs"]) == config_names(result.configs)
    assert data["caps"]["1/2 LFU"] == {"fraction": "1/2", "policy": "lfu", "max_entries": 4}
    assert [p["entries"] for p in data["growth"][FULL]] == [4, 6, 7, 8]
    md = (tmp_path / "results.md").read_text()
    assert "Table 14" in md and "Figure 9" in md and "stream 4 (offset 0), held-out 1 (offset 4)" in md
    assert (tmp_path / "cache_growth.png").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


# ---- the drafter serves several caches ----------------------------------------------------------
def test_drafter_root_mask_follows_the_cache_it_is_given():
    """One drafter serves every configuration; two caches with equal versions/lengths but
    different keys must not share the memo of non-direct-mapped first sub-tokens."""
    d_model, target, bridge = tiny_pair()
    vocab = make_drafter(d_model, bridge, target).lm.vocab_size
    unmapped = [d for d, t in enumerate(bridge.d2t_list) if t < 0 and d < vocab][:2]
    assert len(unmapped) == 2
    first, second = NgramTrie(), NgramTrie()
    first.add([unmapped[0], 5], 7)
    second.add([unmapped[1], 5], 7)

    def root_extras(cache: NgramTrie) -> list[int]:
        translator.propose = cache  # what the decoder does when one bridge serves several caches
        return translator.root_extras(vocab).tolist()

    translator = TokenTranslator(bridge, target.vocab_size, first, first)
    assert root_extras(first) == [unmapped[0]]
    assert root_extras(second) == [unmapped[1]]
    assert root_extras(first) == [unmapped[0]]


# ---- CLI -----------------------------------------------------------------------------------------
def test_ablation_arguments_are_checked_before_loading():
    assert_one_line_error(omnidraft("experiment", "cache", "--modes", "greedy"), "--modes")
    assert_one_line_error(omnidraft("experiment", "cache", "--cache-size", "5"), "--cache-size")
    assert_one_line_error(omnidraft("experiment", "cache", "--stream-n", "0"), "--stream-n")
    assert_one_line_error(omnidraft("bench", "--stream-n", "4"), "--stream-n")
    assert_one_line_error(omnidraft("bench", "--freeze-cache"), "--ngram-cache home")
    assert_one_line_error(omnidraft("bench", "--cache-policy", "lfu"), "--cache-size")


def test_plain_bench_cache_options_pick_the_store(tmp_path, monkeypatch):
    """fresh: in memory, or a capped store under --out; home: the pair's store, frozen if asked."""
    from types import SimpleNamespace

    from omnidraft.cli import build_parser
    from omnidraft.cli.bench import _ngram_factory, _validate
    from omnidraft.ngram.store import PersistentNgramCache

    d_tok, t_tok = tiny_tokenizer(330, DRAFTER_CORPUS), tiny_tokenizer(420)
    pipe = SimpleNamespace(decoder=SimpleNamespace(bridge=SimpleNamespace(drafter_tokenizer=d_tok)), target_tokenizer=t_tok)
    parse = build_parser().parse_args
    out = tmp_path / "out"
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))

    args = parse(["bench", "--out", str(out)])
    assert _validate(args) and type(_ngram_factory(args, pipe)()) is NgramTrie
    args = parse(["bench", "--out", str(out), "--cache-size", "7", "--cache-policy", "lfu"])
    _validate(args)
    make = _ngram_factory(args, pipe)
    first, second = make(), make()
    assert isinstance(first, PersistentNgramCache) and (first.max_entries, first.policy) == (7, "lfu")
    assert first.path.parent == out / "caches" and first.path != second.path  # one store per mode
    first.add([1, 2], 3)
    first.close()
    args = parse(["bench", "--ngram-cache", "home", "--freeze-cache"])
    _validate(args)
    home_cache = _ngram_factory(args, pipe)()
    assert home_cache.frozen and home_cache.path.parent == tmp_path / "home" / "cache_store"


def test_ablation_needs_enough_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert_one_line_error(omnidraft("experiment", "cache", "--prompts", str(prompts), "--stream-n", "2", "--n", "2"),
                          "--offset + --stream-n + --n = 4")


CODE_PROMPTS = [
    'def fizzbuzz(n: int) -> list[str]:\n    """Return the FizzBuzz sequence from 1 to n."""\n',
    'def is_palindrome(text: str) -> bool:\n    """Check whether text reads the same backwards, ignoring case."""\n',
    'def word_count(text: str) -> dict[str, int]:\n    """Count how often each word occurs in text."""\n',
    'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge two sorted lists into one."""\n',
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number iteratively."""\n',
    'def transpose(matrix: list[list[float]]) -> list[list[float]]:\n    """Transpose a rectangular matrix."""\n',
]


@pytest.mark.real
def test_cache_ablation_cli_smoke(tmp_path, cli):
    """A stream of 4 prompts and one held-out prompt, in this process (the session's models)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS))
    out = tmp_path / "out"
    # A home of its own that shares the test home's models: whatever the ablation writes outside
    # --out would show up in it (other test runs may be using the shared home's cache_store).
    home = tmp_path / "home"
    home.mkdir()
    (TEST_HOME / "models").mkdir(exist_ok=True)  # run alone on a fresh clone, nothing has made it yet
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    proc = cli("experiment", "cache", "--drafter", DRAFTER, "--target", "builtin:qwen2.5-coder-0.5b",
               "--prompts", str(prompts), "--stream-n", "4", "--n", "1", "--max-new-tokens", "12", "--out", str(out),
               home=home)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("results.json", "results.md", "cache_growth.png", "speedup.png"):
        assert (out / name).stat().st_size > 100, name
    res = json.loads((out / "results.json").read_text())
    configs = res["configs"]
    assert list(configs) == [TARGET, NO_CACHE, "1/4 LRU", "1/4 LFU", "1/2 LRU", "1/2 LFU", FULL]
    full = res["full_entries"]
    assert full >= 1 and configs[FULL]["cache"]["entries"] == full
    assert [p["prompts"] for p in res["growth"][FULL]] == [1, 2, 3, 4]
    assert res["growth"][FULL][-1]["entries"] == full
    assert res["stream"]["1/4 LRU"]["evictions"] > 0  # eviction acted while the capped cache learned
    for name, cap in res["caps"].items():
        assert cap["max_entries"] == max(1, int(full * Fraction(cap["fraction"]) + Fraction(1, 2)))
        assert configs[name]["cache"]["entries"] <= cap["max_entries"], name
        assert all(p["entries"] <= cap["max_entries"] for p in res["growth"][name]), name
    assert configs[NO_CACHE]["ngram_hits_proposed"] == 0 and configs[NO_CACHE]["cache"]["entries"] == 0
    for name, row in configs.items():
        assert row["identical_to_target"] is True, name  # greedy: every configuration is lossless
        assert row["prompts"] == 1 and row["speedup_vs_target"] > 0
    assert (out / "results.md").read_text().count("\n|") >= 7 + 5
    assert sorted(p.name for p in (out / "caches").glob("*.sqlite")) == sorted(
        ["full.sqlite", "1-4-lru.sqlite", "1-4-lfu.sqlite", "1-2-lru.sqlite", "1-2-lfu.sqlite"])
    assert sorted(p.name for p in home.iterdir()) == ["models"]  # no cache_store/: the user's state untouched
