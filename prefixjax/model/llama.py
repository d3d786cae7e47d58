"""A Llama-style decoder in Flax linen, split into the pieces an engine calls.

:class:`Llama` is the decoder that :class:`prefixjax.configs.ModelConfig`
describes: token embedding, ``num_layers`` pre-norm decoder layers (RMSNorm,
grouped-query self-attention with rotary positions, RMSNorm, SwiGLU MLP, no
biases anywhere), a final RMSNorm and an LM head (or the embedding table,
when ``tie_embeddings``). Besides the dense causal forward (``__call__``) it
exposes the per-layer pieces around attention, so that an engine can run
attention itself (over a paged KV cache) between them:

* :meth:`Llama.embed_tokens`: ids -> residual stream.
* :meth:`Llama.attention_inputs`: residual -> rotated ``q``, ``k`` and ``v``.
* :meth:`Llama.attention_output`: residual and attention result -> the next
  layer's residual (output projection, residual add, MLP block).
* :meth:`Llama.logits`: residual -> float32 logits.

``__call__`` is exactly these four plus :func:`dense_attention`, so the
decomposition and the dense forward agree by construction.

Conventions, those of Hugging Face transformers
``src/transformers/models/llama/modeling_llama.py`` (``LlamaRMSNorm``,
``LlamaRotaryEmbedding``, ``rotate_half``, ``apply_rotary_pos_emb``,
``repeat_kv``, ``eager_attention_forward``, ``LlamaMLP``) and the Llama
papers (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models", arXiv:2302.13971, section 2.2; "Llama 2", arXiv:2307.09288;
Grattafiori et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783):

* RMSNorm (Zhang & Sennrich 2019): ``x * rsqrt(mean(x**2) + eps) * weight``
  over the last axis, all in float32, the result cast to the param dtype.
  (Hugging Face casts back to the input dtype *before* multiplying by the
  weight; for float32 the two are identical.)
* Rotary embedding (Su et al. 2021, RoFormer, arXiv:2104.09864) in the
  "rotate half" layout of the Hugging Face checkpoints: ``inv_freq =
  theta ** (-arange(0, Dh, 2) / Dh)`` (computed in float64, stored as
  float32), ``angles = positions * inv_freq``, ``cos`` and ``sin`` of the
  angles concatenated twice to width ``Dh``, and ``x * cos +
  rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]`` on the two
  halves of the head axis. Applied in float32 to ``q`` and ``k`` (not ``v``),
  the result cast to the param dtype.
* Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): query head
  ``h`` reads key/value head ``h // (num_heads // num_kv_heads)``, as
  ``repeat_kv`` does. Scores ``q . k / sqrt(Dh)`` and softmax in float32; the
  probabilities cast to the value dtype before the weighted sum.
* SwiGLU MLP (Shazeer 2020, arXiv:2002.05202): ``down(silu(gate(x)) *
  up(x))``.
* Layer: ``h = x + o_proj(attention(input_norm(x)))``, ``out = h +
  mlp(post_attention_norm(h))``.
* Params and compute in ``config.dtype`` (``jnp.dtype(config.dtype)``);
  :meth:`Llama.logits` computes the head in that dtype and returns float32.
* Initialisation: ``normal(stddev=0.02)`` for every kernel and the embedding
  table (Hugging Face ``initializer_range``), ones for the RMSNorm weights.

Param tree (``init_params(config)["params"]``), kernels stored as ``[in,
out]`` (the transpose of a Hugging Face ``nn.Linear.weight``)::

  embed/embedding                     [V, d]
  layers_{i}/input_norm/weight        [d]
  layers_{i}/q_proj/kernel            [d, num_heads * Dh]
  layers_{i}/k_proj/kernel            [d, num_kv_heads * Dh]
  layers_{i}/v_proj/kernel            [d, num_kv_heads * Dh]
  layers_{i}/o_proj/kernel            [num_heads * Dh, d]
  layers_{i}/post_attention_norm/weight [d]
  layers_{i}/gate_proj/kernel         [d, f]
  layers_{i}/up_proj/kernel           [d, f]
  layers_{i}/down_proj/kernel         [f, d]
  norm/weight                         [d]
  lm_head/kernel                      [d, V]   (absent when tied)

Shapes in comments: ``T`` query tokens, ``S`` key tokens, ``d`` hidden size,
``Hq`` / ``Hkv`` query / key-value heads, ``Dh`` head dim, ``V`` vocabulary.

Checkpoints (:func:`save_params`, :func:`restore_params`) are orbax
checkpoints with two items: ``params`` (``StandardSave``, the arrays) and
``config`` (``JsonSave``, the :class:`ModelConfig` fields), so a restore
can refuse a checkpoint written for another model.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from prefixjax.configs import ModelConfig

__all__ = [
  "DecoderLayer",
  "Llama",
  "RMSNorm",
  "check_params",
  "checkpoint_path",
  "dense_attention",
  "init_params",
  "num_params",
  "restore_params",
  "rotary_embedding",
  "save_params",
]

_INIT_STDDEV = 0.02
_INIT_TOKENS = 8


def _check_config(config) -> None:
  if not isinstance(config, ModelConfig):
    raise TypeError(f"config must be a ModelConfig, got {config!r}")


def _lift(a: jax.Array, ndim: int) -> jax.Array:
  """``a`` with leading size-1 axes up to rank ``ndim`` (explicit rank)."""
  return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def _check_int_array(name: str, a) -> jax.Array:
  a = jnp.asarray(a)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
  return a


def _concrete(a) -> np.ndarray | None:
  """``a`` as a host array, or None when it is a tracer (inside jit)."""
  if isinstance(a, jax.core.Tracer):
    return None
  return np.asarray(a)


def rotary_embedding(
  x: jax.Array, positions: jax.Array, *, theta: float
) -> jax.Array:
  """Rotates ``x`` by its token positions, rotate-half layout, in float32.

  Args:
    x: ``[..., T, H, Dh]`` queries or keys; ``Dh`` even.
    positions: integer ``[T]`` or ``[..., T]`` (the same leading axes as
      ``x``) position of each token.
    theta: rotary base frequency (``ModelConfig.rope_theta``).

  Returns:
    ``x * cos + rotate_half(x) * sin`` with the angles ``positions *
    inv_freq``, in ``x``'s dtype.

  Raises:
    ValueError: an odd head dim, or positions that do not match ``x``.
  """
  dh = x.shape[-1]
  if dh % 2:
    raise ValueError(f"rotary embedding needs an even head dim, got {dh}")
  positions = _check_int_array("positions", positions)
  if x.ndim < 3 or positions.shape not in (
    x.shape[-3:-2],
    x.shape[:-2],
  ):
    raise ValueError(
      f"positions {positions.shape} must be [T] or [..., T] for x {x.shape} "
      "[..., T, H, Dh]"
    )
  inv_freq = jnp.asarray(
    float(theta) ** (-np.arange(0, dh, 2, dtype=np.float64) / dh),
    dtype=jnp.float32,
  )
  pos = positions.astype(jnp.float32)[..., None]
  angles = pos * _lift(inv_freq, pos.ndim)  # [..., T, Dh/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
  cos = _lift(jnp.cos(angles), x.ndim)  # [..., T, 1, Dh]
  sin = _lift(jnp.sin(angles), x.ndim)
  xf = x.astype(jnp.float32)
  half = dh // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)


def dense_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  q_positions: jax.Array | None = None,
  kv_positions: jax.Array | None = None,
) -> jax.Array:
  """Plain causal grouped-query attention (the reference the engine matches).

  Query ``t`` attends to key ``s`` iff ``kv_positions[s] <=
  q_positions[t]``. By default ``kv_positions = arange(S)`` and
  ``q_positions = arange(S - T, S)``: the queries are the last ``T`` of the
  ``S`` tokens (ordinary causal attention when ``T == S``). A query that sees
  no key (a position before every key, or ``S == 0``) gets zeros.

  Args:
    q: ``[..., T, Hq, Dh]`` queries (already rotated).
    k: ``[..., S, Hkv, Dh]`` keys (already rotated); ``Hkv`` divides ``Hq``.
    v: ``[..., S, Hkv, Dh]`` values.
    q_positions: optional integer ``[T]`` positions of the queries.
    kv_positions: optional integer ``[S]`` positions of the keys.

  Returns:
    ``[..., T, Hq, Dh]`` in ``q``'s dtype: scores ``q . k / sqrt(Dh)`` and
    softmax in float32, probabilities cast to ``v``'s dtype for the sum.

  Raises:
    ValueError: shapes that do not fit together.
  """
  if q.ndim < 3 or k.shape != v.shape or k.ndim != q.ndim:
    raise ValueError(
      f"q {q.shape}, k {k.shape}, v {v.shape} must be [..., T, Hq, Dh], "
      "[..., S, Hkv, Dh], [..., S, Hkv, Dh]"
    )
  *lead, t, hq, dh = q.shape
  s, hkv = k.shape[-3], k.shape[-2]
  if (
    tuple(k.shape[:-3]) != tuple(lead)
    or k.shape[-1] != dh
    or hkv < 1
    or hq % hkv
  ):
    raise ValueError(
      f"q {q.shape} and k {k.shape} disagree (leading axes, head dim, or "
      "num_heads not a multiple of num_kv_heads)"
    )
  if q_positions is None:
    q_positions = jnp.arange(s - t, s, dtype=jnp.int32)
  if kv_positions is None:
    kv_positions = jnp.arange(s, dtype=jnp.int32)
  q_positions = _check_int_array("q_positions", q_positions)
  kv_positions = _check_int_array("kv_positions", kv_positions)
  q_positions = q_positions.astype(jnp.int32)
  kv_positions = kv_positions.astype(jnp.int32)
  if q_positions.shape != (t,) or kv_positions.shape != (s,):
    raise ValueError(
      f"q_positions {q_positions.shape} and kv_positions "
      f"{kv_positions.shape} must be [{t}] and [{s}]"
    )
  g = hq // hkv
  qg = q.reshape(*lead, t, hkv, g, dh)
  scores = jnp.einsum(
    "...tkgd,...skd->...kgts", qg, k, preferred_element_type=jnp.float32
  ) * (1.0 / float(np.sqrt(dh)))  # [..., Hkv, G, T, S]
  mask = kv_positions[None, :] <= q_positions[:, None]  # [T, S]
  mask = _lift(mask, scores.ndim)
  scores = jnp.where(mask, scores, -jnp.inf)
  peak = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  weights = jnp.exp(scores - peak)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  probs = weights / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum(
    "...kgts,...skd->...tkgd",
    probs.astype(v.dtype),
    v,
    preferred_element_type=jnp.float32,
  )
  return out.reshape(*lead, t, hq, dh).astype(q.dtype)


class RMSNorm(nn.Module):
  """Root-mean-square norm over the last axis, in float32.

  Attributes:
    eps: added to the mean square.
    dtype: param and output dtype.
  """

  eps: float
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    weight = self.param(
      "weight", nn.initializers.ones, (x.shape[-1],), self.dtype
    )
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(ms + self.eps)
    y = y * _lift(weight.astype(jnp.float32), y.ndim)
    return y.astype(self.dtype)


def _dense(features: int, dtype, name: str) -> nn.Dense:
  return nn.Dense(
    features,
    use_bias=False,
    dtype=dtype,
    param_dtype=dtype,
    kernel_init=nn.initializers.normal(stddev=_INIT_STDDEV),
    name=name,
  )


class DecoderLayer(nn.Module):
  """One pre-norm decoder layer, split around attention.

  Attributes:
    config: the model.
  """

  config: ModelConfig

  def setup(self):
    c = self.config
    dtype = jnp.dtype(c.dtype)
    self.input_norm = RMSNorm(c.rms_norm_eps, dtype, name="input_norm")
    self.q_proj = _dense(c.num_heads * c.head_dim, dtype, "q_proj")
    self.k_proj = _dense(c.num_kv_heads * c.head_dim, dtype, "k_proj")
    self.v_proj = _dense(c.num_kv_heads * c.head_dim, dtype, "v_proj")
    self.o_proj = _dense(c.hidden_size, dtype, "o_proj")
    self.post_attention_norm = RMSNorm(
      c.rms_norm_eps, dtype, name="post_attention_norm"
    )
    self.gate_proj = _dense(c.intermediate_size, dtype, "gate_proj")
    self.up_proj = _dense(c.intermediate_size, dtype, "up_proj")
    self.down_proj = _dense(c.hidden_size, dtype, "down_proj")

  def attention_inputs(
    self, x: jax.Array, positions: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[..., T, d]`` -> rotated ``q [..., T, Hq, Dh]``, ``k``, ``v``."""
    c = self.config
    h = self.input_norm(x)
    lead = x.shape[:-1]
    q = self.q_proj(h).reshape(*lead, c.num_heads, c.head_dim)
    k = self.k_proj(h).reshape(*lead, c.num_kv_heads, c.head_dim)
    v = self.v_proj(h).reshape(*lead, c.num_kv_heads, c.head_dim)
    q = rotary_embedding(q, positions, theta=c.rope_theta)
    k = rotary_embedding(k, positions, theta=c.rope_theta)
    return q, k, v

  def attention_output(self, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual ``x [..., T, d]``, ``attn [..., T, Hq, Dh]`` -> new residual."""
    width = attn.shape[-2] * attn.shape[-1]
    h = x + self.o_proj(attn.reshape(*attn.shape[:-2], width))
    m = self.post_attention_norm(h)
    m = self.down_proj(nn.silu(self.gate_proj(m)) * self.up_proj(m))
    return h + m


class Llama(nn.Module):
  """The Llama-style decoder of ``config`` (see the module docstring).

  Every submodule is defined in ``setup``, so each method can be called on
  its own through ``model.apply(variables, ..., method=Llama.<name>)``
  (inside ``jit`` or ``lax.map`` too) without creating params; ``init``
  through ``__call__`` creates all of them (use :func:`init_params`).

  Attributes:
    config: the model.

  Raises:
    TypeError: ``config`` is not a :class:`ModelConfig`.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.configs import ModelConfig
    >>> from prefixjax.model.llama import Llama, init_params
    >>> config = ModelConfig.tiny()
    >>> variables = init_params(config)
    >>> Llama(config).apply(variables, jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 256)
  """

  config: ModelConfig

  def __post_init__(self):
    _check_config(self.config)
    super().__post_init__()

  def setup(self):
    c = self.config
    dtype = jnp.dtype(c.dtype)
    self.embed = nn.Embed(
      c.vocab_size,
      c.hidden_size,
      dtype=dtype,
      param_dtype=dtype,
      embedding_init=nn.initializers.normal(stddev=_INIT_STDDEV),
      name="embed",
    )
    self.layers = [
      DecoderLayer(c, name=f"layers_{i}") for i in range(c.num_layers)
    ]
    self.norm = RMSNorm(c.rms_norm_eps, dtype, name="norm")
    if not c.tie_embeddings:
      self.lm_head = _dense(c.vocab_size, dtype, "lm_head")

  def _layer(self, layer) -> DecoderLayer:
    if isinstance(layer, bool):
      raise TypeError(f"layer must be an int, got {layer!r}")
    try:
      i = operator.index(layer)
    except TypeError:
      raise TypeError(
        f"layer must be a static Python int, got {layer!r}"
      ) from None
    if not 0 <= i < self.config.num_layers:
      raise ValueError(
        f"layer={i} out of range for {self.config.num_layers} layers"
      )
    return self.layers[i]

  def _check_hidden(self, name: str, x: jax.Array, min_ndim: int = 2) -> None:
    if x.ndim < min_ndim or x.shape[-1] != self.config.hidden_size:
      raise ValueError(
        f"{name} {x.shape} must be [..., T, {self.config.hidden_size}]"
      )

  def embed_tokens(self, ids: jax.Array) -> jax.Array:
    """Token ids ``int [..., T]`` -> residual stream ``[..., T, d]``.

    Ids are range-checked only when concrete; under ``jit`` an id outside
    ``[0, V)`` gives a NaN row (``jnp.take``'s fill mode).

    Raises:
      ValueError: non-integer ids, or concrete ids outside ``[0, V)``.
    """
    ids = _check_int_array("ids", ids)
    host = _concrete(ids)
    if host is not None and host.size:
      lo, hi = int(host.min()), int(host.max())
      if lo < 0 or hi >= self.config.vocab_size:
        raise ValueError(
          f"ids must be in [0, {self.config.vocab_size}), got values in "
          f"[{lo}, {hi}]"
        )
    return self.embed(ids)

  def attention_inputs(
    self, layer: int, x: jax.Array, positions: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Layer ``layer``'s attention inputs.

    Input RMSNorm, the q/k/v projections, and the rotary embedding of ``q``
    and ``k`` at ``positions``.

    Args:
      layer: static Python int in ``[0, num_layers)``.
      x: ``[T, d]`` (or ``[..., T, d]``) residual stream, the layer input.
      positions: integer ``[T]`` (or ``[..., T]``) token positions.

    Returns:
      ``(q [..., T, Hq, Dh], k [..., T, Hkv, Dh], v [..., T, Hkv, Dh])`` in
      the param dtype.
    """
    block = self._layer(layer)
    self._check_hidden("x", x)
    return block.attention_inputs(x, positions)

  def attention_output(
    self, layer: int, x: jax.Array, attn: jax.Array
  ) -> jax.Array:
    """Layer ``layer``'s output, from its input and its attention result.

    Args:
      layer: static Python int in ``[0, num_layers)``.
      x: ``[T, d]`` (or ``[..., T, d]``) the layer input (the residual).
      attn: ``[T, Hq, Dh]`` (or ``[..., T, Hq, Dh]``) attention result.

    Returns:
      ``h + mlp(post_attention_norm(h))`` with ``h = x + o_proj(attn)``:
      ``[..., T, d]``, the next layer's input.
    """
    block = self._layer(layer)
    self._check_hidden("x", x)
    c = self.config
    if attn.shape != (*x.shape[:-1], c.num_heads, c.head_dim):
      raise ValueError(
        f"attn {attn.shape} must be x's leading axes {x.shape[:-1]} + "
        f"({c.num_heads}, {c.head_dim})"
      )
    return block.attention_output(x, attn)

  def logits(self, x: jax.Array) -> jax.Array:
    """Residual ``[..., T, d]`` (or one row ``[d]``) -> float32 ``[..., T, V]``.

    Final RMSNorm, then the LM head (or ``embed.attend`` when tied) in the
    param dtype; the result cast to float32.
    """
    self._check_hidden("x", x, min_ndim=1)
    h = self.norm(x)
    if self.config.tie_embeddings:
      out = self.embed.attend(h)
    else:
      out = self.lm_head(h)
    return out.astype(jnp.float32)

  def __call__(self, ids: jax.Array) -> jax.Array:
    """Dense causal forward: ``int [B, T]`` -> float32 logits ``[B, T, V]``.

    Positions ``0 .. T-1`` for every row; attention by
    :func:`dense_attention`.

    Raises:
      ValueError: ids not an integer ``[B, T]`` array, or concrete ids out
        of range.
    """
    ids = _check_int_array("ids", ids)
    if ids.ndim != 2:
      raise ValueError(f"ids must be [B, T], got shape {ids.shape}")
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)
    x = self.embed_tokens(ids)
    for i in range(self.config.num_layers):
      q, k, v = self.attention_inputs(i, x, positions)
      attn = dense_attention(
        q, k, v, q_positions=positions, kv_positions=positions
      )
      x = self.attention_output(i, x, attn)
    return self.logits(x)


def init_params(config: ModelConfig, seed: int = 0) -> dict:
  """Fresh variables of ``Llama(config)``.

  Args:
    config: the model.
    seed: non-negative int below ``2**32``, the PRNG seed.

  Returns:
    The full variables dict ``{"params": {...}}`` (pass it as is to
    ``Llama(config).apply``), arrays in ``config.dtype``.

  Raises:
    TypeError: a non-ModelConfig ``config`` or a non-int ``seed``.
    ValueError: a seed outside ``[0, 2**32)``.
  """
  _check_config(config)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"seed must be an int, got {seed!r}")
  if not 0 <= int(seed) < 2**32:
    raise ValueError(f"seed={seed} must be in [0, 2**32)")
  return _init(config, jax.random.key(int(seed)))


