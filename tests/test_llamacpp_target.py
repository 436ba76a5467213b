"""The llama.cpp target on the real GGUFs: plain greedy decoding through ``score`` equals
llama-cpp-python's own greedy loop (prompts read by tinyBLAS included), batched verify rows are
bit-identical to one-token rows on the patched build set-up installs (and are not without the
patch's threshold), a rollback equals a fresh eval, and bad input is one line."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TARGETS, TEST_HOME

from omnidraft import models
from omnidraft.errors import OmnidraftError
from omnidraft.target.llamacpp import LlamaCppTarget

# Longer than the patched build's tinyBLAS threshold: read with llamafile's kernels, like llama.cpp's own.
LONG_PROMPT = ("A binary search tree keeps its keys in order: every key in a node's left subtree is smaller "
               "than the node's key and every key in its right subtree is larger. Searching, inserting and "
               "deleting therefore take time proportional to the height of the tree, which is")
PROMPTS = {
    "builtin:qwen2.5-coder-0.5b": [
        "def quicksort(arr):\n",
        "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
        "# Compute the greatest common divisor of two integers\nimport math\n\ndef gcd(a, b):",
        LONG_PROMPT,
    ],
    "builtin:gemma3-270m": [
        "The history of the Roman Empire",
        "Question: What is the boiling point of water at sea level?\nAnswer:",
        "def fibonacci(n):\n",
        LONG_PROMPT,
    ],
}
NEW_TOKENS = 64


def _tokenizer(spec: str, gguf):
    """The target's transformers tokenizer: the dequantized cache's when present (fast), else read
    from the GGUF."""
    from transformers import AutoTokenizer

    folder = models.cache_dir(models.builtin(spec), TEST_HOME)
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


class Loaded:
    def __init__(self, spec: str) -> None:
        import llama_cpp

        self.spec = spec
        self.gguf = models.gguf_path(models.builtin(spec), home=TEST_HOME, progress=False)
        self.tok = _tokenizer(spec, self.gguf)
        self.target = LlamaCppTarget(self.gguf, self.tok, n_ctx=1024)
        self._llama_cpp = llama_cpp
        self._reference = None

    @property
    def reference(self):
        """llama-cpp-python's high-level Llama on the same file, same threads and context."""
        if self._reference is None:
            low = self._llama_cpp.llama_cpp
            defaults = low.llama_model_default_params

            def same_weights_layout():  # a batch-invariant target does not repack its weights
                params = defaults()
                params.use_extra_bufts = not self.target.batch_invariant
                return params

            low.llama_model_default_params = same_weights_layout
            try:
                self._reference = self._llama_cpp.Llama(
                    str(self.gguf), n_ctx=self.target.max_context, n_batch=self.target.n_batch,
                    n_threads=self.target.n_threads, n_threads_batch=self.target.n_threads, verbose=False)
            finally:
                low.llama_model_default_params = defaults
        return self._reference

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))  # Gemma's tokenizer adds its BOS, Qwen's adds nothing


@pytest.fixture(scope="module", params=TARGETS)
def loaded(request):
    item = Loaded(request.param)
    yield item
    item.target.close()
    if item._reference is not None:
        item._reference.close()


def greedy(target: LlamaCppTarget, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(target.score(prompt + out, 0)[0].argmax()))
    return out


# --------------------------------------------------------------------------- greedy identity


@pytest.mark.real
def test_greedy_equals_llama_cpp_python(loaded):
    ref = loaded.reference
    for text in PROMPTS[loaded.spec]:
        prompt = loaded.encode(text)
        loaded.target.reset()
        ours = greedy(loaded.target, prompt, NEW_TOKENS)
        theirs = []
        for token in ref.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            theirs.append(int(token))
            if len(theirs) == NEW_TOKENS:
                break
        assert ours == theirs, f"{loaded.spec} {text!r}: diverged at {next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"


