"""Bench bookkeeping on hand-made runs and a tiny model, plus one real smoke run of the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import DRAFTER, TEST_HOME
from tiny import tiny_model, tiny_tokenizer

from omnidraft.bench.report import markdown_table
from omnidraft.bench.runner import PromptRun, interleave, our_mode, run_bench, summarize
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.target import TorchTarget


def test_interleave_runs_every_mode_per_prompt_in_turn():
    assert interleave(2, ["a", "b", "c"]) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]


def run(ids, wall, forwards, rate=None):
    return PromptRun(list(ids), wall, forwards, acceptance_rate=rate, split={"draft": wall / 2, "verify": wall / 2})


def test_summarize_ratios_and_identity():
    runs = {
        "target": [run([1, 2, 3, 4], 4.0, 4), run([5, 6], 1.0, 2)],
        "greedy": [run([1, 2, 3, 4], 2.0, 2, 0.5), run([5, 6], 1.0, 1, 1.0)],  # 2x and 1x per prompt
        "greedy-nocache": [run([1, 2, 3, 9], 1.0, 2, 0.25), run([5, 6], 0.5, 1, 0.5)],
    }
    s = summarize(runs)
    assert s["target"]["speedup_vs_target"] == 1.0 and s["target"]["identical_to_target"]
    assert s["greedy"]["speedup_per_prompt"] == [2.0, 1.0]
    assert s["greedy"]["speedup_vs_target"] == 1.5 and s["greedy"]["speedup_vs_target_mean"] == 1.5
    assert s["greedy"]["tokens_per_s"] == 6 / 3.0
    assert s["greedy"]["tokens_per_target_forward"] == 2.0
    assert s["greedy"]["acceptance_rate"] == 0.75
    assert s["greedy"]["identical_to_target"] is True
    assert s["greedy-nocache"]["identical_to_target"] is False
    assert s["target"]["acceptance_rate"] is None
    table = markdown_table(s)
    assert s["greedy-nocache"]["identical_prompts"] == 1  # the second prompt matches, the first does not
    assert "| greedy | 2.00 | 1.50× |" in table and "| NO (1/2) |" in table


def test_the_share_of_forwards_a_streamed_draft_reached_in_time(tmp_path):
    from omnidraft.bench.report import write_results

    runs = {"server-stream": [PromptRun([1, 2, 3, 4], 2.0, 4, server_plain_s=[0.03, 0.03, 0.04])],
            "stream": [PromptRun([1, 2, 3, 4], 1.0, 2, drafted_tokens=2, steps=2, timely_forwards=1, forked_forwards=1,
                                 device_token_s=0.006, server_plain_s=[0.05]),
                       PromptRun([5, 6], 1.0, 2, timely_forwards=2, device_token_s=0.008, server_plain_s=[0.04, 0.06])]}
    s = summarize(runs, baseline="server-stream")
    assert s["stream"]["timely_forward_share"] == 0.75 and s["server-stream"]["timely_forward_share"] == 0
    assert s["stream"]["forked_forward_share"] == 0.25
    # the device drafts off the steps' clock (no draft seconds in them): its pace is the drafter's cost
    assert abs(s["stream"]["drafter_ms_per_token"] - 7.0) < 1e-9 and s["server-stream"]["drafter_ms_per_token"] is None
    meta = dict(drafter="d", target="grpc://127.0.0.1:1", prompts="humaneval", n=2, max_new_tokens=4, draft_len=8,
                draft_stop="auto", drafter_dtype="float32", temperature_sampling_modes=0.7, threads=1)
    write_results(tmp_path, meta, s)
    md = (tmp_path / "results.md").read_text()
    assert "a correction the device foresaw): `stream` 75% (25%)" in md
    # the median over every prompt's plain steps: the device's drafting on a shared host shows as a slower server
    assert "slows the server's steps): `server-stream` 30.0 ms, `stream` 50.0 ms" in md


def test_the_drafters_cost_per_token_leaves_the_catch_up_reads_apart():
    a, b = run([1, 2, 3, 4], 2.0, 2, 0.5), run([5, 6], 1.0, 1, 1.0)
    a.steps, a.drafted_tokens, a.split = 2, 4, {"draft": 0.5, "catch_up": 0.3, "verify": 1.0, "bridge": 0, "other": 0}
    b.steps, b.drafted_tokens, b.split = 1, 6, {"draft": 0.4, "catch_up": 0.0, "verify": 0.5, "bridge": 0, "other": 0}
    s = summarize({"target": [run([1, 2, 3, 4], 4.0, 4), run([5, 6], 1.0, 2)], "greedy": [a, b]})
    assert abs(s["greedy"]["drafter_ms_per_token"] - 1000 * 0.6 / 10) < 1e-9 and s["greedy"]["catch_up_s"] == 0.3
    assert s["target"]["drafter_ms_per_token"] is None
    assert "| 60.0 (+0.3) |" in markdown_table(s)


def test_run_bench_on_a_tiny_model_shares_prompts_and_orders_runs():
    tok = tiny_tokenizer(300)
    target = TorchTarget(tiny_model(len(tok), seed=3), tok)
    seen = []

    def spy(name, fn):
        def wrapped(ids):
            seen.append((name, tuple(ids)))
            return fn(ids)
        return wrapped

    cfg = DecodeConfig(max_new_tokens=6)
    modes = {"target": spy("target", our_mode(SpeculativeDecoder(target), cfg)),
             "greedy": spy("greedy", our_mode(SpeculativeDecoder(target), cfg))}
    prompts = [tok.encode("the cat"), tok.encode("def add")]
    runs = run_bench(modes, prompts, warmup=tok.encode("numbers"), progress=False)
    assert [name for name, _ in seen] == ["target", "greedy"] * 3
    assert seen[2][1] == seen[3][1] == tuple(prompts[0])
    summary = summarize(runs)
    assert summary["greedy"]["identical_to_target"] is True  # same engine, same greedy output
    assert all(len(r.token_ids) == 6 for r in runs["target"])


@pytest.mark.real
def test_bench_cli_smoke(tmp_path, cli):
    """Every default mode of both engines on a code prompt and a chat prompt (in this process: the
    run is not about the process, and the session's models are already loaded)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n"}\n{"prompt": "The sky is blue because", "chat": true}\n')
    out = tmp_path / "out"
    proc = cli("bench", "--drafter", DRAFTER, "--target", "builtin:qwen2.5-coder-0.5b",
               "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    modes = res["modes"]
    assert set(modes) == {"target", "hf-target", "hf-uag", "greedy", "greedy-ngram", "greedy-nocache", "tli", "omnidraft",
                          "llamacpp", "target@llamacpp", "greedy@llamacpp", "greedy-k4@llamacpp"}  # both engines
    for name in ("greedy", "greedy-ngram", "greedy-nocache", "hf-target", "llamacpp"):
        assert modes[name]["identical_to_target"] is True, name
    # (verifying several tokens at once on llama.cpp's default build may break a near-tie: test_llamacpp_e2e)
    # whether drafting pays is timed, so the smoke test only checks that the policy reports per engine
    # (test_llamacpp_e2e checks that it does not draft at a loss)
    assert res["meta"]["policy"]["greedy@llamacpp"]["verify_ms_by_proposals"]
    assert res["meta"]["policy"]["greedy"]["verify_ms_by_proposals"]  # what the policy measured is reported
    for name, row in modes.items():
        assert row["tokens_per_s"] > 0 and row["prompts"] == 2
        assert row["speedup_vs_target"] > 0
    assert modes["greedy-k4@llamacpp"]["tokens_per_target_forward"] > 1.0  # a fixed length: it drafts on any host
    # our modes draft where generate would (the home's measured backend), and transformers' assisted
    # mode really had an assistant: without one it ran plain generate and reported no acceptance
    from omnidraft.runtime import kept_drafter_choice

    assert res["meta"]["drafter_backend"].startswith(kept_drafter_choice(DRAFTER, TEST_HOME).chosen.backend)
    assert modes["hf-uag"]["acceptance_rate"] is not None
    assert (out / "results.md").read_text().count("\n|") >= 8
    assert (out / "speedup.png").stat().st_size > 1000 and (out / "time_split.png").stat().st_size > 1000


def test_an_explicit_llama_engine_applies_to_modes_without_one():
    """``--engine llamacpp --modes target,greedy`` runs on llama.cpp, never silently on torch, and a
    torch-only mode under that flag is refused in one line."""
    from omnidraft.cli.bench import on_engine
    from omnidraft.errors import OmnidraftError

    assert on_engine(["target", "greedy", "llamacpp"], "llamacpp") == ["target@llamacpp", "greedy@llamacpp", "llamacpp"]
    assert on_engine(["target", "greedy@llamacpp"], "llamacpp") == ["target@llamacpp", "greedy@llamacpp"]
    assert on_engine(["target", "greedy"], "torch") == ["target", "greedy"]
    with pytest.raises(OmnidraftError, match="hf-uag, tli run only on torch"):
        on_engine(["target", "hf-uag", "tli"], "llamacpp")


def test_latency_splits_a_chunks_gap_among_its_tokens():
    from omnidraft.bench.runner import latency_ms

    # prompt 1: first token at 0.1 s, then a chunk of 3 at 0.4 s (0.1 s each), then one at 0.5 s
    # prompt 2: first at 0.3 s, one at 0.7 s
    runs = [PromptRun([1, 2, 3, 4, 5], 0.5, 3, token_times=[0.1, 0.4, 0.4, 0.4, 0.5]),
            PromptRun([6, 7], 0.7, 2, token_times=[0.3, 0.7])]
    lat = latency_ms(runs)
    assert lat["ttft_ms"] == pytest.approx(200.0)  # median of 100 and 300
    assert lat["itl_ms_median"] == pytest.approx(100.0)  # 100, 100, 100, 100, 400
    assert 100.0 < lat["itl_ms_p90"] <= 400.0
    assert latency_ms([PromptRun([1], 0.1, 1, token_times=[0.05])])["itl_ms_median"] is None


def test_the_base_mode_refuses_a_torch_drafter_with_a_merged_adapter():
    """A torch drafter merges its adapter into the weights, and a fork copies them: a greedy-base mode
    built from it would silently draft with the adapter. Without one, the fork is the base drafter."""
    import torch

    from omnidraft.bench.runner import without_adapter
    from omnidraft.drafter import Drafter
    from omnidraft.drafter.torch_lm import TorchDraftLM

    lm = TorchDraftLM(tiny_model(64, seed=1))
    drafter = Drafter(lm)
    assert without_adapter(drafter).lm is not lm  # no adapter: a fork is the base
    weight = next(w for n, w in lm.model.named_parameters() if n.endswith("q_proj.weight"))
    name = next(n for n, w in lm.model.named_parameters() if n.endswith("q_proj.weight"))[: -len(".weight")]
    state = {f"base_model.model.{name}.lora_A.weight": torch.ones(2, weight.shape[1]),
             f"base_model.model.{name}.lora_B.weight": torch.ones(weight.shape[0], 2)}
    lm.apply_adapter(state, 1.0)
    assert lm.has_adapter
    with pytest.raises(ValueError, match="native, llamacpp or onnx"):
        without_adapter(drafter)
    with pytest.raises(ValueError, match="needs a drafter"):
        without_adapter(None)


def test_the_report_names_what_ran_the_drafter():
    from omnidraft.bench.report import meta_line

    meta = dict(drafter="builtin:smollm2-135m", target="builtin:qwen2.5-coder-1.5b", prompts="humaneval", n=4,
                max_new_tokens=128, draft_len=8, draft_stop="auto", drafter_dtype="bfloat16",
                temperature_sampling_modes=0.7, threads=2)
    assert "torch drafter in bfloat16" in meta_line(meta)  # a report from before the backend was recorded
    assert "drafter on native" in meta_line(dict(meta, drafter_backend="native"))
    assert "torch drafter in float32" in meta_line(dict(meta, drafter_backend="torch-float32"))  # the pipeline's label
    assert "torch drafter" in meta_line(dict(meta, drafter_backend="auto"))


def test_the_policy_lines_say_which_weights_ran_and_what_the_paired_trials_found():
    from omnidraft.bench.report import policy_lines

    plain = {"verify_ms_by_proposals": {0: 88.0, 4: 100.0}, "draft_ms_per_token": 7.5, "budget_choices": {0: 3, 4: 9}}
    assert policy_lines({"greedy-base": plain}).strip().endswith("drafting skipped in 3 of 12 steps")
    chosen = dict(plain, weights_requests={"adapter": 5, "base": 0, "paired": 2},
                  weights_trials="paired trials: the adapter drafts at 1.08x the base weights' tokens/s")
    line = policy_lines({"greedy": chosen})
    assert "requests by weights: adapter 5, base 0, paired 2" in line and "1.08x the base weights'" in line


def test_the_onnx_modes_use_the_homes_export_beside_a_backend_that_is_no_export(tmp_path):
    """`bench --drafter-backend native --modes greedy,greedy-onnx` compares the native drafter with the
    export: the -onnx modes must look up the home's export (it used to pass "native" on, get None
    and fail with a TypeError), and say in one line how to make one when there is none."""
    from omnidraft.cli.bench import onnx_backend
    from omnidraft.errors import OmnidraftError
    from omnidraft.runtime import onnx_export_for

    for backend in ("auto", "torch", "native", "llamacpp"):
        assert onnx_backend(backend) == "onnx"
    assert onnx_backend(str(tmp_path / "an-export")) == str(tmp_path / "an-export")
    with pytest.raises(OmnidraftError, match="omnidraft export"):
        onnx_export_for("builtin:smollm2-135m", onnx_backend("native"), home=tmp_path)


def test_assisted_modes_refuse_a_pipeline_without_a_torch_drafter():
    """A drafter on a GGUF or an export holds no torch model: transformers' assisted mode must get one
    (the bench loads it) or refuse, never run transformers' plain generate under the assisted name."""
    from types import SimpleNamespace

    from omnidraft.bench.runner import build_modes

    tok = tiny_tokenizer(300)
    model = tiny_model(len(tok), seed=3)
    pipe = SimpleNamespace(decoder=SpeculativeDecoder(TorchTarget(model, tok)), target_model=model, drafter_model=None)
    cfg = DecodeConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="hf-uag: transformers' assisted generation needs the drafter as a torch model"):
        build_modes(pipe, ["target", "hf-uag"], cfg, 0.7)
    assert set(build_modes(pipe, ["target", "hf-target"], cfg, 0.7)) == {"target", "hf-target"}