@functools.partial(jax.jit, static_argnums=0)
def _init(config: ModelConfig, key: jax.Array) -> dict:
  # Jitted, static in the (hashable, frozen) config: one compile per config,
  # and the forward pass that init traces is dead code XLA drops.
  ids = jnp.zeros((1, _INIT_TOKENS), jnp.int32)
  return {"params": Llama(config).init(key, ids)["params"]}


def num_params(params) -> int:
  """Number of elements over all leaves of ``params`` (any pytree)."""
  return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(params))


def _abstract_params(config: ModelConfig) -> dict:
  """``init_params(config)`` as ``ShapeDtypeStruct`` leaves, not computed."""
  return jax.eval_shape(lambda: init_params(config))


def check_params(params, config: ModelConfig) -> None:
  """Raises ValueError unless ``params`` has the tree, shapes and dtypes of
  :func:`init_params` of ``config`` (arrays or ``ShapeDtypeStruct`` leaves)
  and, where its arrays are concrete, only finite values.
  """
  expected = _abstract_params(config)
  got_def = jax.tree.structure(params)
  want_def = jax.tree.structure(expected)
  if got_def != want_def:
    raise ValueError(
      "params do not have the tree of init_params(config) (the variables "
      f"dict {{'params': ...}} of {config.name!r}): got {got_def}, "
      f"expected {want_def}"
    )
  for (path, leaf), want in zip(
    jax.tree_util.tree_leaves_with_path(params),
    jax.tree.leaves(expected),
    strict=True,
  ):
    shape = np.shape(leaf)
    dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else type(leaf))
    if shape != want.shape or dtype != want.dtype:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} is {dtype}{list(shape)}, "
        f"expected {want.dtype}{list(want.shape)} for {config.name!r}"
      )
  # Values, where they are concrete: a NaN weight makes every logit NaN,
  # and greedy sampling then emits token 0 with no error.
  leaves = [
    (path, leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    if not isinstance(leaf, jax.ShapeDtypeStruct)
  ]
  try:
    finite = jax.device_get([jnp.all(jnp.isfinite(x)) for _, x in leaves])
  except (
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
  ):
    return  # traced: shapes and dtypes are all there is to check
  bad = [
    jax.tree_util.keystr(p)
    for (p, _), ok in zip(leaves, finite, strict=True)
    if not ok
  ]
  if bad:
    raise ValueError(
      f"params{bad[0]} holds NaN or inf ({len(bad)} arrays do): the model "
      "would sample garbage"
    )


def checkpoint_path(path) -> pathlib.Path:
  """``path`` (str or PathLike) as an absolute :class:`pathlib.Path`."""
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
  return pathlib.Path(os.path.abspath(os.fspath(path)))


def _config_json(config: ModelConfig) -> dict:
  return dataclasses.asdict(config)


def save_params(params, path, *, config: ModelConfig) -> None:
  """Writes ``params`` and ``config`` as an orbax checkpoint at ``path``.

  Two items under the new directory ``path``: ``params`` (orbax
  ``StandardSave``) and ``config`` (``JsonSave`` of the config's fields).
  Returns once the checkpoint is complete on disk.

  Args:
    params: the variables dict of ``config``'s model, as
      :func:`init_params` returns it.
    path: directory to create; must not exist yet.
    config: the model ``params`` belong to.

  Raises:
    TypeError: a non-ModelConfig ``config`` or a bad ``path`` type.
    FileExistsError: ``path`` exists already.
    ValueError: ``params`` do not match ``config``'s tree, shapes, dtypes.
  """
  _check_config(config)
  target = checkpoint_path(path)
  if target.exists():
    raise FileExistsError(
      f"refusing to overwrite existing path {str(target)!r}; save_params "
      "writes a new checkpoint directory"
    )
  check_params(params, config)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(
      target,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        config=ocp.args.JsonSave(_config_json(config)),
      ),
    )


