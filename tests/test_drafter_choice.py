"""``--drafter-backend auto``: the drafter runs on the fastest backend that agrees with fp32.

The rule (the fastest of those at or above the agreement bar) on made-up measures; the record kept
per home (reused while the CPU, versions and candidates stay, measured again when they change or the
file is damaged); and one real measurement of SmolLM2 on this machine, whose choice follows the rule
and is what ``load_pipeline`` then runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import DRAFTER, TEST_HOME

from omnidraft import models
from omnidraft.drafter import choice
from omnidraft.drafter.choice import MIN_AGREEMENT, BackendChoice, BackendMeasure, pick
from omnidraft.errors import OmnidraftError


def _m(backend: str, dtype: str | None, ms: float, agreement: float) -> BackendMeasure:
    return BackendMeasure(backend, dtype, ms, agreement)


def test_the_fastest_backend_that_agrees_enough_is_chosen():
    fp32, bf16 = _m("torch", "float32", 80, 1.0), _m("torch", "bfloat16", 40, 0.985)
    gguf, bad = _m("llamacpp", None, 12, MIN_AGREEMENT), _m("onnx", "int4", 5, MIN_AGREEMENT - 0.01)
    assert pick([fp32, bf16, gguf, bad]) is gguf  # int4 is faster but disagrees too often
    assert pick([fp32, bf16, bad]) is bf16
    assert pick([fp32]) is fp32
    with pytest.raises(OmnidraftError):
        pick([bad])


class _Steps:
    """A made-up DraftLM that always predicts ``token`` and notes each text it is probed on."""

    def __init__(self, name: str, token: int, log: list[str]) -> None:
        self.name, self.token, self.log = name, token, log

    def reset(self) -> None:
        self.log.append(self.name)

    def logits_for(self, ids):
        import torch

        return torch.nn.functional.one_hot(torch.tensor(self.token), 8).float()

    def step(self, token: int):
        return self.logits_for([token])


def test_the_backends_are_probed_in_turn_each_text_in_the_other_order():
    """All candidates are loaded first and probed text by text, the order reversed every other text,
    so that no backend is timed only right after one other (whose threads may still spin); agreement
    counts the reference's own greedy tokens."""
    log: list[str] = []
    reference = _Steps("fp32", 3, log)
    loaded: list[str] = []

    def candidate(name: str, token: int) -> choice.Candidate:
        return choice.Candidate(name, None, lambda: loaded.append(name) or _Steps(name, token, log))

    def tokenizer(text):
        return {"input_ids": [1, 2, 3]}

    measures = choice.measure(reference, [candidate("a", 3), candidate("b", 5)], tokenizer)
    probes = log[len(choice.PROBE_TEXTS):]  # after the reference's greedy continuations
    assert loaded == ["a", "b"]
    assert probes == ["fp32", "a", "b", "b", "a", "fp32", "fp32", "a", "b"][: 3 * len(choice.PROBE_TEXTS)]
    assert [(m.backend, m.agreement) for m in measures] == [("torch", 1.0), ("a", 1.0), ("b", 0.0)]
    assert all(m.ms_per_token >= 0 for m in measures)


def test_the_record_is_reused_only_under_the_same_fingerprint(tmp_path):
    path = tmp_path / "choice.json"
    key = choice.fingerprint([("torch", "float32"), ("llamacpp", None)])
    measures = [_m("torch", "float32", 80, 1.0), _m("llamacpp", None, 12, 0.97)]
    choice.save_choice(path, BackendChoice(measures[1], measures, "some CPU", 1.0), key)
    kept = choice.load_choice(path, key)
    assert kept is not None and kept.chosen.label == "llamacpp" and [m.ms_per_token for m in kept.measures] == [80, 12]
    assert choice.load_choice(path, {**key, "host": "another CPU"}) is None
    assert choice.load_choice(path, choice.fingerprint([("torch", "float32")])) is None  # the candidates changed
    path.write_text(path.read_text()[:40])  # a damaged record: measured again, never an error
    assert choice.load_choice(path, key) is None


def test_the_native_kernels_build_is_part_of_the_fingerprint():
    """A rebuilt native kernel (other sources, another torch) is measured again, as a new package would be."""
    from omnidraft import kernels

    with_native = choice.fingerprint([("torch", "float32"), ("native", None)])
    assert with_native["native_kernel"] == kernels.build_dir("qdraft").name
    assert "native_kernel" not in choice.fingerprint([("torch", "float32"), ("llamacpp", None)])


