"""Quickstart: SmolLM2-135M drafts for Qwen2.5-Coder-0.5B and Gemma-3-270M (different tokenizers).

For each target and prompt it decodes twice on the same engine — the target alone, then with the
drafter (greedy, lossless) — checks the outputs are token-for-token identical, and prints the
acceptance rate, tokens per target forward and the speedup ratio. First run: the models are
dequantized once and cached under ./models (about two minutes); later runs load in seconds.
"""

from __future__ import annotations

import sys

import torch

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
    torch.manual_seed(0)
    config = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS, verify="greedy", draft_len=5)
    all_identical = True
    for target_spec, prompts in CASES.items():
        pipe = load_pipeline(target_spec, DRAFTER)
        alone = SpeculativeDecoder(pipe.decoder.target)  # same target engine, no drafter
        print(f"\n=== {DRAFTER} -> {target_spec}  (vocabulary intersection: {pipe.decoder.bridge.intersection_size:,} tokens)")
        for text, chat in prompts:
            ids = encode_prompt(pipe.target_tokenizer, text, chat=chat)
            base = alone.generate(ids, config)
            spec = pipe.decoder.generate(ids, config)
            same = spec.token_ids == base.token_ids
            all_identical &= same
            s = spec.stats
            print(f"\n--- prompt: {text!r}{' (chat)' if chat else ''}")
            print(spec.text.strip())
            print(f"[identical to target alone: {same} | acceptance {s.acceptance_rate:.2f} | "
                  f"{s.tokens_per_target_forward:.2f} tokens/target forward | speedup {base.stats.wall_s / s.wall_s:.2f}x]")
    print("\nall outputs identical to the target's own greedy decode:", all_identical)
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
