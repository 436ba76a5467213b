"""Target backends: anything that scores a token list and returns logits at the last m+1 positions."""

from omnidraft.target.local import LocalTarget, TargetBackend

__all__ = ["LocalTarget", "TargetBackend"]