@contextmanager
def fresh_head_rows(home) -> Iterator[None]:
    """The process's native drafter weights with the fewest kept head rows a fresh home can start from: the
    first third of the ids, a vocabulary's base when no set ships for it (the shipped set covers more)."""
    from omnidraft import runtime
    from omnidraft.drafter.native_lm import HeadVocab

    if not runtime.native_drafter_available():
        yield
        return
    weights = runtime._native_weights(models.gguf_of(DRAFTER, home, progress=False).resolve(), home)
    kept = weights.head_vocab
    object.__setattr__(weights, "head_vocab", HeadVocab(weights.model, weights.vocab_size))  # a frozen dataclass
    try:
        yield
    finally:
        object.__setattr__(weights, "head_vocab", kept)


@pytest.mark.real
def test_a_real_measurement_follows_the_rule_and_is_kept(monkeypatch):
    from omnidraft.runtime import choose_drafter_backend, llama_cpp_installed, native_drafter_available

    home = TEST_HOME
    with fresh_head_rows(home):  # as on a fresh home: the native drafter has read nothing yet
        picked = choose_drafter_backend(DRAFTER, home, quiet=True, remeasure=True)
    labels = {m.label for m in picked.measures}
    assert {"torch float32", "torch bfloat16"} <= labels
    assert ("llamacpp" in labels) == llama_cpp_installed()
    assert all(m.ms_per_token > 0 and 0 <= m.agreement <= 1 for m in picked.measures)
    assert picked.chosen is pick(picked.measures)
    assert picked.chosen.label in picked.why() and f"{MIN_AGREEMENT:.0%}" in picked.why()
    if native_drafter_available():  # its arithmetic follows fp32's; the probe does not prune its head (a fresh
        native = next(m for m in picked.measures if m.label == "native")  # home's first words would count as misses)
        assert native.agreement >= 0.98, native
    record = json.loads((home / "models" / "costs" / "drafter-backends" / "smollm2-135m.json").read_text())
    assert record["chosen"] == picked.chosen.label and record["fingerprint"]["host"] == choice.cpu_model()

    def no_loading(*args, **kwargs):
        raise AssertionError("a kept choice must not load the drafter again")

    monkeypatch.setattr(models, "load", no_loading)
    again = choose_drafter_backend(DRAFTER, home, quiet=True)
    assert again.chosen.label == picked.chosen.label and again.measured_at == picked.measured_at


@pytest.mark.real
def test_the_pipeline_runs_the_chosen_backend_and_an_explicit_dtype_skips_the_choice(monkeypatch):
    from omnidraft import runtime

    home, cache = TEST_HOME, runtime.CacheOptions(enabled=False)
    measures = [_m("torch", "float32", 80, 1.0), _m("torch", "bfloat16", 40, 0.99)]
    monkeypatch.setattr(runtime, "choose_drafter_backend",
                        lambda *a, **k: BackendChoice(measures[1], measures, "CPU", 1.0))
    pipe = runtime.load_pipeline("builtin:gemma3-270m", DRAFTER, home=home, quiet=True, engine="llamacpp",
                                cache=cache)
    assert pipe.drafter_backend == "torch-bfloat16"

    def refuse(*a, **k):
        raise AssertionError("an explicit drafter dtype is not measured")

    monkeypatch.setattr(runtime, "choose_drafter_backend", refuse)
    pipe = runtime.load_pipeline("builtin:gemma3-270m", DRAFTER, home=home, quiet=True, engine="llamacpp",
                                 drafter_dtype="float32", cache=cache)
    assert pipe.drafter_backend == "torch-float32"


@pytest.mark.real
def test_models_backends_prints_the_choice(cli):
    run = cli("models", "backends", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["chosen"] in {f"{m['backend']}{' ' + m['dtype'] if m['dtype'] else ''}" for m in doc["measures"]}
    assert doc["host"] == choice.cpu_model()
    listed = cli("models", "list", "--no-check")  # shows the kept choice, measures nothing
    assert listed.returncode == 0 and f"drafter on {doc['chosen']}:" in listed.stdout, listed.stdout
