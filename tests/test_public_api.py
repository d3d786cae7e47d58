"""The public surface: explicit sorted exports, docstring examples, style."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import shutil
import subprocess

import pytest

import prefixjax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_all_is_sorted_and_resolves():
  names = prefixjax.__all__
  assert list(names) == sorted(names, key=lambda n: (not n.isupper(), n))
  for name in names:
    assert hasattr(prefixjax, name), name


@pytest.mark.parametrize(
  "module",
  [
    "prefixjax",
    "prefixjax.cache",
    "prefixjax.cache.paging",
    "prefixjax.cache.paging_state",
    "prefixjax.cache.prefix_state",
    "prefixjax.cache.prefix_cache",
    "prefixjax.cache.index",
    "prefixjax.cache.hashing",
    "prefixjax.cache.policies",
    "prefixjax.cache.checked",
    "prefixjax.cache.checked.paging",
    "prefixjax.replay",
    "prefixjax.replay.vllm",
    "prefixjax.replay.sglang",
    "prefixjax.workloads.synthetic",
    "prefixjax.workloads.trace",
    "prefixjax.sweep",
  ],
)
def test_docstring_examples_run(module):
  mod = importlib.import_module(module)
  result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_is_clean(command):
  result = subprocess.run(
    ["ruff", *command, "."], cwd=ROOT, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stdout + result.stderr
