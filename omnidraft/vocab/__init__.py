"""Vocabulary bridge: direct mapping, forward translation (eq. (1)/(2)), reverse translation."""

from omnidraft.vocab.bridge import Translation, VocabBridge
from omnidraft.vocab.reverse import DrafterContext

__all__ = ["DrafterContext", "Translation", "VocabBridge"]
