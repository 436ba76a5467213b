"""Multi-turn prompt sets for the bench: every turn of a chat becomes one prompt.

A record with ``followups`` (the ``codeedit`` set, or a user's jsonl) is a conversation: the first
message, then later user turns. Turn k's prompt is the chat so far — every earlier user message
and the target's own greedy reply to it — rendered with the target's chat template, exactly what
``omnidraft chat`` sends at that turn. The replies are made once, before any timing, by the target
alone on the bench's engine; since greedy speculative decoding is lossless, they are what every
greedy mode would have answered, so all modes are timed on the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from omnidraft.config import DecodeConfig
from omnidraft.data import PromptRecord
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_messages, encode_prompt


def expand_turns(target, records: Sequence[PromptRecord], config: DecodeConfig,
                 progress: bool = True) -> tuple[list[list[int]], list[int]]:
    """(prompt ids, turn number from 1) for every turn of every record, in order.

    ``target``: the engine that writes the replies of the earlier turns (greedy, ``config``'s
    token budget, no drafting)."""
    from tqdm.auto import tqdm

    tokenizer = target.tokenizer
    prompts: list[list[int]] = []
    turns: list[int] = []
    replies_needed = sum(len(r.followups) for r in records)
    bar = tqdm(total=replies_needed, desc="writing earlier turns", unit="reply",
               disable=not progress or replies_needed == 0)
    plain = SpeculativeDecoder(target)
    greedy = replace(config, verify="greedy", temperature=0.0, lookup=False)
    for record in records:
        if not record.followups:
            prompts.append(encode_prompt(tokenizer, record.text, chat=record.chat))
            turns.append(1)
            continue
        messages = [{"role": "user", "content": record.text}]
        for turn, followup in enumerate((*record.followups, None), start=1):
            ids = encode_messages(tokenizer, messages)
            prompts.append(ids)
            turns.append(turn)
            if followup is None:
                break
            target.reset()
            reply = plain.generate(ids, greedy).text
            bar.update(1)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": followup}]
    bar.close()
    target.reset()
    return prompts, turns
