"""Quickstart: SmolLM2-135M drafts for Qwen2.5-Coder-0.5B and Gemma-3-270M (different tokenizers).

For each target, engine and prompt it decodes twice — the target alone, then with the drafter
under the cost-aware draft policy — checks that the outputs are token for token identical, and
prints both speeds and what the policy chose:

- on llama.cpp (the builtin GGUF targets' default engine) a verify of k proposals costs about
  1 + k/2.5 steps on a CPU, so the drafter rarely pays and the policy mostly decodes plainly; what
  pays is text the target repeats (the code-editing prompt), proposed by prompt lookup for free. Where nothing
  repeats, expect about 1.0x: a draft tried now and then to see whether it pays (each failed try
  makes the next one rarer);
- on torch (memory-bound, like a GPU or a server) a verify of a few tokens costs about one step,
  and the drafter pays on every prompt.

The drafter runs on whatever this machine runs it fastest (``--drafter-backend auto``: its GGUF on
omnidraft's native forward or on llama.cpp, eager torch, or an ONNX export, measured once per home
and CPU); the header of each case says which, and the policy line its cost per token inside the loop.

Speeds are medians of ``TIMED_RUNS`` runs of each prompt (more for the llama.cpp cases, whose runs
take about two seconds), the target alone and with the drafter in turn, in the order A B B A A B …
(a two-second run on a shared machine varies by 10% from one run to the next, and a host whose speed
drifts during the demo would otherwise favour whichever arm runs first). Every run reads
its prompt afresh: the two share the target engine and the drafter, whose caches would otherwise hand
the second of them the prompt already read. The output shown
is the first run's; the later runs draft without the lookup history (they would copy the first run's
answer) and with a copy of the draft policy (so the demo's decoder learns as if each prompt ran once).

Every output is also remembered (the lookup history under ./cache_store), so a second run of this
demo drafts much of each answer from the first one's: that is the product getting faster with use.
The first run unpacks the models once under ./models (the torch target is dequantized from its
GGUF, about a minute), picks the drafter's backend (half a minute) and measures this machine's
verify and drafter costs once per pair; later runs start in seconds.
"""

from __future__ import annotations

import copy
import statistics
import sys

from omnidraft.bench.runner import fresh
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline

DRAFTER = "builtin:smollm2-135m"
PRIME = ("Write a Python function that checks whether a number is prime.", True)
QUICKSORT = ("def quicksort(items):\n", False)
EDIT = ("Rename `xs` to `numbers` in this function and reply with the whole function:\n\n```python\n"
        "def mean_and_spread(xs):\n"
        "    \"\"\"Return the mean of xs and the gap between its largest and smallest value.\"\"\"\n"
        "    if not xs:\n"
        "        raise ValueError(\"xs is empty\")\n"
        "    total = 0\n"
        "    for x in xs:\n"
        "        total += x\n"
        "    return total / len(xs), max(xs) - min(xs)\n```", True)
CASES = [  # (target, engine, prompts)
    ("builtin:qwen2.5-coder-0.5b", "llamacpp", [PRIME, QUICKSORT, EDIT]),
    ("builtin:gemma3-270m", "llamacpp", [("The three most important inventions of the 20th century are", False)]),
    ("builtin:qwen2.5-coder-0.5b", "torch", [("def binary_search(items, target):\n", False),
                                             ("Give three tips for staying focused while studying.", True)]),
]
MAX_NEW_TOKENS = 96
TIMED_RUNS = {"llamacpp": 7, "torch": 3}  # runs per prompt and arm, by engine (a llama.cpp run: ~2 s)


