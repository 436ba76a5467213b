"""`omnidraft adapt`, the adapter in `generate`, and the online distillation benchmark: its
bookkeeping on small inputs, and one short real run of each command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DRAFTER, TEST_HOME

from omnidraft.experiments.online import RecordCache, checkpoints_for, markdown
from omnidraft.train.records import Record


def test_checkpoints_are_spread_evenly_and_end_at_the_stream_end():
    assert checkpoints_for(200, 4) == [0, 50, 100, 150, 200]
    assert checkpoints_for(10, 3) == [0, 3, 7, 10]
    assert checkpoints_for(5, 1) == [0, 5]


def _record(n: int) -> Record:
    return Record([1, 2], list(range(n)), torch.zeros(n, 4, dtype=torch.int32), torch.full((n, 4), -2.0),
                  torch.zeros(n), torch.full((n,), -0.5))


def test_record_cache_round_trip_and_foreign_meta_is_ignored(tmp_path):
    meta = {"target": "t", "drafter": "d", "max_new_tokens": 8, "top_k": 4, "verify": "greedy"}
    cache = RecordCache(tmp_path / "r.pt", meta)
    cache.records[RecordCache.key([5, 6])] = _record(3)
    cache.save()
    again = RecordCache(tmp_path / "r.pt", meta)
    got = again.records[RecordCache.key([5, 6])]
    assert got.emitted_ids == [0, 1, 2] and torch.equal(got.topk_logp, torch.full((3, 4), -2.0))
    assert RecordCache(tmp_path / "r.pt", dict(meta, max_new_tokens=16)).records == {}
    assert RecordCache.key([5, 6]) != RecordCache.key([6, 5])


def test_markdown_reports_relative_change_against_the_untrained_drafter():
    row = lambda acc, spd: {"acceptance_rate": acc, "tokens_per_target_forward": 2.0, "speedup_vs_target": spd,
                            "identical_to_target": True}
    result = {"checkpoints": [
        {"prompts_streamed": 0, "set": "humaneval", "modes": {"target": row(0, 1.0), "none": row(0.5, 1.2)}},
        {"prompts_streamed": 8, "set": "humaneval", "modes": {"target": row(0, 1.0), "dm": row(0.6, 1.5), "hybrid": row(0.75, 1.8)}}],
        "train_curves": {}, "stream_sets": []}
    meta = {"drafter": "d", "target": "t", "stream": "humaneval", "stream_n": 8, "interval": 4, "held_out": {"humaneval": 2},
            "max_new_tokens": 16, "losses": ["dm", "hybrid"], "draft_len": 4, "draft_confidence": 0.0,
            "train": {"rank": 32, "lr": 1e-4, "batch_size": 8, "lam": 0.2, "ngram_weight": "const"}}
    md = markdown(result, meta)
    assert "| L_DM + λ·L_N-gram (LoRA) | 0.750 | +50% | 2.00 | 1.80× | +50% | yes |" in md
    assert "| L_DM (LoRA) | 0.600 | +20% |" in md
    assert "fixed k = 4" in md  # acceptance depends on the draft policy, so the report must name it
    assert "k ≤ 8, confidence stop 0.6" in markdown(result, {**meta, "draft_len": 8, "draft_confidence": 0.6})
    assert "passes per update" not in md and "sharpened" not in md  # Algorithm 2's defaults go unnamed
    tuned = markdown(result, {**meta, "train": {**meta["train"], "epochs": 3, "target_temperature": 0.5}})
    assert "3 passes per update, p sharpened to T = 0.5" in tuned
    assert "tvd at DM positions" in markdown(result, {**meta, "train": {**meta["train"], "divergence": "tvd"}})
    assert "straddling tokens' NLL × 0.2" in markdown(result, {**meta, "train": {**meta["train"], "span_weight": 0.2}})
    assert "head re-fits on the previous 16 prompts" in markdown(result, {**meta, "train": {**meta["train"], "head_replay": 16}})
    result["checkpoints"][1]["modes"]["hybrid+head"] = row(0.9, 1.9)
    headed = markdown(result, {**meta, "modes": ["dm", "hybrid", "hybrid+head"], "stop_gamma": 0.7})
    assert "| L_DM + λ·L_N-gram (LoRA) + acceptance head | 0.900 | +80% | 2.00 | 1.90× | +58% | yes |" in headed
    assert "head stop γ = 0.7" in headed  # the head's threshold is named too


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("online_home")
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)  # reuse dequantized models
    return home


@pytest.mark.real
def test_adapt_trains_the_pairs_adapter_and_generate_uses_it(home, cli):
    """In this process (the session's models): the commands, not the process, are under test."""
    _cli = lambda home, *argv: cli(*argv, home=home)
    proc = _cli(home, "adapt", "--drafter", DRAFTER, "--stream", "humaneval", "--n", "3", "--interval", "2",
                "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["prompts"] == 3 and summary["updates"] == 2  # one full interval + the partial buffer at the end
    assert summary["trainer_errors"] == [] and "smollm2-135m--qwen2.5-coder-0.5b" in summary["adapter"]

    assert list((home / "adapters").rglob("accept_head.safetensors"))  # the head is saved with the adapter
    gen = _cli(home, "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8")
    assert gen.returncode == 0 and "adapter " in gen.stderr and "update 2" in gen.stderr, gen.stderr
    assert "acceptance head" in gen.stderr  # and drafting stops by it (--draft-stop auto)
    plain = _cli(home, "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--adapter", "none")
    assert plain.returncode == 0 and "adapter " not in plain.stderr
    assert gen.stdout == plain.stdout  # greedy output is the target's with or without an adapter

    again = _cli(home, "adapt", "--drafter", DRAFTER, "--stream", "humaneval", "--offset", "3", "--n", "1",
                 "--interval", "1", "--max-new-tokens", "16", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["updates"] == 3  # continues the pair's adapter


@pytest.mark.real
def test_online_bench_short_real_run(home, tmp_path, cli):
    """A stream of 2 prompts (an update after each) and one held-out prompt, in this process."""
    out = tmp_path / "online"
    adapters_before = sorted(str(p) for p in (home / "adapters").rglob("*")) if (home / "adapters").exists() else []
    proc = cli("experiment", "online", "--prompts", "humaneval", "--stream-n", "2", "--n", "1",
               "--max-new-tokens", "16", "--checkpoints", "1", "--interval", "1", "--out", str(out), home=home)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "results.json").read_text())
    points = {(p["prompts_streamed"], p["set"]): p["modes"] for p in result["checkpoints"]}
    assert set(points) == {(0, "humaneval"), (2, "humaneval")}
    assert set(points[(0, "humaneval")]) == {"target", "none"}
    assert set(points[(2, "humaneval")]) == {"target", "dm", "dm+head", "hybrid", "hybrid+head"}  # the head trains by default
    assert all(m["identical_to_target"] for modes in points.values() for m in modes.values())
    assert {len(result["train_curves"][loss]) for loss in ("dm", "hybrid")} == {2}  # an update after each prompt
    assert (out / "online.png").stat().st_size > 10_000 and (out / "records.pt").is_file()
    md = (out / "results.md").read_text()
    assert "L_DM + λ·L_N-gram (LoRA)" in md and "L_DM + λ·L_N-gram (LoRA) + acceptance head" in md
    assert all(p["head_positions"] > 0 and 0 <= p["head_auc"] <= 1 for p in result["train_curves"]["hybrid"])
    adapters_after = sorted(str(p) for p in (home / "adapters").rglob("*")) if (home / "adapters").exists() else []
    assert adapters_after == adapters_before  # the benchmark trains in memory: the user's adapters stay as they were
