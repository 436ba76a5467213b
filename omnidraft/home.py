"""Where omnidraft keeps its state: ``--home`` / ``$OMNIDRAFT_HOME``, default the working directory.

Like MLflow's ``./mlruns``, the state directories (adapters/, cache_store/, export/, models/) live
under one home so that a project folder carries its drafter's learned state with it.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIRS = ("adapters", "cache_store", "export", "models")


def home_dir(home: str | os.PathLike | None = None) -> Path:
    """Resolve the home: an explicit argument wins, then $OMNIDRAFT_HOME, then the cwd."""
    if home is not None:
        return Path(home).expanduser().resolve()
    env = os.environ.get("OMNIDRAFT_HOME")
    return Path(env).expanduser().resolve() if env else Path.cwd().resolve()


def state_dir(name: str, home: str | os.PathLike | None = None) -> Path:
    """Return (and create) one of the state directories under the home."""
    if name not in STATE_DIRS:
        raise ValueError(f"unknown state directory {name!r}; expected one of {STATE_DIRS}")
    path = home_dir(home) / name
    path.mkdir(parents=True, exist_ok=True)
    return path