def host_targets(tree):
  """Host (numpy) restore targets of ``tree``'s shapes and dtypes.

  Orbax restores into numpy; the callers put the arrays on the default
  device uncommitted (``jax.device_put``), as freshly made arrays are.
  Restored as committed device arrays, every program compiled again for
  them (jit keys on committed shardings), and again where fresh and
  restored arrays met: a restored engine compiled its scheduler step four
  times, a fresh one twice, and a new process missed the persistent
  compilation cache for all of them.
  """
  return jax.tree.map(lambda a: np.empty(np.shape(a), a.dtype), tree)


def drop_closed_loop_noise() -> None:
  """Drops the "Event loop is closed" reports a failed array restore leaves.

  When one array of a checkpoint cannot be read, orbax's restore fails and
  closes its asyncio event loop while TensorStore still has reads in
  flight; each read that completes later hands its result to the closed
  loop, and Python prints "Exception ignored ... RuntimeError: Event loop
  is closed" for it (18 for the tiny model; orbax-checkpoint 0.12.8,
  tensorstore 0.1.86), some even before the restore has raised its
  ValueError. Those reports say nothing more; this wraps
  ``sys.unraisablehook`` (once per process, before the first array
  restore) to drop exactly that RuntimeError and pass everything else to
  the hook it replaces.
  """
  previous = sys.unraisablehook
  if getattr(previous, "_drops_closed_loop_noise", False):
    return

  def hook(unraisable):
    err = unraisable.exc_value
    if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
      return
    previous(unraisable)

  hook._drops_closed_loop_noise = True
  sys.unraisablehook = hook


