"""Plain-Python models of the semantics the library must reproduce.

Also locates the shared real traces, which live beside the repository (never
inside it): `../shared/traces` relative to the repository root, or the
directory named by the environment variable `PREFIXJAX_TRACES_DIR`.
"""

from __future__ import annotations

import os
from pathlib import Path

TRACES_ENV_VAR = "PREFIXJAX_TRACES_DIR"


def shared_traces_dir() -> Path:
  """The directory holding the shared real traces (it may not exist)."""
  override = os.environ.get(TRACES_ENV_VAR)
  if override:
    return Path(override)
  # tests/reference_models/__init__.py -> repository root -> its parent.
  return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def shared_trace(name: str) -> Path | None:
  """Path of a shared trace file, or None when it is not available."""
  path = shared_traces_dir() / name
  return path if path.is_file() else None
