"""The bench's multi-turn sets and its repeated-session mode, on the tiny pair."""

from __future__ import annotations

from tiny import tiny_pair

from omnidraft.bench.conversations import expand_turns
from omnidraft.bench.report import turn_table
from omnidraft.bench.runner import repeat_mode, scratch_history
from omnidraft.config import DecodeConfig
from omnidraft.data import PromptRecord
from omnidraft.decode import SpeculativeDecoder
from omnidraft.ngram import NgramTrie
from omnidraft.runtime import make_drafter


def test_every_turn_is_a_prompt_holding_the_chat_so_far():
    _, target, _ = tiny_pair()
    records = [PromptRecord("a", "the cat sat on", True, ("and the dog", "then what")),
               PromptRecord("b", "def add(a, b):", False)]
    config = DecodeConfig(max_new_tokens=6)
    prompts, turns = expand_turns(target, records, config, progress=False)
    assert turns == [1, 2, 3, 1] and len(prompts) == 4
    texts = [target.tokenizer.decode(p) for p in prompts]
    reply = SpeculativeDecoder(target).generate(prompts[0], config).text
    assert "the cat sat on" in texts[1] and reply in texts[1] and "and the dog" in texts[1]
    assert texts[2].startswith(texts[1])  # the same chat, one exchange longer
    assert "then what" in texts[2] and "then what" not in texts[1]
    assert prompts[3] == list(target.tokenizer("def add(a, b):")["input_ids"])


def test_turn_table_gives_the_median_speedup_per_turn():
    summary = {"greedy": {"speedup_per_prompt": [1.0, 2.0, 3.0, 1.4, 2.2, 3.4]}}
    table = turn_table(summary, [1, 2, 3, 1, 2, 3])
    assert "| greedy | 1.20× | 2.10× | 3.20× |" in table


def test_a_repeated_request_drafts_from_its_history_and_keeps_the_output():
    d_model, target, bridge = tiny_pair()
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge, NgramTrie(),
                                 history=scratch_history(target.tokenizer))
    config = DecodeConfig(max_new_tokens=24, draft_stop="fixed", draft_len=4)
    prompt = target.tokenizer.encode("numbers like 12345")
    alone = SpeculativeDecoder(target).generate(prompt, DecodeConfig(max_new_tokens=24, lookup=False)).token_ids
    run = repeat_mode(decoder, config)(prompt)
    assert run.token_ids == alone
    assert decoder.stats.history_steps > 0 and run.lookup_accepted > 0
