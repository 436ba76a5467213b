"""Speculative decoding with the target on llama.cpp, end to end on the real models.

Greedy speculative output must equal plain decoding on the same engine token for token, with no
allowance for ties: set-up installs llama.cpp with a patched llamafile, so every proposal row of a
verify takes the same arithmetic as a one-token eval while prompts are read as llama.cpp reads them
(``LlamaCppTarget.batch_invariant``; the rows are checked bit for bit in test_llamacpp_target), and
a request leaves the KV cache holding what the target alone would, so the next turn's prompt is read
in the same evals. Drafting is forced here (a fixed draft length, and
chats whose later turns repeat earlier ones, so that prompt lookup drafts long runs) besides the
default cost policy. The CLI runs the builtin targets on llama.cpp by default and refuses a bad GGUF
in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import DRAFTER, TARGETS, TEST_HOME

from omnidraft import models
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_messages, encode_prompt, make_drafter
from omnidraft.target.llamacpp import LlamaCppTarget
from omnidraft.vocab.bridge import VocabBridge

PROMPTS = [("Write a Python function that merges two sorted lists.", True), ("def is_prime(n):\n", False),
           ("The three primary colours are", False)]
# Chats of three turns where each request builds on the target's previous reply: the later turns
# repeat code and prose from the conversation, which prompt lookup drafts in long runs.
CHATS = [["Write a Python function that returns the n-th Fibonacci number.",
          "Rename the function to fib and add a docstring.", "Now make it iterative, keeping the docstring."],
         ["Give three tips for writing clear emails.", "Repeat the tips, shorter.", "Turn them into a numbered list."]]
NEW_TOKENS = 48


@pytest.fixture(scope="module", params=TARGETS)
def llama_pair(request, real_models):
    spec = request.param
    d_model, d_tok = real_models(DRAFTER)
    tok = models.load_tokenizer(spec, TEST_HOME, progress=False)
    target = LlamaCppTarget(models.gguf_of(spec, TEST_HOME, progress=False), tok, n_ctx=1024)
    bridge = VocabBridge(d_tok, tok, int(d_model.get_output_embeddings().weight.shape[0]), target.vocab_size)
    yield spec, target, SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    target.close()


@pytest.mark.real
@pytest.mark.parametrize("text,chat", PROMPTS)
def test_drafting_on_llama_cpp_keeps_its_greedy_output(llama_pair, text, chat):
    spec, target, decoder = llama_pair
    assert target.batch_invariant, "scripts/setup.sh builds llama.cpp with the patched llamafile: verify rows are one-token rows"
    ids = encode_prompt(target.tokenizer, text, chat=chat and target.tokenizer.chat_template is not None)
    plain = SpeculativeDecoder(target).generate(ids, DecodeConfig(max_new_tokens=NEW_TOKENS)).token_ids
    forced = DecodeConfig(max_new_tokens=NEW_TOKENS, draft_len=4, draft_stop="fixed")
    got = decoder.generate(ids, forced).token_ids
    assert decoder.stats.proposed_tokens > 0 and decoder.stats.target_forwards < len(got)
    assert got == plain, f"{spec} {text[:20]!r}: diverged at token {_first_difference(got, plain)}"


@pytest.mark.real
@pytest.mark.parametrize("turns", CHATS, ids=["code", "prose"])
def test_chats_of_several_turns_keep_the_greedy_output(llama_pair, turns):
    """Each turn's reply, drafted with the default policy (lookup on) and with forced drafts, is
    the target's own; the conversation carries the target's plain replies forward."""
    spec, target, decoder = llama_pair
    alone, messages, lookup_steps = SpeculativeDecoder(target), [], 0
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        ids = encode_messages(target.tokenizer, messages)
        plain = alone.generate(ids, DecodeConfig(max_new_tokens=NEW_TOKENS)).token_ids
        for config in (DecodeConfig(max_new_tokens=NEW_TOKENS),
                       DecodeConfig(max_new_tokens=NEW_TOKENS, draft_len=4, draft_stop="fixed")):
            got = decoder.generate(ids, config).token_ids
            lookup_steps += decoder.stats.lookup_steps
            assert got == plain, f"{spec} turn {turn}: diverged at token {_first_difference(got, plain)}"
            # what the target alone would hold: the next turn's prompt is read in the same evals
            assert target.cached_ids == ids + got[:-1]
        messages.append({"role": "assistant", "content": target.tokenizer.decode(plain, skip_special_tokens=True)})
    assert lookup_steps > 0  # the later turns were drafted from the conversation


def _first_difference(got: list[int], plain: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), min(len(got), len(plain)))


@pytest.mark.real
def test_a_reply_that_ends_early_leaves_the_cache_as_the_target_alone_would(llama_pair):
    """A verify caches its proposals; when the reply ends at an end-of-sequence token among them, the
    decoder trims the cache back to what the target alone holds (all but the last token), so the
    next turn reads its prompt from the same position, in the same evals."""
    spec, target, decoder = llama_pair
    ids = encode_messages(target.tokenizer, [{"role": "user", "content": "Is water wet? Answer with one word."}])
    newline = target.tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    eos_ids = target.eos_ids
    target.eos_ids = eos_ids | set(newline)  # Gemma-3-270M (a base model) ends a line, never its turn
    try:
        target.reset()
        plain = SpeculativeDecoder(target).generate(ids, DecodeConfig(max_new_tokens=NEW_TOKENS)).token_ids
        assert plain[-1] in target.eos_ids and len(plain) < NEW_TOKENS  # the reply ends by itself
        assert target.cached_ids == ids + plain[:-1]
        target.reset()
        got = decoder.generate(ids, DecodeConfig(max_new_tokens=NEW_TOKENS, draft_len=8, draft_stop="fixed")).token_ids
    finally:
        target.eos_ids = eos_ids
    assert got == plain and decoder.stats.proposed_tokens > 0
    assert target.cached_ids == ids + plain[:-1]


@pytest.mark.real
def test_the_cost_policy_does_not_draft_at_a_loss_on_llama_cpp(llama_pair, monkeypatch):
    """The default policy measures both costs and keeps the target's output. Whether drafting pays
    depends on the machine (a bf16 drafter on AMX tiles can be cheaper than a llama.cpp step), so
    the test holds the policy to its own estimates as they stood at each choice (they move with every
    timed step): the drafter is never chosen while it costs more per token than a plain step."""
    spec, target, decoder = llama_pair
    ids = encode_prompt(target.tokenizer, "def fib(n):\n")
    config = DecodeConfig(max_new_tokens=24)
    policy = decoder.cost_policy
    choose, drafter_chosen = policy.choose, []

    def recording(offers):
        chosen, k = choose(offers)
        if chosen >= 0 and k and not offers[chosen][1]:
            drafter_chosen.append((policy.draft_cost.seconds_per_token, policy._capped_verify()(0)))
        return chosen, k

    monkeypatch.setattr(policy, "choose", recording)
    plain = SpeculativeDecoder(target).generate(ids, config).token_ids
    got = decoder.generate(ids, config).token_ids
    assert got == plain
    assert policy.measured and policy.draft_cost.seconds_per_token > 0 and policy.verify_costs(0) > 0
    assert all(d <= v0 for d, v0 in drafter_chosen), drafter_chosen
    assert drafter_chosen or decoder.stats.drafted_tokens == 0  # what the drafter drafted, it was chosen for here


def _cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMNIDRAFT_HOME=str(TEST_HOME))
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "omnidraft", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.real
def test_generate_runs_builtin_targets_on_llama_cpp_by_default(cli):
    """`generate` with no --engine (the CLI in this process, the session's models)."""
    common = ["generate", "--prompt", "def add(a, b):\n", "--max-new-tokens", "16"]
    spec = cli(*common)
    alone = cli(*common, "--drafter", "none")
    assert spec.returncode == 0 and alone.returncode == 0, spec.stderr + alone.stderr
    assert "(llamacpp)" in spec.stderr and spec.stdout == alone.stdout


def test_a_bad_gguf_is_one_line(tmp_path):
    from test_cli import assert_one_line_error

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2048))
    assert_one_line_error(_cli("generate", "--prompt", "hi", "--json", "--drafter", "none", "--target", str(bad)), "broken.gguf")
    junk = tmp_path / "notes.gguf"
    junk.write_text("not a model")
    assert_one_line_error(_cli("generate", "--prompt", "hi", "--json", "--drafter", "none", "--engine", "llamacpp",
                               "--target", str(junk)), "not a GGUF file")


