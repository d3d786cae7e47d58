"""The roofline cost model and its model and hardware presets.

The reference is an independent float64 re-derivation from the configs' raw
fields (plain Python and numpy); random lanes are drawn fresh per test and
the seed is in every assert message.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax import configs
from prefixjax.configs import (
  HARDWARE,
  MODELS,
  HardwareConfig,
  ModelConfig,
  hardware_config,
  model_config,
)
from prefixjax.serving import roofline
from prefixjax.serving.roofline import (
  RooflineClock,
  StepsClock,
  attention_flops,
  linear_flops,
  step_bytes,
  step_flops,
  step_time_s,
)

RTOL = 1e-5
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _fresh_rng() -> tuple[int, np.random.Generator]:
  seed = int(np.random.default_rng().integers(2**63))
  return seed, np.random.default_rng(seed)


# The reference: float64, from the raw fields, no call into prefixjax.


def _ref_matmul_params(m: ModelConfig) -> float:
  d, f, v = m.hidden_size, m.intermediate_size, m.vocab_size
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  attn = d * q + d * kv + d * kv + q * d
  layer = attn + 3 * d * f + 2 * d
  return float(m.num_layers * layer + d + v * d)  # layers, final norm, head


def _ref_cost(m: ModelConfig, hw: HardwareConfig, n, c):
  """(linear FLOPs, attention FLOPs, bytes, seconds) of one step, float64."""
  n = [float(x) for x in n]
  c = [float(x) for x in c]
  p = _ref_matmul_params(m)
  b = 2.0 * m.num_layers * m.num_kv_heads * m.head_dim * BYTES[m.dtype]
  lin = attn = kv = 0.0
  for ni, ci in zip(n, c, strict=True):
    if ni == 0:
      continue
    lin += 2.0 * p * ni
    # Token j attends to ci + j + 1 keys; 2 matmuls x 2 FLOPs per MAC.
    keys = sum(ci + j + 1 for j in range(int(ni)))
    attn += 4.0 * m.num_layers * m.num_heads * m.head_dim * keys
    kv += b * (ci + ni) + b * ni
  active = any(ni > 0 for ni in n)
  nbytes = (p * BYTES[m.dtype] if active else 0.0) + kv
  t = 0.0
  if active:
    t = hw.step_overhead_s + max(
      (lin + attn) / (hw.peak_flops * hw.matmul_efficiency),
      nbytes / (hw.hbm_bandwidth * hw.bandwidth_efficiency),
    )
  return lin, attn, nbytes, t


def _draw_lanes(rng, shape):
  n = rng.integers(0, 2048, size=shape)
  n[rng.random(shape) < 0.3] = 0  # padding lanes, with a context anyway
  n[rng.random(shape) < 0.2] = 1  # decode lanes
  c = rng.integers(0, 60_000, size=shape)
  return n.astype(np.int32), c.astype(np.int32)


def _draw_hardware(rng) -> HardwareConfig:
  base = list(HARDWARE.values())[rng.integers(len(HARDWARE))]
  return dataclasses.replace(
    base,
    step_overhead_s=float(rng.choice([0.0, 1e-3, 5e-4])),
    matmul_efficiency=float(rng.uniform(0.3, 1.0)),
    bandwidth_efficiency=float(rng.uniform(0.3, 1.0)),
  )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_float64_reference_eager_and_jit(name):
  seed, rng = _fresh_rng()
  m, hw = MODELS[name], _draw_hardware(rng)
  n, c = _draw_lanes(rng, (int(rng.integers(1, 17)),))
  lin, attn, nbytes, t = _ref_cost(m, hw, n, c)
  fns = {
    "eager": (step_flops, step_bytes, step_time_s),
    "jit": (
      jax.jit(step_flops, static_argnums=0),
      jax.jit(step_bytes, static_argnums=0),
      jax.jit(step_time_s, static_argnums=(0, 1)),
    ),
  }
  msg = f"seed={seed} model={name} hw={hw} n={n.tolist()} c={c.tolist()}"
  for how, (flops_fn, bytes_fn, time_fn) in fns.items():
    got_f = flops_fn(m, jnp.asarray(n), jnp.asarray(c))
    got_b = bytes_fn(m, jnp.asarray(n), jnp.asarray(c))
    got_t = time_fn(m, hw, jnp.asarray(n), jnp.asarray(c))
    for got in (got_f, got_b, got_t):
      assert got.dtype == jnp.float32 and got.shape == (), (how, msg)
    np.testing.assert_allclose(float(got_f), lin + attn, rtol=RTOL, err_msg=msg)
    np.testing.assert_allclose(float(got_b), nbytes, rtol=RTOL, err_msg=msg)
    np.testing.assert_allclose(float(got_t), t, rtol=RTOL, err_msg=msg)
  np.testing.assert_allclose(
    float(linear_flops(m, jnp.asarray(n))), lin, rtol=RTOL, err_msg=msg
  )
  np.testing.assert_allclose(
    float(attention_flops(m, jnp.asarray(n), jnp.asarray(c))),
    attn,
    rtol=RTOL,
    err_msg=msg,
  )


def test_matches_float64_reference_under_vmap():
  seed, rng = _fresh_rng()
  batch, lanes = 6, int(rng.integers(1, 17))
  m = list(MODELS.values())[rng.integers(len(MODELS))]
  hw = _draw_hardware(rng)
  n, c = _draw_lanes(rng, (batch, lanes))
  n[0] = 0  # one all-padding step in the batch
  clock = RooflineClock(m, hw)
  got_f = jax.vmap(lambda a, b: step_flops(m, a, b))(n, c)
  got_b = jax.vmap(lambda a, b: step_bytes(m, a, b))(n, c)
  got_t = jax.jit(jax.vmap(clock.step_time_s))(n, c)
  for k in range(batch):
    lin, attn, nbytes, t = _ref_cost(m, hw, n[k], c[k])
    msg = f"seed={seed} model={m.name} hw={hw} row={k}"
    np.testing.assert_allclose(
      float(got_f[k]), lin + attn, rtol=RTOL, err_msg=msg
    )
    np.testing.assert_allclose(float(got_b[k]), nbytes, rtol=RTOL, err_msg=msg)
    np.testing.assert_allclose(float(got_t[k]), t, rtol=RTOL, err_msg=msg)
  assert float(got_t[0]) == 0.0, f"seed={seed}"


@pytest.mark.parametrize(
  "name, published",
  [("llama2_7b", 6.74e9), ("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9)],
)
def test_num_params_match_published_counts(name, published):
  m = model_config(name)
  assert abs(m.num_params - published) / published < 0.01, m.num_params
  # The matmul weights: everything but the input table (the head counts).
  assert m.num_nonembedding_params == _ref_matmul_params(m)
  assert (
    m.num_params == m.num_nonembedding_params + m.vocab_size * m.hidden_size
  )
  assert m.weight_bytes == 2 * m.num_params  # bfloat16


def test_kv_bytes_per_token():
  # Llama-3-8B, bf16: 2 (K, V) * 32 layers * 8 heads * 128 * 2 B = 128 KiB.
  assert ModelConfig.llama3_8b().kv_bytes_per_token == 131072
  assert ModelConfig.llama2_7b().kv_bytes_per_token == 524288
  assert ModelConfig.tiny().kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_tied_embeddings_count_the_table_once():
  m = ModelConfig.tiny()
  tied = dataclasses.replace(m, tie_embeddings=True)
  assert tied.num_params == m.num_params - m.vocab_size * m.hidden_size
  # The head matmul still reads the (shared) table every token.
  assert tied.num_nonembedding_params == m.num_nonembedding_params


def test_worked_example_7b_prefill_with_80_percent_hits():
  """The seed notes: 7B, L = 4096, h = 0.8 -> 5.7e13 / 1.1e13, 115 / 23 ms.

  The notes take P = 7e9 (the nominal "7B"). The matmul weights of
  Llama-2-7B are P = 6.61e9 (6.74e9 less the 0.13e9 input table), so the
  no-cache linear FLOPs are 5.4e13 (5 % under the notes). Attention adds
  4.4e12 FLOPs without the cache and 1.6e12 with it, so the times come out
  117 ms and 24.8 ms: within 10 % of the notes' 115 and 23 ms.
  """
  m = ModelConfig.llama2_7b()
  hw = HardwareConfig(
    name="500T",
    peak_flops=500e12,
    hbm_bandwidth=1e30,
    hbm_bytes=1e12,
    step_overhead_s=0.0,
  )
  length, hits = 4096, round(0.8 * 4096)
  assert (hits, length - hits) == (3277, 819)
  cold = (jnp.array([length]), jnp.array([0]))
  warm = (jnp.array([length - hits]), jnp.array([hits]))
  lin_cold = float(linear_flops(m, cold[0]))
  lin_warm = float(linear_flops(m, warm[0]))
  assert f"{lin_cold:.1e}" == "5.4e+13"
  assert f"{lin_warm:.1e}" == "1.1e+13"
  assert abs(lin_cold - 5.7e13) / 5.7e13 < 0.06  # the notes' P = 7e9
  # The notes' arithmetic with P = 7e9, to 2 digits.
  assert f"{2 * 7e9 * length:.1e}" == "5.7e+13"
  assert f"{2 * 7e9 * (length - hits):.1e}" == "1.1e+13"
  t_cold = float(step_time_s(m, hw, *cold))
  t_warm = float(step_time_s(m, hw, *warm))
  assert abs(t_cold - 0.115) / 0.115 < 0.10, t_cold
  assert abs(t_warm - 0.023) / 0.023 < 0.10, t_warm
  # Attention is the "few percent" on top of the linear FLOPs.
  assert 0.0 < float(attention_flops(m, *cold)) / lin_cold < 0.10
  assert t_cold == pytest.approx(float(step_flops(m, *cold)) / 500e12, rel=1e-6)


def test_padding_lanes_cost_nothing():
  seed, rng = _fresh_rng()
  m, hw = ModelConfig.llama3_8b(), HardwareConfig.h100()
  n, c = _draw_lanes(rng, (8,))
  n[0] = 5  # at least one running lane
  pad_c = rng.integers(1, 100_000, size=8).astype(np.int32)
  n2 = np.concatenate([n, np.zeros(8, np.int32)])
  c2 = np.concatenate([c, pad_c])
  for fn in (step_flops, step_bytes):
    assert float(fn(m, n2, c2)) == pytest.approx(
      float(fn(m, n, c)), rel=1e-6
    ), f"seed={seed} {fn.__name__}"
  assert float(step_time_s(m, hw, n2, c2)) == pytest.approx(
    float(step_time_s(m, hw, n, c)), rel=1e-6
  ), f"seed={seed}"


def test_all_padding_step_costs_zero():
  m, hw = ModelConfig.llama3_70b(), HardwareConfig.h200()
  n = jnp.zeros(16, jnp.int32)
  c = jnp.full(16, 50_000, jnp.int32)
  assert float(step_flops(m, n, c)) == 0.0
  assert float(step_bytes(m, n, c)) == 0.0
  assert float(step_time_s(m, hw, n, c)) == 0.0  # the overhead too


def test_hits_cut_flops_but_not_kv_reads():
  seed, rng = _fresh_rng()
  m = ModelConfig.llama3_8b()
  total = int(rng.integers(100, 20_000))
  hits = int(rng.integers(1, total))
  n_cold, c_cold = jnp.array([total]), jnp.array([0])
  n_warm, c_warm = jnp.array([total - hits]), jnp.array([hits])
  msg = f"seed={seed} total={total} hits={hits}"
  assert float(step_flops(m, n_warm, c_warm)) < float(
    step_flops(m, n_cold, c_cold)
  ), msg
  # Same c + n, so the same KV read and weights; only the writes shrink.
  saved = float(step_bytes(m, n_cold, c_cold)) - float(
    step_bytes(m, n_warm, c_warm)
  )
  assert saved == pytest.approx(m.kv_bytes_per_token * hits, rel=1e-4), msg


def test_long_context_decode_is_bandwidth_bound():
  m, hw = ModelConfig.llama3_8b(), HardwareConfig.h100()
  n = jnp.ones(64, jnp.int32)
  c = jnp.full(64, 32_768, jnp.int32)
  nbytes = float(step_bytes(m, n, c))
  flops = float(step_flops(m, n, c))
  t = float(step_time_s(m, hw, n, c))
  assert flops / hw.peak_flops < 0.1 * nbytes / hw.hbm_bandwidth
  assert t == pytest.approx(hw.step_overhead_s + nbytes / hw.hbm_bandwidth)
  # A derated bandwidth stretches exactly the memory term.
  slow = dataclasses.replace(hw, bandwidth_efficiency=0.5)
  assert float(step_time_s(m, slow, n, c)) == pytest.approx(
    hw.step_overhead_s + 2 * nbytes / hw.hbm_bandwidth
  )


def test_large_prefill_is_compute_bound():
  m, hw = ModelConfig.llama3_8b(), HardwareConfig.h100()
  n, c = jnp.array([8192, 0, 0]), jnp.array([0, 9, 0])
  nbytes = float(step_bytes(m, n, c))
  flops = float(step_flops(m, n, c))
  t = float(step_time_s(m, hw, n, c))
  assert nbytes / hw.hbm_bandwidth < 0.1 * flops / hw.peak_flops
  assert t == pytest.approx(hw.step_overhead_s + flops / hw.peak_flops)
  half = dataclasses.replace(hw, matmul_efficiency=0.5)
  assert float(step_time_s(m, half, n, c)) == pytest.approx(
    hw.step_overhead_s + 2 * flops / hw.peak_flops
  )


def test_clocks_are_hashable_static_arguments():
  seed, rng = _fresh_rng()
  n, c = _draw_lanes(rng, (5,))
  n[1] = 3
  clock = RooflineClock(ModelConfig.tiny(), HardwareConfig.tpu_v5e())
  assert hash(clock) == hash(
    RooflineClock(ModelConfig.tiny(), HardwareConfig.tpu_v5e())
  )

  @jax.jit(static_argnums=0)
  def run(clk, a, b):
    return clk.step_time_s(a, b)

  want = step_time_s(clock.model, clock.hardware, n, c)
  assert float(run(clock, n, c)) == pytest.approx(float(want)), f"seed={seed}"
  steps = StepsClock(0.025)
  got = run(steps, n, c)
  assert got.dtype == jnp.float32 and float(got) == pytest.approx(0.025)
  assert float(run(steps, np.zeros(5, np.int32), c)) == pytest.approx(0.025)
  assert jax.vmap(steps.step_time_s)(
    np.stack([n, n]), np.stack([c, c])
  ).shape == (2,)


def test_presets_and_lookup():
  for name, m in MODELS.items():
    assert model_config(name) is m and m.name == name
  for name, h in HARDWARE.items():
    assert hardware_config(name) is h and h.name == name
  assert ModelConfig.llama3_8b() == MODELS["llama3_8b"]
  h100 = HardwareConfig.h100()
  assert (h100.peak_flops, h100.hbm_bandwidth, h100.hbm_bytes) == (
    989e12,
    3.35e12,
    80 * 2**30,
  )
  assert HardwareConfig.tpu_v6e().hbm_bandwidth == 1640e9
  assert ModelConfig.tiny().num_params < 200_000


@pytest.mark.parametrize(
  "lookup, name, known",
  [(model_config, "llama9", MODELS), (hardware_config, "b200", HARDWARE)],
)
def test_unknown_preset_lists_known_names(lookup, name, known):
  with pytest.raises(ValueError) as err:
    lookup(name)
  assert name in str(err.value)
  for k in known:
    assert k in str(err.value)


@pytest.mark.parametrize(
  "field, value, error",
  [
    ("num_layers", 0, ValueError),
    ("hidden_size", -1, ValueError),
    ("head_dim", 16.0, TypeError),
    ("vocab_size", True, TypeError),
    ("num_kv_heads", 3, ValueError),  # 4 heads
    ("dtype", "int8", ValueError),
    ("dtype", 2, TypeError),
    ("tie_embeddings", 1, TypeError),
    ("rope_theta", 0.0, ValueError),
    ("rms_norm_eps", float("nan"), ValueError),
    ("name", "", TypeError),
  ],
)
def test_model_config_validation(field, value, error):
  with pytest.raises(error, match=rf"ModelConfig\.(.*\W)?{field}\b"):
    dataclasses.replace(ModelConfig.tiny(), **{field: value})


@pytest.mark.parametrize(
  "field, value, error",
  [
    ("peak_flops", 0.0, ValueError),
    ("hbm_bandwidth", -1e9, ValueError),
    ("hbm_bytes", float("inf"), ValueError),
    ("peak_flops", "1e12", TypeError),
    ("step_overhead_s", -1e-3, ValueError),
    ("matmul_efficiency", 0.0, ValueError),
    ("bandwidth_efficiency", 1.5, ValueError),
    ("matmul_efficiency", None, TypeError),
    ("peak_flops", 1e-50, ValueError),  # 0 in the float32 roofline
    ("hbm_bandwidth", 1e39, ValueError),  # inf there
  ],
)
def test_hardware_config_validation(field, value, error):
  with pytest.raises(error, match=rf"HardwareConfig\.{field}\b"):
    dataclasses.replace(HardwareConfig.h100(), **{field: value})


def test_clock_validation():
  with pytest.raises(TypeError, match="RooflineClock.model"):
    RooflineClock("tiny", HardwareConfig.h100())
  with pytest.raises(TypeError, match="RooflineClock.hardware"):
    RooflineClock(ModelConfig.tiny(), "h100")
  with pytest.raises(ValueError, match="StepsClock.seconds_per_step"):
    StepsClock(0.0)
  with pytest.raises(TypeError, match="StepsClock.seconds_per_step"):
    StepsClock("1")


def test_configs_module_imports_no_jax():
  src = importlib.util.find_spec("prefixjax.configs").origin
  with open(src) as f:
    text = f.read()
  assert "import jax" not in text


@pytest.mark.parametrize("module", [configs, roofline])
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0
