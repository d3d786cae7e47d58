"""Engine checkpoints with orbax: weights, KV pool, prefix cache, and a
generation in flight.

A checkpoint is a directory of orbax items (``ocp.CompositeCheckpointHandler``):

* ``meta`` (``JsonSave``): the model and cache configs, the scheduler's
  name, the engine's seed and options, and, with a generation, its requests
  and host-side progress (outputs so far, the schedule, step times);
* ``engine`` (``StandardSave``): the model's variables, the KV pool and the
  prefix cache state;
* ``generation`` (``StandardSave``, with a generation): the scheduler's
  :class:`~prefixjax.serving.vllm_v1.EngineState` and
  :class:`~prefixjax.serving.vllm_v1.RequestTable`, the token rows, and the
  logits kept so far.

:func:`restore` rebuilds the engine from ``meta`` and restores every array
into the tree an engine of that config has, so a restored engine continues
exactly where the saved one was: the same next step, the same hits, the
same bits.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from prefixjax.configs import ModelConfig
from prefixjax.model.engine import CacheConfig, Engine, Generation
from prefixjax.model.llama import (
  check_params,
  checkpoint_path,
  init_params,
  restore_on_host,
)
from prefixjax.serving import schedulers as sch
from prefixjax.serving.simulate import build_inputs

__all__ = ["restore", "save"]

_FORMAT = "prefixjax-engine-1"


def _scheduler_name(engine: Engine) -> str:
  name = engine.scheduler.name
  if name not in sch.scheduler_names() or sch.get_scheduler(name) is not (
    engine.scheduler
  ):
    raise ValueError(
      f"scheduler {name!r} is not a registered scheduler: register it "
      "(prefixjax.serving.register_scheduler) so a restore can find it"
    )
  return name


def _engine_meta(engine: Engine) -> dict:
  interpret = engine.interpret
  if not isinstance(interpret, bool):
    raise ValueError(
      f"interpret={interpret!r}: only True or False can be saved (an "
      "InterpretParams object cannot be written to JSON)"
    )
  return dict(
    format=_FORMAT,
    model_config=dataclasses.asdict(engine.model_config),
    cache_config=dataclasses.asdict(engine.cache_config),
    scheduler=_scheduler_name(engine),
    seed=engine.seed,
    batch_invariant=engine.batch_invariant,
    backend=engine.backend,
    interpret=interpret,
    calls=engine._calls,
    has_cache=engine.cache is not None,
  )


_HOST = (
  "outputs",
  "schedule",
  "context",
  "step_s",
  "forward_s",
  "first_step",
  "finish_step",
  "prefill_tokens",
  "decode_tokens",
  "blocks_peak",
  "num_finished",
  "done",
  "setup_s",
  "copies",
)


def _generation_meta(gen: Generation) -> dict:
  records = []
  for rec in gen.records:
    out = dict(
      input_tok_ids=[int(t) for t in rec["input_tok_ids"]],
      output_toks=int(rec["output_toks"]),
    )
    if "parent" in rec:
      out.update(parent=int(rec["parent"]), sample=int(rec["sample"]))
    records.append(out)
  meta = dict(
    records=records,
    salt=gen.salt[: gen.num_real].tolist(),
    seed=gen.seed,
    temperature=gen.temperature,
    eos_id=gen.eos_id,
    return_logits=gen.return_logits,
    elapsed_s=time.perf_counter() - gen.t0,
  )
  meta.update({name: getattr(gen, name) for name in _HOST})
  meta["dormant"] = sorted(gen.dormant)
  return meta


def _generation_arrays(gen: Generation) -> dict:
  arrays = dict(
    state=gen.state,
    reqs=gen.reqs,
    tokens=gen.tokens,
    lens=gen.lens,
    max_tokens=gen.max_tokens,
  )
  if gen.logits is not None and any(gen.logits):
    arrays["logits"] = np.concatenate([np.stack(r) for r in gen.logits if r])
  return arrays


def save(engine: Engine, path, generation: Generation | None = None) -> None:
  """Writes ``engine`` (and ``generation``, between two of its steps).

  Args:
    engine: the engine.
    path: a directory to create (it must not exist).
    generation: the engine's running :class:`Generation`, or None.

  Raises:
    TypeError: not an Engine / Generation, or a bad path type.
    FileExistsError: ``path`` exists.
    ValueError: the generation belongs to another engine or was
      abandoned, a generation is running and was not passed, or the
      engine's scheduler or ``interpret`` cannot be written.
  """
  if not isinstance(engine, Engine):
    raise TypeError(f"engine must be an Engine, got {type(engine)}")
  if generation is not None:
    if not isinstance(generation, Generation):
      raise TypeError(
        f"generation must be a Generation, got {type(generation)}"
      )
    if generation.eng is not engine:
      raise ValueError("the generation belongs to another engine")
    if generation.abandoned:
      raise ValueError("the generation was abandoned; nothing to resume")
  live = engine._live
  if live is not None and not live.done and generation is not live:
    # The pool already holds the running generation's KV while the prefix
    # cache is the one before it: saved alone, they would disagree.
    raise ValueError(
      "a generation is running on this engine: pass it "
      "(save(path, generation)), or finish or abandon() it first"
    )
  target = checkpoint_path(path)
  if target.exists():
    raise FileExistsError(
      f"refusing to overwrite {str(target)!r}: a checkpoint is a new directory"
    )
  meta = _engine_meta(engine)
  items = dict(params=engine.params, pool=engine.pool)
  if engine.cache is not None:
    items["cache"] = engine.cache
  args = dict(engine=ocp.args.StandardSave(items))
  if generation is not None:
    meta["generation"] = _generation_meta(generation)
    args["generation"] = ocp.args.StandardSave(_generation_arrays(generation))
  args["meta"] = ocp.args.JsonSave(meta)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    ckpt.save(target, args=ocp.args.Composite(**args))


_META_FIELDS = (
  "model_config",
  "cache_config",
  "scheduler",
  "seed",
  "batch_invariant",
  "backend",
  "interpret",
  "has_cache",
  "calls",
)
_GENERATION_FIELDS = (
  "records",
  "salt",
  "seed",
  "temperature",
  "eos_id",
  "return_logits",
  "elapsed_s",
  "dormant",
  *_HOST,
)


def _check_meta_fields(source, meta: dict) -> None:
  """Every field :func:`save` writes is there (a KeyError named none)."""
  missing = [k for k in _META_FIELDS if k not in meta]
  g = meta.get("generation")
  if g is not None:
    if not isinstance(g, dict):
      raise ValueError(f"{str(source)!r}: its 'meta' generation is not a map")
    missing += [f"generation.{k}" for k in _GENERATION_FIELDS if k not in g]
  if missing:
    raise ValueError(
      f"{str(source)!r}: its 'meta' lacks {', '.join(missing)} (damaged, or "
      "written by another version)"
    )


def restore(path) -> tuple[Engine, Generation | None]:
  """The engine (and generation) :func:`save` wrote at ``path``.

  Returns:
    ``(engine, generation or None)``; continue the generation with
    :meth:`Generation.step` or :meth:`Generation.run`.

  Raises:
    TypeError: a bad path type.
    FileNotFoundError: no checkpoint at ``path``.
    ValueError: a checkpoint of another format, or a damaged one (its meta
      unreadable or incomplete, its arrays unreadable or of other shapes);
      the message names the checkpoint and the part.
  """
  source = checkpoint_path(path)
  if not (source / "meta").is_dir() or not (source / "engine").is_dir():
    raise FileNotFoundError(
      f"no engine checkpoint at {str(source)!r} (needs 'meta' and 'engine')"
    )
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    try:
      meta = ckpt.restore(
        source, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
      )["meta"]
    except ValueError as err:  # json.JSONDecodeError among them
      raise ValueError(
        f"{str(source)!r}: its 'meta' cannot be read ({err})"
      ) from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
      meta = meta if isinstance(meta, dict) else {}
      raise ValueError(
        f"{str(source)!r} has format {meta.get('format')!r}, not {_FORMAT!r}"
      )
    _check_meta_fields(source, meta)
    try:
      model_config = ModelConfig(**meta["model_config"])
      cache_config = CacheConfig(**meta["cache_config"])
      params = jax.eval_shape(lambda: init_params(model_config))
      engine = Engine(
        model_config,
        cache_config,
        scheduler=meta["scheduler"],
        seed=meta["seed"],
        params=params,
        batch_invariant=meta["batch_invariant"],
        backend=meta["backend"],
        interpret=meta["interpret"],
      )
    except (TypeError, ValueError) as err:
      raise ValueError(
        f"{str(source)!r}: its 'meta' does not describe a valid engine ({err})"
      ) from err
    skeleton = dict(params=params, pool=engine.pool)
    if meta["has_cache"]:
      dummy = [dict(input_tok_ids=[0], output_toks=1)]
      skeleton["cache"] = build_inputs(dummy, engine.serving)[0].cache
    items = dict(engine=skeleton)
    g = meta.get("generation")
    gen = None
    if g is not None:
      records = [
        {**rec, "input_tok_ids": np.asarray(rec["input_tok_ids"], np.int64)}
        for rec in g["records"]
      ]
      try:
        gen = Generation(
          engine,
          records,
          np.asarray(g["salt"], np.uint32).reshape(-1, 2),
          g["seed"],
          g["temperature"],
          g["eos_id"],
          g["return_logits"],
        )
      except (TypeError, ValueError, KeyError) as err:
        raise ValueError(
          f"{str(source)!r}: its 'meta' does not describe a valid generation "
          f"({type(err).__name__}: {err})"
        ) from err
      parts = _generation_arrays(gen)
      if gen.return_logits and any(g["outputs"]):
        rows = sum(len(o) for o in g["outputs"])
        parts["logits"] = np.zeros((rows, model_config.vocab_size), np.float32)
      items["generation"] = parts
    got = restore_on_host(
      ckpt,
      source,
      f"{str(source)!r}: its arrays",
      "a damaged checkpoint, or one whose arrays do not match its 'meta'",
      **items,
    )
  arrays = jax.device_put(got["engine"])
  check_params(arrays["params"], model_config)  # NaN / inf written or damaged
  engine.params, engine.pool = arrays["params"], arrays["pool"]
  engine.cache = arrays.get("cache")
  engine._calls = meta["calls"]
  if gen is not None:
    parts = got["generation"]
    gen.state, gen.reqs = jax.device_put((parts["state"], parts["reqs"]))
    gen.tokens = np.array(parts["tokens"])
    gen.lens = np.array(parts["lens"])
    gen.max_tokens = np.array(parts["max_tokens"])
    for name in _HOST:
      setattr(gen, name, g[name])
    gen.dormant = set(g["dormant"])
    if gen.return_logits:
      flat = np.asarray(parts.get("logits", np.zeros((0, 1), np.float32)))
      cuts = np.cumsum([len(o) for o in gen.outputs])[:-1]
      gen.logits = [list(rows) for rows in np.split(flat, cuts)]
    gen.t0 = time.perf_counter() - g["elapsed_s"]
    if not gen.done:
      engine._live = gen
  return engine, gen
