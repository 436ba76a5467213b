"""Vocabulary bridge: token bytes, direct mapping, translators (eq. (1)/(2)) and reverse translation.
Import the submodules directly (``vocab.bridge``, ``vocab.token_bytes``…): this package file imports
nothing, so the torch-free parts stay torch-free. Tokenizer-pair identities live in ``omnidraft.identity``."""
