"""Serving simulators: engine-step schedulers on the on-device prefix cache.

* :class:`ServingConfig`: the engine's scheduler and KV-cache sizes.
* :func:`simulate`: a trace through vLLM 0.33's v1 scheduler loop, one
  jitted loop over engine steps (:mod:`prefixjax.serving.vllm_v1`), with a
  waiting-queue scheduler from :mod:`prefixjax.serving.schedulers`
  (``fcfs``, ``priority``, ``lpm``, ``dfs``, ``fair``, user-defined) and a
  clock (counted steps, or :mod:`prefixjax.serving.roofline`'s step times),
  returning a :class:`SimResult` in the oracle's record format, with
  arrivals at step 0, from the trace's times or Poisson, and
  :meth:`SimResult.metrics` (latencies, hit rate, blocks, throughput).
"""

from prefixjax.serving import roofline, schedulers, vllm_v1
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.results import SimResult
from prefixjax.serving.schedulers import (
  Scheduler,
  get_scheduler,
  register_scheduler,
  scheduler_names,
)
from prefixjax.serving.simulate import (
  ARRIVALS,
  CLOCKS,
  arrival_steps,
  arrival_times_s,
  fabricated_token,
  records_from_trace,
  simulate,
  simulate_batch,
)

__all__ = [
  "ARRIVALS",
  "CLOCKS",
  "Scheduler",
  "ServingConfig",
  "SimResult",
  "arrival_steps",
  "arrival_times_s",
  "fabricated_token",
  "get_scheduler",
  "records_from_trace",
  "register_scheduler",
  "roofline",
  "scheduler_names",
  "schedulers",
  "simulate",
  "simulate_batch",
  "vllm_v1",
]
