"""The drafter (Algorithm 1, lines 5-7): one drafting algorithm over torch or onnxruntime backends."""

from omnidraft.drafter.base import Draft, DraftLM
from omnidraft.drafter.drafter import Drafter
from omnidraft.drafter.policy import DraftPolicy, Sampler

__all__ = ["Draft", "DraftLM", "DraftPolicy", "Drafter", "Sampler"]
