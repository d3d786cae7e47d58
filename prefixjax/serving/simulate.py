"""Host side of the serving simulator: trace in, oracle-format records out.

:func:`simulate` prepares a trace (token ids of every request's prompt and
outputs, its block keys, the arrival and priority orders), runs
:func:`prefixjax.serving.vllm_v1.run` (one jitted ``lax.while_loop`` over
engine steps) and returns a :class:`SimResult`, whose :meth:`SimResult.steps`
and :meth:`SimResult.requests` have the keys and values of
``tests/reference_models/vllm_scheduler.py`` ``VllmScheduler.simulate``
(arrivals ``"zero"``, or ``"time"`` for ``"trace"`` and ``"poisson"``; no
``cached_hashes``), and :meth:`SimResult.metrics` summarises them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import configs
from prefixjax.cache import hashing
from prefixjax.cache import prefix_cache as pc
from prefixjax.serving import roofline
from prefixjax.serving import vllm_v1 as engine
from prefixjax.serving.config import ServingConfig
from prefixjax.workloads import Trace

__all__ = [
  "ARRIVALS",
  "CLOCKS",
  "NUM_FABRICATED_VOCAB",
  "SimResult",
  "arrival_steps",
  "fabricated_token",
  "records_from_trace",
  "simulate",
]

NUM_FABRICATED_VOCAB = 32000
ARRIVALS = ("zero", "trace", "poisson")
CLOCKS = ("steps", "roofline")
DEFAULT_MODEL = "llama3_8b"
DEFAULT_HARDWARE = "h100"
Arrivals = Literal["zero", "trace", "poisson"]


def fabricated_token(rid: int, pos: int) -> int:
  """The oracle harness's output token when the trace has no output ids."""
  return (rid * 7919 + pos) % NUM_FABRICATED_VOCAB + 1


def records_from_trace(trace: Trace) -> list[dict[str, Any]]:
  """A :class:`prefixjax.workloads.Trace` as the harness's trace records.

  Each record has ``input_tok_ids``, ``output_toks``, ``arrival_time_ns``
  (``round(arrival_times_s * 1e9)``), with output ids ``output_tok_ids`` and
  with session ids ``client`` (the ``fair`` scheduler's client).

  Raises:
    ValueError: the trace has no token ids.
  """
  if trace.input_token_ids is None:
    raise ValueError("simulate needs a trace with input_token_ids")
  out = []
  for i in range(len(trace)):
    rec: dict[str, Any] = dict(
      input_tok_ids=[int(t) for t in trace.input_token_ids[i]],
      output_toks=int(trace.output_lengths[i]),
      arrival_time_ns=int(round(float(trace.arrival_times_s[i]) * 1e9)),
    )
    if trace.output_token_ids is not None:
      rec["output_tok_ids"] = [int(t) for t in trace.output_token_ids[i]]
    if trace.session_ids is not None:
      rec["client"] = int(trace.session_ids[i])
    out.append(rec)
  return out


def _parse(rid: int, rec: Mapping[str, Any]) -> tuple[list[int], int, list]:
  """``sched_harness.py load_trace`` (the oracle's ``_parse``)."""
  prompt = [int(t) for t in rec["input_tok_ids"]]
  out_ids = rec.get("output_tok_ids")
  out_ids = None if out_ids is None else [int(t) for t in out_ids]
  if "output_toks" in rec:
    max_tokens = int(rec["output_toks"])
  elif out_ids is not None:
    max_tokens = len(out_ids)
  else:
    raise ValueError(f"record {rid}: no output_toks and no output_tok_ids")
  if max_tokens < 1:
    raise ValueError(f"record {rid}: {max_tokens=} must be >= 1")
  return prompt, max_tokens, out_ids or []


