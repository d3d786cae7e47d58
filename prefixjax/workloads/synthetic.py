"""Seeded synthetic workloads with the request structures of prefix sharing.

Every generator returns a `Trace` with `input_token_ids` and
`output_token_ids` (ids drawn from a vocabulary, default 32,000), so blocks
of any size can be cut from it, and `session_ids` naming the conversation,
sampling group, tree or agent run each request belongs to. Requests are in
arrival order. The same `(kind, num_requests, seed, params)` always gives
the same trace (numpy `Generator` seeded with `seed`).

Kinds (see `workload_kinds()`; parameters are listed by each function):

- `system_prompt`: a few shared system prompts with Zipf popularity, each
  followed by a private question.
- `multi_turn`: chat sessions; turn `t + 1`'s prompt is turn `t`'s prompt,
  then turn `t`'s answer, then a new question.
- `few_shot`: per-task instructions plus shots from the task's pool of
  examples, then a question.
- `parallel_sampling`: groups of `n` requests with the same prompt.
- `beam_search`: beams share the prompt, then each round re-sends the
  parent beam's trajectory (beams diverge, and some die out).
- `tree_of_thought`: a frontier of partial trajectories, each expanded by
  `branching` requests that re-send it; `keep` children survive per level.
- `agent`: agent runs re-sending their growing trajectory (shared tool
  instructions, then actions and tool observations).
- `default`: the built-in default workload (`default_workload()`): Zipf
  system prompts mixed with multi-turn chat.

Arrivals are Poisson at `rate` (requests per second, or sessions / groups /
trees / runs per second for the structured kinds); follow-up requests of a
session come after exponential gaps.

Length parameters take an int (fixed) or an inclusive `(low, high)` range
sampled uniformly.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixjax.workloads.trace import Trace, merge_traces

__all__ = [
  "DEFAULT_VOCAB_SIZE",
  "default_workload",
  "generate_workload",
  "register_workload",
  "unregister_workload",
  "workload_defaults",
  "workload_kinds",
]

DEFAULT_VOCAB_SIZE = 32_000

LengthRange = int | tuple[int, int]
WorkloadFn = Callable[..., Trace]


# -- parameter checks ----------------------------------------------------------
def _is_int(value: Any) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _int_param(
  name: str, value: Any, minimum: int, maximum: int | None = None
) -> int:
  if not _is_int(value):
    raise TypeError(f"{name}={value!r} must be an int")
  if value < minimum:
    raise ValueError(f"{name}={value} must be >= {minimum}")
  if maximum is not None and value > maximum:
    raise ValueError(f"{name}={value} must be <= {maximum}")
  return int(value)


def _vocab_param(value: Any) -> int:
  """Token ids are int32, so ``[0, vocab_size)`` must fit: at most 2**31."""
  return _int_param("vocab_size", value, 2, 2**31)


def _rate_param(name: str, value: Any) -> float:
  """A positive rate whose mean gap ``1 / rate`` is a finite float."""
  value = _float_param(name, value)
  if not np.isfinite(1.0 / value):
    raise ValueError(
      f"{name}={value!r} is too small: the mean gap 1/{name} overflows float64"
    )
  return value


def _float_param(
  name: str, value: Any, *, minimum: float = 0.0, strict: bool = True
) -> float:
  if isinstance(value, bool) or not isinstance(
    value, int | float | np.integer | np.floating
  ):
    raise TypeError(f"{name}={value!r} must be a number")
  value = float(value)
  if not np.isfinite(value) or value < minimum or (strict and value == minimum):
    bound = ">" if strict else ">="
    raise ValueError(f"{name}={value} must be finite and {bound} {minimum}")
  return value


def _range_param(name: str, value: Any, minimum: int) -> tuple[int, int]:
  if _is_int(value):
    value = (value, value)
  if (
    not isinstance(value, tuple | list)
    or len(value) != 2
    or not all(_is_int(v) for v in value)
  ):
    raise TypeError(
      f"{name}={value!r} must be an int or a (low, high) pair of ints"
    )
  low, high = int(value[0]), int(value[1])
  if low < minimum or high < low:
    raise ValueError(f"{name}={value!r} must satisfy {minimum} <= low <= high")
  return low, high


# -- building blocks -----------------------------------------------------------
@dataclasses.dataclass
class _Builder:
  """Collects requests, then sorts them by arrival (stable) into a Trace."""

  rng: np.random.Generator
  vocab_size: int
  arrivals: list[float] = dataclasses.field(default_factory=list)
  prompts: list[np.ndarray] = dataclasses.field(default_factory=list)
  answers: list[np.ndarray] = dataclasses.field(default_factory=list)
  sessions: list[int] = dataclasses.field(default_factory=list)

  def tokens(self, length: int) -> np.ndarray:
    return self.rng.integers(0, self.vocab_size, length, dtype=np.int32)

  def length(self, bounds: tuple[int, int]) -> int:
    return int(self.rng.integers(bounds[0], bounds[1] + 1))

  def add(
    self, arrival: float, prompt: np.ndarray, answer: np.ndarray, session: int
  ) -> None:
    self.arrivals.append(arrival)
    self.prompts.append(prompt)
    self.answers.append(answer)
    self.sessions.append(session)

  def __len__(self) -> int:
    return len(self.prompts)

  def build(self, num_requests: int) -> Trace:
    arrivals = np.asarray(self.arrivals[:num_requests], np.float64)
    if not np.isfinite(arrivals).all():
      raise ValueError(
        "arrival times overflow float64: the rate is too small or a mean "
        "gap (think / tool time) too large for this many requests"
      )
    order = np.argsort(arrivals, kind="stable")
    prompts = [self.prompts[i] for i in order]
    answers = [self.answers[i] for i in order]
    return Trace(
      arrivals[order],
      np.asarray([p.shape[0] for p in prompts], np.int64),
      np.asarray([a.shape[0] for a in answers], np.int64),
      input_token_ids=prompts,
      output_token_ids=answers,
      session_ids=np.asarray(self.sessions[:num_requests], np.int64)[order],
    )


def _poisson_arrivals(
  rng: np.random.Generator, count: int, rate: float
) -> np.ndarray:
  """Arrival times of a Poisson process with `rate` events per second."""
  return np.cumsum(rng.exponential(1.0 / rate, count))


def _zipf_choice(
  rng: np.random.Generator, num_items: int, zipf_a: float, count: int
) -> np.ndarray:
  """Draws item indices with P(rank k) proportional to k ** -zipf_a."""
  weights = np.arange(1, num_items + 1, dtype=np.float64) ** -zipf_a
  return rng.choice(num_items, size=count, p=weights / weights.sum())


# -- registry ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Kind:
  function: WorkloadFn
  defaults: dict[str, Any]
  description: str


_KINDS: dict[str, _Kind] = {}


def register_workload(kind: str) -> Callable[[WorkloadFn], WorkloadFn]:
  """Registers a generator `fn(rng, num_requests, **params) -> Trace`.

  The function's keyword-only parameters and their defaults are the kind's
  parameters; the first docstring line is its description.

  Args:
    kind: the name `generate_workload` will know it by.

  Returns:
    A decorator that registers and returns the function unchanged.

  Example:
    >>> @register_workload("one_prompt")  # doctest: +SKIP
    ... def one_prompt(rng, num_requests, *, length=8):
    ...   '''Every request sends the same prompt.'''
    ...   ...
  """
  if not isinstance(kind, str) or not kind.isidentifier():
    raise ValueError(f"workload kind {kind!r} must be an identifier string")

  def decorator(function: WorkloadFn) -> WorkloadFn:
    if kind in _KINDS:
      raise ValueError(f"workload kind {kind!r} is already registered")
    defaults = {
      name: parameter.default
      for name, parameter in inspect.signature(function).parameters.items()
      if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    if any(v is inspect.Parameter.empty for v in defaults.values()):
      raise ValueError(
        f"every keyword-only parameter of workload kind {kind!r} needs a "
        "default"
      )
    doc = inspect.getdoc(function) or ""
    _KINDS[kind] = _Kind(function, defaults, doc.split("\n", 1)[0])
    return function

  return decorator


def unregister_workload(kind: str) -> None:
  """Removes a registered workload kind (a no-op if it is not registered).

  For notebooks and tests that register a kind for a while; the built-in
  kinds can be removed too, until the process restarts.
  """
  _KINDS.pop(kind, None)


def workload_kinds() -> dict[str, str]:
  """Returns `{kind: one-line description}` of every registered kind.

  Example:
    >>> "multi_turn" in workload_kinds()
    True
  """
  return {kind: spec.description for kind, spec in sorted(_KINDS.items())}


def workload_defaults(kind: str) -> dict[str, Any]:
  """Returns the parameters of `kind` with their default values."""
  return dict(_lookup(kind).defaults)


def _lookup(kind: str) -> _Kind:
  if kind not in _KINDS:
    raise ValueError(
      f"unknown workload kind {kind!r}; expected one of "
      f"{', '.join(sorted(_KINDS))}"
    )
  return _KINDS[kind]


def generate_workload(
  kind: str, *, num_requests: int, seed: int, **params: Any
) -> Trace:
  """Generates a seeded synthetic workload of a registered kind.

  Args:
    kind: one of `workload_kinds()`.
    num_requests: exact number of requests, >= 1.
    seed: seed of the numpy Generator, >= 0; equal seeds give equal traces.
    **params: the kind's parameters (`workload_defaults(kind)`); unknown
      names and bad values raise `ValueError` / `TypeError`.

  Returns:
    A `Trace` with token ids, output token ids and session ids, named
    `kind`, whose `source` spells out the full generator spec.

  Example:
    >>> trace = generate_workload(
    ...   "multi_turn", num_requests=20, seed=0, num_turns=(2, 4))
    >>> len(trace), trace.has_token_ids
    (20, True)
  """
  spec = _lookup(kind)
  num_requests = _int_param("num_requests", num_requests, 1)
  seed = _int_param("seed", seed, 0)
  unknown = sorted(set(params) - set(spec.defaults))
  if unknown:
    raise ValueError(
      f"unknown parameter(s) {', '.join(unknown)} for workload kind "
      f"{kind!r}; expected some of {', '.join(sorted(spec.defaults))}"
    )
  merged = {**spec.defaults, **params}
  trace = spec.function(np.random.default_rng(seed), num_requests, **merged)
  if len(trace) != num_requests:
    raise RuntimeError(
      f"workload kind {kind!r} made {len(trace)} requests, not {num_requests}"
    )
  settings = ", ".join(f"{k}={v!r}" for k, v in sorted(merged.items()))
  source = (
    f"generate_workload({kind!r}, num_requests={num_requests}, seed={seed}"
    + (f", {settings})" if settings else ")")
  )
  return dataclasses.replace(trace, name=kind, source=source)


# -- generators ----------------------------------------------------------------
@register_workload("system_prompt")
def system_prompt_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  num_prompts: int = 16,
  zipf_a: float = 1.2,
  prompt_len: LengthRange = (256, 2048),
  question_len: LengthRange = (16, 512),
  output_len: LengthRange = (16, 512),
  rate: float = 10.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Shared system prompts with Zipf popularity, then a private question.

  Args:
    rng: the random generator.
    num_requests: number of requests.
    num_prompts: number of distinct system prompts.
    zipf_a: Zipf exponent of prompt popularity (0 = uniform).
    prompt_len: system prompt length.
    question_len: length of each request's own question.
    output_len: answer length.
    rate: arrivals per second.
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; each request is its own session.
  """
  num_prompts = _int_param("num_prompts", num_prompts, 1)
  zipf_a = _float_param("zipf_a", zipf_a, strict=False)
  prompt_len = _range_param("prompt_len", prompt_len, 0)
  question_len = _range_param("question_len", question_len, 1)
  output_len = _range_param("output_len", output_len, 1)
  rate = _rate_param("rate", rate)
  builder = _Builder(rng, _vocab_param(vocab_size))
  prompts = [
    builder.tokens(builder.length(prompt_len)) for _ in range(num_prompts)
  ]
  choices = _zipf_choice(rng, num_prompts, zipf_a, num_requests)
  arrivals = _poisson_arrivals(rng, num_requests, rate)
  for i in range(num_requests):
    question = builder.tokens(builder.length(question_len))
    prompt = np.concatenate([prompts[choices[i]], question])
    builder.add(
      arrivals[i], prompt, builder.tokens(builder.length(output_len)), i
    )
  return builder.build(num_requests)


