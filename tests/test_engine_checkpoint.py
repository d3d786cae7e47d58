"""Engine checkpoints: saved mid-generation, restored in a fresh process.

The restored engine must finish the generation with the tokens, logits
(to the bit) and hits of the engine that was never stopped, and a later
batch must hit what the saved cache held.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xla_flags

from prefixjax.configs import ModelConfig
from prefixjax.model import CacheConfig, Engine

MODEL = ModelConfig.tiny()
CFG = CacheConfig(
  block_size=16,
  num_blocks=33,
  max_num_seqs=3,
  max_num_batched_tokens=48,
  max_model_len=192,
)

_CHILD = textwrap.dedent(
  """
  import hashlib, json, sys
  import numpy as np
  from prefixjax.model import Engine

  path, later = sys.argv[1], json.loads(sys.argv[2])
  engine, gen = Engine.restore(path)
  steps_before = len(gen.schedule)
  res = gen.run()
  after = engine.generate(later, 6, return_logits=True)

  def digest(logits):
    h = hashlib.sha256()
    for a in logits:
      h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()

  print(json.dumps(dict(
    steps_before=steps_before,
    tokens=res.tokens, stats={k: v for k, v in res.stats.items()
                              if k != "wall_s"},
    schedule=res.schedule, logits=digest(res.logits),
    later_tokens=after.tokens, later_hits=after.stats["hit_tokens"],
    later_logits=digest(after.logits))))
  """
)


def _digest(logits):
  h = hashlib.sha256()
  for a in logits:
    h.update(np.ascontiguousarray(a, np.float32).tobytes())
  return h.hexdigest()


def _ids(rng, n):
  return rng.integers(0, MODEL.vocab_size, int(n)).tolist()


def test_a_generation_saved_midway_finishes_the_same_in_a_new_process(
  rng, tmp_path
):
  # Every batch here pads to 4 requests (the engine pads its request axis
  # to a power of two), so each process compiles the scheduler's programs
  # for one request count: those compiles are most of this test's time.
  system = _ids(rng, rng.integers(20, 50))
  warm = [system + _ids(rng, 5) for _ in range(int(rng.integers(3, 5)))]
  batch = [system + _ids(rng, rng.integers(1, 40)) for _ in range(4)]
  later = [
    system + _ids(rng, rng.integers(1, 20))
    for _ in range(int(rng.integers(3, 5)))
  ]
  mnt = int(rng.integers(10, 30))
  eng = Engine(MODEL, CFG)
  eng.generate(warm, 3)
  gen = eng.start(batch, mnt, temperature=0.8, seed=7, return_logits=True)
  for _ in range(int(rng.integers(2, 8))):
    gen.step()
  assert not gen.done
  saved_steps = len(gen.schedule)
  eng.save(tmp_path / "ckpt", gen)
  res = gen.run()
  after = eng.generate(later, 6, return_logits=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags.with_devices(None)
  out = subprocess.run(
    [sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), json.dumps(later)],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  child = json.loads(out.stdout.strip().splitlines()[-1])
  assert child["steps_before"] == saved_steps
  assert child["tokens"] == res.tokens
  assert child["schedule"] == res.schedule
  want = {k: v for k, v in res.stats.items() if k != "wall_s"}
  assert child["stats"] == want
  assert child["logits"] == _digest(res.logits)
  assert child["later_tokens"] == after.tokens
  assert child["later_hits"] == after.stats["hit_tokens"] > 0
  assert child["later_logits"] == _digest(after.logits)


def test_an_idle_engine_round_trips_its_cache(rng, tmp_path):
  prompt = _ids(rng, rng.integers(33, 60))
  eng = Engine(MODEL, CFG, seed=int(rng.integers(100)))
  eng.generate([prompt], 4)
  eng.save(tmp_path / "idle")
  back, gen = Engine.restore(tmp_path / "idle")
  assert gen is None
  a = eng.generate([prompt], 4, return_logits=True)
  b = back.generate([prompt], 4, return_logits=True)
  assert (
    a.stats["hit_tokens"]
    == b.stats["hit_tokens"]
    == 16 * ((len(prompt) - 1) // 16)
  )
  assert a.tokens == b.tokens
  assert _digest(a.logits) == _digest(b.logits)


def test_a_restored_engine_compiles_nothing_the_saved_one_compiled(
  rng, tmp_path, caplog
):
  """Restored arrays were committed to device 0, and jit keys its programs
  on committed shardings: a restored engine compiled every program again
  (in a new process the persistent cache missed them all: 28 s against
  5 s for the checkpoint test above)."""
  import logging
  import re

  import jax

  prompts = [_ids(rng, rng.integers(20, 60)) for _ in range(3)]
  eng = Engine(MODEL, CFG, seed=int(rng.integers(100)))
  first = eng.generate(prompts, 4)
  eng.save(tmp_path / "c")
  back, _ = Engine.restore(tmp_path / "c")
  caplog.clear()
  with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
    again = back.generate(prompts, 4)
  assert re.findall(r"Compiling jit\((\w+)\)", caplog.text) == []
  assert again.tokens == first.tokens
  assert again.stats["hit_tokens"] > 0


def test_checkpoint_errors(rng, tmp_path):
  eng = Engine(MODEL, CFG)
  eng.save(tmp_path / "x")
  with pytest.raises(FileExistsError, match="refusing to overwrite"):
    eng.save(tmp_path / "x")
  with pytest.raises(FileNotFoundError, match="no engine checkpoint"):
    Engine.restore(tmp_path / "missing")
  other = Engine(MODEL, CFG)
  gen = other.start([_ids(rng, 5)], 2)
  with pytest.raises(ValueError, match="another engine"):
    eng.save(tmp_path / "y", gen)
  with pytest.raises(RuntimeError, match="still running"):
    other.start([_ids(rng, 5)], 2)
  # Saved alone, the pool (holding the running generation's KV) and the
  # prefix cache (from before it) would disagree.
  with pytest.raises(ValueError, match="a generation is running"):
    other.save(tmp_path / "z")
  assert not (tmp_path / "z").exists()
  gen.run()
  with pytest.raises(RuntimeError, match="done"):
    gen.step()
  # A damaged meta file: named, not a bare JSONDecodeError.
  for f in (tmp_path / "x" / "meta").rglob("*"):
    if f.is_file():
      f.write_text("{not json")
  with pytest.raises(ValueError, match="its 'meta' cannot be read"):
    Engine.restore(tmp_path / "x")


def test_damaged_checkpoints_are_named_with_the_part(rng, tmp_path):
  """Damage the meta's fields, its configs, or the array files: each gives
  a ValueError naming the checkpoint and the part (a KeyError, orbax's
  JSONDecodeError or TensorStore's error named neither)."""
  import shutil

  eng = Engine(MODEL, CFG, seed=int(rng.integers(100)))
  eng.save(tmp_path / "base")
  (meta_file,) = [
    f for f in (tmp_path / "base" / "meta").rglob("*") if f.name == "metadata"
  ]
  meta = json.loads(meta_file.read_text())
  dropped = str(rng.choice(["seed", "calls", "has_cache", "cache_config"]))

  def write_meta(folder, obj):
    (folder / meta_file.relative_to(tmp_path / "base")).write_text(
      json.dumps(obj)
    )

  def damage_arrays(folder):
    files = [f for f in (folder / "engine").rglob("*") if f.parent.name == "d"]
    assert files
    for f in files:
      f.write_bytes(rng.bytes(64))

  cases = {
    "dropped": (
      lambda d: write_meta(d, {k: v for k, v in meta.items() if k != dropped}),
      f"its 'meta' lacks {dropped}",
    ),
    "config": (
      lambda d: write_meta(
        d, {**meta, "cache_config": {**meta["cache_config"], "block_size": 0}}
      ),
      "its 'meta' does not describe a valid engine .CacheConfig.block_size",
    ),
    "arrays": (damage_arrays, "its arrays cannot be restored"),
  }
  for name, (damage, match) in cases.items():
    folder = tmp_path / name
    shutil.copytree(tmp_path / "base", folder)
    damage(folder)
    with pytest.raises(ValueError, match=match) as info:
      Engine.restore(folder)
    assert repr(str(folder)) in str(info.value), name


SMALL = CacheConfig(
  block_size=4,
  num_blocks=14,
  max_num_seqs=2,
  max_num_batched_tokens=16,
  max_model_len=48,
)


@pytest.mark.parametrize("how", ["abandon", "error"])
def test_a_generation_stopped_midway_leaves_the_engine_usable(
  rng, how, monkeypatch
):
  """A generation stopped before it is done (``abandon()``, or an error
  inside ``generate``) has written KV into pages the prefix cache lists
  as holding an earlier prompt; the engine must not serve those as hits.
  Afterwards it generates what a fresh engine with the same weights does."""
  seed = int(rng.integers(100))
  a, b = _ids(rng, 40), _ids(rng, 40)
  eng = Engine(MODEL, SMALL, seed=seed)
  eng.generate([a], 1)  # a's blocks cached
  if how == "abandon":
    gen = eng.start([b], 4)
    for _ in range(3):
      gen.step()
    gen.abandon()
    assert gen.done and gen.abandoned
    with pytest.raises(RuntimeError, match="abandoned"):
      gen.step()
  else:
    from prefixjax.model import engine as engine_module

    real_step, calls = engine_module.Generation.step, []

    def failing_step(self):  # the real step, then a failure on the 4th
      calls.append(1)
      if len(calls) == 4:
        raise KeyboardInterrupt
      real_step(self)

    monkeypatch.setattr(engine_module.Generation, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
      eng.generate([b], 4)
    monkeypatch.undo()
  got = eng.generate([a], 4, return_logits=True)
  fresh = Engine(MODEL, SMALL, seed=seed).generate([a], 4, return_logits=True)
  assert got.tokens == fresh.tokens
  assert _digest(got.logits) == _digest(fresh.logits)
  assert got.stats["hit_tokens"] == fresh.stats["hit_tokens"] == 0
