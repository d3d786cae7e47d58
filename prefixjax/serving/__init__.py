"""Serving simulators: engine-step schedulers on the on-device prefix cache.

* :class:`ServingConfig`: the engine's scheduler and KV-cache sizes.
* :func:`simulate`: a trace through vLLM 0.33's v1 FCFS scheduler, one
  jitted loop over engine steps (:mod:`prefixjax.serving.vllm_fcfs`),
  returning a :class:`SimResult` in the oracle's record format.
"""

from prefixjax.serving import vllm_fcfs
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.simulate import (
  SimResult,
  fabricated_token,
  records_from_trace,
  simulate,
)

__all__ = [
  "ServingConfig",
  "SimResult",
  "fabricated_token",
  "records_from_trace",
  "simulate",
  "vllm_fcfs",
]
