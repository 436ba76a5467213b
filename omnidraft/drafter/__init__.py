"""Drafter backends (torch now; onnxruntime with the export issue)."""

from omnidraft.drafter.torch_drafter import Draft, Drafter

__all__ = ["Draft", "Drafter"]