def _growing_sessions(
  rng: np.random.Generator,
  num_requests: int,
  *,
  vocab_size: int,
  shared_len: tuple[int, int],
  first_len: tuple[int, int],
  num_steps: tuple[int, int],
  output_len: tuple[int, int],
  appended_len: tuple[int, int],
  gap_s: float,
  rate: float,
  max_input_len: int,
) -> Trace:
  """Sessions whose next prompt = prompt + answer + new appended tokens.

  Every session's first prompt is one prefix shared by all sessions
  (`shared_len` tokens, drawn once) then `first_len` tokens of its own;
  `max_input_len` must leave room for the longest first prompt the ranges
  allow (``shared_len[1] + first_len[1]``), whatever the seed draws.
  """
  builder = _Builder(rng, _vocab_param(vocab_size))
  # The longest first prompt the ranges allow, whatever the seed draws.
  max_input_len = _int_param(
    "max_input_len", max_input_len, shared_len[1] + first_len[1]
  )
  shared = builder.tokens(builder.length(shared_len))
  session = 0
  start = 0.0
  while len(builder) < num_requests:
    start += rng.exponential(1.0 / rate)
    steps = builder.length(num_steps)
    prompt = np.concatenate([shared, builder.tokens(builder.length(first_len))])
    arrival = start
    for step in range(steps):
      if len(builder) == num_requests:
        break
      answer = builder.tokens(builder.length(output_len))
      builder.add(arrival, prompt, answer, session)
      appended = builder.tokens(builder.length(appended_len))
      next_length = prompt.shape[0] + answer.shape[0] + appended.shape[0]
      if step + 1 == steps or next_length > max_input_len:
        break
      prompt = np.concatenate([prompt, answer, appended])
      arrival += rng.exponential(gap_s) if gap_s > 0 else 0.0
    session += 1
  return builder.build(num_requests)


