"""omnidraft: one tiny on-device drafter that speeds up any target LLM, whatever its tokenizer.

The package layout follows one decoding step (Algorithm 1 of the OmniDraft paper):
``drafter -> vocab (bridge + n-gram cache) -> target -> verify -> ngram/train``.
"""

import os

# Large torch allocations (the target's and drafter's weights) in transparent huge pages: a one-row
# decoding step streams every weight once, and with 4 KiB pages its TLB misses cost the 0.5B fp32
# target ~25% per step on a 2-core AMD EPYC (docs/performance.md, "Huge pages"). PyTorch reads the
# variable once, at its first allocation, so it is set before anything imports torch; a value the
# user set wins. Only Linux acts on it (madvise), and only where THP is "madvise" or "always".
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
