"""Prompt lookup on hand-made token lists: the longest earlier match wins, overlapping and
self-matches continue correctly, the suffix never matches itself, and the index follows a list."""

from __future__ import annotations

import random

import pytest

from omnidraft.sources.lookup import LookupIndex


def index(ids, **kw) -> LookupIndex:
    lk = LookupIndex(**kw)
    lk.extend(ids)
    return lk


def test_the_continuation_of_the_last_earlier_match():
    assert index([5, 6, 7, 8, 9, 5, 6]).propose(3) == ([7, 8, 9], 2)


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    ids = [1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3]  # (2, 3) ended last before 9; (1, 2, 3) is longer
    assert index(ids).propose(2) == ([40, 41], 3)


def test_overlapping_and_self_matches():
    assert index([1, 2, 1, 2, 1, 2]).propose(4) == ([1, 2], 4)  # periodic text: what followed last time
    assert index([7, 7, 7, 7]).propose(3) == ([7], 3)


def test_no_match_means_no_draft():
    assert index([1, 2, 3, 4, 5]).propose(4) == ([], 0)
    assert index([1, 2, 9, 2], min_n=2).propose(4) == ([], 0)  # one matching token is below min_n
    assert index([1, 2, 9, 2], min_n=1).propose(4) == ([9, 2], 1)


def test_a_copy_ends_before_a_special_token():
    """A reply that repeats the user's words matches the prompt, whose continuation runs into the chat
    template's markers (here 90 and 91): the copy stops before them, and a match that continues with
    one at once proposes nothing from there."""
    prompt = [5, 6, 7, 8, 90, 91, 3]  # "... words? <|im_end|> <|im_start|>assistant"
    assert index(prompt + [5, 6, 7], stops=frozenset({90, 91})).propose(6) == ([8], 3)
    assert index(prompt + [6, 7, 8], stops=frozenset({90, 91})).propose(6) == ([], 0)
    assert index(prompt + [6, 7, 8]).propose(6) == ([90, 91, 3, 6, 7, 8], 3)  # without stops: the markers too


def test_the_special_ids_include_the_chat_markers():
    from conftest import TEST_HOME

    from omnidraft import models
    from omnidraft.vocab.token_bytes import special_ids

    tok = models.load_tokenizer("builtin:qwen2.5-coder-0.5b", TEST_HOME, progress=False)
    ids = special_ids(tok)
    assert set(tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])) <= ids
    assert not ids & set(tok.encode("def f(x):\n    return x  # a comment", add_special_tokens=False))


def test_sync_extends_or_reindexes():
    lk = index([1, 2, 3])
    lk.sync([1, 2, 3, 4, 1, 2])
    assert lk.ids == [1, 2, 3, 4, 1, 2] and lk.propose(2) == ([3, 4], 2)
    lk.sync([9, 1, 2, 9, 1, 2])  # a different context (a new prompt): indexed afresh
    assert lk.propose(3) == ([9, 1, 2], 3)


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_brute_force_search(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(6) for _ in range(300)]
    lk = LookupIndex(max_n=4, min_n=1)
    for end in range(1, len(ids) + 1):
        lk.extend(ids[end - 1:end])
        expected = ([], 0)
        for n in range(min(4, end - 1), 0, -1):  # longest n, then the latest earlier occurrence
            starts = [s for s in range(end - n) if ids[s:s + n] == ids[end - n:end]]
            if starts:
                pos = starts[-1] + n
                expected = (ids[:end][pos:pos + 5], n)
                break
        assert lk.propose(5) == expected, end
