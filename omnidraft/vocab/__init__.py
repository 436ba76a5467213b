"""Vocabulary bridge: token bytes, direct mapping, translators (eq. (1)/(2)), reverse translation,
and the identities of tokenizer pairs. Import the submodules directly (``vocab.bridge``,
``vocab.identity``…): this package file imports nothing, so the torch-free parts stay torch-free."""
