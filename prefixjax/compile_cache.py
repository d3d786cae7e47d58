"""JAX's persistent compilation cache, switched on for prefixjax's programs.

Compiling dominates a short replay (seconds against a fraction of a second
of running), and every new process used to pay it again. JAX keeps compiled
executables on disk when ``jax_compilation_cache_dir`` is set; this module
only chooses the folder and the thresholds, it does not cache anything
itself.

The folder, first match wins:

1. the ``path`` argument (the CLI's ``--compile-cache DIR``);
2. the environment variable ``PREFIXJAX_COMPILE_CACHE`` (a folder, or
   ``off`` / ``0`` / ``none`` to disable);
3. ``$XDG_CACHE_HOME/prefixjax/jax`` (by default ``~/.cache/prefixjax/jax``).

JAX's cache key covers the program, the jax and XLA versions, the backend
and the flags, so one folder serves several installs safely.

Example:
  >>> import prefixjax
  >>> prefixjax.enable_compile_cache("off") is None
  True
"""

from __future__ import annotations

import os
import pathlib
import sys

__all__ = ["ENV_VAR", "default_cache_dir", "enable_compile_cache"]

ENV_VAR = "PREFIXJAX_COMPILE_CACHE"
"""Environment variable naming the cache folder (or ``off``)."""

_OFF = ("", "0", "off", "none", "false", "no")


def default_cache_dir() -> pathlib.Path:
  """``$XDG_CACHE_HOME/prefixjax/jax``, else ``~/.cache/prefixjax/jax``."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  return pathlib.Path(base) / "prefixjax" / "jax"


def enable_compile_cache(path: str | os.PathLike | None = None) -> str | None:
  """Points JAX's persistent compilation cache at a folder.

  Every program is cached, however fast it compiled (JAX's default skips
  programs under one second, which is most of ours). Call it before the
  first compilation of the process: JAX reads the setting once.

  Args:
    path: the folder, or ``"off"`` to turn the cache off (JAX's own
      too, where ``JAX_COMPILATION_CACHE_DIR`` names a folder); ``None`` reads
      ``PREFIXJAX_COMPILE_CACHE``, then uses :func:`default_cache_dir`.

  Returns:
    The folder in use, or ``None`` when the cache stays off (disabled, or
    the folder cannot be created: then a one-line warning goes to stderr
    and the run goes on without a cache).
  """
  if path is None:
    path = os.environ.get(ENV_VAR)
    if path is None:
      path = default_cache_dir()
  if str(path).strip().lower() in _OFF:
    # "off" is off even where JAX_COMPILATION_CACHE_DIR names a folder.
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    return None
  folder = pathlib.Path(path).expanduser()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
      raise PermissionError(f"{folder} is not writable")
  except OSError as err:
    print(f"prefixjax: warning: compilation cache off ({err})", file=sys.stderr)
    return None
  import jax

  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", str(folder))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return str(folder)
