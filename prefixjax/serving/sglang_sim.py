"""Host side of ``semantics="sglang"``: records in, a :class:`SimResult` out.

:func:`simulate_sglang` prepares a trace for
:mod:`prefixjax.serving.sglang_engine` (SGLang 0.5.23's scheduler loop, one
jitted ``lax.while_loop``), runs it, doubling the step rows while they run
out, and returns the same :class:`SimResult` as the vLLM semantics, so
:meth:`SimResult.metrics`, :meth:`SimResult.requests`, the CLI and sweeps
read both alike. Differences in meaning: ``num_preemptions`` counts
SGLang's retractions, ``resume_hit_tokens`` the hits when a retracted
request is admitted again, ``free_blocks`` counts free plus evictable pages
(the pages no running request holds, as vLLM's free queue holds its cached
blocks), and ``sched_kind`` 1 / 2 / 0 is a first admission / an admission
after a retraction / a running request (a decode or a chunk continued).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from prefixjax._host import replicate, shard_lanes
from prefixjax.serving import sglang_engine as eng
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.engine_state import (
  StepRecord,
  first_rows,
  join_rows,
  segment_rows,
)
from prefixjax.serving.results import SimResult

__all__ = ["simulate_sglang", "simulate_sglang_batch"]

_STATUS = {
  eng.Status.OK: "OK",
  eng.Status.STEP_ROWS: "OUT_OF_STEPS",
  eng.Status.OUT_OF_MEMORY: "OUT_OF_MEMORY",
  eng.Status.STUCK: "STALLED",
  eng.Status.BAD_STEP_TIME: "BAD_STEP_TIME",
}


@dataclasses.dataclass(frozen=True)
class _Prepared:
  consts: eng.Consts
  cfg: eng.Config
  knobs: eng.Knobs
  host: dict[str, Any]


def _max_new(outputs) -> np.ndarray:
  return np.asarray([max(len(o), 1) for o in outputs], np.int32)


def page_trie(tokens, page_size: int) -> dict:
  """The page trie of ``tokens`` (``simulate._request_tokens``'s result)
  at ``page_size``: :func:`~prefixjax.serving.sglang_tree.page_trie`,
  which runs over one trace at any arrivals share."""
  prompts, outputs = tokens[0], tokens[1]
  return eng.page_trie(prompts, outputs, _max_new(outputs), page_size)


def _prepare(
  config: ServingConfig,
  tokens,
  arr,
  client=None,
  priority=None,
  parent=None,
  sample=None,
  trie=None,
) -> _Prepared:
  k = config.block_size
  prompts, outputs, prompt_len, max_tokens, rejected = tokens
  r = len(prompts)
  max_new = _max_new(outputs)
  arrival = arr["arrival"]
  consts = eng.prepare(
    prompts,
    outputs,
    max_new,
    arrival,
    rejected,
    k,
    arrival_ms=arr["arrival_ms"],
    arrival_frac=arr["arrival_frac"],
    sort_by=arr["sort_by"],
    client=client,
    pv=None
    if priority is None
    else np.asarray(priority, np.int64)
    * (-1 if config.low_priority_first else 1),
    trie=trie,
  )
  ok = ~rejected
  work = int(prompt_len[ok].sum()) // max(config.max_num_batched_tokens, 1)
  rows = 1 << (work + 2 * r + int(max_new[ok].sum()) + 64).bit_length()
  cfg = eng.Config(
    page_size=k,
    num_pages=config.num_gpu_blocks - 1,
    max_running=config.max_num_seqs,
    policy=config.scheduler,
    refresh=config.waiting_prefix_refresh,
    steps=rows,
  )
  if config.scheduler == "priority":  # other policies share one program
    cfg = cfg._replace(preempt=config.priority_preemption)
  knobs = eng.knobs(
    config.max_num_batched_tokens if config.chunked_prefill else 0,
    config.max_prefill_tokens,
    config.priority_preemption_threshold,
  )
  return _Prepared(
    consts,
    cfg,
    knobs,
    dict(
      prompt_len=prompt_len,
      max_tokens=max_tokens,
      arrival=arrival,
      arrival_s=arr["arrival_s"],
      arrival_msf=arr["arrival_msf"],
      rejected=rejected,
      priority=None if priority is None else np.asarray(priority, np.int64),
      parent=parent,
      sample=sample,
    ),
  )


def simulate_sglang(
  config: ServingConfig,
  tokens,
  arr: Mapping[str, Any],
  *,
  client=None,
  priority=None,
  parent=None,
  sample=None,
  trie=None,
  step_time_ms=None,
  max_steps=None,
  timer=None,
  progress: bool = False,
) -> SimResult:
  """:func:`prefixjax.serving.simulate` with ``semantics="sglang"``.

  ``tokens`` and ``arr`` are the host preparation :func:`simulate` shares
  by both semantics (``simulate._request_tokens`` of the records after
  ``fan_out``, ``simulate._arrival_arrays``); ``timer`` ``None`` (the steps
  clock) or a clock object; ``client``: ``[R]`` dense client ids (the
  ``fair`` policy's, ``simulate._clients``; default all 0); ``priority``:
  ``[R]`` ints, ``|p| < 2**30`` (the ``priority`` policy's, records'
  ``priority``; default all 0); ``parent``, ``sample``: ``[R]`` ints of
  the fanned-out records (``n > 1``), or None, carried to the result;
  ``trie``: :func:`page_trie` of ``tokens`` at the config's block size,
  when the caller keeps it (default: computed here); ``progress``: a tqdm
  bar of finished requests on stderr.
  """
  if config.semantics != "sglang":
    raise ValueError("simulate_sglang needs ServingConfig.semantics='sglang'")
  prep = _prepare(config, tokens, arr, client, priority, parent, sample, trie)
  num_requests = len(tokens[0])
  cfg = prep.cfg
  if max_steps is not None:
    cfg = cfg._replace(steps=int(max_steps))
  else:
    cfg = cfg._replace(
      steps=segment_rows(cfg.steps, min(cfg.max_running, num_requests))
    )
  bar = None
  if progress:
    from tqdm import tqdm

    from prefixjax.serving import vllm_v1

    bar = tqdm(total=num_requests, unit="req", desc="simulate (sglang)")

    def update(done, steps):
      bar.set_postfix_str(f"{steps:,} steps", refresh=False)
      bar.update(done - bar.n)

    vllm_v1.set_progress_sink(update)
  try:
    s = eng.start(prep.consts, cfg)
    pieces, n = [], 0
    while True:  # a segment of cfg.steps rows at a time (eng.resume)
      s = eng.resume(
        prep.consts, cfg, prep.knobs, s, np.int32(n), clock=timer,
        progress=progress,
      )  # fmt: skip
      rows = int(s.row)
      pieces.append((jax.device_get(first_rows(s.out, rows)), rows))
      n += rows
      s = s._replace(out=None)
      if max_steps is not None or int(s.status) != eng.Status.STEP_ROWS:
        break
  finally:
    if bar is not None:
      vllm_v1.set_progress_sink(None)
      bar.update(num_requests - bar.n)
      bar.close()
  out = join_rows(pieces)
  return _collect(prep, config, jax.device_get(s), out, n, step_time_ms, timer)


# The Consts fields that depend on a configuration's arrivals (rate, seed)
# or priority order; the rest (the trace's page trie) one batch shares.
_PER_CONFIG = ("arrival", "arr_rank", "arr_ms", "arr_frac", "pv")

# ServingConfig fields behind the static eng.Config of a batch.
BATCH_STATIC = ("waiting_prefix_refresh", "priority_preemption")


@functools.cache
def _batched_run(cfg: eng.Config, clock, until_full: bool = False):
  """The loop over the configurations' arrival arrays and knobs (the
  shared ``Consts`` unbatched), :func:`~prefixjax.serving.sglang_engine.
  run_batched`; one compiled program per ``(cfg, clock, until_full)``."""
  return jax.jit(
    functools.partial(
      eng.run_batched, cfg=cfg, clock=clock, until_full=until_full
    )
  )


@functools.cache
def _batched_start(cfg: eng.Config):
  return jax.jit(functools.partial(eng.start_batched, cfg=cfg))


def simulate_sglang_batch(
  configs, inputs, *, step_times, max_steps=None, timer=None, devices=None
) -> list[SimResult]:
  """:func:`simulate_sglang` for many configurations as one loop whose
  steps are ``jax.vmap``-ed
  (:func:`~prefixjax.serving.sglang_engine.run_batched`): the budgets
  (:class:`~prefixjax.serving.sglang_engine.Knobs`) and the arrival arrays
  batched, the trace's page trie shared.

  ``inputs``: per configuration, the keyword arguments ``tokens``, ``arr``,
  ``client`` and ``priority`` of :func:`simulate_sglang`; ``step_times``
  each one's ``step_time_ms``. The configurations must give one static
  ``Config`` (block size, pool, ``max_num_seqs``, scheduler and
  :data:`BATCH_STATIC`; checked by the caller). The step buffers hold
  ``max_steps`` rows, or by default a segment of
  :func:`~prefixjax.serving.engine_state.segment_rows` rows for all lanes
  together, every lane resumed into fresh buffers once one lane's fill
  (``until_full``). ``devices``:
  the configurations' axis sharded over them (padded with copies of the
  last configuration, dropped again). Each result equals
  :func:`simulate_sglang`'s, with ``lanes_recorded`` False as every
  :func:`~prefixjax.serving.simulate_batch` result.
  """
  preps = [
    _prepare(
      c,
      i["tokens"],
      i["arr"],
      i["client"],
      i["priority"],
      i.get("parent"),
      i.get("sample"),
      i.get("trie"),
    )
    for c, i in zip(configs, inputs, strict=True)
  ]
  n = len(preps)
  if max_steps is None:
    steps = segment_rows(max(p.cfg.steps for p in preps), 0, configs=n)
  else:
    steps = max_steps
  cfg = preps[0].cfg._replace(steps=int(steps))
  for i, p in enumerate(preps):
    if p.cfg._replace(steps=cfg.steps) != cfg:
      raise ValueError(
        f"configs[{i}] needs another compiled program than configs[0] "
        f"({p.cfg} vs {preps[0].cfg})"
      )
  shared = preps[0].consts
  lanes = {
    f: np.stack([np.asarray(getattr(p.consts, f)) for p in preps])
    for f in _PER_CONFIG
  }
  knobs = eng.Knobs(
    *(np.stack([getattr(p.knobs, f) for p in preps]) for f in eng.Knobs._fields)
  )
  if devices is not None and len(devices) > 1:
    lanes, knobs = shard_lanes((lanes, knobs), devices)
    shared = replicate(shared, devices)
  if max_steps is None:
    s, pieces = _batched_start(cfg)(shared, lanes), []
    while True:
      s = _batched_run(cfg, timer, True)(shared, lanes, knobs, s=s)
      rows = np.asarray(s.row)[:n]
      cut = first_rows(s.out, int(rows.max()), 1)
      pieces.append((jax.device_get(cut), rows))
      s = s._replace(out=None)
      status, done = np.asarray(s.status)[:n], np.asarray(s.done)[:n]
      if not np.any((status == eng.Status.STEP_ROWS) | ((status == 0) & ~done)):
        break
    final = jax.device_get(s)
  else:
    final = _batched_run(cfg, timer)(shared, lanes, knobs)
    rows = np.asarray(final.row)[:n]
    pieces = [(jax.device_get(first_rows(final.out, int(rows.max()), 1)), rows)]
    final = jax.device_get(final._replace(out=None))
  out = []
  for i, (p, c) in enumerate(zip(preps, configs, strict=True)):
    f = jax.tree.map(lambda x, i=i: x[i], final)
    bufs = join_rows(
      [(jax.tree.map(lambda x, i=i: x[i], b), r[i]) for b, r in pieces]
    )
    n_i = int(sum(r[i] for _, r in pieces))
    res = _collect(p, c, f, bufs, n_i, step_times[i], timer)
    out.append(dataclasses.replace(res, lanes_recorded=False))
  return out


def _status_name(status: int) -> str:
  bits = (
    eng.Status.BAD_STEP_TIME,
    eng.Status.OUT_OF_MEMORY,
    eng.Status.STUCK,
    eng.Status.STEP_ROWS,
  )
  for bit in bits:
    if status & bit:
      return _STATUS[bit]
  return "OK"


def _collect(
  prep: _Prepared, config, final, out, n: int, step_time_ms, timer
) -> SimResult:
  """The result of a lane's final state ``final``, its step buffers
  ``out`` (at least ``n`` rows) and ``n`` executed steps."""
  h = prep.host
  q = final.q
  trace = StepRecord(**{k: np.asarray(out[k]) for k in eng.RECORD_FIELDS})
  arrival = h["arrival"]
  if timer is not None:  # the first step that started at or after
    start = trace.time_ms[:n].astype(np.float64) + trace.time_frac[:n]
    arrival = np.searchsorted(start, h["arrival_msf"], side="left").astype(
      np.int32
    )
  return SimResult(
    config=config,
    status=_status_name(int(final.status)),
    num_steps=n,
    idle_steps=int(final.idle),
    step_time_ms=None if step_time_ms is None else float(step_time_ms),
    trace=trace,
    prompt_len=h["prompt_len"],
    max_tokens=h["max_tokens"],
    arrival_step=arrival,
    rejected=h["rejected"],
    finished=np.asarray(q.finish) >= 0,
    first_sched_step=np.asarray(q.first_sched),
    hit_first_sched=np.maximum(np.asarray(q.hit), 0),
    first_token_step=np.asarray(q.first_tok),
    finish_step=np.asarray(q.finish),
    num_output_tokens=np.asarray(q.n_out),
    num_preemptions=np.asarray(q.retr),
    resume_hit_tokens=np.asarray(q.resume_hit),
    sched_steps=np.asarray(q.sched_steps),
    prefill_steps=np.asarray(q.prefill_steps),
    priority=h["priority"],
    parent=h["parent"],
    sample=h["sample"],
    clock="steps" if timer is None else timer,
    arrival_s=h["arrival_s"],
    evictions=int(final.tree.evicted),
  )
