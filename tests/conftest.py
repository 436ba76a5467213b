"""Shared fixtures. Real models load once per session from a home under the repo (.test_home),
so the one-time dequantization is reused by later local runs; CI builds it fresh."""

from __future__ import annotations

import io
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TEST_HOME = Path(os.environ.get("OMNIDRAFT_TEST_HOME", REPO / ".test_home"))
os.environ["OMNIDRAFT_HOME"] = str(TEST_HOME)
TEST_HOME.mkdir(exist_ok=True)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DRAFTER = "builtin:smollm2-135m"
TARGETS = ["builtin:qwen2.5-coder-0.5b", "builtin:gemma3-270m"]


@pytest.fixture(scope="session")
def home() -> Path:
    return TEST_HOME


@pytest.fixture(scope="session")
def real_models():
    """spec -> (model, tokenizer), loaded lazily and kept for the session."""
    from omnidraft import models

    cache: dict = {}

    def get(spec: str):
        if spec not in cache:
            cache[spec] = models.load(spec, home=TEST_HOME, progress=False)
        return cache[spec]

    return get


@pytest.fixture(scope="session")
def peft_drafter(real_models):
    """(peft model, its LoRA state, scaling): the fp32 drafter under peft with a random rank-8 LoRA
    strong enough to move its logits far (peft starts B at zero), for the backends' adapter tests."""
    import copy

    from omnidraft.train import lora

    model, _ = real_models(DRAFTER)
    peft = lora.attach(copy.deepcopy(model), lora.lora_config(rank=8, alpha=16)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.06)
    return peft, lora.lora_state(peft), 16 / 8


def last_logits(model, ids) -> torch.Tensor:
    """A transformers model's float32 logits after ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def long_document(tokenizer) -> list[int]:
    """1,300 tokens of real prose and tables (one of the repository's docs) for long-context tests."""
    return list(tokenizer.encode((REPO / "docs" / "online-distillation.md").read_text()))[:1300]


def check_drop(lm, text: list[int], dropped: int = 300) -> None:
    """A drafter backend's ``drop`` forgets cached positions and moves the later ones down, their keys
    re-rotated to their new positions. What follows must then be closer to a fresh read of the kept
    tokens than a cache that still holds the dropped ones is (keys left at their old angles are far
    further off: KL ~30x, measured), and reading on must not need the kept tokens again."""

    def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
        return float(torch.nn.functional.kl_div(torch.log_softmax(q_logits, 0), torch.log_softmax(p_logits, 0),
                                                log_target=True, reduction="sum"))

    ids = text[:700]
    kept = ids[:4] + ids[4 + dropped:]
    fresh, full = lm.fork(), lm.fork()
    fresh.logits_for(kept)
    full.logits_for(ids)
    lm.reset()
    lm.logits_for(ids)
    lm.drop(4, dropped)
    assert lm.cached_ids == kept
    off_dropped = off_full = 0.0
    same = 0
    for token in text[700:740]:
        a, b, c = lm.step(token).clone(), fresh.step(token).clone(), full.step(token).clone()
        off_dropped += kl(b, a)
        off_full += kl(b, c)
        same += int(a.argmax() == b.argmax())
    assert off_dropped < 0.75 * off_full and same >= 32, (off_dropped, off_full, same)
    with pytest.raises(ValueError):
        lm.drop(len(lm.cached_ids) - 2, 3)


def greedy_with_backend(lm, real_models, target_spec: str = "builtin:qwen2.5-coder-0.5b"):
    """(tokens greedy speculative decoding gives with drafter backend ``lm``, the target's own greedy
    tokens, that decoder's stats) on a torch target, drafting 4 tokens per step."""
    from omnidraft.config import DecodeConfig
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.drafter import Drafter
    from omnidraft.runtime import build_bridge, encode_prompt
    from omnidraft.target import TorchTarget

    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models(target_spec)
    target = TorchTarget(t_model, t_tok)
    bridge = build_bridge(d_model, d_tok, t_model, t_tok)
    stop = [d for d, t in enumerate(bridge.d2t_list) if t in target.eos_ids]
    decoder = SpeculativeDecoder(target, Drafter(lm, stop_ids=stop), bridge)
    ids = encode_prompt(t_tok, "def fibonacci(n):\n")
    plain = SpeculativeDecoder(target).generate(ids, DecodeConfig(max_new_tokens=32)).token_ids
    got = decoder.generate(ids, DecodeConfig(max_new_tokens=32, draft_len=4, draft_stop="fixed")).token_ids
    return got, plain, decoder.stats


@pytest.fixture(scope="session")
def qwen_bridge(real_models):
    """The SmolLM2 -> Qwen2.5 vocabulary bridge on the real tokenizers."""
    from omnidraft.runtime import build_bridge

    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    return build_bridge(d_model, d_tok, t_model, t_tok)


@pytest.fixture(scope="session")
def real_pipeline(real_models):
    """target spec -> (SpeculativeDecoder with SmolLM2 drafter, target model, target tokenizer)."""
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.runtime import build_bridge, make_drafter
    from omnidraft.target import TorchTarget

    cache: dict = {}

    def get(target_spec: str):
        if target_spec not in cache:
            d_model, d_tok = real_models(DRAFTER)
            t_model, t_tok = real_models(target_spec)
            target = TorchTarget(t_model, t_tok)
            bridge = build_bridge(d_model, d_tok, t_model, t_tok)
            cache[target_spec] = (SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge), t_model, t_tok)
        return cache[target_spec]

    return get


