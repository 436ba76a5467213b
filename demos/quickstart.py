"""Quickstart: SmolLM2-135M drafts for Qwen2.5-Coder-0.5B and Gemma-3-270M (different tokenizers).

For each target and prompt it decodes twice on the default engine (llama.cpp for the builtin GGUF
targets) — the target alone, then with the drafter under the cost-aware draft policy — checks that
the outputs are token for token identical, and prints both speeds and what the policy chose. On
llama.cpp's compute-bound CPU kernels a drafter that costs more per token than a target step can
never pay, and the policy then decodes plainly (never slower); on a memory-bound target
(`--engine torch`, a GPU, a remote server) the same drafter pays (see docs/performance.md).
First run: the tokenizers and the drafter are unpacked once under ./models; later runs start in seconds.
"""

from __future__ import annotations

import sys

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline

DRAFTER = "builtin:smollm2-135m"
CASES = {
    "builtin:qwen2.5-coder-0.5b": [("Write a Python function that checks whether a number is prime.", True),
                                   ("def quicksort(items):\n", False)],
    "builtin:gemma3-270m": [("The three most important inventions of the 20th century are", False)],
}
MAX_NEW_TOKENS = 64


def main() -> int:
    config = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS)
    all_identical = True
    for target_spec, prompts in CASES.items():
        pipe = load_pipeline(target_spec, DRAFTER)
        alone = SpeculativeDecoder(pipe.decoder.target)  # same target engine, no drafter
        print(f"\n=== {DRAFTER} -> {target_spec} on {pipe.engine} "
              f"(vocabulary intersection: {pipe.decoder.bridge.intersection_size:,} tokens)")
        for text, chat in prompts:
            ids = encode_prompt(pipe.target_tokenizer, text, chat=chat)
            base = alone.generate(ids, config)
            spec = pipe.decoder.generate(ids, config)
            same = spec.token_ids == base.token_ids
            all_identical &= same
            s = spec.stats
            print(f"\n--- prompt: {text!r}{' (chat)' if chat else ''}")
            print(spec.text.strip())
            print(f"[identical to the target alone: {same} | target alone {base.stats.tokens_per_s:.1f} tok/s, "
                  f"with the drafter {s.tokens_per_s:.1f} tok/s | drafted in {s.steps - s.plain_steps} of {s.steps} "
                  f"steps | {s.tokens_per_target_forward:.2f} tokens per target forward]")
        budget = pipe.decoder.budget
        print(f"policy: target verify ms by proposals {budget.cost_table_ms()}, drafter "
              f"{budget.draft.seconds_per_token * 1000:.1f} ms/token")
    print("\nall outputs identical to the target's own greedy decode:", all_identical)
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
