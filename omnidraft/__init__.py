"""omnidraft: one tiny on-device drafter that speeds up any target LLM, whatever its tokenizer.

The package layout follows one decoding step (Algorithm 1 of the OmniDraft paper):
``drafter -> vocab (bridge + n-gram cache) -> target -> verify -> ngram/train``.
"""

__version__ = "0.1.0"