@register_workload("multi_turn")
def multi_turn_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  num_turns: LengthRange = (2, 8),
  system_prompt_len: LengthRange = 256,
  question_len: LengthRange = (16, 256),
  output_len: LengthRange = (32, 512),
  think_time_s: float = 5.0,
  max_input_len: int = 32_768,
  rate: float = 2.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Multi-turn chat: each turn re-sends the history plus a new question.

  Turn `t + 1`'s prompt is exactly turn `t`'s prompt, then turn `t`'s
  answer (`output_token_ids`), then a new question. All sessions share one
  system prompt at the start of turn 1.

  Args:
    rng: the random generator.
    num_requests: number of requests (the last session may be cut short).
    num_turns: turns per session.
    system_prompt_len: length of the system prompt shared by every session
      (0 for none).
    question_len: length of each user question.
    output_len: answer length.
    think_time_s: mean (exponential) gap between consecutive turns.
    max_input_len: a session ends before a prompt would exceed this length.
    rate: new sessions per second.
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; `session_ids` name the chat session.
  """
  num_turns = _range_param("num_turns", num_turns, 1)
  system_prompt_len = _range_param("system_prompt_len", system_prompt_len, 0)
  question_len = _range_param("question_len", question_len, 1)
  output_len = _range_param("output_len", output_len, 1)
  think_time_s = _float_param("think_time_s", think_time_s, strict=False)
  rate = _rate_param("rate", rate)
  return _growing_sessions(
    rng,
    num_requests,
    vocab_size=vocab_size,
    shared_len=system_prompt_len,
    first_len=question_len,
    num_steps=num_turns,
    output_len=output_len,
    appended_len=question_len,
    gap_s=think_time_s,
    rate=rate,
    max_input_len=max_input_len,
  )


@register_workload("agent")
def agent_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  num_steps: LengthRange = (3, 12),
  instructions_len: LengthRange = 1024,
  task_len: LengthRange = (64, 512),
  action_len: LengthRange = (16, 256),
  observation_len: LengthRange = (32, 1024),
  tool_time_s: float = 1.0,
  max_input_len: int = 32_768,
  rate: float = 1.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Agent loops re-sending their growing trajectory every step.

  Step `s + 1`'s prompt is step `s`'s prompt, then its action (the answer),
  then the tool's observation. All runs share the tool instructions.

  Args:
    rng: the random generator.
    num_requests: number of requests (the last run may be cut short).
    num_steps: model calls per agent run.
    instructions_len: length of the shared tool instructions.
    task_len: length of each run's task description.
    action_len: length of each action (the model's answer).
    observation_len: length of each tool observation.
    tool_time_s: mean (exponential) gap between consecutive steps.
    max_input_len: a run ends before a prompt would exceed this length.
    rate: new runs per second.
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; `session_ids` name the agent run.
  """
  num_steps = _range_param("num_steps", num_steps, 1)
  instructions_len = _range_param("instructions_len", instructions_len, 0)
  task_len = _range_param("task_len", task_len, 1)
  action_len = _range_param("action_len", action_len, 1)
  observation_len = _range_param("observation_len", observation_len, 0)
  tool_time_s = _float_param("tool_time_s", tool_time_s, strict=False)
  rate = _rate_param("rate", rate)
  return _growing_sessions(
    rng,
    num_requests,
    vocab_size=vocab_size,
    shared_len=instructions_len,
    first_len=task_len,
    num_steps=num_steps,
    output_len=action_len,
    appended_len=observation_len,
    gap_s=tool_time_s,
    rate=rate,
    max_input_len=max_input_len,
  )