def run_case(target_spec: str, engine: str, prompts: list[tuple[str, bool]], config: DecodeConfig) -> bool:
    """Decode each prompt with the target alone and with the drafter; True if every output matched."""
    pipe = load_pipeline(target_spec, DRAFTER, engine=engine)
    alone = SpeculativeDecoder(pipe.decoder.target)  # same target engine, no drafter
    print(f"\n=== {DRAFTER} (on {pipe.drafter_backend}) -> {target_spec} on {pipe.engine} "
          f"(vocabulary intersection: {pipe.decoder.bridge.intersection_size:,} tokens)")
    alone.generate(encode_prompt(pipe.target_tokenizer, "Hello", chat=False), DecodeConfig(max_new_tokens=4))  # warm-up
    identical = True
    for text, chat in prompts:
        ids = encode_prompt(pipe.target_tokenizer, text, chat=chat)
        base = _cold(alone).generate(ids, config)
        spec = _cold(pipe.decoder).generate(ids, config)
        same = spec.token_ids == base.token_ids
        identical &= same
        s = spec.stats
        alone_speeds, spec_speeds = [base.stats.tokens_per_s], [s.tokens_per_s]
        again = _rerun_decoder(pipe.decoder)
        for run in range(1, TIMED_RUNS[pipe.engine]):
            for arm in ("spec", "alone") if run % 2 else ("alone", "spec"):  # ABBA: a drifting host favours neither
                if arm == "alone":
                    alone_speeds.append(_cold(alone).generate(ids, config).stats.tokens_per_s)
                    continue
                rerun = _cold(again).generate(ids, config)
                identical &= rerun.token_ids == base.token_ids
                spec_speeds.append(rerun.stats.tokens_per_s)
        alone_speed, spec_speed = statistics.median(alone_speeds), statistics.median(spec_speeds)
        print(f"\n--- prompt: {text.splitlines()[0]!r}{' (chat)' if chat else ''}")
        print(spec.text.strip())
        measured = f" (after measuring this machine's costs once: {s.measure_s:.1f} s)" if s.measure_s else ""
        print(f"[identical to the target alone: {same} | target alone {alone_speed:.1f} tok/s, "
              f"with the drafter {spec_speed:.1f} tok/s = {spec_speed / alone_speed:.2f}x{measured} | "
              f"drafted in {s.steps - s.plain_steps - s.lookup_steps} of {s.steps} steps, "
              f"prompt lookup in {s.lookup_steps}{_earlier(s.history_steps, s.tokens_per_s / alone_speed)} | "
              f"{s.tokens_per_target_forward:.2f} tokens per target forward]")
    policy = pipe.decoder.cost_policy
    print(f"policy: target verify ms by proposals {policy.cost_table_ms()}, drafter "
          f"{policy.draft_cost.seconds_per_token * 1000:.1f} ms/token")
    return identical


def _rerun_decoder(decoder: SpeculativeDecoder) -> SpeculativeDecoder:
    """For the timing reruns: the same target, drafter and n-gram cache, a copy of the cost policy as
    it stands (kept in memory only, so the demo's own decoder learns as if each prompt ran once), and
    no lookup history (a rerun would otherwise draft the whole answer from the first run)."""
    twin = SpeculativeDecoder(decoder.target, decoder.drafter, decoder.bridge, decoder.ngrams)
    twin.cost_policy = copy.deepcopy(decoder.cost_policy)
    twin.cost_policy.path = None
    return twin


def _cold(decoder: SpeculativeDecoder) -> SpeculativeDecoder:
    """``decoder`` with its engines' caches emptied (``bench.runner.fresh``): the run reads its prompt."""
    fresh(decoder)
    return decoder


def _earlier(history_steps: int, speedup: float) -> str:
    """Lookup drafts from the target's earlier outputs: a second run of this demo is a repeated session.
    The timed reruns draft without them, so the first run's own speedup is shown beside them."""
    return f" ({history_steps} from earlier outputs: {speedup:.2f}x in that run)" if history_steps else ""


def main() -> int:
    config = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS)
    identical = all([run_case(target, engine, prompts, config) for target, engine, prompts in CASES])
    print("\nall outputs identical to the target's own greedy decode:", identical)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