@contextmanager
def shared_drafter_choice():
    """While it lasts, homes without an export of their own reuse the test home's measured drafter
    backend and its GGUF architecture memo (both pure functions of this machine and the files), as
    the builtin models themselves are shared: a fresh home would otherwise measure for ~30 s."""
    from omnidraft import runtime
    from omnidraft.home import home_dir

    choose, arch = runtime.choose_drafter_backend, runtime.gguf_architecture

    def shared_choose(spec, home=None, quiet=False, remeasure=False):
        own = (home_dir(home) / "export").is_dir()  # its export is a candidate the test home lacks
        return choose(spec, home if own else TEST_HOME, quiet, remeasure)

    runtime.choose_drafter_backend = shared_choose
    runtime.gguf_architecture = lambda gguf, home=None: arch(gguf, TEST_HOME)
    try:
        yield
    finally:
        runtime.choose_drafter_backend, runtime.gguf_architecture = choose, arch


class CliRun:
    """What an in-process ``omnidraft ARGV`` gave: exit status, stdout, stderr (as a subprocess's)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class _NoTTY(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture(scope="session")
def cli(real_models):
    """``cli(*argv, home=PATH)``: the real CLI's ``main(argv)`` in this process, for the real-model
    cases that are not about the process itself (exit codes, signals and the serve process stay
    subprocesses). It saves a subprocess's ~10 s of importing torch/transformers, and the builtin
    models come from the session's loaded ones (the drafter as a fresh deep copy each time: a pipeline
    converts it to bfloat16 and may merge an adapter into it), with one vocabulary bridge per pair of
    them. $OMNIDRAFT_HOME, the cwd, stdin, the loader and the bridge are restored after each call."""
    import copy
    from contextlib import redirect_stderr, redirect_stdout

    from omnidraft import models, runtime
    from omnidraft.cli import main

    shared = {DRAFTER, *TARGETS}
    kept: dict[int, object] = {}  # id -> tokenizer of the session's models (alive all session: ids stay theirs)
    bridges: dict[tuple, object] = {}
    real_bridge = runtime.VocabBridge

    def bridge(d_tok, t_tok, d_vocab: int, t_vocab: int):
        """One bridge per pair of the session's tokenizers (it is a pure function of them)."""
        lasting = lambda tok: kept.get(id(tok)) is tok or any(tok is t for t in models._TOKENIZERS.values())  # noqa: E731
        if not (lasting(d_tok) and lasting(t_tok)):
            return real_bridge(d_tok, t_tok, d_vocab, t_vocab)
        key = (id(d_tok), id(t_tok), d_vocab, t_vocab)
        if key not in bridges:
            bridges[key] = real_bridge(d_tok, t_tok, d_vocab, t_vocab)
        return bridges[key]

    def run(*argv: str, home: Path | None = None, stdin: str = "") -> CliRun:
        original = models.load

        def load(spec, home=None, dtype="float32", progress=True):
            if spec in shared and dtype == "float32":
                models.load = original  # real_models loads through models.load on its first call
                try:
                    model, tok = real_models(spec)
                finally:
                    models.load = load
                kept[id(tok)] = tok
                return (copy.deepcopy(model) if spec == DRAFTER else model), tok
            return original(spec, home=home, dtype=dtype, progress=progress)

        out, err = io.StringIO(), io.StringIO()
        old_env, old_stdin, old_cwd = os.environ.get("OMNIDRAFT_HOME"), sys.stdin, os.getcwd()
        os.environ["OMNIDRAFT_HOME"] = str(home or TEST_HOME)
        sys.stdin = _NoTTY(stdin)
        models.load, runtime.VocabBridge = load, bridge
        try:
            with redirect_stdout(out), redirect_stderr(err), shared_drafter_choice():
                try:
                    code = main(list(argv))
                except SystemExit as exc:  # argparse's own exit (bad options)
                    code = exc.code if isinstance(exc.code, int) else 1
        finally:
            models.load, runtime.VocabBridge = original, real_bridge
            os.chdir(old_cwd)
            sys.stdin = old_stdin
            if old_env is None:
                os.environ.pop("OMNIDRAFT_HOME", None)
            else:
                os.environ["OMNIDRAFT_HOME"] = old_env
            torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        return CliRun(code, out.getvalue(), err.getvalue())

    return run
