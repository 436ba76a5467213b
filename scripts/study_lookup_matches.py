"""How often a prompt-lookup draft is right, by the length of the match it came from.

Decodes prompts of several sets greedily with the target alone, then replays each output: at every
position, the lookup over prompt + output so far (``LookupIndex`` up to ``--max-n``) proposes the
continuation of its longest earlier match, and the replay counts how many of its tokens the target
actually wrote next. Prints, per match length n, how often a match of that length occurs and its
per-position acceptance: the evidence behind the lookup statistics' prior by match length.

    python scripts/study_lookup_matches.py --target builtin:qwen2.5-coder-0.5b --home /tmp/h
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from omnidraft.config import DecodeConfig
from omnidraft.data import load_prompts
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline
from omnidraft.sources.lookup import LookupIndex

SETS = ("humaneval", "alpaca", "xsum", "codeedit")
POSITIONS = 8  # acceptance is counted for the first POSITIONS tokens of each proposal


def decode_outputs(target: str, engine: str, per_set: int, max_new: int, home: str | None) -> list[tuple[str, list[int], list[int]]]:
    """(set, prompt ids, the target's greedy output ids) for ``per_set`` prompts of each set."""
    pipe = load_pipeline(target, None, engine=engine, home=home)
    alone = SpeculativeDecoder(pipe.decoder.target)
    out = []
    for name in SETS:
        for record in load_prompts(name, per_set, home=home):
            ids = encode_prompt(pipe.target_tokenizer, record.text, chat=record.chat)
            result = alone.generate(ids, DecodeConfig(max_new_tokens=max_new))
            out.append((name, ids, list(result.token_ids)))
            print(f"{record.id}: {len(result.token_ids)} tokens", flush=True)
    return out


def replay(prompt: list[int], output: list[int], max_n: int, counts: dict) -> None:
    """Count, for each position of ``output``, the lookup's proposal against what followed."""
    index = LookupIndex(max_n=max_n)
    index.reset(prompt)
    for t in range(len(output)):
        proposal, n = index.propose(POSITIONS)
        if proposal:
            row = counts[n]
            row["matches"] += 1
            for i, tok in enumerate(proposal):
                if t + i >= len(output):
                    break
                row["tried"][i] += 1
                if tok != output[t + i]:
                    break
                row["accepted"][i] += 1
        counts["positions"]["matches"] += 1
        index.extend(output[t:t + 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="builtin:qwen2.5-coder-0.5b")
    ap.add_argument("--engine", default="llamacpp")
    ap.add_argument("--per-set", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-n", type=int, default=12)
    ap.add_argument("--home", default=None)
    ap.add_argument("--json", default=None, help="also write the counts here")
    args = ap.parse_args()
    outputs = decode_outputs(args.target, args.engine, args.per_set, args.max_new_tokens, args.home)
    by_set: dict[str, dict] = {}
    for name, prompt, output in outputs:
        counts = by_set.setdefault(name, defaultdict(lambda: {"matches": 0, "tried": [0] * POSITIONS,
                                                              "accepted": [0] * POSITIONS}))
        replay(prompt, output, args.max_n, counts)
    print(f"\n{args.target} on {args.engine}: per match length n, matches / positions, and a_i = P(token i "
          f"right | tokens before it right)")
    for name, counts in by_set.items():
        total = counts["positions"]["matches"]
        print(f"\n{name} ({total} positions)")
        for n in sorted(k for k in counts if k != "positions"):
            row = counts[n]
            rates = [a / t if t else float("nan") for a, t in zip(row["accepted"], row["tried"])]
            print(f"  n={n:2d}  {row['matches']:5d} ({row['matches'] / total:5.1%})  "
                  + " ".join(f"{r:.2f}" for r in rates))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({name: {str(k): v for k, v in c.items()} for name, c in by_set.items()}, f, indent=1)


if __name__ == "__main__":
    main()
