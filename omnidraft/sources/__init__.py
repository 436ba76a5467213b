"""Draft sources: every way to draft is a peer behind one interface (``base.DraftSource``).

A new source is one file and one entry in :data:`SOURCES`. The decoder builds each from its parts
(a source not configured returns None) and asks them in the order the policy gives (the free ones
first: lookups, target ids at no drafting cost; then the model drafter) what they could propose;
the policy picks at most one offer per step.
"""

from omnidraft.sources.base import DraftSource, Offer, Parts, StepResult, StepTimes
from omnidraft.sources.drafter import ModelDraft
from omnidraft.sources.history import HistoryLookup
from omnidraft.sources.lookup import ContextLookup

SOURCES = (ContextLookup.build, HistoryLookup.build, ModelDraft.build)

__all__ = ["SOURCES", "DraftSource", "Offer", "Parts", "StepResult", "StepTimes"]
