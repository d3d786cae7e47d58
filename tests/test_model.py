"""Tests of the Llama decoder against a plain-numpy float64 reference.

The reference (:func:`_reference_logits`) is written from the formulas of
Hugging Face ``modeling_llama.py`` (RMSNorm, rotate-half rotary embedding,
``repeat_kv`` grouped-query attention, SwiGLU), reading the weights out of
the params pytree; it shares no code with :mod:`prefixjax.model.llama`.
Weights are redrawn at O(1) scale (:func:`_randomize`) so that every term of
the forward moves the logits well above the tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax.configs import ModelConfig
from prefixjax.model import llama
from prefixjax.model.llama import Llama

TINY = ModelConfig.tiny()
# Multi-head attention (num_kv_heads == num_heads), other rope/eps values.
MHA = ModelConfig(
  name="mha",
  num_layers=2,
  hidden_size=32,
  num_heads=4,
  num_kv_heads=4,
  head_dim=8,
  intermediate_size=48,
  vocab_size=97,
  dtype="float32",
  rope_theta=500000.0,
  rms_norm_eps=1e-2,
)
# Tied embeddings, multi-query attention, three layers.
TIED = ModelConfig(
  name="tied",
  num_layers=3,
  hidden_size=24,
  num_heads=6,
  num_kv_heads=1,
  head_dim=4,
  intermediate_size=40,
  vocab_size=50,
  dtype="float32",
  tie_embeddings=True,
  rope_theta=100.0,
)
CONFIGS = [TINY, MHA, TIED]
IDS = [c.name for c in CONFIGS]


# bfloat16 twin of TINY; the same name, so the restore tests' configs differ
# from TINY in one field only.
TINY_BF16 = dataclasses.replace(TINY, dtype="bfloat16")


@functools.cache
def _init(config):
  """init_params(config), once per config (each compiles for about 1 s)."""
  return llama.init_params(config)


@functools.cache
def _forward(config):
  """The jitted dense forward ``(variables, ids) -> logits``."""
  return jax.jit(Llama(config).apply)


@pytest.fixture(scope="module")
def tiny_variables():
  return _init(TINY)


def _randomize(variables, rng):
  """Same tree, fresh O(1)-scale values: weights ~ N(0, 1/fan_in)."""

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    shape = leaf.shape
    if name.endswith("['weight']"):  # RMSNorm
      value = 1.0 + 0.5 * rng.standard_normal(shape)
    elif name.endswith("['embedding']"):
      value = rng.standard_normal(shape)
    else:  # kernel [in, out]
      value = rng.standard_normal(shape) / np.sqrt(shape[0])
    return jnp.asarray(value, dtype=leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, variables)


def _np(a):
  return np.asarray(jnp.asarray(a, jnp.float32), dtype=np.float64)


def _rms_norm(x, weight, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x, positions, theta):
  """x [T, H, Dh] rotated at positions [T] (rotate-half layout)."""
  dh = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
  angles = np.outer(positions, inv_freq)
  angles = np.concatenate([angles, angles], axis=-1)[:, None, :]
  half = dh // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * np.cos(angles) + rotated * np.sin(angles)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _reference_logits(variables, config, ids):
  """Plain float64 numpy forward of one sequence ``ids [T]`` -> ``[T, V]``."""
  p = jax.tree.map(_np, variables["params"])
  c = config
  t = len(ids)
  positions = np.arange(t)
  x = p["embed"]["embedding"][np.asarray(ids)]
  group = c.num_heads // c.num_kv_heads
  causal = np.tril(np.ones((t, t), dtype=bool))
  for i in range(c.num_layers):
    w = p[f"layers_{i}"]
    h = _rms_norm(x, w["input_norm"]["weight"], c.rms_norm_eps)
    q = (h @ w["q_proj"]["kernel"]).reshape(t, c.num_heads, c.head_dim)
    k = (h @ w["k_proj"]["kernel"]).reshape(t, c.num_kv_heads, c.head_dim)
    v = (h @ w["v_proj"]["kernel"]).reshape(t, c.num_kv_heads, c.head_dim)
    q = _rope(q, positions, c.rope_theta)
    k = _rope(k, positions, c.rope_theta)
    heads = []
    for head in range(c.num_heads):
      kv = head // group  # repeat_kv: query head h reads kv head h // G
      s = q[:, head] @ k[:, kv].T / np.sqrt(c.head_dim)
      s = np.where(causal, s, -np.inf)
      s = np.exp(s - s.max(axis=-1, keepdims=True))
      s = s / s.sum(axis=-1, keepdims=True)
      heads.append(s @ v[:, kv])
    attn = np.concatenate(heads, axis=-1)  # [T, Hq * Dh], head-major
    x = x + attn @ w["o_proj"]["kernel"]
    h = _rms_norm(x, w["post_attention_norm"]["weight"], c.rms_norm_eps)
    gate = _silu(h @ w["gate_proj"]["kernel"])
    x = x + (gate * (h @ w["up_proj"]["kernel"])) @ w["down_proj"]["kernel"]
  x = _rms_norm(x, p["norm"]["weight"], c.rms_norm_eps)
  if c.tie_embeddings:
    return x @ p["embed"]["embedding"].T
  return x @ p["lm_head"]["kernel"]


def _random_ids(rng, config, shape):
  return jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_logits_match_numpy_reference(config, rng):
  variables = _randomize(_init(config), rng)
  ids = _random_ids(rng, config, (2, 7))
  got = _forward(config)(variables, ids)
  assert got.shape == (2, 7, config.vocab_size)
  assert got.dtype == jnp.float32
  for b in range(2):
    want = _reference_logits(variables, config, np.asarray(ids[b]))
    assert np.abs(want).max() > 1.0  # a test with something to compare
    np.testing.assert_allclose(np.asarray(got[b]), want, rtol=1e-4, atol=1e-4)


def test_bfloat16_logits_near_reference(rng):
  config = TINY_BF16
  variables = _randomize(_init(config), rng)
  leaves = jax.tree.leaves(variables)
  assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
  ids = _random_ids(rng, config, (1, 6))
  got = np.asarray(_forward(config)(variables, ids)[0])
  assert got.dtype == np.float32
  want = _reference_logits(variables, config, np.asarray(ids[0]))
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel < 5e-2, rel


def test_init_params_tree_dtypes_and_determinism():
  a = llama.init_params(TINY, seed=1)
  b = llama.init_params(TINY, seed=1)
  c = llama.init_params(TINY, seed=2)
  assert set(a) == {"params"}
  p = a["params"]
  assert set(p) == {"embed", "layers_0", "layers_1", "norm", "lm_head"}
  assert p["layers_0"]["q_proj"]["kernel"].shape == (64, 64)
  assert p["layers_0"]["k_proj"]["kernel"].shape == (64, 32)
  assert p["layers_0"]["down_proj"]["kernel"].shape == (128, 64)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(a))
  np.testing.assert_array_equal(p["norm"]["weight"], np.ones(64, np.float32))
  std = float(jnp.std(p["embed"]["embedding"]))
  assert 0.015 < std < 0.025
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(
    a["params"]["embed"]["embedding"], c["params"]["embed"]["embedding"]
  )
  assert "lm_head" not in _init(TIED)["params"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_num_params_matches_config(config):
  assert llama.num_params(_init(config)) == config.num_params


def _decomposed(model, variables, ids):
  """embed -> per layer inputs / dense attention / output -> logits [T, V]."""
  t = ids.shape[-1]
  positions = jnp.arange(t, dtype=jnp.int32)
  x = model.apply(variables, ids, method=Llama.embed_tokens)
  for i in range(model.config.num_layers):
    q, k, v = model.apply(
      variables, i, x, positions, method=Llama.attention_inputs
    )
    attn = llama.dense_attention(q, k, v)
    x = model.apply(variables, i, x, attn, method=Llama.attention_output)
  return model.apply(variables, x, method=Llama.logits)


@pytest.mark.parametrize("config", [TINY, TIED], ids=["tiny", "tied"])
def test_method_decomposition_equals_call(config, rng):
  model = Llama(config)
  variables = _randomize(_init(config), rng)
  ids = _random_ids(rng, config, (3, 6))
  dense = _forward(config)(variables, ids)

  # As the engine calls them: one method at a time, jitted, in lax.map.
  @jax.jit
  def mapped(variables, ids):
    return jax.lax.map(lambda row: _decomposed(model, variables, row), ids)

  np.testing.assert_allclose(
    mapped(variables, ids), dense, rtol=1e-5, atol=1e-5
  )


def test_method_decomposition_eager(rng, tiny_variables):
  model = Llama(TINY)
  variables = _randomize(tiny_variables, rng)
  ids = _random_ids(rng, TINY, (1, 5))
  dense = _forward(TINY)(variables, ids)
  np.testing.assert_allclose(
    _decomposed(model, variables, ids[0]), dense[0], rtol=1e-5, atol=1e-5
  )


def test_methods_shapes_and_dtypes(tiny_variables):
  model = Llama(TINY)
  x = model.apply(
    tiny_variables, jnp.zeros((5,), jnp.int32), method=Llama.embed_tokens
  )
  assert x.shape == (5, 64) and x.dtype == jnp.float32
  pos = jnp.arange(5, dtype=jnp.int32)
  q, k, v = model.apply(
    tiny_variables, 1, x, pos, method=Llama.attention_inputs
  )
  assert q.shape == (5, 4, 16) and k.shape == v.shape == (5, 2, 16)
  y = model.apply(tiny_variables, 1, x, q, method=Llama.attention_output)
  assert y.shape == (5, 64)
  out = model.apply(tiny_variables, y, method=Llama.logits)
  assert out.shape == (5, 256) and out.dtype == jnp.float32
  # Leading batch axes, with per-row or shared positions.
  xb = jnp.stack([x, 2 * x])
  qb, _, _ = model.apply(
    tiny_variables, 0, xb, jnp.stack([pos, pos]), method=Llama.attention_inputs
  )
  qs, _, _ = model.apply(
    tiny_variables, 0, xb, pos, method=Llama.attention_inputs
  )
  np.testing.assert_array_equal(qb, qs)
  assert qb.shape == (2, 5, 4, 16)


def test_causality(rng, tiny_variables):
  forward = _forward(TINY)
  variables = _randomize(tiny_variables, rng)
  ids = _random_ids(rng, TINY, (1, 8))
  j = int(rng.integers(1, 7))
  changed = ids.at[0, j].set((ids[0, j] + 1) % TINY.vocab_size)
  a = np.asarray(forward(variables, ids))
  b = np.asarray(forward(variables, changed))
  np.testing.assert_allclose(a[:, :j], b[:, :j], rtol=1e-6, atol=1e-6)
  assert np.abs(a[:, j:] - b[:, j:]).max(axis=-1).min() > 1e-3


def test_prefix_logits_do_not_depend_on_length(rng, tiny_variables):
  forward = _forward(TINY)
  variables = _randomize(tiny_variables, rng)
  ids = _random_ids(rng, TINY, (2, 9))
  full = forward(variables, ids)
  short = forward(variables, ids[:, :4])
  np.testing.assert_allclose(short, full[:, :4], rtol=1e-5, atol=1e-5)


def test_rope_dot_product_depends_only_on_offset(rng):
  dh = 16
  q = jnp.asarray(rng.standard_normal((1, 1, dh)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, dh)), jnp.float32)

  def score(m, n):
    qm = llama.rotary_embedding(q, jnp.asarray([m], jnp.int32), theta=1e4)
    kn = llama.rotary_embedding(k, jnp.asarray([n], jnp.int32), theta=1e4)
    return float(jnp.sum(qm * kn))

  m, n = (int(v) for v in rng.integers(0, 40, 2))
  base = score(m, n)
  for shift in (1, 7, int(rng.integers(8, 60))):
    assert score(m + shift, n + shift) == pytest.approx(base, abs=1e-4)
  # And it does depend on the offset, and position 0 is the identity.
  assert abs(score(m + 3, n) - base) > 1e-3
  np.testing.assert_array_equal(
    llama.rotary_embedding(q, jnp.asarray([0], jnp.int32), theta=1e4), q
  )
  # Rotation preserves the norm.
  qr = llama.rotary_embedding(q, jnp.asarray([m], jnp.int32), theta=1e4)
  assert float(jnp.linalg.norm(qr)) == pytest.approx(
    float(jnp.linalg.norm(q)), rel=1e-5
  )


def test_rope_matches_reference(rng):
  x = rng.standard_normal((5, 3, 8))
  pos = rng.integers(0, 1000, 5)
  got = llama.rotary_embedding(
    jnp.asarray(x, jnp.float32), jnp.asarray(pos, jnp.int32), theta=500.0
  )
  np.testing.assert_allclose(got, _rope(x, pos, 500.0), rtol=1e-4, atol=1e-4)


def test_dense_attention_positions_and_empty_rows(rng):
  q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
  # Default: the queries are the last 3 of 5 tokens.
  default = llama.dense_attention(q, k, v)
  explicit = llama.dense_attention(
    q,
    k,
    v,
    q_positions=jnp.asarray([2, 3, 4], jnp.int32),
    kv_positions=jnp.arange(5, dtype=jnp.int32),
  )
  np.testing.assert_array_equal(default, explicit)
  # The last query sees every key: plain softmax attention, head h on kv h//2.
  s = np.einsum("hd,shd->hs", _np(q[2]), np.repeat(_np(k), 2, axis=1))
  p = np.exp(s / np.sqrt(8) - (s / np.sqrt(8)).max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  want = np.einsum("hs,shd->hd", p, np.repeat(_np(v), 2, axis=1))
  np.testing.assert_allclose(default[2], want, rtol=1e-5, atol=1e-5)
  # A query before every key sees nothing and gets zeros.
  none = llama.dense_attention(
    q, k, v, q_positions=jnp.asarray([-1, 0, 9], jnp.int32)
  )
  np.testing.assert_array_equal(none[0], np.zeros((4, 8), np.float32))
  assert np.isfinite(np.asarray(none)).all()
  # No keys at all: zeros too, not NaN.
  empty = llama.dense_attention(q, k[:0], v[:0])
  np.testing.assert_array_equal(empty, np.zeros((3, 4, 8), np.float32))


def _bits(a):
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("config", [TINY, TINY_BF16], ids=["f32", "bf16"])
def test_save_restore_round_trip_bitwise(tmp_path, rng, config, caplog):
  variables = _randomize(_init(config), rng)
  path = tmp_path / "ckpt"
  assert llama.save_params(variables, path, config=config) is None
  restored = llama.restore_params(str(path), config)
  assert jax.tree.structure(restored) == jax.tree.structure(variables)
  for a, b in zip(
    jax.tree.leaves(variables), jax.tree.leaves(restored), strict=True
  ):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(_bits(a), _bits(b))
  ids = _random_ids(rng, config, (2, 5))
  forward = _forward(config)
  want = forward(variables, ids)
  # Restored arrays are uncommitted, as fresh ones: the program compiled
  # for the saved variables serves them (committed, jit compiled again).
  caplog.clear()
  with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
    got = forward(restored, ids)
  assert "Compiling jit(apply)" not in caplog.text
  np.testing.assert_array_equal(want, got)


def test_damaged_params_are_named(tmp_path, rng):
  """TensorStore's error named an inner file; a ValueError names the
  checkpoint now, and the reads left in flight report nothing later."""
  path = tmp_path / "ckpt"
  llama.save_params(_init(TINY), path, config=TINY)
  data = [f for f in (path / "params").rglob("*") if f.parent.name == "d"]
  assert data
  for f in data:
    f.write_bytes(rng.bytes(48))
  with pytest.raises(ValueError, match="its params cannot be restored"):
    llama.restore_params(path, TINY)


def test_restore_with_other_config_names_field(tmp_path, tiny_variables):
  path = tmp_path / "ckpt"
  llama.save_params(tiny_variables, path, config=TINY)
  other = dataclasses.replace(TINY, rope_theta=500000.0)
  with pytest.raises(ValueError, match="rope_theta"):
    llama.restore_params(path, other)
  with pytest.raises(ValueError, match="rms_norm_eps"):
    llama.restore_params(path, dataclasses.replace(TINY, rms_norm_eps=1e-6))
  with pytest.raises(ValueError, match="num_layers"):
    llama.restore_params(path, dataclasses.replace(TINY, num_layers=3))
  with pytest.raises(ValueError, match="dtype"):
    llama.restore_params(path, TINY_BF16)


def test_save_refuses_existing_path(tmp_path, tiny_variables):
  path = tmp_path / "ckpt"
  llama.save_params(tiny_variables, path, config=TINY)
  with pytest.raises(FileExistsError, match="existing"):
    llama.save_params(tiny_variables, path, config=TINY)
  empty = tmp_path / "empty"
  os.mkdir(empty)
  with pytest.raises(FileExistsError):
    llama.save_params(tiny_variables, empty, config=TINY)


def test_save_checks_params_against_config(tmp_path, tiny_variables):
  with pytest.raises(ValueError, match="tree"):
    llama.save_params(tiny_variables, tmp_path / "a", config=TIED)
  with pytest.raises(ValueError, match="tree"):
    llama.save_params(tiny_variables["params"], tmp_path / "b", config=TINY)
  with pytest.raises(ValueError, match="bfloat16"):
    llama.save_params(tiny_variables, tmp_path / "c", config=TINY_BF16)
  assert not any(tmp_path.iterdir())


def test_restore_missing_path(tmp_path):
  with pytest.raises(FileNotFoundError):
    llama.restore_params(tmp_path / "nothing", TINY)
  os.mkdir(tmp_path / "not_a_checkpoint")
  with pytest.raises(FileNotFoundError, match="save_params"):
    llama.restore_params(tmp_path / "not_a_checkpoint", TINY)


def test_input_validation(tiny_variables, tmp_path):
  model = Llama(TINY)
  with pytest.raises(TypeError, match="ModelConfig"):
    Llama("tiny")
  with pytest.raises(TypeError, match="ModelConfig"):
    llama.init_params(dataclasses.asdict(TINY))
  with pytest.raises(TypeError, match="ModelConfig"):
    llama.save_params(tiny_variables, tmp_path / "x", config=None)
  with pytest.raises(TypeError, match="ModelConfig"):
    llama.restore_params(tmp_path / "x", "tiny")
  with pytest.raises(TypeError, match="seed"):
    llama.init_params(TINY, seed=True)
  with pytest.raises(TypeError, match="seed"):
    llama.init_params(TINY, seed=1.5)
  with pytest.raises(ValueError, match="seed"):
    llama.init_params(TINY, seed=-1)
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    model.apply(tiny_variables, jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="integer"):
    model.apply(tiny_variables, jnp.zeros((1, 4), jnp.float32))
  with pytest.raises(ValueError, match=r"\[0, 256\)"):
    model.apply(tiny_variables, jnp.asarray([[0, 256]], jnp.int32))
  with pytest.raises(ValueError, match=r"\[0, 256\)"):
    model.apply(
      tiny_variables, jnp.asarray([-1], jnp.int32), method=Llama.embed_tokens
    )
  x = jnp.zeros((3, 64), jnp.float32)
  pos = jnp.arange(3, dtype=jnp.int32)
  with pytest.raises(ValueError, match="layer=2"):
    model.apply(tiny_variables, 2, x, pos, method=Llama.attention_inputs)
  with pytest.raises(TypeError, match="layer"):
    model.apply(tiny_variables, True, x, pos, method=Llama.attention_inputs)
  with pytest.raises(ValueError, match="positions"):
    model.apply(tiny_variables, 0, x, pos[:2], method=Llama.attention_inputs)
  with pytest.raises(ValueError, match="x"):
    model.apply(tiny_variables, 0, x[:, :8], pos, method=Llama.attention_inputs)
  with pytest.raises(ValueError, match="attn"):
    model.apply(
      tiny_variables,
      0,
      x,
      jnp.zeros((3, 2, 16), jnp.float32),
      method=Llama.attention_output,
    )
