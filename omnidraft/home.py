"""Where omnidraft keeps its state: ``--home`` / ``$OMNIDRAFT_HOME``, default the working directory.

Like MLflow's ``./mlruns``, the state directories (adapters/, cache_store/, export/, models/) live
under one home so that a project folder carries its drafter's learned state with it.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIRS = ("adapters", "cache_store", "export", "models")  # created by what writes them, never by readers


def home_dir(home: str | os.PathLike | None = None) -> Path:
    """Resolve the home: an explicit argument wins, then $OMNIDRAFT_HOME, then the cwd."""
    if home is not None:
        return Path(home).expanduser().resolve()
    env = os.environ.get("OMNIDRAFT_HOME")
    return Path(env).expanduser().resolve() if env else Path.cwd().resolve()
