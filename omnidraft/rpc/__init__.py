"""The target on a server: ``omnidraft serve`` (``server.py``) and the ``grpc://`` client (``client.py``),
over the service in ``target.proto``. Importing this package loads neither grpc nor torch."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from omnidraft.errors import OmnidraftError


def read_token(token_file: str | None) -> str | None:
    """The auth token from --token-file, else $OMNIDRAFT_TOKEN (never from the command line)."""
    if token_file:
        try:
            token = Path(token_file).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise OmnidraftError(f"cannot read --token-file {token_file}: {getattr(exc, 'strerror', None) or exc}") from None
        if not token:
            raise OmnidraftError(f"--token-file {token_file} is empty")
        return token
    return os.environ.get("OMNIDRAFT_TOKEN") or None


def prefix_digest(ids: Sequence[int]) -> bytes:
    """What a request's ``prefix_len`` assumes the server holds, as 16 bytes (BLAKE2b of the ids as
    little-endian int32). A length alone is not enough: behind a load balancer another replica may hold
    the same session id with other tokens, and keeping its prefix would verify against the wrong text."""
    return hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes(), digest_size=16).digest()
