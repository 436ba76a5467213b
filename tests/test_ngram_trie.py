"""The in-memory n-gram trie: the lookups the decode loop relies on, checked against a dict model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnidraft.ngram.trie import NgramTrie


def test_add_and_get_exact_keys_only() -> None:
    trie = NgramTrie()
    assert trie.add([5, 6], 100) is True
    assert trie.add((5, 6, 7), 200) is True
    assert len(trie) == 2
    assert trie.get([5, 6]) == 100
    assert trie.get([5, 6, 7]) == 200
    assert trie.get([5]) is None  # a prefix of a key is not a key
    assert trie.get([5, 6, 7, 8]) is None
    assert trie.get([9, 9]) is None


def test_add_existing_key_replaces_target_and_is_not_new() -> None:
    trie = NgramTrie()
    trie.add([1, 2], 10)
    assert trie.add([1, 2], 11) is False
    assert trie.get([1, 2]) == 11
    assert len(trie) == 1


def test_unigram_is_rejected() -> None:
    trie = NgramTrie()
    with pytest.raises(ValueError):
        trie.add([3], 1)
    with pytest.raises(ValueError):
        trie.add([], 1)


def test_longest_match_prefers_the_longest_key_at_start() -> None:
    trie = NgramTrie()
    trie.add([1, 2], 12)
    trie.add([1, 2, 3], 123)
    trie.add([2, 3], 23)
    assert trie.longest_match([1, 2, 3, 4]) == (3, 123)
    assert trie.longest_match([1, 2, 4]) == (2, 12)
    assert trie.longest_match([0, 1, 2, 3], start=1) == (3, 123)
    assert trie.longest_match([0, 2, 3], start=1) == (2, 23)
    assert trie.longest_match([1, 4]) is None
    assert trie.longest_match([1]) is None
    assert trie.longest_match([]) is None


def test_remove_prunes_and_keeps_other_keys() -> None:
    trie = NgramTrie()
    trie.add([1, 2], 12)
    trie.add([1, 2, 3], 123)
    assert trie.remove([1, 2, 3]) is True
    assert trie.get([1, 2, 3]) is None
    assert trie.get([1, 2]) == 12
    assert 3 not in trie.root.children[1].children[2].children  # empty branch pruned
    assert trie.remove([1, 2, 3]) is False
    assert trie.remove([1]) is False  # an inner node is not a key
    assert trie.remove([1, 2]) is True
    assert len(trie) == 0
    assert trie.root.children == {}


def test_items_lists_every_key_once() -> None:
    trie = NgramTrie()
    entries = {(1, 2): 5, (1, 2, 3): 6, (4, 5): 7}
    for key, target in entries.items():
        trie.add(key, target)
    assert dict(trie.items()) == entries
    assert len(list(trie.items())) == len(entries)


def test_hit_counters() -> None:
    trie = NgramTrie()
    trie.add([1, 2], 3)
    trie.note_proposed([1, 2])
    trie.note_proposed([1, 2])
    trie.note_accepted([1, 2])
    assert (trie.hits_proposed, trie.hits_accepted) == (2, 1)


keys = st.lists(st.integers(0, 6), min_size=2, max_size=4).map(tuple)
ops = st.lists(st.tuples(st.booleans(), keys, st.integers(0, 50)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=ops, probe=st.lists(st.integers(0, 6), max_size=6))
def test_matches_a_dict_model(ops: list[tuple[bool, tuple[int, ...], int]], probe: list[int]) -> None:
    trie, model = NgramTrie(), {}
    for is_add, key, target in ops:
        if is_add:
            assert trie.add(key, target) is (key not in model)
            model[key] = target
        else:
            assert trie.remove(key) is (key in model)
            model.pop(key, None)
    assert len(trie) == len(model)
    assert dict(trie.items()) == model
    expected = None
    for n in range(2, len(probe) + 1):
        if tuple(probe[:n]) in model:
            expected = (n, model[tuple(probe[:n])])
    assert trie.longest_match(probe) == expected
