"""Cross-vocabulary n-gram cache (OmniDraft §3.1): drafter sub-token sequences -> one target token."""

from omnidraft.ngram.trie import NgramTrie, TrieNode

__all__ = ["NgramTrie", "TrieNode"]
