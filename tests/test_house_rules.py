"""DESIGN.md's layering rule, read from the source: no module of the
package imports another module's ``_private`` names.

Private modules (``prefixjax/_host.py``, ``_struct.py``, ...) are the
package's shared internals and may be imported; what may not is a
``_name`` defined inside another module, whether by ``from m import
_name`` or by ``m._name`` on an imported module.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("prefixjax", "pallas_kernels")


def _module_files():
  for pkg in PACKAGES:
    yield from sorted((ROOT / pkg).rglob("*.py"))


def _is_module(dotted: str) -> bool:
  """``dotted`` names a module or package file in this checkout."""
  path = ROOT.joinpath(*dotted.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def violations(path: pathlib.Path, source: str) -> list[str]:
  """``file:line: what`` for every private name ``source`` takes from
  another module of the packages."""
  tree = ast.parse(source, filename=str(path))
  rel = path.relative_to(ROOT) if path.is_absolute() else path
  out, modules = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module.split(".")[0] not in PACKAGES:
        continue
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if _is_module(full):
          modules[a.asname or a.name] = full
        elif _private(a.name):
          out.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in PACKAGES and a.asname:
          modules[a.asname] = a.name
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in modules
      and _private(node.attr)
    ):
      mod = modules[node.value.id]
      if not _is_module(f"{mod}.{node.attr}"):
        out.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
  return out


def test_no_module_imports_anothers_private_names():
  found = []
  for path in _module_files():
    found += violations(path, path.read_text())
  assert not found, "\n".join(found)


@pytest.mark.parametrize(
  "source, bad",
  [
    ("from prefixjax.serving.simulate import _build\n", True),
    ("from prefixjax.serving import vllm_v1\nvllm_v1._run\n", True),
    ("from prefixjax.serving import simulate as s\ns._collect(1)\n", True),
    ("from prefixjax import _struct as struct\n", False),
    ("from prefixjax._host import to_device\n", False),
    ("from prefixjax.serving import vllm_v1\nvllm_v1.run\n", False),
    ("import numpy as np\nnp._NoValue\n", False),
  ],
)
def test_the_rule_checker_sees_what_it_should(source, bad):
  got = violations(pathlib.Path("x.py"), source)
  assert bool(got) == bad, got