@pytest.mark.real
def test_shape_vocab_and_eos(loaded):
    t = loaded.target
    rows = t.score(loaded.encode("Hello there, how are"), 2)
    assert rows.dtype == torch.float32 and rows.shape == (3, t.vocab_size)
    assert t.vocab_size >= len(loaded.tok) - 1 and torch.isfinite(rows).all()
    expected = {"builtin:qwen2.5-coder-0.5b": {151645}, "builtin:gemma3-270m": {1, 106}}[loaded.spec]
    assert expected <= t.eos_ids  # the generation config's eos plus llama.cpp's eos / eot
    assert t.max_context == 1024


# ----------------------------------------------------------------------------- batched rows

# llama.cpp's fast CPU matmuls pick kernels by batch size (llamafile from 2 rows, repacked gemm
# from 4, tiled from 8) and the rounding differences grow through the layers: on the default build
# batched rows are *not* bit-identical to one-token rows. Seen here: max |diff| 0.55 (Qwen) and
# 1.4 (Gemma) logits, i.e. 2.5-4.5 % of the largest logit; argmax differs only at near-ties.
# A batch-invariant target (the patched build set-up installs) must match exactly.
REL_TOL = 0.08  # of the largest |logit| in the row block


def _assert_rows_match(got: torch.Tensor, want: torch.Tensor, invariant: bool) -> tuple[int, float]:
    """(argmax disagreements, max |diff|); exact when invariant, else within REL_TOL and only at near-ties."""
    diff = (got - want).abs().max().item()
    if invariant:
        assert diff == 0.0, f"batch-invariant target: max |diff| {diff}"
        return 0, diff
    assert diff <= REL_TOL * want.abs().max().item(), f"max |diff| {diff:.3f}"
    top2 = want.topk(2, dim=1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    differ = got.argmax(1) != want.argmax(1)
    assert (margin[differ] <= 2 * diff).all(), "argmax differs on a row without a near-tie"
    return int(differ.sum()), diff


@pytest.mark.real
def test_batched_rows_match_one_token_rows(loaded):
    t = loaded.target
    rows_total = flips = 0
    for text in PROMPTS[loaded.spec][:2]:
        ids = loaded.encode(text + " and then, as everyone expected, it went on")
        for m in (1, 2, 3, 6, 8):  # 2-9 rows: the multi-row kernels' groups of 4 and every remainder
            split = len(ids) - m
            t.reset()
            t.score(ids[:split], 0)
            batched = t.score(ids, m)  # one eval of m + 1 tokens
            t.reset()
            single = torch.cat([t.score(ids[:i], 0) for i in range(split, len(ids) + 1)])
            flipped, _ = _assert_rows_match(batched, single, t.batch_invariant)
            rows_total += m + 1
            flips += flipped
    assert flips <= rows_total // 4


@pytest.mark.real
def test_batch_invariance_comes_from_the_patched_build(loaded):
    from omnidraft.target import llamacpp

    assert llamacpp._HAS_LLAMAFILE and llamacpp._TINYBLAS_MIN_ROWS == llamacpp.TINYBLAS_MIN_ROWS, \
        "scripts/setup.sh installs llama.cpp with the patched llamafile"
    assert loaded.target.batch_invariant  # on by default where the build allows it
    assert loaded.target.logit_batch == llamacpp.TINYBLAS_MIN_ROWS - 1
    # the multi-row kernels, which the rows above went through, are built wherever x86 has AVX2
    avx2 = " avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    assert llamacpp._MULTI_ROW == (avx2 and platform.machine() in ("x86_64", "AMD64"))


@pytest.mark.real
def test_without_the_threshold_verify_rows_are_not_one_token_rows(loaded, tmp_path):
    """The same build with the patch's threshold off is llama.cpp as released: the target says it is
    not batch-invariant, refuses to be made so, and its batched rows really differ."""
    script = f"""
import torch
from omnidraft.errors import OmnidraftError
from omnidraft.target.llamacpp import LlamaCppTarget
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(tmp_path)!r})
t = LlamaCppTarget({str(loaded.gguf)!r}, tok, n_ctx=256)
assert not t.batch_invariant and t.logit_batch == t.n_batch
ids = list(tok.encode({PROMPTS[loaded.spec][0]!r} + " and then, as everyone expected, it went on"))
t.score(ids[:-8], 0)
batched = t.score(ids, 8)
t.reset()
single = torch.cat([t.score(ids[:i], 0) for i in range(len(ids) - 8, len(ids) + 1)])
print("DIFF", (batched - single).abs().max().item())
try:
    LlamaCppTarget({str(loaded.gguf)!r}, tok, n_ctx=256, batch_invariant=True)
except OmnidraftError as exc:
    print("REFUSED", str(exc))
"""
    loaded.tok.save_pretrained(tmp_path)
    env = {**os.environ, "GGML_LLAMAFILE_MIN_ROWS": "0"}
    env.pop("GGML_CPU_TILED_MM", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    diff = float(run.stdout.split("DIFF ")[1].split()[0])
    assert diff > 0.0
    assert "REFUSED" in run.stdout and "patched llamafile" in run.stdout


@pytest.mark.real
def test_a_verify_longer_than_the_logit_batch_is_still_one_token_rows(loaded):
    t = loaded.target
    ids = loaded.encode(LONG_PROMPT + " " + LONG_PROMPT)
    m = t.logit_batch + 9  # the proposals take two evals
    split = len(ids) - m
    t.reset()
    t.score(ids[:split], 0)
    batched = t.score(ids, m)
    t.reset()
    t.score(ids[:split], 0)
    single = torch.cat([t.score(ids[:i], 0) for i in range(split, len(ids) + 1)])
    assert batched.shape == single.shape
    assert (batched - single).abs().max().item() == 0.0


@pytest.mark.real
def test_long_prompt_is_chunked(loaded):
    """A prompt longer than n_batch is read in chunks. Chunks of another size take other kernels
    (tinyBLAS from its threshold on), so the rows agree up to near-ties, not bit for bit."""
    small = LlamaCppTarget(loaded.gguf, loaded.tok, n_ctx=256, n_batch=16)
    try:
        ids = loaded.encode("The quick brown fox jumps over the lazy dog. " * 8)[:100]
        got = small.score(ids, 3)
        assert small.cached_ids == ids
        loaded.target.reset()
        want = loaded.target.score(ids, 3)
        assert got.shape == want.shape
        _assert_rows_match(got, want, invariant=False)
    finally:
        small.close()


@pytest.mark.real
def test_trim_drops_what_a_request_cached_past_its_end(loaded):
    t = loaded.target
    ids = loaded.encode(PROMPTS[loaded.spec][0])
    t.reset()
    t.score(ids + [ids[-1]] * 4, 4)
    t.trim(len(ids) - 1)
    assert t.cached_ids == ids[:-1]
    t.trim(len(ids) + 5)  # nothing past the end: unchanged
    assert t.cached_ids == ids[:-1]


# --------------------------------------------------------------------------------- rollback


@pytest.mark.real
def test_rollback_then_eval_equals_fresh_eval(loaded):
    t = loaded.target
    ids = loaded.encode("The quick brown fox jumps over the lazy dog. " * 70)
    prefix = ids[:560] if "gemma" in loaded.spec else ids[:120]  # past Gemma-3's 512-token sliding window
    rejected = list(loaded.tok.encode(" zebra umbrella lantern", add_special_tokens=False))
    accepted = list(loaded.tok.encode(" and then it slept", add_special_tokens=False))
    m = len(accepted)

    t.reset()
    t.score(prefix, 0)
    t.score(prefix + rejected, len(rejected))
    got = t.score(prefix + accepted, m)  # rolls back the rejected tokens, then one eval
    assert t.cached_ids == prefix + accepted

    t.reset()
    t.score(prefix, 0)
    fresh = t.score(prefix + accepted, m)  # the same evals, no rollback
    torch.testing.assert_close(got, fresh, rtol=0, atol=0)

    again = t.score(prefix + accepted, m)  # everything cached: the last m + 1 are recomputed
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)
    t.score(prefix + accepted[:2], 0)  # a shorter list: pure rollback
    assert t.cached_ids == prefix + accepted[:2]


@pytest.mark.real
def test_measure_costs_leaves_a_clean_state(loaded):
    t = loaded.target
    prompt = loaded.encode(PROMPTS[loaded.spec][0])
    t.reset()
    before = t.score(prompt, 0)
    costs = t.measure_costs(ks=(1, 2, 4), context=32, repeats=1, warmup=0)
    assert sorted(costs) == [1, 2, 4] and all(v > 0 for v in costs.values())
    assert t.cached_ids == []
    torch.testing.assert_close(t.score(prompt, 0), before, rtol=0, atol=0)


# -------------------------------------------------------------------------------- bad input


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


def test_missing_file(tmp_path):
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(tmp_path / "nope.gguf", None)
    assert "no GGUF file" in _one_line(exc)


def test_garbage_file(tmp_path, capfd):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a model\n" * 100)
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(bad, None)
    assert "not a GGUF file" in _one_line(exc)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # the magic, then nonsense
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(junk, None)
    assert "truncated or corrupt" in _one_line(exc)
    assert capfd.readouterr().err == ""  # llama.cpp's own logging stays silent


@pytest.mark.real
def test_truncated_file(tmp_path, capfd):
    real = models.gguf_path(models.builtin(TARGETS[1]), home=TEST_HOME, progress=False)
    cut = tmp_path / "truncated.gguf"
    with open(real, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(real.stat().st_size // 3))
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(cut, None)
    assert "truncated or corrupt" in _one_line(exc)
    assert capfd.readouterr().err == ""


def test_unknown_architecture(tmp_path, capfd):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "alien.gguf"
    writer = GGUFWriter(str(path), "alienformer")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(path, None)
    message = _one_line(exc)
    assert "unknown model architecture" in message and "alienformer" in message
    assert capfd.readouterr().err == ""


@pytest.mark.real
def test_context_overflow_is_refused_before_any_eval(loaded):
    small = LlamaCppTarget(loaded.gguf, loaded.tok, n_ctx=32)
    try:
        ids = loaded.encode("word " * 40)[:30]
        small.score(ids, 0)
        with pytest.raises(OmnidraftError) as exc:
            small.score(ids + [ids[-1]] * 3, 2)
        assert "do not fit" in _one_line(exc)
        assert small.cached_ids == ids  # nothing was evaluated or dropped
    finally:
        small.close()
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(loaded.gguf, loaded.tok, n_ctx=10**7)
    assert "trained" in _one_line(exc)


@pytest.mark.real
def test_token_outside_the_vocabulary(loaded):
    t = loaded.target
    ids = loaded.encode("Hello")
    t.reset()
    with pytest.raises(OmnidraftError) as exc:
        t.score(ids + [t.vocab_size + 5], 0)
    assert "outside the target's vocabulary" in _one_line(exc)
    assert t.cached_ids == ids[: len(t.cached_ids)]  # the cache still follows a prefix of the ids
    torch.testing.assert_close(t.score(ids, 0), _fresh_rows(loaded, ids), rtol=0, atol=0)


def _fresh_rows(loaded, ids):
    loaded.target.reset()
    return loaded.target.score(ids, 0)


def test_llama_cpp_python_missing(monkeypatch, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(OmnidraftError) as exc:
        LlamaCppTarget(path, None)
    assert "pip install llama-cpp-python" in _one_line(exc)