def _next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What :func:`simulate` returns; numpy arrays on the host.

  Attributes:
    config: the engine configuration.
    status: :class:`prefixjax.serving.vllm_v1.SimStatus` name (``"OK"``).
    num_steps: engine steps executed (each scheduled tokens).
    idle_steps: clock steps skipped while nothing was running or waiting.
    step_time_ms: milliseconds per engine step, or ``None`` (then the
      metrics in seconds are ``None``).
    trace: a :class:`prefixjax.serving.vllm_v1.StepRecord` of ``[T, ...]``
      numpy arrays (rows past ``num_steps`` are padding).
    prompt_len: ``[R]`` prompt lengths.
    max_tokens: ``[R]`` output tokens requested.
    arrival_step: ``[R]`` step at which each request arrived.
    rejected: ``[R]`` bool, prompts the input checks refused.
    finished: ``[R]`` bool.
    first_sched_step, hit_first_sched, first_token_step, finish_step,
    num_output_tokens, num_preemptions, resume_hit_tokens, sched_steps,
    prefill_steps: ``[R]`` int per request (-1 where a step never came).
    priority: ``[R]`` int each record's ``priority`` (0 without one), or
      ``None`` (all 0).
    clock: ``"steps"``, or the timed clock (e.g. a
      :class:`prefixjax.serving.roofline.RooflineClock`).
    arrival_s: ``[R]`` float64 arrival times of a timed clock, else
      ``None``. With a timed clock, step numbers count executed steps
      (row ``s`` of ``trace`` is step ``s``), and ``arrival_step`` is the
      first step that started at or after the arrival.
  """

  config: ServingConfig
  status: str
  num_steps: int
  idle_steps: int
  step_time_ms: float | None
  trace: engine.StepRecord
  prompt_len: np.ndarray
  max_tokens: np.ndarray
  arrival_step: np.ndarray
  rejected: np.ndarray
  finished: np.ndarray
  first_sched_step: np.ndarray
  hit_first_sched: np.ndarray
  first_token_step: np.ndarray
  finish_step: np.ndarray
  num_output_tokens: np.ndarray
  num_preemptions: np.ndarray
  resume_hit_tokens: np.ndarray
  sched_steps: np.ndarray
  prefill_steps: np.ndarray
  priority: np.ndarray | None = None
  clock: Any = "steps"
  arrival_s: np.ndarray | None = None

  @property
  def ok(self) -> bool:
    return self.status == "OK"

  @property
  def timed(self) -> bool:
    """Whether a timed clock (roofline, user function) set the times."""
    return self.arrival_s is not None

  def step_times_s(self) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` float64 seconds of every executed step.

    A timed clock's own times; with ``"steps"``, ``s * step_time_ms`` and
    ``(s + 1) * step_time_ms`` (``NaN`` without ``step_time_ms``).
    """
    t = self.trace
    n = self.num_steps
    if self.timed:
      start = (t.time_ms[:n].astype(np.float64) + t.time_frac[:n]) / 1e3
      return start, start + t.dt_s[:n].astype(np.float64)
    dt = np.nan if self.step_time_ms is None else self.step_time_ms / 1e3
    s = t.step[:n].astype(np.float64)
    return s * dt, (s + 1) * dt

  def scheduled(self) -> list[list[list[int]]]:
    """Per step, ``[[rid, num_tokens], ...]`` in scheduler order."""
    t = self.trace
    return [
      [
        [int(r), int(n)]
        for r, n in zip(t.sched_rid[i], t.sched_n[i], strict=True)
        if r >= 0
      ]
      for i in range(self.num_steps)
    ]

  def steps(self) -> list[dict[str, Any]]:
    """The oracle's ``steps`` records (``steps.jsonl`` keys)."""
    t = self.trace
    usable = self.config.usable_blocks
    start, _ = self.step_times_s()
    out = []
    for i, sched in enumerate(self.scheduled()):
      lanes = t.sched_rid[i] >= 0
      kind = t.sched_kind[i]
      free = int(t.free_blocks[i])
      rec = dict(
        step=int(t.step[i]),
        sched=sched,
        tokens=int(t.sched_n[i].sum()),
        prefill_tokens=int(t.prefill_tokens[i]),
        decode_tokens=int(t.decode_tokens[i]),
        new=sorted(int(r) for r in t.sched_rid[i][lanes & (kind == 1)]),
        resumed=sorted(int(r) for r in t.sched_rid[i][lanes & (kind == 2)]),
        preempted=sorted(int(r) for r in t.preempted[i] if r >= 0),
        finished=sorted(int(r) for r in t.finished[i] if r >= 0),
        running=int(t.num_running[i]),
        waiting=int(t.num_waiting[i]),
        free_blocks=free,
        usage=round(1 - free / usable, 5),
        free_blocks_end=int(t.free_blocks_end[i]),
        pc_hits=int(t.pc_hits[i]),
        pc_queries=int(t.pc_queries[i]),
      )
      if self.timed:
        rec["time_s"] = float(start[i])
        rec["dt_s"] = float(t.dt_s[i])
      out.append(rec)
    return out

  def requests(self) -> list[dict[str, Any]]:
    """The oracle's ``requests`` records (``requests.jsonl`` keys)."""

    def opt(x):
      return None if x < 0 else int(x)

    out = []
    for rid in range(len(self.prompt_len)):
      rec: dict[str, Any] = dict(
        rid=rid,
        prompt_len=int(self.prompt_len[rid]),
        max_tokens=int(self.max_tokens[rid]),
        arrival_step=int(self.arrival_step[rid]),
        priority=0 if self.priority is None else int(self.priority[rid]),
      )
      if self.rejected[rid]:
        rec["status"] = "rejected"
        out.append(rec)
        continue
      first = opt(self.first_sched_step[rid])
      done = bool(self.finished[rid])
      rec.update(
        status="finished" if done else "waiting",
        first_sched_step=first,
        hit_first_sched=None
        if first is None
        else int(self.hit_first_sched[rid]),
        num_cached_tokens=None
        if first is None
        else int(self.hit_first_sched[rid]),
        first_token_step=opt(self.first_token_step[rid]),
        finish_step=opt(self.finish_step[rid]),
        finish_reason="length" if done else None,
        num_output_tokens=int(self.num_output_tokens[rid]),
        num_preemptions=int(self.num_preemptions[rid]),
        resume_hit_tokens=int(self.resume_hit_tokens[rid]),
        sched_steps=int(self.sched_steps[rid]),
        prefill_steps=int(self.prefill_steps[rid]),
      )
      if self.timed:
        rec.update(self._request_times(rid))
      out.append(rec)
    return out

  def _request_times(self, rid: int) -> dict[str, float | None]:
    """A timed clock's seconds of one request (``None`` where none)."""
    start, end = self.step_times_s()

    def at(times, step):
      return None if step < 0 else float(times[step])

    arrival = float(self.arrival_s[rid])
    first = at(end, self.first_token_step[rid])
    done = at(end, self.finish_step[rid])
    return dict(
      arrival_s=arrival,
      first_sched_s=at(start, self.first_sched_step[rid]),
      first_token_s=first,
      finish_s=done,
      ttft_s=None if first is None else first - arrival,
      e2e_s=None if done is None else done - arrival,
    )

  def metrics(self) -> dict[str, Any]:
    """Summary of the run; plain Python numbers (``None`` where undefined).

    Keys (steps are engine steps; with ``clock="steps"`` the ``*_s`` keys
    are ``steps * step_time_ms / 1000`` and ``None`` without
    ``step_time_ms``; with a timed clock they are the clock's seconds:
    TTFT = end of the first token's step - arrival, TPOT = (end of the
    finishing step - end of the first token's step) / (outputs - 1), E2E =
    end of the finishing step - arrival, queueing = start of the first
    scheduled step - arrival, makespan = end of the last step):

    * ``steps``: steps executed; ``idle_steps``: steps the clock skipped
      while the engine was empty; ``makespan_steps``: last executed step +
      1 (idle steps included), ``makespan_s``.
    * ``requests``, ``finished``, ``rejected``: request counts.
    * ``prompt_tokens``: prompt tokens of the requests not rejected;
      ``hit_tokens``: prefix-cache hits at each request's first admission
      (vLLM's ``num_cached_tokens``); ``token_hit_rate`` = their ratio.
    * ``prefill_tokens_computed``: prefill tokens scheduled (recomputation
      after preemption included); ``prefill_tokens_saved``: tokens served by
      the cache instead, ``hit_tokens`` plus the hits at resumptions.
    * ``preemptions``: preemptions summed over requests.
    * ``peak_blocks_in_use``, ``mean_blocks_in_use``: usable blocks not
      free after scheduling, max and mean over executed steps.
    * ``internal_fragmentation_tokens``: reserved but unused token slots
      after scheduling (each running request's last block's empty slots),
      mean over executed steps; ``internal_fragmentation``: the same over
      the reserved slots ``blocks_in_use * K`` (mean of per-step ratios).
    * ``ttft_steps_p50/p90/p99``: ``first_token_step + 1 - arrival_step``;
      ``tpot_steps_*``: ``(finish_step - first_token_step) /
      (num_output_tokens - 1)`` over requests with 2+ outputs;
      ``e2e_steps_*``: ``finish_step + 1 - arrival_step``;
      ``queue_steps_*``: ``first_sched_step - arrival_step``; each also in
      seconds (``ttft_s_p50`` ...). Over finished requests; percentiles are
      ``numpy.percentile``'s (linear).
    * ``output_tokens``; ``throughput_tokens_per_step``: output tokens over
      ``makespan_steps``; ``throughput_tokens_per_s``.
    """
    n = self.num_steps
    t = self.trace
    k = self.config.block_size
    scale = None if self.step_time_ms is None else self.step_time_ms / 1e3

    def sec(x):
      return None if scale is None or x is None else float(x) * scale

    admitted = ~self.rejected
    seen = admitted & (self.first_sched_step >= 0)
    done = self.finished & admitted
    prompt_tokens = int(self.prompt_len[admitted].sum())
    hit = int(self.hit_first_sched[seen].sum())
    in_use = self.config.usable_blocks - t.free_blocks[:n].astype(np.int64)
    frag = t.frag_tokens[:n].astype(np.int64)
    reserved = in_use * k
    ratio = np.divide(
      frag, reserved, out=np.zeros(n, np.float64), where=reserved > 0
    )
    makespan = int(t.step[n - 1]) + 1 if n else 0
    out_tokens = int(self.num_output_tokens[admitted].sum())
    arr = self.arrival_step[done].astype(np.int64)
    first_tok = self.first_token_step[done].astype(np.int64)
    fin = self.finish_step[done].astype(np.int64)
    nout = self.num_output_tokens[done].astype(np.int64)
    multi = nout > 1
    series = dict(
      ttft=first_tok + 1 - arr,
      tpot=(fin[multi] - first_tok[multi]) / (nout[multi] - 1),
      e2e=fin + 1 - arr,
      queue=self.first_sched_step[done].astype(np.int64) - arr,
    )
    m: dict[str, Any] = dict(
      steps=n,
      idle_steps=self.idle_steps,
      makespan_steps=makespan,
      makespan_s=sec(makespan),
      requests=len(self.prompt_len),
      finished=int(done.sum()),
      rejected=int(self.rejected.sum()),
      prompt_tokens=prompt_tokens,
      hit_tokens=hit,
      token_hit_rate=hit / prompt_tokens if prompt_tokens else None,
      prefill_tokens_computed=int(t.prefill_tokens[:n].sum()),
      prefill_tokens_saved=hit + int(self.resume_hit_tokens[seen].sum()),
      preemptions=int(self.num_preemptions.sum()),
      peak_blocks_in_use=int(in_use.max()) if n else 0,
      mean_blocks_in_use=float(in_use.mean()) if n else None,
      internal_fragmentation_tokens=float(frag.mean()) if n else None,
      internal_fragmentation=float(ratio.mean()) if n else None,
    )
    timed = self._timed_series(done, multi) if self.timed else None
    for name, x in series.items():
      for q in (50, 90, 99):
        v = float(np.percentile(x, q)) if len(x) else None
        m[f"{name}_steps_p{q}"] = v
        if timed is None:
          m[f"{name}_s_p{q}"] = sec(v)
        else:
          y = timed[name]
          m[f"{name}_s_p{q}"] = float(np.percentile(y, q)) if len(y) else None
    m["output_tokens"] = out_tokens
    m["throughput_tokens_per_step"] = (
      out_tokens / makespan if makespan else None
    )
    if self.timed:
      _, end = self.step_times_s()
      span = float(end[-1]) if n else 0.0
      m["makespan_s"] = span
      m["throughput_tokens_per_s"] = out_tokens / span if span > 0 else None
    else:
      m["throughput_tokens_per_s"] = (
        None
        if scale is None or not makespan
        else out_tokens / (makespan * scale)
      )
    return m

  def _timed_series(self, done, multi) -> dict[str, np.ndarray]:
    start, end = self.step_times_s()
    arr = self.arrival_s[done]
    first = end[self.first_token_step[done]]
    fin = end[self.finish_step[done]]
    nout = self.num_output_tokens[done].astype(np.int64)
    return dict(
      ttft=first - arr,
      tpot=(fin[multi] - first[multi]) / (nout[multi] - 1),
      e2e=fin - arr,
      queue=start[self.first_sched_step[done]] - arr,
    )