def test_missing_llama_cpp_python_names_the_install():
    from test_cli import assert_one_line_error

    code = ("import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'llama_cpp' or name.startswith('llama_cpp.'):\n"
            "            raise ImportError('blocked for this test')\n"
            "sys.meta_path.insert(0, Block())\nfrom omnidraft.cli import main\nsys.exit(main(sys.argv[1:]))")
    proc = _cli("generate", "--prompt", "hi", "--drafter", "none", "--engine", "llamacpp", "--json", code=code)
    assert_one_line_error(proc, "pip install llama-cpp-python")


@pytest.mark.real
def test_the_bench_baseline_is_llama_cpp_python_decoding_the_same_weights(llama_pair):
    """The bench's ``llamacpp`` mode (``Llama.generate``, what a CPU user already has) loads the weights
    as the target does, so it decodes what the target alone decodes: with the weights repacked (the
    library's default) this HumanEval prompt diverged at its 43rd token on a Zen 4 host."""
    from omnidraft.bench.runner import llama_native_mode
    from omnidraft.data import load_prompts

    spec, target, _ = llama_pair
    record = load_prompts("humaneval", n=1, offset=2, home=TEST_HOME)[0]
    ids = encode_prompt(target.tokenizer, record.text, chat=record.chat)
    native = llama_native_mode(target, NEW_TOKENS)(ids).token_ids
    plain = SpeculativeDecoder(target).generate(ids, DecodeConfig(max_new_tokens=NEW_TOKENS)).token_ids
    assert native == plain, f"{spec}: diverged at token {_first_difference(native, plain)}"
