"""Engine configuration of the serving simulator (vLLM's scheduler knobs).

The rules are those of the plain-Python oracle
``tests/reference_models/vllm_scheduler.py`` (``VllmScheduler.__init__``),
which takes them from vLLM 0.33.0: ``SchedulerConfig.verify_max_model_len``
and ``check_enough_kv_cache_memory``.
"""

from __future__ import annotations

import dataclasses

from prefixjax.serving import schedulers as sch

__all__ = ["POLICIES", "ServingConfig"]

POLICIES = ("fcfs", "priority")
"""vLLM's own scheduling policies (``SchedulerConfig.policy``)."""


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _int_field(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"ServingConfig.{name} must be an int, got {value!r}")
  return int(value)


PARALLEL_SAMPLING = ("fan_out", "fork")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
  """A vLLM v1 engine's scheduler and KV-cache sizes.

  Attributes:
    num_gpu_blocks: KV blocks *including* vLLM's null block 0 (the oracle
      harness's ``--num-gpu-blocks``); ``num_gpu_blocks - 1`` are usable.
    block_size: tokens per block ``K``.
    max_num_seqs: most requests running at once (``S``; the cache's
      sequence slots).
    max_num_batched_tokens: token budget of one engine step.
    max_model_len: longest sequence (prompt + output); a request stops at
      it, and a prompt of this length or more is rejected.
    chunked_prefill: whether a prompt may be split over several steps.
    long_prefill_token_threshold: cap on one request's tokens per step
      while more than one request is running or waiting; 0 is no cap.
    scheduler: a registered scheduler name
      (:func:`prefixjax.serving.schedulers.scheduler_names`) or a
      :class:`prefixjax.serving.schedulers.Scheduler`: ``"fcfs"``
      (default) and ``"priority"`` are vLLM's ``SchedulerConfig.policy``
      (``"priority"`` reads each record's ``priority``, lower first,
      default 0); ``"lpm"``, ``"dfs"``, ``"fair"`` and user-defined ones
      order the waiting queue inside vLLM's loop.
    parallel_sampling: how a request with ``n > 1`` samples: ``"fan_out"``
      (vLLM 0.33: ``n`` independent child requests sharing the prompt's
      blocks through the prefix cache) or ``"fork"`` (the parent prefills,
      the children fork its blocks with copy-on-write at its first token;
      :mod:`prefixjax.serving.fork`).

  Raises:
    TypeError: a field of the wrong type.
    ValueError: a rule broken; the message names the field and the rule.

  Example:
    >>> from prefixjax.serving import ServingConfig
    >>> ServingConfig(num_gpu_blocks=9, block_size=4, max_num_seqs=2,
    ...               max_num_batched_tokens=16, max_model_len=32).usable_blocks
    8
  """

  num_gpu_blocks: int
  block_size: int
  max_num_seqs: int
  max_num_batched_tokens: int
  max_model_len: int
  chunked_prefill: bool = True
  long_prefill_token_threshold: int = 0
  scheduler: str | sch.Scheduler = "fcfs"
  parallel_sampling: str = "fan_out"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if f.name == "parallel_sampling":
        if self.parallel_sampling not in PARALLEL_SAMPLING:
          raise ValueError(
            "ServingConfig.parallel_sampling="
            f"{self.parallel_sampling!r} must be one of {PARALLEL_SAMPLING}"
          )
      elif f.name == "scheduler":
        if not isinstance(self.scheduler, (str, sch.Scheduler)):
          raise TypeError(
            "ServingConfig.scheduler must be a str or a Scheduler, got "
            f"{self.scheduler!r}"
          )
        if (
          isinstance(self.scheduler, str)
          and self.scheduler not in sch.scheduler_names()
        ):
          raise ValueError(
            f"ServingConfig.scheduler={self.scheduler!r} must be one of "
            f"{sch.scheduler_names()}"
          )
      elif f.name == "chunked_prefill":
        if not isinstance(self.chunked_prefill, bool):
          raise TypeError(
            "ServingConfig.chunked_prefill must be a bool, got "
            f"{self.chunked_prefill!r}"
          )
      else:
        _int_field(f.name, getattr(self, f.name))
    for name in ("num_gpu_blocks", "block_size", "max_num_seqs"):
      if getattr(self, name) < 1:
        raise ValueError(
          f"ServingConfig.{name}={getattr(self, name)} must be >= 1"
        )
    if self.max_model_len < 1:
      raise ValueError(
        f"ServingConfig.max_model_len={self.max_model_len} must be >= 1"
      )
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise ValueError(
        "ServingConfig.max_num_batched_tokens="
        f"{self.max_num_batched_tokens} must be >= max_num_seqs="
        f"{self.max_num_seqs} (vLLM SchedulerConfig.verify_max_model_len)"
      )
    if (
      not self.chunked_prefill
      and self.max_num_batched_tokens < self.max_model_len
    ):
      raise ValueError(
        "ServingConfig.max_num_batched_tokens="
        f"{self.max_num_batched_tokens} must be >= max_model_len="
        f"{self.max_model_len} without chunked prefill (vLLM "
        "SchedulerConfig.verify_max_model_len)"
      )
    if not 0 <= self.long_prefill_token_threshold <= self.max_model_len:
      raise ValueError(
        "ServingConfig.long_prefill_token_threshold="
        f"{self.long_prefill_token_threshold} must be in [0, max_model_len="
        f"{self.max_model_len}]"
      )
    need = _cdiv(self.max_model_len, self.block_size)
    if need > self.num_gpu_blocks - 1:
      raise ValueError(
        f"ServingConfig.num_gpu_blocks={self.num_gpu_blocks}: max_model_len="
        f"{self.max_model_len} needs {need} blocks of block_size="
        f"{self.block_size} but only {self.num_gpu_blocks - 1} are usable "
        "(the null block is extra; vLLM's check_enough_kv_cache_memory)"
      )

  @property
  def scheduler_object(self) -> sch.Scheduler:
    """The :class:`prefixjax.serving.schedulers.Scheduler` it names."""
    return sch.get_scheduler(self.scheduler)

  @property
  def scheduler_name(self) -> str:
    return self.scheduler_object.name

  @property
  def usable_blocks(self) -> int:
    """Blocks the scheduler can hand out: ``num_gpu_blocks - 1``."""
    return self.num_gpu_blocks - 1

  @property
  def max_blocks_per_seq(self) -> int:
    """Block-table columns ``M = ceil(max_model_len / K)``."""
    return _cdiv(self.max_model_len, self.block_size)
