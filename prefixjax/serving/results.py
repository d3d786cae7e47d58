"""What the serving simulator returns: :class:`SimResult`.

Per-step and per-request records in the oracle's format (the keys of
``tests/reference_models/vllm_scheduler.py`` ``VllmScheduler.simulate``),
a timed clock's seconds, and :meth:`SimResult.metrics`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from prefixjax.serving.config import ServingConfig
from prefixjax.serving.engine_state import StepRecord

__all__ = ["SimResult"]


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
    parent, sample: ``[R]`` int, with parallel sampling (records with
      ``n > 1``, :func:`prefixjax.serving.simulate.fan_out`): each child
      request's record index and sample index; ``None`` without.
    evictions: cached blocks (SGLang: pages) that lost their identity to
      make room for new ones, over the run; ``None`` where not counted.
    lanes_recorded: whether ``trace`` holds every step's ``[S]`` fields
      (:func:`prefixjax.serving.simulate_batch` keeps only the per-step
      scalars the metrics need; then :meth:`scheduled` and :meth:`steps`
      raise).
  """

  config: ServingConfig
  status: str
  num_steps: int
  idle_steps: int
  step_time_ms: float | None
  trace: StepRecord
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
  lanes_recorded: bool = True
  parent: np.ndarray | None = None
  sample: np.ndarray | None = None
  evictions: int | None = None

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

  def _need_lanes(self) -> None:
    if not self.lanes_recorded:
      raise ValueError(
        "this result kept no per-step request lists (simulate_batch "
        "records the per-step totals only); run simulate() for them"
      )

  def scheduled(self) -> list[list[list[int]]]:
    """Per step, ``[[rid, num_tokens], ...]`` in scheduler order."""
    self._need_lanes()
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
    self._need_lanes()
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

    times = self.step_times_s() if self.timed else None
    out = []
    for rid in range(len(self.prompt_len)):
      rec: dict[str, Any] = dict(
        rid=rid,
        prompt_len=int(self.prompt_len[rid]),
        max_tokens=int(self.max_tokens[rid]),
        arrival_step=int(self.arrival_step[rid]),
        priority=0 if self.priority is None else int(self.priority[rid]),
      )
      if self.parent is not None:
        rec.update(parent=int(self.parent[rid]), sample=int(self.sample[rid]))
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
        rec.update(self._request_times(rid, *times))
      out.append(rec)
    return out

  def _request_times(self, rid: int, start, end) -> dict[str, float | None]:
    """A timed clock's seconds of one request (``None`` where none), from
    :meth:`step_times_s`."""

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
      (vLLM's ``num_cached_tokens``; a child forked under
      ``parallel_sampling="fork"`` has its whole prompt, shared from its
      parent); ``token_hit_rate`` = their ratio.
    * ``prefill_tokens_computed``: prefill tokens scheduled (recomputation
      after preemption included); ``prefill_tokens_saved``: tokens served by
      the cache instead, ``hit_tokens`` plus the hits at resumptions.
    * ``preemptions``: preemptions summed over requests.
    * ``evictions``: cached blocks whose identity was dropped to make room
      (vLLM: a hashed free block popped for a new one, its hash removed;
      SGLang: pages of evicted radix-tree leaves).
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
      ``makespan_steps``; ``throughput_tokens_per_s``;
      ``throughput_requests_per_step`` and ``throughput_requests_per_s``:
      finished requests over the makespan.
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
      evictions=self.evictions,
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
    finished = m["finished"]
    m["throughput_tokens_per_step"] = (
      out_tokens / makespan if makespan else None
    )
    m["throughput_requests_per_step"] = (
      finished / makespan if makespan else None
    )
    if self.timed:
      _, end = self.step_times_s()
      span = float(end[-1]) if n else 0.0
      m["makespan_s"] = span
    else:
      span = None if scale is None or not makespan else makespan * scale
    ok = span is not None and span > 0
    m["throughput_tokens_per_s"] = out_tokens / span if ok else None
    m["throughput_requests_per_s"] = finished / span if ok else None
    return m

  def frame(self, what: str = "requests"):
    """A tidy ``pandas.DataFrame`` of the run, for research code.

    Args:
      what: ``"requests"`` (one row per request, :meth:`requests`'s keys;
        ``rid`` the 0-based record index), ``"steps"`` (one row per
        executed step, :meth:`steps`'s keys) or ``"metrics"`` (one row,
        :meth:`metrics`, with the configuration's fields beside it).

    Example:
      >>> import prefixjax as pj
      >>> from prefixjax.serving import ServingConfig, simulate
      >>> trace = pj.generate_workload("multi_turn", num_requests=6, seed=0)
      >>> config = ServingConfig(num_gpu_blocks=200, block_size=16,
      ...                        max_num_seqs=4, max_num_batched_tokens=256,
      ...                        max_model_len=2048)
      >>> df = simulate(trace, config).frame()
      >>> len(df), "hit_first_sched" in df.columns
      (6, True)
    """
    import pandas as pd

    if what == "requests":
      return pd.DataFrame(self.requests())
    if what == "steps":
      return pd.DataFrame(self.steps())
    if what == "metrics":
      config = {
        f.name: getattr(self.config, f.name)
        for f in dataclasses.fields(self.config)
      }
      config["scheduler"] = self.config.scheduler_name
      return pd.DataFrame([{**config, **self.metrics()}])
    raise ValueError(f"what={what!r} must be 'requests', 'steps' or 'metrics'")

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
