"""Where greedy drafts fail on a prompt set: teacher-forced along the target's own greedy output.

    .venv/bin/python scripts/diagnose_drafts.py --prompts zh --offset 100 --n 4 --tokens 48 --k 4

For each position of the target's output (llama.cpp target, the drafter's GGUF), the drafter drafts
k tokens greedily from the drafter spelling of the context, the bridge re-tokenizes them as greedy
mode does (``VocabBridge.forward_text``), and the proposals are compared with what the target
emitted. Prints acceptance per proposal; at each first mismatch, whether it was the draft's last
proposal and whether the proposal was a proper byte prefix of the target's token (a word cut by the
draft's end); the share of drafted bytes that became proposals; and drafts with no proposal.
No timing: counts only (docs/online-distillation.md, "The bridge on Chinese").
"""

from __future__ import annotations

import argparse
import collections

from omnidraft.data import PROMPTS_HELP, load_prompts
from omnidraft.drafter.policy import FixedLength, Sampler
from omnidraft.runtime import encode_prompt, load_pipeline
from omnidraft.vocab.translate import TextTranslator


def target_greedy(target, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """The target's own greedy continuation, one token at a time."""
    out, ctx = [], list(ids)
    for _ in range(n):
        token = int(target.score(ctx, 0)[0].argmax())
        out.append(token)
        ctx.append(token)
        if token in eos:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="zh", help=PROMPTS_HELP)
    p.add_argument("--offset", type=int, default=100)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48, help="target tokens per prompt")
    p.add_argument("--k", type=int, default=4, help="drafter tokens per draft")
    p.add_argument("--target", default="builtin:qwen2.5-coder-0.5b")
    p.add_argument("--drafter", default="builtin:smollm2-135m")
    args = p.parse_args()

    pipe = load_pipeline(args.target, args.drafter, engine="llamacpp", adapter="none", drafter_backend="llamacpp")
    dec, tok = pipe.decoder, pipe.target_tokenizer
    bridge = dec.bridge
    policy = TextTranslator(bridge).draft_policy(Sampler(), FixedLength(), len(bridge.d2t_list))
    st: collections.Counter = collections.Counter()
    for rec in load_prompts(args.prompts, args.n, args.offset):
        ids = encode_prompt(tok, rec.text, rec.chat)
        out = target_greedy(dec.target, ids, args.tokens, set(dec.target.eos_ids))
        for i in range(len(out) - 1):
            context = ids + out[:i]
            drafted = dec.drafter.draft(bridge.target_to_drafter(context), args.k, policy).tokens
            props = bridge.forward_text(context, drafted).target_ids
            st["drafts"] += 1
            st["drafted_bytes"] += sum(len(bridge.drafter_bytes(d) or b"") for d in drafted)
            st["proposed_bytes"] += sum(len(bridge.target_bytes(t) or b"") for t in props)
            st["proposals"] += len(props)
            st["empty"] += not props
            a = 0
            while a < len(props) and i + a < len(out) and props[a] == out[i + a]:
                a += 1
            st["accepted"] += a
            if a < len(props) and i + a < len(out):
                said, meant = bridge.target_bytes(props[a]) or b"", bridge.target_bytes(out[i + a]) or b""
                st["mismatches"] += 1
                st["at_last"] += a == len(props) - 1
                st["cut_word"] += meant.startswith(said) and len(said) < len(meant)
    print(f"{args.prompts}: {st['drafts']} drafts, acceptance per proposal {st['accepted'] / max(st['proposals'], 1):.2f}, "
          f"{st['proposals'] / st['drafts']:.2f} proposals per draft; drafted bytes proposed "
          f"{st['proposed_bytes'] / max(st['drafted_bytes'], 1):.0%}; drafts with no proposal {st['empty'] / st['drafts']:.0%}; "
          f"of the mismatches, at the draft's last proposal {st['at_last'] / max(st['mismatches'], 1):.0%}, "
          f"a word cut by the draft's end {st['cut_word'] / max(st['mismatches'], 1):.0%}")


if __name__ == "__main__":
    main()
