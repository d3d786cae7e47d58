"""A model served through the paged cache: the serving simulator plus a
forward pass.

:class:`Engine` runs vLLM 0.33's v1 scheduler loop exactly as
:func:`prefixjax.serving.simulate` does (the same jitted
:func:`prefixjax.serving.vllm_v1.admit`, :func:`~prefixjax.serving.vllm_v1.
schedule` and :func:`~prefixjax.serving.vllm_v1.complete`, the same prefix
cache and block pool), and between ``schedule`` and ``complete`` runs the
model (:func:`prefixjax.model.forward.forward`) on the scheduled tokens and
samples. What the simulator knows up front, the engine learns step by step:

* a request's block keys (:func:`prefixjax.cache.hashing.block_hashes`) are
  those of the tokens it has so far; after each step the keys of the blocks
  the sampled tokens filled are added (a key is needed only once its block is
  full, before the next step publishes it);
* a request that samples ``eos_id`` has its ``max_tokens`` lowered to its
  outputs so far before ``complete``, which then finishes it by its own rule.

So the engine's schedule (which request, how many tokens, every step) is the
simulator's on a trace whose outputs are the engine's samples
(``tests/test_engine.py`` checks it). The cache and the KV pool persist
across :meth:`Engine.generate` calls: a later batch hits what an earlier one
published.

Parallel sampling (``n > 1``) follows ``CacheConfig.parallel_sampling``:
``"fan_out"`` is vLLM 0.33's (``n`` child requests with the same prompt,
:func:`prefixjax.serving.simulate.fan_out`, sharing the prompt's full
blocks through the prefix cache; each recomputes the partial last block);
``"fork"`` prefills the prompt once and forks the children at the parent's
first token (:mod:`prefixjax.serving.fork`): they share its blocks, the
partly filled last page is copied for each with
:func:`pallas_kernels.copy_blocks`, and each child draws its first token
from the parent's logits with its own key. Both give the same tokens and
logits to the bit; fork computes fewer prefill tokens.

``prefix_caching=False`` salts every request's block keys with a unique
value (as vLLM's ``cache_salt`` would), so no request can hit another's
blocks; everything else runs the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from prefixjax._checks import check_int
from prefixjax._host import release_compiled_near_map_limit, to_device
from prefixjax.cache import hashing
from prefixjax.configs import ModelConfig
from prefixjax.model import forward as fwd
from prefixjax.model.llama import Llama, check_params, init_params
from prefixjax.serving import schedulers as sch
from prefixjax.serving import vllm_v1
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.simulate import build_inputs, fan_out

__all__ = ["CacheConfig", "Engine", "GenerateResult", "Generation"]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """The engine's KV cache and scheduler sizes (vLLM's names).

  Attributes:
    block_size: tokens per block ``K``.
    num_blocks: KV blocks including vLLM's null block (``num_blocks - 1``
      usable), the pool's pages.
    max_num_seqs: most requests running at once.
    max_num_batched_tokens: token budget of one step.
    max_model_len: longest sequence, prompt plus outputs.
    chunked_prefill: whether a prompt may be split over several steps.
    long_prefill_token_threshold: cap on one request's tokens per step while
      others run or wait; 0 is no cap.
    parallel_sampling: ``"fan_out"`` (vLLM 0.33: ``n`` independent child
      requests sharing the prompt's full blocks) or ``"fork"`` (the parent
      prefills once; at its first token the children fork its blocks and
      copy the partly filled last one, :mod:`prefixjax.serving.fork`).

  Raises:
    TypeError, ValueError: a field of the wrong type or value (the rules of
      :class:`prefixjax.serving.ServingConfig`; the message names the field).
  """

  block_size: int = 16
  num_blocks: int = 129
  max_num_seqs: int = 8
  max_num_batched_tokens: int = 256
  max_model_len: int = 512
  chunked_prefill: bool = True
  long_prefill_token_threshold: int = 0
  parallel_sampling: str = "fan_out"

  def __post_init__(self):
    try:
      self.serving_config()
    except (TypeError, ValueError) as e:
      msg = str(e).replace(
        "ServingConfig.num_gpu_blocks", "CacheConfig.num_blocks"
      )
      raise type(e)(msg.replace("ServingConfig.", "CacheConfig.")) from None
    if self.max_model_len < 2:
      raise ValueError(
        f"CacheConfig.max_model_len={self.max_model_len} must be >= 2: a "
        "prompt needs a token and room for one output"
      )

  def serving_config(self, scheduler: str | sch.Scheduler = "fcfs"):
    """The :class:`prefixjax.serving.ServingConfig` the engine schedules
    with."""
    return ServingConfig(
      num_gpu_blocks=self.num_blocks,
      block_size=self.block_size,
      max_num_seqs=self.max_num_seqs,
      max_num_batched_tokens=self.max_num_batched_tokens,
      max_model_len=self.max_model_len,
      chunked_prefill=self.chunked_prefill,
      long_prefill_token_threshold=self.long_prefill_token_threshold,
      scheduler=scheduler,
      parallel_sampling=self.parallel_sampling,
    )


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """What :meth:`Engine.generate` returns.

  Attributes:
    tokens: generated ids, one list per prompt and sample in prompt order
      (prompt 0's ``n`` samples, then prompt 1's, ...).
    stats: ``prompt_tokens``, ``hit_tokens`` (the prefix index's hits at
      each request's first admission, vLLM's ``num_cached_tokens``),
      ``resume_hit_tokens`` (hits when preempted requests came back),
      ``prefill_tokens_computed`` (tokens computed for prompts and, after a
      preemption, recomputed; ``prompt_tokens - hit_tokens`` when nothing
      was preempted), ``decode_tokens``, ``generated_tokens``,
      ``preemptions``, ``evictions`` (cached blocks whose identity was
      dropped to make room), ``blocks_peak`` (usable blocks held after
      scheduling, the most over steps), ``cow_copies`` (pages copied when
      fork children started), ``steps``, ``wall_s``.
    schedule: per step ``[[request, tokens], ...]`` in scheduler order
      (requests numbered as ``tokens``), as
      :meth:`prefixjax.serving.SimResult.scheduled`.
    setup_s: wall seconds :meth:`Engine.start` took before the first step
      (checks, request table, block keys).
    step_s: wall seconds of each step (scheduling, forward, sampling and
      bookkeeping, host round trips included).
    forward_s: of those, the seconds from the forward's dispatch to the
      sampled ids on the host (the model's share).
    context: per step, ``[[request, computed tokens before the step], ...]``
      in ``schedule``'s order (what a step-time model reads).
    first_token_step, finish_step: per request, the step (index into
      ``schedule``) that sampled its first token and its last.
    logits: with ``return_logits=True``, per request a float32 array
      ``[len(tokens[i]), V]``: the logits each generated token was sampled
      from; else ``None``.
  """

  tokens: list[list[int]]
  stats: dict[str, Any]
  schedule: list[list[list[int]]]
  setup_s: float
  step_s: list[float]
  forward_s: list[float]
  context: list[list[list[int]]]
  first_token_step: list[int]
  finish_step: list[int]
  logits: list[np.ndarray] | None = None


@functools.partial(jax.jit, static_argnames=("scheduler",))
def _schedule(state, reqs, params, *, scheduler):
  state = vllm_v1.admit(state, reqs, scheduler)
  return vllm_v1.schedule(state, reqs, params, scheduler)


@functools.partial(jax.jit, static_argnames=("scheduler",))
def _complete(plan, reqs, params, *, scheduler):
  st, rec = vllm_v1.complete(plan, reqs, params, scheduler)
  ran = rec.sched_rid[0] >= 0
  st = st.replace(
    step=st.step + 1, num_steps=st.num_steps + ran.astype(jnp.int32)
  )
  return st, rec


@functools.partial(jax.jit, static_argnames=("block_size",))
def _keys(tokens, lens, salt, *, block_size):
  """``[R, M, 2]`` block keys of every request's known tokens."""

  def one(t, n, s):
    return hashing.block_hashes(t, n, block_size=block_size, extra=s)[0]

  return jax.vmap(one)(tokens, lens, salt)


@functools.partial(
  jax.jit, static_argnames=("backend", "interpret"), donate_argnames=("pool",)
)
def _copy_pages(pool, src, dst, *, backend, interpret):
  """Copy-on-write of a fork: pages ``src -> dst`` in every layer
  (:func:`pallas_kernels.copy_blocks`)."""
  ks, vs = [], []
  for layer in range(pool.k.shape[0]):
    k, v = pk.copy_blocks(
      pool.k[layer],
      pool.v[layer],
      src,
      dst,
      backend=backend,
      interpret=interpret,
    )
    ks.append(k)
    vs.append(v)
  return fwd.KVPool(k=jnp.stack(ks), v=jnp.stack(vs))


@jax.jit
def _sample(logits, seed, uid, position, temperature):
  """Greedy (``temperature == 0``) or seeded sampling, one row per chunk.

  A row's key is ``fold_in(fold_in(key(seed), uid), position)``: the same
  request and position draw the same number whatever else runs.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(row, u, p):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), u), p)
    t = jnp.maximum(temperature, 1e-6)
    return jax.random.categorical(key, row / t).astype(jnp.int32)

  drawn = jax.vmap(draw)(logits, uid, position)
  return jnp.where(temperature > 0, drawn, greedy)


class Engine:
  """A Llama-style model served by the serving simulator's scheduler.

  Args:
    model_config: the model (:class:`prefixjax.configs.ModelConfig`;
      ``ModelConfig.tiny()`` runs in seconds on a CPU).
    cache_config: the KV cache and scheduler sizes.
    scheduler: a registered waiting-queue scheduler
      (:func:`prefixjax.serving.scheduler_names`), default vLLM's FCFS.
    seed: seed of the random weights (when ``params`` is not given) and of
      sampling (when :meth:`generate` gets none).
    params: the model's variables (e.g. from
      :func:`prefixjax.model.restore_params`); default
      :func:`prefixjax.model.init_params` of ``seed``.
    batch_invariant: bitwise batch-invariant forward
      (:mod:`prefixjax.model.forward`); default True on CPU, False on an
      accelerator.
    backend, interpret: passed to the :mod:`pallas_kernels` calls (default:
      the platform's, the jnp reference on CPU).

  Raises:
    TypeError, ValueError: bad configs or arguments.
  """

  def __init__(
    self,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    *,
    scheduler: str | sch.Scheduler = "fcfs",
    seed: int = 0,
    params: Any = None,
    batch_invariant: bool | None = None,
    backend: str | None = None,
    interpret: Any = False,
  ):
    if not isinstance(model_config, ModelConfig):
      raise TypeError(
        f"model_config must be a ModelConfig, got {type(model_config)}"
      )
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(
        f"cache_config must be a CacheConfig, got {type(cache_config)}"
      )
    self.seed = check_int("seed", seed, 0, 2**31)
    self.model_config = model_config
    self.cache_config = cache_config
    self.serving = cache_config.serving_config(scheduler)
    self.scheduler = self.serving.scheduler_object
    fwd.jnp_dtype(model_config)  # refuses a dtype the engine cannot run
    self.model = Llama(model_config)
    if params is None:
      params = init_params(model_config, self.seed)
    else:
      check_params(params, model_config)
    self.params = params
    if batch_invariant is None:
      batch_invariant = jax.default_backend() == "cpu"
    if not isinstance(batch_invariant, bool):
      raise TypeError(
        f"batch_invariant must be a bool, got {batch_invariant!r}"
      )
    self.batch_invariant = batch_invariant
    # Refuses an unknown backend, or a Pallas one this platform cannot
    # run, now rather than in the first forward.
    if backend is not None or interpret is not False:
      pk.resolve_backend(backend, interpret, kernel="Engine")
    self.backend, self.interpret = backend, interpret
    k = cache_config.block_size
    self.num_chunks = fwd.max_chunks(
      k, cache_config.max_num_batched_tokens, cache_config.max_num_seqs
    )
    self.cache = None  # the prefix cache, built by the first generate
    self.pool = fwd.init_pool(model_config, cache_config.num_blocks, k)
    self._calls = 0
    self._live: Generation | None = None

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    prefix_caching: bool = True,
    n: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_id: int | None = None,
    return_logits: bool = False,
    progress: bool = False,
  ) -> GenerateResult:
    """Serves ``prompts`` to completion, all arriving at once.

    Args:
      prompts: token-id lists, each non-empty, shorter than
        ``max_model_len``, ids in ``[0, vocab_size)``.
      max_new_tokens: outputs per request (one int, or one per prompt); a
        request also stops at ``max_model_len`` tokens or at ``eos_id``.
      prefix_caching: reuse cached blocks (see the module docstring).
      n: samples per prompt (``CacheConfig.parallel_sampling``: vLLM's
        fan-out, or fork with copy-on-write).
      temperature: 0 is greedy; otherwise softmax sampling at this
        temperature, seeded per request and position.
      seed: sampling seed (default the engine's).
      eos_id: an end id that stops a request (included in its tokens).
      return_logits: keep the logits of every sampled token.
      progress: a progress bar over requests (tqdm).

    Returns:
      A :class:`GenerateResult`.

    Raises:
      TypeError, ValueError: bad arguments, before any work.
      RuntimeError: the scheduler stalled or a cache verb failed (a bug).
    """
    gen = self.start(
      prompts,
      max_new_tokens,
      prefix_caching=prefix_caching,
      n=n,
      temperature=temperature,
      seed=seed,
      eos_id=eos_id,
      return_logits=return_logits,
    )
    try:
      return gen.run(progress=progress)
    except BaseException:  # an error or Ctrl-C mid-run: the engine stays usable
      gen.abandon()
      raise

  def start(
    self,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    prefix_caching: bool = True,
    n: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_id: int | None = None,
    return_logits: bool = False,
  ) -> Generation:
    """:meth:`generate`, a step at a time: returns the
    :class:`Generation` (call its :meth:`~Generation.step` until
    :attr:`~Generation.done`, or :meth:`~Generation.run`); the engine can
    be saved between steps (:meth:`save`). One generation at a time: the
    next ``start`` must wait until this one is done.

    Raises:
      TypeError, ValueError: bad arguments (see :meth:`generate`).
      RuntimeError: a generation is still running.
    """
    t_start = time.perf_counter()
    if self._live is not None and not self._live.done:
      raise RuntimeError(
        "a generation is still running on this engine; finish it (its "
        "run() or step()) or abandon() it first"
      )
    records, salt = self._records(prompts, max_new_tokens, n, prefix_caching)
    v = self.model_config.vocab_size
    if isinstance(temperature, bool) or not isinstance(
      temperature, (int, float, np.floating)
    ):
      raise TypeError(f"temperature must be a float, got {temperature!r}")
    temperature = float(temperature)
    if not 0 <= temperature < float("inf"):
      raise ValueError(f"temperature={temperature} must be finite and >= 0")
    seed = self.seed if seed is None else check_int("seed", seed, 0, 2**31)
    if eos_id is not None:
      eos_id = check_int("eos_id", eos_id, 0, v)
    if not isinstance(return_logits, bool):
      raise TypeError(f"return_logits must be a bool, got {return_logits!r}")
    release_compiled_near_map_limit()
    self._calls += 1
    self._live = Generation(
      self, records, salt, seed, temperature, eos_id, return_logits
    )
    self._live.setup_s = time.perf_counter() - t_start
    return self._live

  def save(self, path, generation: Generation | None = None) -> None:
    """Writes the engine (weights, KV pool, prefix cache) and, if given, a
    running generation with orbax (:func:`prefixjax.model.checkpoint.save`).
    """
    from prefixjax.model import checkpoint

    checkpoint.save(self, path, generation)

  @classmethod
  def restore(cls, path) -> tuple[Engine, Generation | None]:
    """An engine (and its saved generation, or None) from :meth:`save`'s
    checkpoint (:func:`prefixjax.model.checkpoint.restore`)."""
    from prefixjax.model import checkpoint

    return checkpoint.restore(path)

  def _records(self, prompts, max_new_tokens, n, prefix_caching):
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
      raise TypeError("prompts must be a list of token-id lists")
    if not prompts:
      raise ValueError("prompts is empty")
    if not isinstance(prefix_caching, bool):
      raise TypeError(f"prefix_caching must be a bool, got {prefix_caching!r}")
    n = check_int("n", n, 1)
    mml = self.cache_config.max_model_len
    v = self.model_config.vocab_size
    if isinstance(max_new_tokens, Sequence):
      if len(max_new_tokens) != len(prompts):
        raise ValueError(
          f"max_new_tokens has {len(max_new_tokens)} entries for "
          f"{len(prompts)} prompts"
        )
      outs = [
        check_int(f"max_new_tokens[{i}]", m, 1)
        for i, m in enumerate(max_new_tokens)
      ]
    else:
      outs = [check_int("max_new_tokens", max_new_tokens, 1)] * len(prompts)
    records = []
    for i, p in enumerate(prompts):
      a = np.asarray(p)
      if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"prompts[{i}] must be a non-empty list of int ids")
      if a.min() < 0 or a.max() >= v:
        raise ValueError(
          f"prompts[{i}] has ids outside [0, vocab_size={v}): "
          f"min {a.min()}, max {a.max()}"
        )
      if len(a) >= mml:
        raise ValueError(
          f"prompts[{i}] has {len(a)} tokens; max_model_len={mml} allows "
          f"at most {mml - 1}"
        )
      # Past max_model_len - prompt no request can go (it stops there).
      out = min(outs[i], mml - len(a))
      records.append(
        dict(input_tok_ids=a.astype(np.int64), output_toks=out, n=n)
      )
    records = fan_out(records)
    r = len(records)
    salt = np.zeros((r, 2), np.uint32)
    if not prefix_caching:  # a value no other request has: no sharing
      salt[:, 0] = self._calls + 1
      salt[:, 1] = np.arange(r, dtype=np.uint32) + 1
    return records, salt


class Generation:
  """One :meth:`Engine.start` call, a step at a time.

  Attributes:
    done: every request has finished (the engine keeps the cache), or
      the generation was abandoned.
    abandoned: :meth:`abandon` stopped it (an error or Ctrl-C in
      :meth:`Engine.generate` does too).
    num_real: requests (prompts times ``n``).
    num_finished: of those, finished.
  """

  def __init__(self, eng, records, salt, seed, temperature, eos_id, logits):
    self.eng = eng
    cfg = eng.cache_config
    k = cfg.block_size
    self.k = k
    self.num_real = len(records)
    # Pad the request axis to a power of two with empty prompts (rejected
    # and never queued) so calls of similar size share compiled programs.
    r = 1 << max(self.num_real - 1, 0).bit_length()
    pad = dict(input_tok_ids=np.zeros((0,), np.int64), output_toks=1)
    if "parent" in records[0]:
      pad.update(parent=-1, sample=0)
    records = records + [pad] * (r - self.num_real)
    state, reqs, params, scheduler = build_inputs(records, eng.serving)
    if eng.cache is not None:
      state = state.replace(cache=eng.cache)
    m = eng.serving.max_blocks_per_seq
    self.tokens = np.zeros((r, m * k), np.int32)
    self.lens = np.zeros((r,), np.int32)
    self.prompt_len = np.zeros((r,), np.int32)
    for rid, rec in enumerate(records[: self.num_real]):
      p = rec["input_tok_ids"]
      self.tokens[rid, : len(p)] = p
      self.lens[rid] = self.prompt_len[rid] = len(p)
    self.salt = np.zeros((r, 2), np.uint32)
    self.salt[: self.num_real] = salt
    self.max_tokens = np.asarray(reqs.max_tokens).copy()
    self.reqs = reqs.replace(keys=self._keys())
    self.state, self.params, self.scheduler = state, params, scheduler
    self.seed, self.temperature, self.eos_id = seed, temperature, eos_id
    self.uid = np.asarray(
      [
        rec.get("parent", rid) * 65536 + rec.get("sample", 0)
        for rid, rec in enumerate(records)
      ],
      np.int32,
    )
    self.fork_parent = (
      None if reqs.fork_parent is None else np.asarray(reqs.fork_parent)
    )
    self.children: dict[int, list[int]] = {}
    self.dormant: set[int] = set()
    if self.fork_parent is not None:
      for c in np.flatnonzero(self.fork_parent >= 0):
        self.children.setdefault(int(self.fork_parent[c]), []).append(int(c))
        self.dormant.add(int(c))
    self.copies = 0
    self.outputs: list[list[int]] = [[] for _ in range(self.num_real)]
    self.logits = [[] for _ in range(self.num_real)] if logits else None
    self.schedule: list[list[list[int]]] = []
    self.context: list[list[list[int]]] = []
    self.step_s: list[float] = []
    self.forward_s: list[float] = []
    self.first_step = [-1] * self.num_real
    self.finish_step = [-1] * self.num_real
    self.prefill_tokens = self.decode_tokens = 0
    self.blocks_peak = 0
    self.num_finished = 0
    self.done = False
    self.abandoned = False
    self.t0 = time.perf_counter()
    self.setup_s = 0.0
    self.records = records[: self.num_real]
    self.return_logits = logits

  def _keys(self):
    return _keys(
      to_device(self.tokens),
      to_device(self.lens),
      to_device(self.salt),
      block_size=self.k,
    )

  def step(self) -> None:
    """One engine step: schedule, forward, sample, complete.

    Raises:
      RuntimeError: the generation is done, the scheduler stalled, or a
        cache verb failed.
    """
    if self.done:
      raise RuntimeError(
        "the generation was abandoned"
        if self.abandoned
        else "the generation is done"
      )
    eng, k = self.eng, self.k
    t0 = time.perf_counter()
    plan = _schedule(
      self.state, self.reqs, self.params, scheduler=self.scheduler
    )
    st = plan["st"]
    num_sched, rids, ns, computed, ntok, slot, tables, err = jax.device_get(
      (
        plan["num_sched"],
        plan["sched_rid"],
        plan["sched_n"],
        st.num_computed,
        st.num_tokens,
        st.slot,
        st.cache.paging.block_tables,
        st.error,
      )
    )
    if err != vllm_v1.SimStatus.OK:
      raise RuntimeError(
        f"engine step {len(self.schedule)}: scheduler status "
        f"{vllm_v1.SimStatus(int(err)).name}"
      )
    if num_sched == 0:
      raise RuntimeError(
        f"engine step {len(self.schedule)}: nothing could be scheduled with "
        "requests left (STALLED)"
      )
    runs, samples = [], []
    for i in range(num_sched):
      rid, n = int(rids[i]), int(ns[i])
      stop = int(computed[rid])
      runs.append((stop - n, stop, self.tokens[rid], tables[slot[rid]]))
      if stop == int(ntok[rid]):  # the step reaches its last known token
        samples.append((i, rid, stop))
    arrays, last = fwd.plan_chunks(
      runs, k, eng.num_chunks, eng.serving.max_blocks_per_seq
    )
    chunks = fwd.Chunks(**{key: to_device(a) for key, a in arrays.items()})
    t1 = time.perf_counter()
    logits, eng.pool = fwd.forward(
      eng.model,
      eng.params,
      eng.pool,
      chunks,
      batch_invariant=eng.batch_invariant,
      shared_decode=(not eng.batch_invariant) and fwd.has_groups(arrays),
      backend=eng.backend,
      interpret=eng.interpret,
    )
    uid = np.zeros((eng.num_chunks,), np.int32)
    pos = np.zeros((eng.num_chunks,), np.int32)
    for i, rid, stop in samples:
      uid[last[i]], pos[last[i]] = self.uid[rid], stop
    toks = np.asarray(
      _sample(logits, self.seed, uid, pos, jnp.float32(self.temperature))
    )
    t2 = time.perf_counter()
    rows = np.asarray(logits) if self.logits is not None else None
    lowered = False
    for i, rid, stop in samples:
      tok = int(toks[last[i]])
      if rid < self.num_real:
        self.outputs[rid].append(tok)
        if self.first_step[rid] < 0:
          self.first_step[rid] = len(self.schedule)
        if rows is not None:
          self.logits[rid].append(rows[last[i]].copy())
      if stop < self.tokens.shape[1]:
        self.tokens[rid, stop] = tok
      self.lens[rid] = stop + 1
      if self.eos_id is not None and tok == self.eos_id:
        self.max_tokens[rid] = len(self.outputs[rid])
        lowered = True
    forks = self._fork_draws(samples, last, logits, rows)
    lowered |= any(self.max_tokens[c] == 1 for c, *_ in forks)
    reqs = self.reqs
    if lowered:
      reqs = reqs.replace(max_tokens=to_device(self.max_tokens))
    self.state, rec = _complete(
      plan, reqs, self.params, scheduler=self.scheduler
    )
    forked = self._forked(forks, slot, tables) if forks else []
    filled = any(self.lens[rid] % k == 0 for _, rid, _ in samples) or any(
      self.lens[c] % k == 0 for c in forked
    )
    self.reqs = reqs.replace(keys=self._keys()) if filled else reqs
    rec = jax.device_get(rec)
    here = len(self.schedule)
    for rid in rec.finished[rec.finished >= 0]:
      if rid < self.num_real:
        self.finish_step[rid] = here
    sched = [[int(r), int(x)] for r, x in zip(rids, ns, strict=True)]
    self.schedule.append(sched[:num_sched])
    self.context.append(
      [[r, start] for (r, _), (start, *_) in zip(sched, runs, strict=False)]
    )
    self.step_s.append(time.perf_counter() - t0)
    self.forward_s.append(t2 - t1)
    self.prefill_tokens += int(rec.prefill_tokens)
    self.decode_tokens += int(rec.decode_tokens)
    self.blocks_peak = max(
      self.blocks_peak, eng.serving.usable_blocks - int(rec.free_blocks)
    )
    self.num_finished += int(np.sum(rec.finished >= 0))
    st = self.state
    left = int(st.num_running) + int(st.num_waiting)
    self.done = left == 0 and int(st.num_arrived) == len(self.lens)
    if self.done:
      eng.cache = st.cache

  def _fork_draws(self, samples, last, logits, rows):
    """Fork mode: each dormant child of a request that samples its first
    token now draws its own first token from the parent's logits (its own
    key). Returns ``[(child, token, row)]``; eos lowers ``max_tokens``."""
    if not self.dormant:
      return []
    draws = []  # (child, logits row index, position)
    for i, rid, stop in samples:
      if rid < self.num_real and len(self.outputs[rid]) == 1:
        draws += [(c, last[i], stop) for c in self.children.get(rid, ())]
    if not draws:
      return []
    size = 1 << max(len(draws) - 1, 0).bit_length()
    pick = np.zeros((size,), np.int32)
    uid = np.zeros((size,), np.int32)
    pos = np.zeros((size,), np.int32)
    for j, (c, row, stop) in enumerate(draws):
      pick[j], uid[j], pos[j] = row, self.uid[c], stop
    toks = np.asarray(
      _sample(
        logits[to_device(pick)],
        self.seed,
        uid,
        pos,
        jnp.float32(self.temperature),
      )
    )
    out = []
    for j, (c, row, _) in enumerate(draws):
      tok = int(toks[j])
      if self.eos_id is not None and tok == self.eos_id:
        self.max_tokens[c] = 1
      out.append((c, tok, None if rows is None else rows[row]))
    return out

  def _forked(self, forks, slot_before, tables_before):
    """After ``complete``: the children that forked (or finished at once)
    take their first token; the forked ones get their copied page."""
    k = self.k
    status, slot, tables = jax.device_get(
      (self.state.status, self.state.slot, self.state.cache.paging.block_tables)
    )
    here = len(self.schedule)
    src, dst, started = [], [], []
    for c, tok, row in forks:
      self.dormant.discard(c)
      st = int(status[c])
      if st not in (vllm_v1.ReqStatus.RUNNING, vllm_v1.ReqStatus.FINISHED):
        continue  # queued as a plain request: it samples for itself
      plen = int(self.prompt_len[c])
      self.outputs[c].append(tok)
      self.first_step[c] = here
      if row is not None:
        self.logits[c].append(row.copy())
      self.tokens[c, plen] = tok
      self.lens[c] = plen + 1
      started.append(c)
      if st == vllm_v1.ReqStatus.FINISHED:
        self.finish_step[c] = here
        self.num_finished += 1
      elif plen % k:
        parent = int(self.fork_parent[c])
        src.append(int(tables_before[slot_before[parent], plen // k]))
        dst.append(int(tables[slot[c], plen // k]))
    if src:
      eng = self.eng
      eng.pool = _copy_pages(
        eng.pool,
        to_device(src, jnp.int32),
        to_device(dst, jnp.int32),
        backend=eng.backend,
        interpret=eng.interpret,
      )
      self.copies += len(src)
    return started

  def abandon(self) -> None:
    """Stops this generation before it is done, so the engine can start
    another. The engine's prefix cache is dropped and its KV pool zeroed:
    the pages this generation wrote may be pages the cache still lists
    as holding earlier prefixes. A done generation is left as it is."""
    if self.done:
      return
    eng = self.eng
    cfg = eng.cache_config
    eng.cache = None
    eng.pool = fwd.init_pool(eng.model_config, cfg.num_blocks, cfg.block_size)
    self.done = True
    self.abandoned = True
    if eng._live is self:
      eng._live = None

  def run(self, progress: bool = False) -> GenerateResult:
    """Steps until done (a tqdm bar over requests with ``progress``)."""
    bar = None
    if progress:
      from tqdm import tqdm

      bar = tqdm(total=self.num_real, unit="req", desc="generate")
    try:
      while not self.done:
        self.step()
        if bar is not None:
          bar.update(self.num_finished - bar.n)
    finally:
      if bar is not None:
        bar.close()
    return self.result()

  def result(self) -> GenerateResult:
    """The outputs so far (all of them once :attr:`done`)."""
    st = jax.device_get(self.state)
    real = slice(0, self.num_real)
    stats = dict(
      prompt_tokens=int(self.prompt_len[real].sum()),
      hit_tokens=int(st.hit_first_sched[real].sum()),
      resume_hit_tokens=int(st.resume_hit_tokens[real].sum()),
      prefill_tokens_computed=self.prefill_tokens,
      decode_tokens=self.decode_tokens,
      generated_tokens=sum(len(o) for o in self.outputs),
      preemptions=int(st.num_preemptions[real].sum()),
      evictions=int(st.cache.stats.evictions),
      blocks_peak=self.blocks_peak,
      cow_copies=self.copies,
      steps=len(self.schedule),
      wall_s=time.perf_counter() - self.t0,
    )
    logits = None
    if self.logits is not None:
      v = self.eng.model_config.vocab_size
      logits = [
        np.stack(rows) if rows else np.zeros((0, v), np.float32)
        for rows in self.logits
      ]
    return GenerateResult(
      tokens=[list(o) for o in self.outputs],
      stats=stats,
      schedule=self.schedule,
      setup_s=self.setup_s,
      step_s=self.step_s,
      forward_s=self.forward_s,
      context=self.context,
      first_token_step=self.first_step,
      finish_step=self.finish_step,
      logits=logits,
    )
