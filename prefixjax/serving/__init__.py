"""Serving simulators: engine-step schedulers on the on-device prefix cache.

* :class:`ServingConfig`: the engine's scheduler and KV-cache sizes.
* :func:`simulate`: a trace through vLLM 0.33's v1 scheduler (FCFS or
  priority, ``ServingConfig.policy``), one jitted loop over engine steps
  (:mod:`prefixjax.serving.vllm_v1`),
  returning a :class:`SimResult` in the oracle's record format, with
  arrivals at step 0, from the trace's times or Poisson, and
  :meth:`SimResult.metrics` (latencies, hit rate, blocks, throughput).
"""

from prefixjax.serving import vllm_v1
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.simulate import (
  ARRIVALS,
  SimResult,
  arrival_steps,
  fabricated_token,
  records_from_trace,
  simulate,
)

__all__ = [
  "ARRIVALS",
  "ServingConfig",
  "SimResult",
  "arrival_steps",
  "fabricated_token",
  "records_from_trace",
  "simulate",
  "vllm_v1",
]
