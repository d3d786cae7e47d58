"""Replicas behind a router: one jitted loop over cluster steps.

``P`` replicas, each a whole serving engine (vLLM 0.33's v1 scheduler and
its own prefix cache: :class:`prefixjax.serving.vllm_v1.EngineState` with a
leading replica axis), step in lockstep on the steps clock. Every cluster
step:

1. if no replica has work, the clock jumps to the next arrival;
2. the requests arriving by now are routed one by one in arrival order: the
   router (:mod:`prefixjax.routing.routers`) reads a :class:`RouteView` of
   every replica at that moment (load, and the prefix each holds for the
   request) and picks one; the request joins that replica's waiting queue
   (its ``add_request``); routing a request changes the load the next one
   sees;
3. every replica runs one engine step (:func:`prefixjax.serving.vllm_v1.
   step`: ``lax.map`` over replicas, or ``vmap`` with ``vectorize``, the
   replica axis then shardable over devices).

``mode`` decides what ``match_tokens`` is. ``"exact"``: each replica's
prefix cache looked up (:func:`prefixjax.cache.prefix_cache.match`, whole
blocks, capped at the prompt's last token). ``"approximate"``: the
router's own picture, a per-replica LRU of the block hashes of the full
prompt blocks of the requests it sent there, which never hears of
evictions. Its size, expiry and longest match are the router's
(:class:`~prefixjax.routing.routers.ApproxView`: SGLang's gateway a tree
of ``2**26`` tokens per worker, Dynamo a 120 s time-to-live, llm-d 31,250
blocks of 16 tokens per pod). An LRU never full evicts nothing, so the
arrays hold ``min(capacity, distinct prompt blocks in the trace)`` slots.

A request never routed to a replica stays ``WAITING`` (unqueued) in that
replica's arrays; ``ClusterState.route`` says where each request went.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import _struct as struct
from prefixjax._checks import check_fits_in_memory, check_int
from prefixjax._host import release_compiled_near_map_limit
from prefixjax._masked import NONE, gather
from prefixjax.cache import prefix_cache as pc
from prefixjax.routing import routers as rt
from prefixjax.serving import vllm_v1
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.fork import enqueue
from prefixjax.serving.simulate import (
  build_inputs,
  check_run_arguments,
  prepare_records,
)

__all__ = ["MODES", "ClusterResult", "ClusterState", "simulate_cluster"]

MODES = ("exact", "approximate")
Status = vllm_v1.ReqStatus


@struct.dataclass
class ClusterState:
  """Replicas, router and clock.

  Attributes:
    replicas: :class:`~prefixjax.serving.vllm_v1.EngineState`, every leaf
      with a leading ``[P]`` axis.
    router: the router's state.
    view_keys: ``[P, A, 2]`` uint32 the approximate view's block hashes.
    view_stamp: ``[P, A]`` int32 when each was last routed, in routed
      requests (the LRU order; -1: empty).
    view_time: ``[P, A]`` int32 the step it was last routed in.
    view_ttl: ``[]`` int32 steps an entry lives unrouted.
    route: ``[R]`` int32 the replica of each routed request (-1 before).
    num_arrived: ``[]`` int32 entries of ``arrival_order`` routed (or
      rejected).
    routed: ``[]`` int32 requests routed (the LRU clock).
    step: ``[]`` int32 the clock.
    num_steps: ``[]`` int32 cluster steps in which some replica ran.
    error: ``[]`` int32 :class:`~prefixjax.serving.vllm_v1.SimStatus`.
  """

  replicas: Any
  router: Any
  view_keys: jax.Array
  view_stamp: jax.Array
  view_time: jax.Array
  view_ttl: jax.Array
  route: jax.Array
  num_arrived: jax.Array
  routed: jax.Array
  step: jax.Array
  num_steps: jax.Array
  error: jax.Array


def _approx_match(
  cs: ClusterState, keys, prompt_len, k, max_blocks: int | None = None
) -> jax.Array:
  """``[P]`` tokens of the leading prompt blocks in each replica's
  approximate view (live entries only; at most ``max_blocks``)."""
  m = keys.shape[0]
  usable = jnp.arange(m) < (prompt_len - 1) // k  # the exact match's cap
  if max_blocks is not None:
    usable &= jnp.arange(m) < max_blocks
  live = (cs.view_stamp >= 0) & (cs.step - cs.view_time < cs.view_ttl)
  hit = jnp.any(
    (cs.view_keys[:, None, :, :] == keys[None, :, None, :]).all(-1)
    & live[:, None, :],
    axis=2,
  )  # [P, M]
  run = jnp.cumprod((hit & usable[None]).astype(jnp.int32), axis=1)
  return (jnp.sum(run, axis=1) * k).astype(jnp.int32)


def _remember(
  cs: ClusterState, replica, keys, prompt_len, k, ok
) -> ClusterState:
  """The approximate view of ``replica`` learns the prompt's full blocks
  (present ones refreshed, others replace the least recently routed)."""
  keys_p = cs.view_keys[replica]
  stamp_p = cs.view_stamp[replica]
  time_p = cs.view_time[replica]

  def body(j, carry):
    keys_p, stamp_p, time_p = carry
    key = keys[j]
    same = (keys_p == key[None]).all(-1) & (stamp_p >= 0)
    slot = jnp.where(same.any(), jnp.argmax(same), jnp.argmin(stamp_p)).astype(
      jnp.int32
    )
    return (
      keys_p.at[slot].set(key),
      stamp_p.at[slot].set(cs.routed),
      time_p.at[slot].set(cs.step),
    )

  keys_p, stamp_p, time_p = jax.lax.fori_loop(
    0, jnp.where(ok, prompt_len // k, 0), body, (keys_p, stamp_p, time_p)
  )
  return cs.replace(
    view_keys=cs.view_keys.at[replica].set(keys_p),
    view_stamp=cs.view_stamp.at[replica].set(stamp_p),
    view_time=cs.view_time.at[replica].set(time_p),
  )


def route_view(
  cs: ClusterState, reqs, params, rid, mode: str, max_blocks: int | None = None
) -> rt.RouteView:
  """What the router sees of every replica when ``rid`` arrives
  (``max_blocks``: the approximate view's longest match)."""
  reps = cs.replicas
  cache = reps.cache
  k = cache.block_size
  p = reps.num_running.shape[0]
  keys = reqs.keys[rid]
  plen = reqs.prompt_len[rid]
  if mode == "exact":
    match = jax.vmap(lambda c: pc.match(c, keys, plen).hit_tokens)(cache)
  else:
    match = _approx_match(cs, keys, plen, k, max_blocks)
  mine = cs.route[None, :] == jnp.arange(p, dtype=jnp.int32)[:, None]
  status = reps.status
  live = mine & (
    (status == Status.WAITING)
    | (status == Status.RUNNING)
    | (status == Status.PREEMPTED)
  )
  todo = reps.num_tokens - reps.num_computed
  outs = reqs.max_tokens[None, :] - reps.num_output
  outstanding = jnp.sum(jnp.where(live, todo + outs, 0), axis=1)
  plens = reqs.prompt_len[None, :]
  pre = live & (reps.num_computed < plens)
  prefill = jnp.sum(jnp.where(pre, -(-(plens - reps.num_computed) // k), 0), 1)
  dec = mine & (status == Status.RUNNING) & (reps.num_computed >= plens)
  decode = jnp.sum(jnp.where(dec, -(-reps.num_tokens // k), 0), axis=1)
  usable = cache.paging.refcounts.shape[1] - 1
  held = usable - cache.paging.num_free
  client = jnp.int32(0) if reqs.client is None else reqs.client[rid]
  return rt.RouteView(
    match_tokens=match.astype(jnp.int32),
    prompt_len=plen,
    prompt_blocks=-(-plen // k),
    output_len=reqs.max_tokens[rid],
    block_size=jnp.int32(k),
    running=reps.num_running,
    waiting=reps.num_waiting,
    outstanding_tokens=outstanding.astype(jnp.int32),
    prefill_blocks=prefill.astype(jnp.int32),
    decode_blocks=decode.astype(jnp.int32),
    kv_usage=(held / max(usable, 1)).astype(jnp.float32),
    client=client,
    step=cs.step,
  )


def _route_arrivals(cs, reqs, params, router, scheduler, mode):
  """Routes every request due by the clock, in arrival order."""
  r_len = reqs.arrival_order.shape[0]
  k = cs.replicas.cache.block_size
  p = cs.replicas.num_running.shape[0]

  def due(cs):
    rid = gather(reqs.arrival_order, cs.num_arrived[None], NONE)[0]
    return (
      (cs.num_arrived < r_len)
      & (gather(reqs.arrival_step, rid[None], 0)[0] <= cs.step)
      & (cs.error == vllm_v1.SimStatus.OK)
    )

  def body(cs):
    rid = reqs.arrival_order[cs.num_arrived]
    ok = cs.replicas.status[0, rid] == Status.WAITING  # not rejected
    cap = router.view.max_match_tokens
    view = route_view(
      cs, reqs, params, rid, mode, None if cap is None else cap // k
    )
    pick = router.pick(cs.router, view, rid)
    dtype = jnp.result_type(pick)
    if (
      jnp.shape(pick) != ()
      or dtype == jnp.bool_
      or not jnp.issubdtype(dtype, jnp.integer)
    ):
      raise TypeError(
        f"router {router.name!r}: pick must return one integer replica id, "
        f"got shape {jnp.shape(pick)} dtype {dtype}"
      )
    # A replica that does not exist stops the run with BAD_ROUTE (the
    # request is not routed), never a clipped guess.
    bad = ok & ((pick < 0) | (pick >= p))
    replica = jnp.clip(pick, 0, p - 1).astype(jnp.int32)
    ok = ok & ~bad
    lanes = (jnp.arange(p) == replica) & ok
    reps = jax.vmap(lambda st, q: enqueue(st, reqs, scheduler, rid, q))(
      cs.replicas, lanes
    )
    new_router = router.on_route(cs.router, view, rid, replica)
    cs = cs.replace(
      replicas=reps,
      router=jax.tree.map(
        lambda a, b: jnp.where(ok, a, b), new_router, cs.router
      ),
      route=cs.route.at[rid].set(jnp.where(ok, replica, cs.route[rid])),
      num_arrived=cs.num_arrived + jnp.where(bad, 0, 1),
      error=jnp.where(
        bad & (cs.error == vllm_v1.SimStatus.OK),
        jnp.int32(vllm_v1.SimStatus.BAD_ROUTE),
        cs.error,
      ),
    )
    if mode == "approximate":
      cs = _remember(cs, replica, reqs.keys[rid], reqs.prompt_len[rid], k, ok)
    return cs.replace(routed=cs.routed + ok.astype(jnp.int32))

  return jax.lax.while_loop(due, body, cs)


@functools.partial(
  jax.jit,
  static_argnames=("router", "scheduler", "mode", "max_steps", "vectorize"),
)
def run_cluster(
  cs: ClusterState,
  reqs,
  params,
  *,
  router: rt.Router,
  scheduler,
  mode: str,
  max_steps: int,
  vectorize: bool,
):
  """Cluster steps until no request is left (see the module docstring).

  Returns:
    ``(final ClusterState, trace)``: ``trace`` holds per executed step
    ``ran``, ``tokens``, ``prefill_tokens``, ``decode_tokens``,
    ``free_blocks``, ``running``, ``waiting`` as ``[T, P]`` and ``step``
    ``[T]``; rows past ``final.num_steps`` are zero.
  """
  r_len = reqs.arrival_order.shape[0]
  p = cs.replicas.num_running.shape[0]
  fields = ("ran", "tokens", "prefill_tokens", "decode_tokens", "free_blocks")
  trace0 = {f: jnp.zeros((max_steps, p), jnp.int32) for f in fields}
  trace0["running"] = jnp.zeros((max_steps, p), jnp.int32)
  trace0["waiting"] = jnp.zeros((max_steps, p), jnp.int32)
  trace0["step"] = jnp.zeros((max_steps,), jnp.int32)

  def pending(cs):
    return jnp.any(cs.replicas.num_running + cs.replicas.num_waiting > 0)

  def more(cs):
    return cs.num_arrived < r_len

  def cond(carry):
    cs, _ = carry
    return (
      (cs.error == vllm_v1.SimStatus.OK)
      & (cs.num_steps < max_steps)
      & (pending(cs) | more(cs))
    )

  def one(st):
    return vllm_v1.step(st, reqs, params, scheduler)

  def body(carry):
    cs, trace = carry
    rid = gather(reqs.arrival_order, cs.num_arrived[None], NONE)[0]
    nxt = gather(reqs.arrival_step, rid[None], 0)[0]
    jump = (~pending(cs)) & more(cs) & (nxt > cs.step)
    cs = cs.replace(step=jnp.where(jump, nxt, cs.step))
    reps = cs.replicas.replace(step=jnp.full((p,), cs.step, jnp.int32))
    cs = _route_arrivals(
      cs.replace(replicas=reps), reqs, params, router, scheduler, mode
    )
    if vectorize:
      reps, rec = jax.vmap(one)(cs.replicas)
    else:
      reps, rec = jax.lax.map(one, cs.replicas)
    ran = rec.sched_rid[:, 0] >= 0
    any_ran = jnp.any(ran)
    row = jnp.where(any_ran, cs.num_steps, max_steps)
    values = dict(
      ran=ran.astype(jnp.int32),
      tokens=jnp.sum(rec.sched_n, axis=1),
      prefill_tokens=rec.prefill_tokens,
      decode_tokens=rec.decode_tokens,
      free_blocks=rec.free_blocks,
      running=rec.num_running,
      waiting=rec.num_waiting,
      step=cs.step,
    )
    trace = {f: trace[f].at[row].set(values[f], mode="drop") for f in trace}
    reps = reps.replace(num_steps=reps.num_steps + ran.astype(jnp.int32))
    stalled = (~any_ran) & pending(cs) & ~more(cs)
    err = jnp.max(reps.error)
    cs = cs.replace(
      replicas=reps,
      step=cs.step + 1,
      num_steps=cs.num_steps + any_ran.astype(jnp.int32),
      error=jnp.where(
        err != vllm_v1.SimStatus.OK,
        err,
        jnp.where(stalled, jnp.int32(vllm_v1.SimStatus.STALLED), cs.error),
      ),
    )
    return cs, trace

  cs, trace = jax.lax.while_loop(cond, body, (cs, trace0))
  cs = cs.replace(
    error=jnp.where(
      (cs.error == vllm_v1.SimStatus.OK) & (pending(cs) | more(cs)),
      jnp.int32(vllm_v1.SimStatus.OUT_OF_STEPS),
      cs.error,
    )
  )
  return cs, trace


@dataclasses.dataclass(frozen=True)
class ClusterResult:
  """A cluster run on the host (numpy).

  Attributes:
    replicas: ``P``.
    router, mode: what routed.
    status: ``"OK"`` or the :class:`~prefixjax.serving.vllm_v1.SimStatus`
      name.
    route: ``[R]`` the replica of each request (-1: rejected, or not
      routed yet when the run stopped early).
    arrival_step, prompt_len, first_token_step, finish_step,
      hit_first_sched, num_output, num_preemptions: ``[R]`` per request,
      read from the replica that served it.
    trace: the per-step ``[T, P]`` arrays of :func:`run_cluster`, cut to
      the executed steps.
    step_time_ms: milliseconds per step, or None.
    evictions: ``[P]`` cached blocks each replica's cache evicted (identity
      dropped to make room), or None.
  """

  replicas: int
  router: str
  mode: str
  status: str
  route: np.ndarray
  arrival_step: np.ndarray
  prompt_len: np.ndarray
  first_token_step: np.ndarray
  finish_step: np.ndarray
  hit_first_sched: np.ndarray
  num_output: np.ndarray
  num_preemptions: np.ndarray
  trace: dict[str, np.ndarray]
  step_time_ms: float | None
  evictions: np.ndarray | None = None
  rejected: np.ndarray | None = None  # [R] refused by the input check

  def per_replica(self) -> list[dict[str, Any]]:
    """Per replica: ``requests``, ``prompt_tokens``, ``hit_tokens``,
    ``token_hit_rate``, ``output_tokens``, ``tokens_computed`` (prefill and
    decode tokens it ran: its load), ``busy_steps``, ``ttft_steps_p50`` /
    ``_p99`` (and ``ttft_s_*`` with ``step_time_ms``) over its finished
    requests, and ``throughput_tokens_per_step`` (``_per_s``): its output
    tokens over the cluster's makespan."""
    steps = self.trace["step"]
    makespan = int(steps[-1]) + 1 if len(steps) else 0
    scale = None if self.step_time_ms is None else self.step_time_ms / 1e3
    out = []
    for p in range(self.replicas):
      mine = self.route == p
      prompt = int(self.prompt_len[mine].sum())
      hit = int(self.hit_first_sched[mine].sum())
      outputs = int(self.num_output[mine].sum())
      row = dict(
        replica=p,
        requests=int(mine.sum()),
        prompt_tokens=prompt,
        hit_tokens=hit,
        token_hit_rate=hit / prompt if prompt else None,
        output_tokens=outputs,
        tokens_computed=int(self.trace["tokens"][:, p].sum()),
        busy_steps=int(self.trace["ran"][:, p].sum()),
      )
      row.update(_ttft(self, mine & (self.finish_step >= 0), scale))
      row["throughput_tokens_per_step"] = (
        outputs / makespan if makespan else None
      )
      row["throughput_tokens_per_s"] = (
        None if scale is None or not makespan else outputs / (makespan * scale)
      )
      out.append(row)
    return out

  def metrics(self) -> dict[str, Any]:
    """The cluster's summary: ``requests``, ``finished``, ``rejected`` (by
    the input check), ``unrouted`` (arrived after a run that stopped early,
    ``status`` not OK),
    ``prompt_tokens``, ``hit_tokens``, ``token_hit_rate``, ``imbalance``
    (max over mean of the replicas' computed tokens; 1 is even),
    ``request_imbalance`` (the same of routed requests), ``preemptions``,
    ``evictions`` (summed over the replicas), ``ttft_steps_p50/p99``
    (``first_token_step + 1 - arrival_step``) and ``_s`` with
    ``step_time_ms``, ``makespan_steps``, ``output_tokens``,
    ``throughput_tokens_per_step`` (and ``_per_s``)."""
    per = self.per_replica()
    routed = self.route >= 0
    done = routed & (self.finish_step >= 0)
    rejected = int(
      (~routed).sum() if self.rejected is None else self.rejected.sum()
    )
    prompt = int(self.prompt_len[routed].sum())
    hit = int(self.hit_first_sched[routed].sum())
    work = np.asarray([r["tokens_computed"] for r in per], np.float64)
    reqs = np.asarray([r["requests"] for r in per], np.float64)
    steps = self.trace["step"]
    makespan = int(steps[-1]) + 1 if len(steps) else 0
    out_tokens = int(self.num_output[routed].sum())
    scale = None if self.step_time_ms is None else self.step_time_ms / 1e3
    m: dict[str, Any] = dict(
      replicas=self.replicas,
      router=self.router,
      mode=self.mode,
      requests=len(self.route),
      finished=int(done.sum()),
      rejected=rejected,
      unrouted=int((~routed).sum()) - rejected,
      prompt_tokens=prompt,
      hit_tokens=hit,
      token_hit_rate=hit / prompt if prompt else None,
      imbalance=float(work.max() / work.mean()) if work.sum() else None,
      request_imbalance=float(reqs.max() / reqs.mean()) if reqs.sum() else None,
      preemptions=int(self.num_preemptions[routed].sum()),
      evictions=None if self.evictions is None else int(self.evictions.sum()),
      makespan_steps=makespan,
      output_tokens=out_tokens,
      throughput_tokens_per_step=out_tokens / makespan if makespan else None,
    )
    m.update(_ttft(self, done, scale))
    m["throughput_tokens_per_s"] = (
      None if scale is None or not makespan else out_tokens / (makespan * scale)
    )
    return m


def _ttft(res: ClusterResult, done, scale) -> dict[str, Any]:
  """``ttft_steps_p50/p99`` (``first_token_step + 1 - arrival_step``) of
  the ``done`` requests, and ``ttft_s_*`` with a step time."""
  ttft = (res.first_token_step[done] + 1 - res.arrival_step[done]).astype(
    np.float64
  )
  m: dict[str, Any] = {}
  for q in (50, 99):
    v = float(np.percentile(ttft, q)) if len(ttft) else None
    m[f"ttft_steps_p{q}"] = v
    m[f"ttft_s_p{q}"] = None if v is None or scale is None else v * scale
  return m


def _view_shape(router, reqs, config, capacity, step_time_ms):
  """``(slots, ttl steps)`` of the approximate view: the LRU's capacity in
  blocks, cut to the distinct full prompt blocks of the trace (then it
  never evicts either way) rounded up to a power of two."""
  k = config.block_size
  spec = router.view
  if capacity is None and spec.capacity_tokens is not None:
    capacity = max(spec.capacity_tokens // k, 1)
  keys = np.asarray(reqs.keys)
  full = (
    np.arange(keys.shape[1])[None, :]
    < (np.asarray(reqs.prompt_len) // k)[:, None]
  )
  distinct = max(len(np.unique(keys[full].reshape(-1, 2), axis=0)), 1)
  slots = 1 << (distinct - 1).bit_length()
  if capacity is not None:
    slots = min(slots, capacity)
  never = np.iinfo(np.int32).max
  if spec.ttl_s is None or not step_time_ms:
    return slots, never
  return slots, int(min(np.ceil(spec.ttl_s * 1e3 / step_time_ms), never))


@functools.partial(jax.jit, static_argnames=("p", "r", "a", "router"))
def _initial_cluster(state, ttl, *, p, r, a, router) -> ClusterState:
  """``p`` copies of one replica's initial ``state``, the router's state
  and empty cache views (``a`` entries each): one compiled program (op by
  op outside ``jit``, every constructor would compile its own)."""
  return ClusterState(
    replicas=jax.tree.map(lambda x: jnp.broadcast_to(x, (p, *x.shape)), state),
    router=router.init(p, r),
    view_keys=jnp.zeros((p, a, 2), jnp.uint32),
    view_stamp=jnp.full((p, a), -1, jnp.int32),
    view_time=jnp.zeros((p, a), jnp.int32),
    view_ttl=jnp.asarray(ttl, jnp.int32),
    route=jnp.full((r,), -1, jnp.int32),
    num_arrived=jnp.int32(0),
    routed=jnp.int32(0),
    step=jnp.int32(0),
    num_steps=jnp.int32(0),
    error=jnp.int32(0),
  )


def simulate_cluster(
  trace,
  config: ServingConfig,
  *,
  replicas: int,
  router: str | rt.Router = "round_robin",
  router_params: dict | None = None,
  mode: str = "exact",
  approx_capacity: int | None = None,
  arrivals: str = "zero",
  step_time_ms: float | None = None,
  rate: float | None = None,
  seed: int = 0,
  max_steps: int | None = None,
  vectorize: bool | None = None,
  devices=None,
) -> ClusterResult:
  """Serves a trace with ``replicas`` engines of ``config`` behind a router.

  Args:
    trace: as :func:`prefixjax.serving.simulate` (a Trace or records).
    config: every replica's engine (fan-out parallel sampling only).
    replicas: ``P >= 1``.
    router: a registered name (:func:`prefixjax.routing.router_names`) or
      a :class:`~prefixjax.routing.Router`; ``router_params`` build it.
    mode: ``"exact"`` or ``"approximate"`` (module docstring).
    approx_capacity: block hashes per replica in the approximate view
      (default: the router's :class:`~prefixjax.routing.routers.ApproxView`
      ``capacity_tokens // block_size``, unbounded when None).
    arrivals, step_time_ms, rate, seed: as :func:`prefixjax.serving.
      simulate` (the steps clock).
    max_steps: rows of the step buffers; by default doubled while the run
      runs out of them.
    vectorize: ``vmap`` the replicas (default on accelerators) instead of
      ``lax.map``.
    devices: shard the replica axis over these devices (a one-axis
      ``jax.sharding.Mesh`` named ``"replicas"``; needs ``vectorize`` and
      ``P`` a multiple of their number).

  Returns:
    A :class:`ClusterResult`.

  Raises:
    TypeError, ValueError: bad arguments, before any work.
  """
  if not isinstance(config, ServingConfig):
    raise TypeError(f"config must be a ServingConfig, got {type(config)}")
  if config.semantics != "vllm":
    raise ValueError(
      f"simulate_cluster runs vLLM semantics only (its replicas are "
      f"vllm_v1 engines), got config.semantics={config.semantics!r}"
    )
  check_run_arguments(
    step_time_ms=step_time_ms, rate=rate, seed=seed, max_steps=max_steps
  )
  if config.parallel_sampling != "fan_out":
    raise ValueError(
      "simulate_cluster runs parallel_sampling='fan_out' only, got "
      f"{config.parallel_sampling!r}"
    )
  p = check_int("replicas", replicas, 1)
  if approx_capacity is not None:
    check_int("approx_capacity", approx_capacity, 1)
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} must be one of {MODES}")
  router = rt.get_router(router, **(router_params or {}))
  if vectorize is None:
    vectorize = jax.default_backend() != "cpu"
  if devices is not None:
    devices = list(devices)
    if not vectorize:
      raise ValueError("devices= shards the vmapped replicas: vectorize=True")
    if p % len(devices):
      raise ValueError(
        f"replicas={p} must be a multiple of the {len(devices)} devices"
      )
  records = prepare_records(trace)
  if router.name == "session_affinity" and not any(
    "client" in rec for rec in records
  ):
    raise ValueError(
      "router='session_affinity' routes by session, and no request has one "
      "(a trace's session_ids, records' client): every request would go to "
      "one replica"
    )
  state, reqs, params, scheduler = build_inputs(
    records, config, arrivals, step_time_ms, rate, seed
  )
  release_compiled_near_map_limit()
  r = len(records)
  a, ttl = (
    _view_shape(router, reqs, config, approx_capacity, step_time_ms)
    if mode == "approximate"
    else (1, np.iinfo(np.int32).max)  # no view: one unused slot
  )
  per_replica = sum(x.nbytes for x in jax.tree.leaves(state)) + a * 16
  # The router's own state too (e2's window, session_affinity's ring): its
  # shapes without building it.
  routed = jax.eval_shape(lambda: router.init(p, r))
  router_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(routed))
  # The jitted run holds its input and its result at once: two copies.
  check_fits_in_memory(
    f"replicas={p} with router {router.name!r}",
    p * per_replica + router_bytes,
    copies=2,
  )
  cs = _initial_cluster(state, ttl, p=p, r=r, a=a, router=router)
  if devices is not None:
    mesh = jax.sharding.Mesh(np.asarray(devices), ("replicas",))
    spec = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("replicas")
    )
    cs = cs.replace(replicas=jax.device_put(cs.replicas, spec))
  arrival = np.asarray(reqs.arrival_step)
  plen = np.asarray(reqs.prompt_len)
  mt = np.asarray(reqs.max_tokens)
  retry = max_steps is None
  steps = (
    max_steps
    or 1
    << int(
      max(int(arrival.max()) + int((plen + mt).sum()) // p + 16, 16) - 1
    ).bit_length()
  )
  while True:
    final, tr = run_cluster(
      cs,
      reqs,
      params,
      router=router,
      scheduler=scheduler,
      mode=mode,
      max_steps=steps,
      vectorize=bool(vectorize),
    )
    err = vllm_v1.SimStatus(int(final.error))
    if not (retry and err == vllm_v1.SimStatus.OUT_OF_STEPS):
      break
    steps *= 2
  final, tr = jax.device_get((final, tr))
  n = int(final.num_steps)
  route = np.asarray(final.route)
  # Every replica marks the input check's refusals REJECTED from the start.
  rejected = np.asarray(final.replicas.status)[0] == Status.REJECTED
  rows = np.where(route >= 0, route, 0)
  idx = np.arange(r)
  reps = final.replicas

  def mine(x):
    return np.asarray(x)[rows, idx]

  return ClusterResult(
    replicas=p,
    router=router.name,
    mode=mode,
    status=err.name,
    route=route,
    arrival_step=arrival,
    prompt_len=plen,
    first_token_step=mine(reps.first_token_step),
    finish_step=mine(reps.finish_step),
    hit_first_sched=mine(reps.hit_first_sched),
    num_output=mine(reps.num_output),
    num_preemptions=mine(reps.num_preemptions),
    trace={k: np.asarray(v)[:n] for k, v in tr.items()},
    step_time_ms=None if step_time_ms is None else float(step_time_ms),
    evictions=np.asarray(reps.cache.stats.evictions),
    rejected=rejected,
  )
