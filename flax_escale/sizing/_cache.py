"""The planner's cache: each compiled candidate's figures on disk, keyed by its programs.

A second plan of the same workload reads the figures rather than compiling again; the key is
the programs' text with the JAX version and the HLO reader's (so a fix to either is not
outlived by figures read the old way).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jaxlib

from flax_escale.errors import EscaleError

__all__ = ["cache_key", "read_cache", "write_cache"]


def cache_key(*texts: str) -> str:
    digest = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    for text in texts:
        digest.update(text.encode())
    return digest.hexdigest()


def read_cache(cache_dir: Path | None, key: str) -> dict[str, Any] | None:
    if cache_dir is None:
        return None
    try:
        return json.loads((cache_dir / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def write_cache(cache_dir: Path | None, key: str, figures: dict[str, Any]) -> None:
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a reader never sees half a file.
        partial = cache_dir / f"{key}.json.partial"
        partial.write_text(json.dumps(figures))
        partial.replace(cache_dir / f"{key}.json")
    except OSError as error:
        # plan_mesh checks the directory up front; what only writing tells (a file system
        # that refuses it, a disk full) is said here, naming the cache rather than the file.
        raise EscaleError(
            f"cache: cannot keep the compiled candidates' figures in {str(cache_dir)!r} "
            f"({error.strerror or error}); give a directory you can write in, or cache=False."
        ) from error
