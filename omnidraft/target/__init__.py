"""Target backends: anything that scores a token list and returns logits at the last m+1 positions."""

from omnidraft.target.base import Target
from omnidraft.target.torch_target import TorchTarget

__all__ = ["Target", "TorchTarget"]