def restore_on_host(checkpointer, source, what: str, why: str, **items):
  """Orbax-restores ``items`` (name -> a tree of arrays or shapes) into
  numpy (:func:`host_targets`); the caller puts them on the device.

  Raises:
    ValueError: ``"{what} cannot be restored ({why}): ..."`` for damaged or
      missing array files or arrays of other shapes (orbax and TensorStore
      name only the inner file); the reads left in flight report nothing
      later (:func:`drop_closed_loop_noise`).
  """
  args = {
    k: ocp.args.StandardRestore(host_targets(v)) for k, v in items.items()
  }
  # Before the restore: a read can hand its result to the closed loop
  # before the failure reaches the except clause below (a teardown error
  # under pytest's unraisable-exception check, seen once in 1,340 tests).
  drop_closed_loop_noise()
  try:
    return checkpointer.restore(source, args=ocp.args.Composite(**args))
  except (ValueError, TypeError, KeyError, OSError) as err:
    raise ValueError(
      f"{what} cannot be restored ({why}): {type(err).__name__}: {err}"
    ) from err


def restore_params(path, config: ModelConfig) -> dict:
  """Reads a checkpoint :func:`save_params` wrote for ``config``.

  Args:
    path: the checkpoint directory.
    config: the model expected; every field must equal the saved one.

  Returns:
    The variables dict ``{"params": ...}``, arrays bitwise equal to those
    saved, on the default device.

  Raises:
    TypeError: a non-ModelConfig ``config`` or a bad ``path`` type.
    FileNotFoundError: no directory at ``path``, or one without a config
      item (not written by :func:`save_params`).
    ValueError: the saved config differs (the message names the fields),
      or the params cannot be read (a damaged checkpoint).
  """
  _check_config(config)
  source = checkpoint_path(path)
  if not source.is_dir():
    raise FileNotFoundError(f"no checkpoint directory at {str(source)!r}")
  if not (source / "config").is_dir() or not (source / "params").is_dir():
    raise FileNotFoundError(
      f"{str(source)!r} is not a save_params checkpoint (no 'config' and "
      "'params' items)"
    )
  abstract = _abstract_params(config)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    saved = checkpointer.restore(
      source, args=ocp.args.Composite(config=ocp.args.JsonRestore())
    )["config"]
    want = _config_json(config)
    differing = [
      f"{k} (saved {saved.get(k, '<missing>')!r}, expected {want[k]!r})"
      for k in want
      if saved.get(k, "<missing>") != want[k]
    ]
    differing += [f"{k} (saved, unknown)" for k in saved if k not in want]
    if differing:
      raise ValueError(
        f"checkpoint {str(source)!r} was saved for another model config; "
        f"differing fields: {', '.join(differing)}"
      )
    restored = restore_on_host(
      checkpointer,
      source,
      f"checkpoint {str(source)!r}: its params",
      "a damaged checkpoint",
      params=abstract,
    )["params"]
  return jax.device_put(restored)