@register_workload("few_shot")
def few_shot_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  num_tasks: int = 8,
  zipf_a: float = 1.0,
  instruction_len: LengthRange = (32, 256),
  pool_size: int = 16,
  example_len: LengthRange = (32, 256),
  num_shots: LengthRange = (3, 8),
  shuffle_shots: bool = False,
  question_len: LengthRange = (16, 128),
  output_len: LengthRange = (1, 64),
  rate: float = 10.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Few-shot prompts: task instruction, shots from a shared pool, question.

  Each task has an instruction and a pool of `pool_size` examples. A
  request picks a task (Zipf popularity) and `k` shots: the first `k` of
  the pool (fixed order, as in k-shot benchmarks) or, with
  `shuffle_shots`, `k` distinct examples in random order.

  Args:
    rng: the random generator.
    num_requests: number of requests.
    num_tasks: number of tasks.
    zipf_a: Zipf exponent of task popularity (0 = uniform).
    instruction_len: length of each task's instruction.
    pool_size: examples per task.
    example_len: length of each example.
    num_shots: shots per request (at most `pool_size`).
    shuffle_shots: sample shots at random instead of the pool's first `k`.
    question_len: length of each request's question.
    output_len: answer length.
    rate: arrivals per second.
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; `session_ids` name the task.
  """
  num_tasks = _int_param("num_tasks", num_tasks, 1)
  zipf_a = _float_param("zipf_a", zipf_a, strict=False)
  instruction_len = _range_param("instruction_len", instruction_len, 0)
  pool_size = _int_param("pool_size", pool_size, 1)
  example_len = _range_param("example_len", example_len, 1)
  num_shots = _range_param("num_shots", num_shots, 0)
  if num_shots[1] > pool_size:
    raise ValueError(f"num_shots={num_shots} exceeds pool_size={pool_size}")
  if not isinstance(shuffle_shots, bool):
    raise TypeError(f"shuffle_shots={shuffle_shots!r} must be a bool")
  question_len = _range_param("question_len", question_len, 1)
  output_len = _range_param("output_len", output_len, 1)
  rate = _rate_param("rate", rate)
  builder = _Builder(rng, _vocab_param(vocab_size))
  instructions = [
    builder.tokens(builder.length(instruction_len)) for _ in range(num_tasks)
  ]
  pools = [
    [builder.tokens(builder.length(example_len)) for _ in range(pool_size)]
    for _ in range(num_tasks)
  ]
  tasks = _zipf_choice(rng, num_tasks, zipf_a, num_requests)
  arrivals = _poisson_arrivals(rng, num_requests, rate)
  for i, task in enumerate(tasks):
    shots = builder.length(num_shots)
    picks = (
      rng.permutation(pool_size)[:shots] if shuffle_shots else range(shots)
    )
    prompt = np.concatenate(
      [instructions[task]]
      + [pools[task][j] for j in picks]
      + [builder.tokens(builder.length(question_len))]
    )
    builder.add(
      arrivals[i], prompt, builder.tokens(builder.length(output_len)), task
    )
  return builder.build(num_requests)


@register_workload("parallel_sampling")
def parallel_sampling_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  n: int = 4,
  prompt_len: LengthRange = (128, 2048),
  output_len: LengthRange = (32, 512),
  rate: float = 2.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Parallel sampling: groups of `n` requests with the same prompt.

  Args:
    rng: the random generator.
    num_requests: number of requests (the last group may be cut short).
    n: samples per prompt, >= 1.
    prompt_len: prompt length.
    output_len: length of each sample.
    rate: groups per second (a group's requests arrive together).
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; `session_ids` name the group.
  """
  n = _int_param("n", n, 1)
  prompt_len = _range_param("prompt_len", prompt_len, 1)
  output_len = _range_param("output_len", output_len, 1)
  rate = _rate_param("rate", rate)
  builder = _Builder(rng, _vocab_param(vocab_size))
  num_groups = -(-num_requests // n)
  arrivals = _poisson_arrivals(rng, num_groups, rate)
  for group in range(num_groups):
    prompt = builder.tokens(builder.length(prompt_len))
    for _ in range(n):
      if len(builder) == num_requests:  # the rest would be cut (n = 10**12)
        break
      answer = builder.tokens(builder.length(output_len))
      builder.add(arrivals[group], prompt, answer, group)
  return builder.build(num_requests)


@register_workload("beam_search")
def beam_search_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  beam_width: int = 4,
  num_rounds: LengthRange = (2, 6),
  prompt_len: LengthRange = (128, 1024),
  step_len: LengthRange = (8, 64),
  step_time_s: float = 0.1,
  rate: float = 1.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Beam search at request granularity: beams share a prompt, diverge.

  Round 0 sends the prompt once per beam. In each later round every beam
  picks a parent among the previous round's beams (at random, with
  replacement, so some lines die out) and re-sends the parent's prompt plus
  the parent's answer (the `step_len` tokens it produced).

  Args:
    rng: the random generator.
    num_requests: number of requests (the last search may be cut short).
    beam_width: beams per round, >= 1.
    num_rounds: rounds per search.
    prompt_len: length of the search's prompt.
    step_len: tokens each beam produces per round.
    step_time_s: time between rounds.
    rate: new searches per second.
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; `session_ids` name the search.
  """
  beam_width = _int_param("beam_width", beam_width, 1)
  num_rounds = _range_param("num_rounds", num_rounds, 1)
  prompt_len = _range_param("prompt_len", prompt_len, 1)
  step_len = _range_param("step_len", step_len, 1)
  step_time_s = _float_param("step_time_s", step_time_s, strict=False)
  rate = _rate_param("rate", rate)
  builder = _Builder(rng, _vocab_param(vocab_size))
  search, start = 0, 0.0
  while len(builder) < num_requests:
    start += rng.exponential(1.0 / rate)
    prompt = builder.tokens(builder.length(prompt_len))
    # (prompt, answer) per beam; past the requests left none is sent (and
    # the search ends after this round), so no list of beam_width = 10**9.
    beams = [(prompt, None)] * min(beam_width, num_requests - len(builder))
    for round_index in range(builder.length(num_rounds)):
      arrival = start + round_index * step_time_s
      if round_index:
        parents = np.sort(rng.integers(0, beam_width, beam_width))
        beams = [(np.concatenate(beams[p]), None) for p in parents.tolist()]
      sent = []
      for beam_prompt, _ in beams:
        if len(builder) == num_requests:
          break
        answer = builder.tokens(builder.length(step_len))
        builder.add(arrival, beam_prompt, answer, search)
        sent.append((beam_prompt, answer))
      if len(sent) < beam_width:
        break
      beams = sent
    search += 1
  return builder.build(num_requests)


@register_workload("tree_of_thought")
def tree_of_thought_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  branching: int = 3,
  depth: int = 3,
  keep: int = 2,
  prompt_len: LengthRange = (256, 1024),
  thought_len: LengthRange = (32, 256),
  step_time_s: float = 2.0,
  rate: float = 0.5,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """Tree-of-thought search: branches re-send shared partial trajectories.

  A tree keeps a frontier of states (the problem plus the thoughts chosen so
  far). At each level every state is sent `branching` times (each request
  proposes one thought, its answer); `keep` of the resulting states, chosen
  at random, form the next frontier. A tree has `depth` levels.

  Args:
    rng: the random generator.
    num_requests: number of requests (the last tree may be cut short).
    branching: thoughts proposed per state, >= 1.
    depth: levels per tree, >= 1.
    keep: states kept per level, >= 1.
    prompt_len: length of the problem statement.
    thought_len: length of each thought.
    step_time_s: time between levels.
    rate: new trees per second.
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The trace; `session_ids` name the tree.
  """
  branching = _int_param("branching", branching, 1)
  depth = _int_param("depth", depth, 1)
  keep = _int_param("keep", keep, 1)
  prompt_len = _range_param("prompt_len", prompt_len, 1)
  thought_len = _range_param("thought_len", thought_len, 1)
  step_time_s = _float_param("step_time_s", step_time_s, strict=False)
  rate = _rate_param("rate", rate)
  builder = _Builder(rng, _vocab_param(vocab_size))
  tree, start = 0, 0.0
  while len(builder) < num_requests:
    start += rng.exponential(1.0 / rate)
    frontier = [builder.tokens(builder.length(prompt_len))]
    for level in range(depth):
      children = []
      for state in frontier:
        for _ in range(branching):
          if len(builder) == num_requests:
            break
          thought = builder.tokens(builder.length(thought_len))
          builder.add(start + level * step_time_s, state, thought, tree)
          children.append(np.concatenate([state, thought]))
      if not children:
        break
      picks = np.sort(rng.permutation(len(children))[:keep])
      frontier = [children[i] for i in picks.tolist()]
    tree += 1
  return builder.build(num_requests)


@register_workload("default")
def default_mix_workload(
  rng: np.random.Generator,
  num_requests: int,
  *,
  system_prompt_fraction: float = 0.5,
  rate: float = 20.0,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Trace:
  """The built-in default: Zipf system prompts mixed with multi-turn chat.

  Moderate sizes (prompts of about 700 tokens on average, at most about
  2,500) so that replaying 2,000 requests on a CPU takes seconds.

  Args:
    rng: the random generator.
    num_requests: number of requests.
    system_prompt_fraction: share of requests from the system-prompt part;
      the rest are multi-turn chat.
    rate: total requests per second (split between the two parts).
    vocab_size: token ids are drawn from `[0, vocab_size)`.

  Returns:
    The merged trace, in arrival order; sessions are renumbered.
  """
  fraction = _float_param(
    "system_prompt_fraction", system_prompt_fraction, strict=False
  )
  if fraction > 1.0:
    raise ValueError(f"system_prompt_fraction={fraction} must be in [0, 1]")
  rate = _rate_param("rate", rate)
  vocab_size = _vocab_param(vocab_size)
  num_system = round(num_requests * fraction)
  num_chat = num_requests - num_system
  system_rng, chat_rng = rng.spawn(2)
  parts = []
  if num_system:
    parts.append(
      system_prompt_workload(
        system_rng,
        num_system,
        num_prompts=8,
        zipf_a=1.1,
        prompt_len=(256, 1024),
        question_len=(16, 256),
        output_len=(16, 256),
        rate=rate * fraction,
        vocab_size=vocab_size,
      )
    )
  if num_chat:
    turns = (2, 6)
    parts.append(
      multi_turn_workload(
        chat_rng,
        num_chat,
        num_turns=turns,
        system_prompt_len=128,
        question_len=(16, 128),
        output_len=(32, 256),
        think_time_s=10.0,
        max_input_len=4096,
        # Sessions per second so that turns arrive at this part's rate.
        rate=rate * (1.0 - fraction) / (sum(turns) / 2),
        vocab_size=vocab_size,
      )
    )
  return merge_traces(parts, name="default")


def default_workload(*, num_requests: int = 2000, seed: int = 0) -> Trace:
  """The built-in workload used when no trace is given (`prefixjax demo`).

  Half the requests share one of 8 system prompts (Zipf popularity), half
  are multi-turn chat sessions re-sending their history; see the `default`
  kind of `generate_workload`.

  Args:
    num_requests: number of requests.
    seed: random seed.

  Returns:
    The trace.

  Example:
    >>> trace = default_workload(num_requests=100)
    >>> len(trace), trace.name
    (100, 'default')
  """
  return generate_workload("default", num_requests=num_requests, seed=seed)