def test_the_assistant_steps_in_the_torch_dtype_timed_faster():
    from omnidraft.cli.bench import fastest_torch_dtype
    from omnidraft.drafter.choice import BackendChoice, BackendMeasure

    def choice(fp32_ms: float, bf16_ms: float) -> BackendChoice:
        native = BackendMeasure("native", None, 5.0, 1.0)
        measures = [native, BackendMeasure("torch", "float32", fp32_ms, 1.0), BackendMeasure("torch", "bfloat16", bf16_ms, 0.98)]
        return BackendChoice(native, measures, "a CPU", 0.0)

    assert fastest_torch_dtype(choice(26.1, 48.0)) == "float32"  # no AMX: bf16 is emulated
    assert fastest_torch_dtype(choice(33.0, 20.0)) == "bfloat16"
    assert fastest_torch_dtype(None) == "float32"  # nothing timed: transformers' own default


HAS_CLOSE = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)
    True
    """
'''


@pytest.mark.real
def test_transformers_assisted_generation_decodes_a_code_prompt_through_many_drafts(real_models):
    """The bench's assisted baseline (transformers' universal assisted generation with our drafter as its
    assistant) must run a real code prompt through many drafts and give the target's own greedy tokens.
    transformers 5.25 crashed there after a few drafts (an empty assistant input once its cache was
    rolled back): pyproject's pin keeps that release out, and this test finds such a release if the pin
    is raised."""
    from omnidraft.bench.runner import hf_mode
    from omnidraft.runtime import encode_prompt

    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    d_model, d_tok = real_models(DRAFTER)
    ids = encode_prompt(t_tok, HAS_CLOSE)
    plain = hf_mode(t_model, t_tok, 32)(ids)
    assisted = hf_mode(t_model, t_tok, 32, d_model, d_tok)(ids)
    assert assisted.token_ids == plain.token_ids and len(plain.token_ids) == 32
    assert assisted.drafted_tokens > 0 and assisted.target_forwards < 32  # it drafted, and drafts were kept
