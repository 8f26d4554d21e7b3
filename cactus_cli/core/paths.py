"""Where cactus keeps things on disk: ``$CACTUS_HOME`` (default ``~/.cache/cactus``) holds the
converted models, quantized weights and measured costs; profiles live beside it (profiles.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cactus_home() -> Path | None:
    """``$CACTUS_HOME`` if set (tests and CI point it at a temporary folder)."""
    home = os.environ.get("CACTUS_HOME")
    return Path(home).expanduser() if home else None


def cache_dir() -> Path:
    return cactus_home() or Path("~/.cache/cactus").expanduser()


def cache_path(key: dict[str, Any], prefix: str = "") -> Path:
    """Where a measurement keyed by ``key`` is cached: ``$CACTUS_HOME/costs/<prefix><hash>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{prefix}{digest}.json"
