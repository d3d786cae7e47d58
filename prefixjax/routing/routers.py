"""Routers: which replica serves an arriving request.

A :class:`Router` is a small protocol of traceable functions, registered by
name (:func:`register_router`, :func:`get_router`), like the schedulers:

* ``init(num_replicas, num_requests) -> state``: the router's own state (a
  pytree, e.g. a counter or a window of recent work);
* ``pick(state, view: RouteView, rid) -> replica``: ``[]`` int32;
* ``on_route(state, view, rid, replica) -> state``: after the choice.

:class:`RouteView` is what a router may read of the cluster at the moment
the request arrives: per replica its load and the prefix the replica holds
for this request (``match_tokens``). Whether that match is the replica's
real cache or the router's own picture of it is the cluster's ``mode``
(:mod:`prefixjax.routing.cluster`: ``"exact"`` reads each replica's prefix
cache, ``"approximate"`` a per-replica LRU of the block hashes the router
itself sent there, as production routers keep one, sized, aged and capped
as that router's product does: :class:`ApproxView`), so every
cache-reading router runs in both modes unchanged.

Rules and defaults, each cited in its factory's docstring: ``round_robin``,
``least_load``, ``cache_aware`` (SGLang's gateway), ``kv_cost`` (Dynamo's
KV router), ``e2`` (Preble), ``session_affinity`` (consistent hashing),
``llm_d`` (llm-d's weighted scorers).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "ApproxView",
  "RouteView",
  "Router",
  "get_router",
  "register_router",
  "router_names",
]


class RouteView(NamedTuple):
  """What a router reads when request ``rid`` arrives (traced arrays).

  Attributes:
    match_tokens: ``[P]`` int32 prefix tokens of the request each replica
      holds (whole blocks; the cluster's mode says from where).
    prompt_len: ``[]`` int32 the request's prompt tokens.
    prompt_blocks: ``[]`` int32 its blocks, ``ceil(prompt_len / K)``.
    output_len: ``[]`` int32 its ``max_tokens``.
    block_size: ``[]`` int32 ``K``.
    running: ``[P]`` int32 requests running.
    waiting: ``[P]`` int32 requests queued.
    outstanding_tokens: ``[P]`` int32 work left of every queued or running
      request: tokens to compute plus outputs to sample.
    prefill_blocks: ``[P]`` int32 blocks of prompt tokens still to compute
      (queued and prefilling requests).
    decode_blocks: ``[P]`` int32 blocks held by decoding requests.
    kv_usage: ``[P]`` float32 fraction of usable blocks held by requests.
    client: ``[]`` int32 the request's session (client) id.
    step: ``[]`` int32 the clock.
  """

  match_tokens: jax.Array
  prompt_len: jax.Array
  prompt_blocks: jax.Array
  output_len: jax.Array
  block_size: jax.Array
  running: jax.Array
  waiting: jax.Array
  outstanding_tokens: jax.Array
  prefill_blocks: jax.Array
  decode_blocks: jax.Array
  kv_usage: jax.Array
  client: jax.Array
  step: jax.Array


def _no_state(num_replicas: int, num_requests: int):
  del num_replicas, num_requests
  return ()


def _keep(state, view, rid, replica):
  del view, rid, replica
  return state


class ApproxView(NamedTuple):
  """How a router's own picture of a replica's cache (the cluster's
  ``"approximate"`` mode) is kept: an LRU of the block hashes of the
  prompts it routed there, as production routers keep one.

  Attributes:
    capacity_tokens: the LRU's size in tokens (``capacity_tokens // K``
      block hashes per replica); None: unbounded.
    ttl_s: an entry not routed again for this long is forgotten (needs the
      clock's ``step_time_ms``; without one entries never expire); None:
      never.
    max_match_tokens: the longest match the router looks for; None: the
      whole prompt.
  """

  capacity_tokens: int | None = None
  ttl_s: float | None = None
  max_match_tokens: int | None = None


class Router(NamedTuple):
  """A routing policy (see the module docstring for the protocol).

  ``reads_cache``: the policy reads ``match_tokens`` (then the cluster's
  mode, exact or approximate, matters). ``view``: how it keeps its
  approximate view (:class:`ApproxView`).
  """

  name: str
  pick: Callable[[Any, RouteView, jax.Array], jax.Array]
  init: Callable[[int, int], Any] = _no_state
  on_route: Callable[..., Any] = _keep
  reads_cache: bool = False
  view: ApproxView = ApproxView()


# A real parameter multiplies counts below 2**31 and is summed in float32;
# within 2**64 in magnitude the products stay finite (float32 reaches
# 2**128), and a nonzero one of at least 2**-64 stays nonzero.
_REAL_RANGE = 2.0**-64, 2.0**64


def _check(router: str, **params) -> None:
  """Refuses a factory parameter that is not a real number 0 or of
  magnitude in :data:`_REAL_RANGE` (the integer ones: not an int below
  2**31, the routers' int32 arithmetic), naming the router."""
  for name, value in params.items():
    integer = name in ("window_steps", "virtual_nodes", "balance_abs_threshold")
    kinds = (int, np.integer) if integer else (int, float, np.number)
    if isinstance(value, bool) or not isinstance(value, kinds):
      what = "an int" if integer else "a number"
      raise ValueError(f"{router} {name}={value!r} must be {what}")
    if not math.isfinite(value):
      raise ValueError(f"{router} {name}={value!r} must be finite")
    if integer and abs(value) >= 2**31:
      raise ValueError(
        f"{router} {name}={value} must be below 2**31 in magnitude (int32)"
      )
    low, high = _REAL_RANGE
    if not integer and value != 0 and not low <= abs(value) <= high:
      raise ValueError(
        f"{router} {name}={value!r} must be 0 or of magnitude in "
        "[2**-64, 2**64] (float32 arithmetic over counts up to 2**31)"
      )


def _first_min(x: jax.Array) -> jax.Array:
  """Index of the smallest entry, the lowest index among equals."""
  return jnp.argmin(x).astype(jnp.int32)


def _first_max(x: jax.Array) -> jax.Array:
  return jnp.argmax(x).astype(jnp.int32)


# ----------------------------------------------------------- round_robin
@functools.cache
def round_robin() -> Router:
  """Replica ``k mod P`` for the ``k``-th routed request."""

  def init(p, r):
    del p, r
    return jnp.int32(0)

  def pick(state, view, rid):
    del rid
    return (state % view.running.shape[0]).astype(jnp.int32)

  def on_route(state, view, rid, replica):
    del view, rid, replica
    return state + 1

  return Router("round_robin", pick, init, on_route)


# ------------------------------------------------------------ least_load
@functools.cache
def least_load() -> Router:
  """Fewest outstanding **tokens** (prompt tokens still to compute plus
  outputs still to sample, over the replica's queued and running
  requests); ties to the lowest replica."""

  def pick(state, view, rid):
    del state, rid
    return _first_min(view.outstanding_tokens)

  return Router("least_load", pick)


# ----------------------------------------------------------- cache_aware
@functools.cache
def cache_aware(
  balance_abs_threshold: int = 64,
  balance_rel_threshold: float = 1.5,
  cache_threshold: float = 0.3,
) -> Router:
  """SGLang's gateway ``cache_aware`` policy (sgl-router
  ``policies/cache_aware.rs``; defaults ``balance_abs_threshold = 64``,
  ``balance_rel_threshold = 1.5``, ``cache_threshold = 0.3``).

  Load is the replica's outstanding requests (running + queued, the
  router's in-flight count). When ``max - min > balance_abs_threshold`` and
  ``max > balance_rel_threshold * min`` the load is imbalanced: route to
  the least loaded. Otherwise route to the replica with the longest match
  if ``match / prompt > cache_threshold``, else to the least loaded (the
  rule of issue 16; the gateway itself then picks the smallest tree).

  Approximate view: the gateway's radix tree per worker holds the text it
  routed there, pruned LRU to ``max_tree_size = 2**26`` (sgl-router
  ``CacheAwareConfig`` default, checked every ``eviction_interval_secs =
  60``): here an LRU of ``2**26`` tokens of block hashes, pruned at once.
  The gateway matches characters; this view matches whole blocks.
  """
  _check(
    "cache_aware",
    balance_abs_threshold=balance_abs_threshold,
    balance_rel_threshold=balance_rel_threshold,
    cache_threshold=cache_threshold,
  )

  def pick(state, view, rid):
    del state, rid
    load = view.running + view.waiting
    lo, hi = jnp.min(load), jnp.max(load)
    f32 = jnp.float32
    imbalanced = (hi - lo > balance_abs_threshold) & (
      hi.astype(f32) > f32(balance_rel_threshold) * lo.astype(f32)
    )
    best = _first_max(view.match_tokens)
    rate = view.match_tokens[best].astype(f32) / jnp.maximum(
      view.prompt_len, 1
    ).astype(f32)
    least = _first_min(load)
    return jnp.where(
      imbalanced, least, jnp.where(rate > cache_threshold, best, least)
    ).astype(jnp.int32)

  return Router("cache_aware", pick, reads_cache=True, view=ApproxView(2**26))


# --------------------------------------------------------------- kv_cost
@functools.cache
def kv_cost(
  prefill_scale: float = 1.0,
  overlap_credit: float = 1.0,
  temperature: float = 0.0,
) -> Router:
  """Dynamo's KV router cost (``lib/llm/src/kv_router/scheduler.rs``,
  ``overlap_score_weight`` 1.0 and ``router_temperature`` 0.0 by default).

  ``cost = prefill_scale * max(prefill_blocks + prompt_blocks -
  overlap_credit * cached_blocks, 0) + decode_blocks``; the lowest cost
  wins (ties to the lowest replica), or with ``temperature > 0`` a replica
  drawn from ``softmax(-cost / temperature)`` (keyed by the request id).

  Approximate view: Dynamo's router without KV events
  (``--no-kv-events``) records the blocks it routed and forgets them
  after ``router_ttl_secs = 120``, its tree pruned at ``router_max_tree_size
  = 2**20`` blocks (``KvRouterConfig`` / ``PruneConfig`` defaults in
  ``lib/llm/src/kv_router``): ttl 120 s, an LRU of ``2**20`` blocks of 16
  tokens.
  """
  _check(
    "kv_cost",
    prefill_scale=prefill_scale,
    overlap_credit=overlap_credit,
    temperature=temperature,
  )
  if not temperature >= 0:
    raise ValueError(f"kv_cost temperature={temperature} must be >= 0")

  def pick(state, view, rid):
    del state
    f32 = jnp.float32
    cached = (view.match_tokens // view.block_size).astype(f32)
    new = (view.prefill_blocks + view.prompt_blocks).astype(f32)
    cost = f32(prefill_scale) * jnp.maximum(
      new - f32(overlap_credit) * cached, f32(0)
    ) + view.decode_blocks.astype(f32)
    if temperature == 0:
      return _first_min(cost)
    key = jax.random.fold_in(jax.random.key(0), rid)
    # softmax is shift-free: from the cheapest, so that the best replica's
    # logit is 0 and a small temperature cannot make them all -inf.
    logits = -(cost - jnp.min(cost)) / f32(temperature)
    return jax.random.categorical(key, logits).astype(jnp.int32)

  return Router(
    "kv_cost",
    pick,
    reads_cache=True,
    view=ApproxView(capacity_tokens=2**20 * 16, ttl_s=120.0),
  )


# -------------------------------------------------------------------- e2
@functools.cache
def e2(window_steps: int = 64) -> Router:
  """Preble's E2 (Srivatsa et al., "Preble: Efficient Distributed Prompt
  Scheduling for LLM Serving", ICLR 2025, Algorithm 1).

  Exploit when the request's unmatched tokens are fewer than its matched
  tokens on the best replica: the least loaded among the replicas holding
  that longest prefix. Otherwise explore: the least loaded of all. Load is
  the work the router sent to the replica over the last ``window_steps``
  steps (prefill: unmatched prompt tokens; decode: the output tokens),
  kept per step in a ring (the paper's window ``H``).

  Approximate view: Preble's global scheduler keeps one radix tree of the
  prompts it routed, with the GPUs holding each node; the paper evicts
  from it as the GPUs do, which a router cannot see: here an unbounded
  LRU of routed block hashes.
  """
  _check("e2", window_steps=window_steps)
  if window_steps < 1:
    raise ValueError(f"e2 window_steps={window_steps} must be >= 1")

  def init(p, r):
    del r
    return dict(
      work=jnp.zeros((p, window_steps), jnp.int32),
      stamp=jnp.full((p, window_steps), -1, jnp.int32),
    )

  def load(state, view):
    live = state["stamp"] > view.step - window_steps
    return jnp.sum(jnp.where(live, state["work"], 0), axis=1)

  def pick(state, view, rid):
    del rid
    w = load(state, view)
    best = jnp.max(view.match_tokens)
    exploit = (view.prompt_len - best) < best
    holders = view.match_tokens == best
    among = _first_min(jnp.where(holders, w, jnp.iinfo(jnp.int32).max))
    return jnp.where(exploit, among, _first_min(w)).astype(jnp.int32)

  def on_route(state, view, rid, replica):
    del rid
    col = view.step % window_steps
    fresh = state["stamp"][replica, col] == view.step
    cost = (
      view.prompt_len - view.match_tokens[replica] + view.output_len
    ).astype(jnp.int32)
    old = jnp.where(fresh, state["work"][replica, col], 0)
    return dict(
      work=state["work"].at[replica, col].set(old + cost),
      stamp=state["stamp"].at[replica, col].set(view.step),
    )

  return Router("e2", pick, init, on_route, reads_cache=True)


# ------------------------------------------------------ session_affinity
def _mix(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (murmur3's finaliser)."""
  x = x.astype(jnp.uint32)
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


@functools.cache
def session_affinity(virtual_nodes: int = 64) -> Router:
  """Consistent hashing of the request's session (client) id: each replica
  owns ``virtual_nodes`` points on a 32-bit ring; a session goes to the
  owner of the first point at or after its hash (Karger et al., 1997), so
  a session always reaches the same replica."""
  _check("session_affinity", virtual_nodes=virtual_nodes)
  if virtual_nodes < 1:
    raise ValueError(f"virtual_nodes={virtual_nodes} must be >= 1")

  def pick(state, view, rid):
    del state, rid
    p = view.running.shape[0]
    owner = jnp.repeat(jnp.arange(p, dtype=jnp.int32), virtual_nodes)
    vnode = jnp.tile(jnp.arange(virtual_nodes, dtype=jnp.int32), p)
    points = _mix(
      _mix(owner + 1) ^ (vnode.astype(jnp.uint32) * jnp.uint32(0x9E3779B9))
    )
    order = jnp.argsort(points)
    points, owner = points[order], owner[order]
    h = _mix(view.client.astype(jnp.uint32) ^ jnp.uint32(0x5BD1E995))
    i = jnp.searchsorted(points, h, side="left") % points.shape[0]
    return owner[i]

  return Router("session_affinity", pick)


# ----------------------------------------------------------------- llm_d
@functools.cache
def llm_d(
  queue_weight: float = 2.0,
  kv_weight: float = 2.0,
  prefix_weight: float = 3.0,
) -> Router:
  """llm-d's inference scheduler with its default weighted scorers
  (``queue-scorer`` 2, ``kv-cache-utilization-scorer`` 2,
  ``prefix-cache-scorer`` 3; llm-d-inference-scheduler ``deploy/config``).

  Each scorer gives a replica a value in ``[0, 1]``: queue ``(max q - q) /
  (max q - min q)`` over queued requests (1 for all when equal), KV
  ``1 - kv_usage``, prefix ``match blocks / prompt blocks``; the highest
  weighted sum wins (ties to the lowest replica).

  Approximate view: the approximate prefix-cache plugin of the gateway API
  inference extension (``approximateprefix``; defaults
  ``DefaultLRUCapacityPerServer = 31250`` blocks of
  ``DefaultBlockSizeTokens = 16``, ``DefaultMaxPrefixBlocks = 256``): an
  LRU of 31,250 x 16 tokens per replica, matches up to 4,096 tokens.
  """
  _check(
    "llm_d",
    queue_weight=queue_weight,
    kv_weight=kv_weight,
    prefix_weight=prefix_weight,
  )

  def pick(state, view, rid):
    del state, rid
    f32 = jnp.float32
    q = view.waiting.astype(f32)
    span = jnp.max(q) - jnp.min(q)
    safe = jnp.where(span > 0, span, f32(1))
    queue = jnp.where(span > 0, (jnp.max(q) - q) / safe, f32(1))
    kv = f32(1) - view.kv_usage
    blocks = jnp.maximum(view.prompt_blocks, 1).astype(f32)
    prefix = (view.match_tokens // view.block_size).astype(f32) / blocks
    score = (
      f32(queue_weight) * queue
      + f32(kv_weight) * kv
      + f32(prefix_weight) * prefix
    )
    return _first_max(score)

  return Router(
    "llm_d",
    pick,
    reads_cache=True,
    view=ApproxView(capacity_tokens=31250 * 16, max_match_tokens=256 * 16),
  )


# --------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[..., Router]] = {
  "round_robin": round_robin,
  "least_load": least_load,
  "cache_aware": cache_aware,
  "kv_cost": kv_cost,
  "e2": e2,
  "session_affinity": session_affinity,
  "llm_d": llm_d,
}


def register_router(
  name: str, factory: Callable[..., Router], *, overwrite: bool = False
) -> None:
  """Adds a router factory under ``name``."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"router name must be a non-empty str, got {name!r}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"router {name!r} is registered already")
  if not callable(factory):
    raise TypeError(
      f"router {name!r}: the factory must be callable (params -> Router), "
      f"got {factory!r}"
    )
  _REGISTRY[name] = factory


def router_names() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def get_router(name: str | Router, **params) -> Router:
  """The router called ``name`` (built with ``params``), or ``name`` if it
  is a :class:`Router`.

  Raises:
    ValueError: an unknown name, or bad parameters.
  """
  if isinstance(name, Router):
    if params:
      raise ValueError("parameters go with a router name, not a Router")
    return name
  if name not in _REGISTRY:
    raise ValueError(f"unknown router {name!r}; known: {router_names()}")
  try:
    router = _REGISTRY[name](**params)
  except TypeError as e:
    raise ValueError(f"router {name!r}: {e}") from None
  if not isinstance(router, Router):
    raise TypeError(
      f"router {name!r}: its factory returned {type(router).__name__}, not "
      "a Router"
    )
  return router