def _clients(records: list[Mapping[str, Any]]) -> np.ndarray:
  """``[R]`` int32 dense client ids from each record's ``client`` (else 0).

  Raises:
    ValueError: a ``client`` that is not an int.
  """
  raw = []
  for rid, rec in enumerate(records):
    c = rec.get("client", 0)
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
      raise ValueError(f"record {rid}: client={c!r} must be an int")
    raw.append(int(c))
  _, dense = np.unique(np.asarray(raw, np.int64), return_inverse=True)
  return dense.astype(np.int32)


def _poisson_ns(r: int, rate: float, seed: int) -> list[int]:
  """Poisson arrival times in ns: 0, then ``exponential(1 / rate)`` gaps."""
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, r)
  times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
  return [int(round(x * 1e9)) for x in times]


def _priority_order(
  records: list[Mapping[str, Any]],
  arrivals: str,
  rate: float | None,
  seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Each record's ``priority`` and its ranks in vLLM's priority order.

  ``Request.__lt__`` orders by ``(priority, arrival_time, request_id)``;
  ``arrival_time`` is the harness's: ``arrival_time_ns / 1e9`` (the drawn
  time for ``"poisson"``), or ``rid * 1e-3`` without one; ``request_id``
  sorts as the rid.

  Returns:
    ``(priority, rank, prio_key)``: ``[R]`` int64 priorities; ``[R]`` int32
    ranks: ``rank`` is the
    position in the full order, ``prio_key`` the dense rank of
    ``(priority, arrival_time)`` (ties equal: the victim key).
  """
  r = len(records)
  priority = [int(rec.get("priority", 0)) for rec in records]
  if arrivals == "poisson":
    assert rate is not None
    ns: list[Any] = list(_poisson_ns(r, rate, seed))
  else:
    ns = [rec.get("arrival_time_ns") for rec in records]
  times = [x / 1e9 if x is not None else rid * 1e-3 for rid, x in enumerate(ns)]
  keys = list(zip(priority, times, strict=True))
  order = sorted(range(r), key=lambda rid: (keys[rid], rid))
  rank = np.zeros((r,), np.int32)
  rank[order] = np.arange(r, dtype=np.int32)
  distinct = {k: j for j, k in enumerate(sorted(set(keys)))}
  prio_key = np.asarray([distinct[k] for k in keys], np.int32)
  return np.asarray(priority, np.int64), rank, prio_key


def arrival_times_s(
  records: list[Mapping[str, Any]],
  arrivals: str,
  rate: float | None = None,
  seed: int = 0,
) -> np.ndarray:
  """``[R]`` float64 arrival time in seconds of each record (a timed clock).

  ``"zero"``: all 0; ``"trace"``: ``arrival_time_ns / 1e9``; ``"poisson"``:
  the draws of :func:`arrival_steps`.

  Raises:
    ValueError: an unknown ``arrivals``, a bad ``rate``, a record without
      ``arrival_time_ns``, or a negative time.
  """
  r = len(records)
  if arrivals not in ARRIVALS:
    raise ValueError(f"arrivals={arrivals!r}; expected one of {ARRIVALS}")
  if arrivals == "zero":
    return np.zeros((r,), np.float64)
  if arrivals == "poisson":
    if rate is None or not rate > 0:
      raise ValueError(f"arrivals='poisson' needs rate > 0, got {rate!r}")
    ns = _poisson_ns(r, rate, seed)
  else:
    ns = []
    for rid, rec in enumerate(records):
      if rec.get("arrival_time_ns") is None:
        raise ValueError(f"record {rid}: no arrival_time_ns")
      ns.append(int(rec["arrival_time_ns"]))
  out = np.asarray(ns, np.float64) / 1e9
  if out.min() < 0 or out.max() * 1e3 >= 2**31 - 1:
    raise ValueError(
      f"arrival times span [{out.min()}, {out.max()}] s: negative, or past "
      "the timed clock's 2**31 ms"
    )
  return out


def _clock(clock, model, hardware):
  """``None`` for ``"steps"``, else a clock object (see :func:`simulate`)."""
  if isinstance(clock, str):
    if clock not in CLOCKS:
      raise ValueError(
        f"clock={clock!r}; expected one of {CLOCKS} or an object"
      )
    if clock == "steps":
      if model is not None or hardware is not None:
        raise ValueError("model= and hardware= need clock='roofline'")
      return None
    m = model if model is not None else DEFAULT_MODEL
    h = hardware if hardware is not None else DEFAULT_HARDWARE
    m = configs.model_config(m) if isinstance(m, str) else m
    h = configs.hardware_config(h) if isinstance(h, str) else h
    return roofline.RooflineClock(m, h)
  if model is not None or hardware is not None:
    raise ValueError("model= and hardware= go with clock='roofline' only")
  if hasattr(clock, "step_time_s"):
    return clock
  if callable(clock):
    return roofline.FunctionClock(clock)
  raise TypeError(
    f"clock must be 'steps', 'roofline', a clock object or a function, got "
    f"{clock!r}"
  )


def arrival_steps(
  records: list[Mapping[str, Any]],
  arrivals: str,
  step_time_ms: float | None,
  rate: float | None = None,
  seed: int = 0,
) -> np.ndarray:
  """``[R]`` int32 arrival step of each record.

  ``"zero"``: all 0. ``"trace"``: ``arrival_time_ns // step_ns`` with
  ``step_ns = round(step_time_ms * 1e6)`` (the harness's ``time``
  arrivals). ``"poisson"``: the first request at time 0, then gaps drawn
  with ``numpy.random.default_rng(seed).exponential(1 / rate)`` seconds,
  rounded to nanoseconds, then as ``"trace"``.

  Raises:
    ValueError: an unknown ``arrivals``, a missing or non-positive
      ``step_time_ms`` or ``rate``, a record without ``arrival_time_ns``.
  """
  r = len(records)
  if arrivals not in ARRIVALS:
    raise ValueError(f"arrivals={arrivals!r}; expected one of {ARRIVALS}")
  if arrivals == "zero":
    return np.zeros((r,), np.int32)
  if step_time_ms is None or not step_time_ms > 0:
    raise ValueError(
      f"arrivals={arrivals!r} needs step_time_ms > 0, got {step_time_ms!r}"
    )
  step_ns = int(round(step_time_ms * 1e6))
  if step_ns < 1:
    raise ValueError(f"step_time_ms={step_time_ms!r} is under a nanosecond")
  if arrivals == "poisson":
    if rate is None or not rate > 0:
      raise ValueError(f"arrivals='poisson' needs rate > 0, got {rate!r}")
    ns = _poisson_ns(r, rate, seed)
  else:
    ns = []
    for rid, rec in enumerate(records):
      if rec.get("arrival_time_ns") is None:
        raise ValueError(f"record {rid}: no arrival_time_ns")
      ns.append(int(rec["arrival_time_ns"]))
  steps = [x // step_ns for x in ns]
  if min(steps) < 0 or max(steps) >= 2**31 - 1:
    raise ValueError(
      f"arrival steps span [{min(steps)}, {max(steps)}]: negative times or "
      f"too many steps of step_time_ms={step_time_ms}"
    )
  return np.asarray(steps, np.int32)


def _prepare(records: list[Mapping[str, Any]], config: ServingConfig):
  k, mml = config.block_size, config.max_model_len
  m = config.max_blocks_per_seq
  r = len(records)
  tokens = np.zeros((r, m * k), np.int32)
  lens = np.zeros((r,), np.int32)
  prompt_len = np.zeros((r,), np.int32)
  max_tokens = np.zeros((r,), np.int32)
  rejected = np.zeros((r,), bool)
  for rid, rec in enumerate(records):
    prompt, mt, out_ids = _parse(rid, rec)
    prompt_len[rid], max_tokens[rid] = len(prompt), mt
    if not 0 < len(prompt) < mml:  # InputProcessor
      rejected[rid] = True
      continue
    outs = [
      out_ids[j] if j < len(out_ids) else fabricated_token(rid, j)
      for j in range(min(mt, mml - len(prompt)))
    ]
    seq = prompt + outs
    tokens[rid, : len(seq)] = seq
    lens[rid] = len(seq)
  keys, _ = jax.vmap(lambda t, n: hashing.block_hashes(t, n, block_size=k))(
    jnp.asarray(tokens), jnp.asarray(lens)
  )
  return keys, prompt_len, max_tokens, rejected, lens


def simulate(
  trace: Trace | Iterable[Mapping[str, Any]],
  config: ServingConfig,
  *,
  arrivals: Arrivals = "zero",
  step_time_ms: float | None = None,
  rate: float | None = None,
  seed: int = 0,
  max_steps: int | None = None,
  clock: Any = "steps",
  model: str | configs.ModelConfig | None = None,
  hardware: str | configs.HardwareConfig | None = None,
) -> SimResult:
  """Serves a trace with vLLM 0.33's v1 scheduler, step by step.

  ``config.scheduler`` picks FCFS (the default), PRIORITY (the waiting
  queue is ordered by each record's ``priority``, lower first, default 0;
  a :class:`prefixjax.workloads.Trace` has none; then arrival time, then
  rid; the preemption victim is the running request with the largest
  ``(priority, arrival_time)``), or another order of the waiting queue
  (:mod:`prefixjax.serving.schedulers`: ``lpm``, ``dfs``, ``fair``, whose
  clients are the records' ``client`` field, a Trace's ``session_ids``).

  rid is the record's index. Requests arrive at the step of
  :func:`arrival_steps` and can be scheduled in that step; when nothing is
  running or waiting the clock jumps to the next arrival (idle steps), as
  ``sched_harness.py`` does. The whole run is one jitted loop
  (:func:`prefixjax.serving.vllm_v1.run`).

  Args:
    trace: a :class:`prefixjax.workloads.Trace` with token ids, or the
      harness's records (``input_tok_ids``, ``output_toks`` and/or
      ``output_tok_ids``; outputs past the ids are the harness's
      :func:`fabricated_token`).
    config: the engine.
    arrivals: ``"zero"`` (all at step 0), ``"trace"`` (each record's
      ``arrival_time_ns``, a Trace's ``arrival_times_s``, at step
      ``floor(t / step_time_ms)``: the oracle's ``arrivals="time"``) or
      ``"poisson"`` (times drawn at ``rate`` requests/s with ``seed``).
    step_time_ms: milliseconds per engine step; needed by ``"trace"`` and
      ``"poisson"``, optional for ``"zero"`` (the metrics in seconds).
    rate: requests per second of ``"poisson"``.
    seed: seed of ``"poisson"``'s ``numpy.random.default_rng``.
    max_steps: rows of the step buffers ``T``; by default a power of two
      above twice the trace's tokens, doubled and rerun while the run
      reports ``OUT_OF_STEPS``.
    clock: ``"steps"`` (default: every step lasts ``step_time_ms``, a
      request arriving at ``t`` is queued at step ``floor(t /
      step_time_ms)``), ``"roofline"`` (each step's time from
      :func:`prefixjax.serving.roofline.step_time_s` over its batch, with
      ``model`` and ``hardware``, default ``"llama3_8b"`` on ``"h100"``),
      a clock object with ``step_time_s(new_tokens, context_tokens)`` or a
      function ``(new_tokens [S], context_tokens [S]) -> seconds``
      (traceable). A timed clock queues a request when the time at the
      start of a step has reached its arrival, jumps an empty engine to
      the next arrival, and needs no ``step_time_ms``.
    model, hardware: names (:data:`prefixjax.configs.MODELS`,
      :data:`prefixjax.configs.HARDWARE`) or configs, for ``"roofline"``.

  Returns:
    A :class:`SimResult`; ``status`` is not ``"OK"`` when the run stalled
    or ran out of steps (then records are partial).

  Raises:
    TypeError: ``config`` is not a :class:`ServingConfig`.
    ValueError: a record without outputs or with ``max_tokens < 1``; bad
      ``arrivals``, ``step_time_ms`` or ``rate`` (see :func:`arrival_steps`).
  """
  if not isinstance(config, ServingConfig):
    raise TypeError(f"config must be a ServingConfig, got {type(config)}")
  records = (
    records_from_trace(trace) if isinstance(trace, Trace) else list(trace)
  )
  if not records:
    raise ValueError("simulate needs at least one request")
  if step_time_ms is not None and not step_time_ms > 0:
    raise ValueError(f"step_time_ms={step_time_ms!r} must be > 0")
  timer = _clock(clock, model, hardware)
  if timer is None:
    arrival = arrival_steps(records, arrivals, step_time_ms, rate, seed)
    arrival_s = None
    sort_by = arrival
  else:
    if step_time_ms is not None:
      raise ValueError("step_time_ms is for clock='steps' only")
    arrival = np.zeros((len(records),), np.int32)
    secs = arrival_times_s(records, arrivals, rate, seed)
    arrival_ms = np.floor(secs * 1e3)
    arrival_frac = (secs * 1e3 - arrival_ms).astype(np.float32)
    arrival_ms = arrival_ms.astype(np.int32)
    # The times the device compares, to the bit (in ms).
    arrival_msf = arrival_ms + arrival_frac.astype(np.float64)
    arrival_s = arrival_msf / 1e3
    sort_by = arrival_s
  priority, rank, prio_key = _priority_order(records, arrivals, rate, seed)
  scheduler = config.scheduler_object
  client = _clients(records)
  keys, prompt_len, max_tokens, rejected, lens = _prepare(records, config)
  r = len(records)
  order = np.lexsort((np.arange(r), sort_by)).astype(np.int32)
  waiting = np.full((r,), -1, np.int32)
  status = np.where(
    rejected, engine.ReqStatus.REJECTED, engine.ReqStatus.WAITING
  ).astype(np.int32)
  if not scheduler.deque:
    waiting = np.full((r,), -1, np.int32)
  cache = pc.init(
    config.num_gpu_blocks,
    config.block_size,
    max_seqs=config.max_num_seqs,
    max_blocks_per_seq=config.max_blocks_per_seq,
    vllm_version="0.33",
  )
  state = engine.init_state(
    cache,
    jnp.asarray(waiting),
    0,
    jnp.asarray(status),
    jnp.asarray(prompt_len),
    scheduler=scheduler,
  )
  reqs = engine.RequestTable(
    keys=keys,
    prompt_len=jnp.asarray(prompt_len),
    max_tokens=jnp.asarray(max_tokens),
    arrival_step=jnp.asarray(arrival),
    arrival_order=jnp.asarray(order),
    rank=jnp.asarray(rank),
    prio_key=jnp.asarray(prio_key),
    client=jnp.asarray(client),
  )
  if timer is not None:
    reqs = reqs.replace(
      arrival_ms=jnp.asarray(arrival_ms), arrival_frac=jnp.asarray(arrival_frac)
    )
  params = engine.EngineParams(
    max_num_batched_tokens=jnp.int32(config.max_num_batched_tokens),
    max_model_len=jnp.int32(config.max_model_len),
    chunked_prefill=jnp.bool_(config.chunked_prefill),
    long_prefill_token_threshold=jnp.int32(config.long_prefill_token_threshold),
  )
  retry = max_steps is None
  steps = max_steps or _next_pow2(2 * int(lens.sum()) + 16)
  while True:
    final, trace_out = engine.run(
      state, reqs, params, max_steps=steps, scheduler=scheduler, clock=timer
    )
    err = engine.SimStatus(int(final.error))
    if not (retry and err == engine.SimStatus.OUT_OF_STEPS):
      break
    steps *= 2
  f = jax.device_get(final)
  trace_np = engine.StepRecord(*(np.asarray(x) for x in trace_out))
  if timer is not None:  # the first step that started at or after arrival
    n = int(f.num_steps)
    start = trace_np.time_ms[:n].astype(np.float64) + trace_np.time_frac[:n]
    arrival = np.searchsorted(start, arrival_msf, side="left").astype(np.int32)
  return SimResult(
    config=config,
    status=err.name,
    num_steps=int(f.num_steps),
    idle_steps=int(f.idle_steps),
    step_time_ms=None if step_time_ms is None else float(step_time_ms),
    trace=trace_np,
    prompt_len=prompt_len,
    max_tokens=max_tokens,
    arrival_step=arrival,
    rejected=rejected,
    finished=np.asarray(f.status) == engine.ReqStatus.FINISHED,
    first_sched_step=np.asarray(f.first_sched_step),
    hit_first_sched=np.asarray(f.hit_first_sched),
    first_token_step=np.asarray(f.first_token_step),
    finish_step=np.asarray(f.finish_step),
    num_output_tokens=np.asarray(f.num_output),
    num_preemptions=np.asarray(f.num_preemptions),
    resume_hit_tokens=np.asarray(f.resume_hit_tokens),
    sched_steps=np.asarray(f.sched_steps),
    prefill_steps=np.asarray(f.prefill_steps),
    priority=priority,
    clock="steps" if timer is None else timer,
    arrival_s=arrival_s,
  )
