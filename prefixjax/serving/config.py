"""Engine configuration of the serving simulator (vLLM's scheduler knobs).

The rules are those of the plain-Python oracle
``tests/reference_models/vllm_scheduler.py`` (``VllmScheduler.__init__``),
which takes them from vLLM 0.33.0: ``SchedulerConfig.verify_max_model_len``
and ``check_enough_kv_cache_memory``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prefixjax.serving import schedulers as sch

__all__ = ["POLICIES", "SEMANTICS", "SGLANG_POLICIES", "ServingConfig"]

POLICIES = ("fcfs", "priority")
"""vLLM's own scheduling policies (``SchedulerConfig.policy``)."""


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _int_field(name: str, value) -> int:
  """``value`` as a Python int (numpy ints too), refused unless it fits the
  simulator's int32 arrays."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"ServingConfig.{name} must be an int, got {value!r}")
  if not -(2**31) < value < 2**31:
    raise ValueError(
      f"ServingConfig.{name}={value} must be in (-2**31, 2**31): the "
      "simulator holds it in int32"
    )
  return int(value)


PARALLEL_SAMPLING = ("fan_out", "fork")
SEMANTICS = ("vllm", "sglang")
"""Whose scheduler loop the simulator runs (:class:`ServingConfig`)."""
SGLANG_POLICIES = ("fcfs", "lpm", "dfs", "fair", "priority")
"""The schedulers of ``semantics="sglang"``: SGLang's ``--schedule-policy``
values this project models (``dfs``: ``dfs-weight``), and ``fair``, this
project's VTC over SGLang's loop (not an SGLang policy; see
:mod:`prefixjax.serving.sglang_engine`)."""
_SGLANG_PRIORITY_KNOBS = (  # sglang-only fields, defaults
  ("low_priority_first", False),
  ("priority_preemption", True),
  ("priority_preemption_threshold", 10),
)


@dataclasses.dataclass(frozen=True)
class ServingConfig:
  """A vLLM v1 engine's scheduler and KV-cache sizes.

  Attributes:
    num_gpu_blocks: KV blocks *including* vLLM's null block 0 (the oracle
      harness's ``--num-gpu-blocks``); ``num_gpu_blocks - 1`` are usable.
    block_size: tokens per block ``K``.
    max_num_seqs: most requests running at once (``S``; the cache's
      sequence slots).
    max_num_batched_tokens: token budget of one engine step. vLLM's
      rules: at least ``max_num_seqs``, and at least ``max_model_len``
      without chunked prefill; below ``block_size`` it is refused under
      ``"sglang"`` (a chunk is cut to whole pages) but kept under
      ``"vllm"``, which accepts it (a chunk then fills part of a block).
    max_model_len: longest sequence (prompt + output); a request stops at
      it, and a prompt of this length or more is rejected. Under
      ``"sglang"`` it is SGLang's ``--context-length`` with SGLang's
      rules (:attr:`prompt_limit`): prompts of ``max_model_len - 6``
      tokens or more are aborted and a request samples at most
      ``max_model_len - 2 - prompt`` tokens.
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
    semantics: ``"vllm"`` (vLLM 0.33's v1 scheduler and block pool,
      :mod:`prefixjax.serving.vllm_v1`) or ``"sglang"`` (SGLang 0.5.23's
      scheduler loop over its paged radix cache,
      :mod:`prefixjax.serving.sglang_engine`). Under ``"sglang"`` the fields
      are SGLang's server arguments: ``num_gpu_blocks - 1`` usable pages of
      ``block_size`` tokens (``--page-size``), ``max_num_seqs`` is
      ``--max-running-requests``, ``max_num_batched_tokens`` is
      ``--chunked-prefill-size`` (with ``chunked_prefill``; without it no
      chunking), ``max_model_len`` is ``--context-length``, ``scheduler`` is
      ``--schedule-policy`` (``"fcfs"``, ``"lpm"`` or ``"dfs"``, SGLang's
      ``dfs-weight``; ``"priority"`` is ``fcfs`` with
      ``--enable-priority-scheduling``, reading each record's ``priority``,
      default 0, **higher first** as SGLang's default; ``"fair"`` is this
      project's VTC).
    max_prefill_tokens: SGLang's ``--max-prefill-tokens`` (default 16384,
      ``server_args.py``): prefill tokens of one batch; ``"sglang"`` only.
    waiting_prefix_refresh: SGLang's ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH``
      (on by default): the ``fcfs`` policy's 1st, 33rd, 65th, ...
      ``calc_priority`` refreshes the prompt paths of the first 128 waiting
      requests; ``"sglang"`` only.
    low_priority_first: SGLang's ``--schedule-low-priority-values-first``
      (off by default: higher ``priority`` values go first; vLLM's
      ``priority`` policy is always lower first); ``"sglang"``,
      ``scheduler="priority"`` only.
    priority_preemption: SGLang's priority preemption (on by default;
      ``False`` is ``--disable-priority-preemption``): with the running
      slots full, a waiting request preempts running ones whose priority
      it beats by more than ``priority_preemption_threshold``;
      ``"sglang"``, ``scheduler="priority"`` only.
    priority_preemption_threshold: SGLang's
      ``--priority-scheduling-preemption-threshold`` (default 10);
      ``"sglang"``, ``scheduler="priority"`` only.

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
  semantics: str = "vllm"
  max_prefill_tokens: int = 16384
  waiting_prefix_refresh: bool = True
  low_priority_first: bool = False
  priority_preemption: bool = True
  priority_preemption_threshold: int = 10

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if f.name == "semantics":
        if self.semantics not in SEMANTICS:
          raise ValueError(
            f"ServingConfig.semantics={self.semantics!r} must be one of "
            f"{SEMANTICS}"
          )
      elif f.name == "parallel_sampling":
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
      elif f.name in (
        "chunked_prefill",
        "waiting_prefix_refresh",
        "low_priority_first",
        "priority_preemption",
      ):
        if not isinstance(getattr(self, f.name), bool):
          raise TypeError(
            f"ServingConfig.{f.name} must be a bool, got "
            f"{getattr(self, f.name)!r}"
          )
      else:  # numpy ints become Python ints (hashing, JSON)
        value = _int_field(f.name, getattr(self, f.name))
        object.__setattr__(self, f.name, value)
    for name in (
      "num_gpu_blocks",
      "block_size",
      "max_num_seqs",
      "max_num_batched_tokens",
    ):
      if getattr(self, name) < 1:
        raise ValueError(
          f"ServingConfig.{name}={getattr(self, name)} must be >= 1"
        )
    if self.max_model_len < 1:
      raise ValueError(
        f"ServingConfig.max_model_len={self.max_model_len} must be >= 1"
      )
    if self.max_num_seqs * _cdiv(self.max_model_len, self.block_size) >= 2**31:
      raise ValueError(
        f"ServingConfig.max_num_seqs={self.max_num_seqs}: its block tables of "
        f"ceil(max_model_len={self.max_model_len} / block_size="
        f"{self.block_size}) columns overflow int32 entry ids (at most "
        f"{2**31 - 1:_} entries)"
      )
    if self.num_gpu_blocks * self.block_size >= 2**31:
      raise ValueError(
        f"ServingConfig.num_gpu_blocks={self.num_gpu_blocks} * block_size="
        f"{self.block_size} token slots overflow int32 slot ids (at most "
        f"{2**31 - 1:_})"
      )
    vllm = self.semantics == "vllm"
    if vllm and self.max_num_batched_tokens < self.max_num_seqs:
      raise ValueError(
        "ServingConfig.max_num_batched_tokens="
        f"{self.max_num_batched_tokens} must be >= max_num_seqs="
        f"{self.max_num_seqs} (vLLM SchedulerConfig.verify_max_model_len)"
      )
    if (
      vllm
      and not self.chunked_prefill
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
        "(block 0 is reserved: vLLM's null block, SGLang's padding page; "
        "vLLM's check_enough_kv_cache_memory)"
      )

    if self.semantics == "sglang":
      self._check_sglang()
    elif self.max_prefill_tokens != 16384:
      raise ValueError(
        f"ServingConfig.max_prefill_tokens={self.max_prefill_tokens}: an "
        "sglang-semantics knob (SGLang's --max-prefill-tokens); vllm "
        "semantics has none"
      )
    elif knob := self._priority_knob_set():
      raise ValueError(
        f"ServingConfig.{knob[0]}={knob[1]!r}: an sglang-semantics knob "
        "(SGLang's priority scheduling); vLLM's priority policy is always "
        "lower first and preempts by (priority, arrival), no threshold"
      )
    elif not self.waiting_prefix_refresh:
      raise ValueError(
        "ServingConfig.waiting_prefix_refresh=False: an sglang-semantics "
        "knob; vllm semantics has none"
      )

  def _priority_knob_set(self) -> tuple[str, object] | None:
    """The first SGLang priority knob off its default, as (name, value)."""
    return next(
      (
        (name, getattr(self, name))
        for name, default in _SGLANG_PRIORITY_KNOBS
        if getattr(self, name) != default
      ),
      None,
    )

  def _check_sglang(self) -> None:
    """The rules of ``semantics="sglang"``."""
    name = self.scheduler
    if not isinstance(name, str) or name not in SGLANG_POLICIES:
      raise ValueError(
        f"ServingConfig.scheduler={name!r}: semantics='sglang' runs "
        f"the schedulers {SGLANG_POLICIES} only"
      )
    if self.max_prefill_tokens < 1:
      raise ValueError(
        f"ServingConfig.max_prefill_tokens={self.max_prefill_tokens} must "
        "be >= 1"
      )
    if abs(self.priority_preemption_threshold) >= 2**30:
      raise ValueError(
        "ServingConfig.priority_preemption_threshold="
        f"{self.priority_preemption_threshold} must be in (-2**30, 2**30)"
      )
    if name != "priority" and (knob := self._priority_knob_set()):
      raise ValueError(
        f"ServingConfig.{knob[0]}={knob[1]!r} is a rule of "
        f"scheduler='priority' (SGLang's --enable-priority-scheduling); "
        f"scheduler={name!r} reads no priority"
      )
    if self.long_prefill_token_threshold:
      raise ValueError(
        "ServingConfig.long_prefill_token_threshold is a vLLM knob; "
        "semantics='sglang' has none (leave it 0)"
      )
    if self.parallel_sampling != "fan_out":
      raise ValueError(
        "ServingConfig.parallel_sampling='fork' needs semantics='vllm'; "
        "under 'sglang' the n samples are independent requests (fan_out)"
      )
    k = self.block_size
    if self.chunked_prefill and self.max_num_batched_tokens < k:
      raise ValueError(
        "ServingConfig.max_num_batched_tokens="
        f"{self.max_num_batched_tokens} (SGLang's chunked_prefill_size) "
        f"must be >= block_size={k}: a chunk is cut to whole pages"
      )
    if self.max_model_len < 8:
      raise ValueError(
        f"ServingConfig.max_model_len={self.max_model_len} must be >= 8 "
        "with semantics='sglang': SGLang aborts every prompt of "
        "context_len - 6 tokens or more (max_req_input_len, "
        "managers/tp_worker.py), so a shorter context admits nothing"
      )
    pages = self.num_gpu_blocks - 1
    if self.max_model_len + k >= pages * k:
      raise ValueError(
        f"ServingConfig.num_gpu_blocks={self.num_gpu_blocks}: with "
        f"semantics='sglang' a request of max_model_len={self.max_model_len} "
        f"tokens needs max_model_len + block_size < {pages} usable pages x "
        f"{k} tokens, or SGLang's admission (PrefillAdder: prompt + "
        "max_new_tokens + one page < free tokens) never admits it"
      )

  @property
  def scheduler_object(self) -> sch.Scheduler:
    """The :class:`prefixjax.serving.schedulers.Scheduler` it names."""
    return sch.get_scheduler(self.scheduler)

  @property
  def scheduler_name(self) -> str:
    return self.scheduler_object.name

  @property
  def prompt_limit(self) -> int:
    """Prompts of this many tokens or more are rejected (so are empty ones).

    ``"vllm"``: ``max_model_len`` (vLLM 0.33 ``InputProcessor``).
    ``"sglang"``: SGLang 0.5.23's ``max_req_input_len = max_req_len - 5``
    with ``max_req_len = min(context_len - 1, pool tokens - 1)``
    (``managers/tp_worker.py`` ``get_worker_info``; the abort in
    ``managers/utils.py`` ``validate_input_length``), which is
    ``max_model_len - 6`` here, the pool always holding more than
    ``max_model_len`` tokens.
    """
    if self.semantics != "sglang":
      return self.max_model_len
    pool = self.usable_blocks * self.block_size
    return min(self.max_model_len - 1, pool - 1) - 5

  @property
  def usable_blocks(self) -> int:
    """Blocks the scheduler can hand out: ``num_gpu_blocks - 1``."""
    return self.num_gpu_blocks - 1

  @property
  def max_blocks_per_seq(self) -> int:
    """Block-table columns ``M = ceil(max_model_len / K)``."""
    return _cdiv(self.max_model_len, self.block_size)
