"""A long-lived process stays under the kernel's memory-map limit.

XLA:CPU maps each compiled program's sections separately (about 1,100
mappings for a vLLM serving loop, 1,300 for SGLang's, jax 0.10.2), and
Linux caps a process at ``vm.max_map_count`` mappings (65,530 by
default): a process that compiled about 50 serving programs was aborted
inside LLVM (``LLVM ERROR: Unable to allocate section memory``, session
33's scratch fuzz of SGLang configurations, after 47). The public run
functions drop the compiled programs first when the process holds more
than ``_host.MAPS_SHARE`` of the limit. Here the limit is lowered so that
one program crosses it.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from prefixjax import _host
from prefixjax import replay as rp
from prefixjax.replay import frame
from prefixjax.serving import ServingConfig, simulate
from prefixjax.workloads import default_workload

pytestmark = pytest.mark.skipif(
  _host.memory_maps() is None or _host.max_memory_maps() is None,
  reason="needs Linux's /proc/self/maps and /proc/sys/vm/max_map_count",
)


def _records(rng, n=12):
  return [
    dict(
      input_tok_ids=rng.integers(1, 50, int(rng.integers(4, 40))).tolist(),
      output_toks=int(rng.integers(1, 20)),
    )
    for _ in range(n)
  ]


def _config(blocks, semantics):
  return ServingConfig(
    num_gpu_blocks=blocks,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=64,
    semantics=semantics,
  )


def _limit_between(low: int):
  """A limit whose MAPS_SHARE is ``low`` mappings."""
  return lambda: int(low / _host.MAPS_SHARE) + 1


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_simulate_drops_the_programs_past_the_share_of_the_limit(
  rng, monkeypatch, semantics
):
  """A second configuration of other shapes: with the limit's share
  between the maps before and after the first program, ``simulate`` drops
  that program before compiling the next (the maps grow by one program,
  not two), and its results equal a run with nothing dropped."""
  records = _records(rng)
  blocks = int(rng.integers(40, 60))
  _host.release_compiled()
  base = _host.memory_maps()
  simulate(records, _config(blocks, semantics))
  held = _host.memory_maps()
  one = held - base
  assert one > 300, f"a program mapped only {one} regions"
  monkeypatch.setattr(_host, "max_memory_maps", _limit_between(base + one // 2))
  got = simulate(records, _config(blocks + 8, semantics))
  after = _host.memory_maps()
  assert after - held < one // 2, (base, held, after)
  monkeypatch.undo()
  _host.release_compiled()
  want = simulate(records, _config(blocks + 8, semantics))
  assert got.metrics() == want.metrics()
  np.testing.assert_array_equal(got.finish_step, want.finish_step)


def test_under_the_share_nothing_is_dropped(rng):
  records = _records(rng)
  simulate(records, _config(48, "vllm"))
  held = _host.memory_maps()
  assert held <= _host.MAPS_SHARE * _host.max_memory_maps()
  simulate(records, _config(56, "vllm"))
  assert _host.memory_maps() > held + 300  # both programs kept


def test_only_the_main_thread_drops_programs_and_replays_own_go_too(
  monkeypatch,
):
  """Off the main thread (a sweep's points, running beside each other)
  nothing is dropped; on it, JAX's caches and the replay frame's own
  compiled programs go."""
  rp.replay(
    default_workload(num_requests=30, seed=0),
    policy="fifo",
    capacities=[16, 32],
  )
  assert frame._COMPILED
  monkeypatch.setattr(_host, "max_memory_maps", _limit_between(1))
  out = []
  t = threading.Thread(
    target=lambda: out.append(_host.release_compiled_near_map_limit())
  )
  t.start()
  t.join()
  assert out == [False] and frame._COMPILED
  cleared = []
  real = jax.clear_caches
  monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), real()))
  assert _host.release_compiled_near_map_limit()
  assert cleared == [1] and not frame._COMPILED


def test_the_engine_drops_them_before_a_generation(rng, monkeypatch):
  """``Engine.generate`` (through ``start``) checks the limit too, and
  generates the same tokens after the drop (greedy, so a rerun with
  nothing dropped must agree)."""
  from prefixjax.configs import ModelConfig
  from prefixjax.model import CacheConfig, Engine

  cfg = CacheConfig(
    block_size=16,
    num_blocks=33,
    max_num_seqs=2,
    max_num_batched_tokens=64,
    max_model_len=128,
  )
  eng = Engine(ModelConfig.tiny(), cfg)
  prompts = [rng.integers(1, 200, int(rng.integers(5, 40))).tolist()]
  want = eng.generate(prompts, 4)
  cleared = []
  real = jax.clear_caches
  monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), real()))
  monkeypatch.setattr(_host, "max_memory_maps", _limit_between(1))
  got = eng.generate(prompts, 4)
  assert cleared == [1]
  assert got.tokens == want.tokens
