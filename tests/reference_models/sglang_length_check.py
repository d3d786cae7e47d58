"""SGLang 0.5.23's own request-length functions against the simulator's rule.

Run by hand in a scratch environment, never collected by pytest: it needs
the SGLang sources of the oracle of ``/work/shared/oracle`` set up in a copy
(``./setup.sh``), and runs under any interpreter that imports prefixjax::

  python tests/reference_models/sglang_length_check.py /tmp/oracle \\
      [--configs 3000] [--seed 0]

It takes the unmodified source of three SGLang functions out of their files
with ``ast`` (nothing else of SGLang is imported) and executes them:

* ``Scheduler.init_req_max_new_tokens`` (``srt/managers/scheduler.py``),
  which clips a request's ``max_new_tokens`` to ``max_req_len - input - 1``
  and calls
* ``BaseTokenToKVPoolAllocator.max_new_tokens_for_memory``
  (``srt/mem_cache/allocator/base.py``), the page-rounded pool bound;
* ``validate_input_length`` (``srt/managers/utils.py``), which aborts a
  prompt of ``max_req_input_len`` tokens or more.

``max_req_len = min(context_len - 1, pool tokens - 1)`` and
``max_req_input_len = max_req_len - 5`` are
``TpModelWorker.get_worker_info``'s (``srt/managers/tp_worker.py``, read:
it needs a model runner). On random ``ServingConfig(semantics="sglang")``
(page size, context, pool from the smallest the configuration check allows)
and random prompts and ``max_tokens``, each request's rejection and output
count must equal ``prefixjax.serving.simulate._request_tokens``'s; where
SGLang gives an accepted request ``max_new_tokens = 0`` (its prefill-only
path) prefixjax must refuse the trace, and nowhere else.
"""

from __future__ import annotations
import __future__

import argparse
import ast
import importlib
import logging
import pathlib
import random
import sys
import types


def _function(src: pathlib.Path, path: str, name: str, cls: str | None):
  """The function ``name`` (of class ``cls``) of ``src / path``, compiled
  from its own source with decorators dropped."""
  tree = ast.parse((src / path).read_text())
  body = tree.body
  if cls is not None:
    body = next(
      n for n in body if isinstance(n, ast.ClassDef) and n.name == cls
    ).body
  fn = next(
    n for n in body if isinstance(n, ast.FunctionDef) and n.name == name
  )
  fn.decorator_list = []
  code = compile(
    ast.Module(body=[fn], type_ignores=[]),
    str(src / path),
    "exec",
    flags=__future__.annotations.compiler_flag,
    dont_inherit=True,
  )
  env = {"logger": logging.getLogger("sglang_length_check")}
  exec(code, env)  # noqa: S102 - SGLang's own function, read from its file
  return env[name]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("oracle", type=pathlib.Path, help="the oracle copy")
  ap.add_argument("--configs", type=int, default=3000)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  src = args.oracle / "src" / "sglang" / "srt"
  if not (src / "managers" / "scheduler.py").is_file():
    ap.error(f"{src}/managers/scheduler.py not found: run the oracle's setup")
  init_max_new = _function(
    src, "managers/scheduler.py", "init_req_max_new_tokens", "Scheduler"
  )
  for_memory = _function(
    src,
    "mem_cache/allocator/base.py",
    "max_new_tokens_for_memory",
    "BaseTokenToKVPoolAllocator",
  )
  validate = _function(src, "managers/utils.py", "validate_input_length", None)

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from prefixjax.serving import ServingConfig

  sim = importlib.import_module("prefixjax.serving.simulate")
  rng = random.Random(args.seed)
  counts = dict(requests=0, rejected=0, by_context=0, by_pool=0, refused=0)
  for _ in range(args.configs):
    k = rng.choice([1, 2, 4, 8, 16, 32])
    mml = rng.randint(8, 600)
    pages = (mml + k) // k + 1 + rng.choice([0, 0, 0, 1, 2, 5, 50])
    cfg = ServingConfig(
      num_gpu_blocks=pages + 1,
      block_size=k,
      max_num_seqs=4,
      max_num_batched_tokens=max(k, 64),
      max_model_len=mml,
      semantics="sglang",
    )
    cap = pages * k
    max_req_len = min(mml - 1, cap - 1)  # get_worker_info
    records, want = [], []
    for _ in range(20):
      p = rng.choice([rng.randint(1, mml + 3), rng.randint(mml - 12, mml + 2)])
      p = max(p, 1)
      mt = rng.choice([1, rng.randint(1, 40), rng.randint(1, 2 * mml)])
      records.append(dict(input_tok_ids=list(range(1, p + 1)), output_toks=mt))
      alloc = types.SimpleNamespace(page_size=k)
      alloc.max_new_tokens_for_memory = types.MethodType(for_memory, alloc)
      sched = types.SimpleNamespace(
        max_new_tokens_limit=None,
        max_req_len=max_req_len,
        max_total_num_tokens=cap,
        kv_shard_widening=1,
        page_size=k,
        token_to_kv_pool_allocator=alloc,
        sliding_window_size=None,
        chunked_prefill_size=None,
      )
      aborted = []
      req = types.SimpleNamespace(
        rid=0,
        origin_input_ids=list(range(p)),
        sampling_params=types.SimpleNamespace(
          max_new_tokens=mt, min_new_tokens=0
        ),
        set_finish_with_abort=aborted.append,
      )
      init_max_new(sched, req)
      error = validate(req, max_req_len - 5, False)
      want.append(
        (error is not None or bool(aborted), req.sampling_params.max_new_tokens)
      )
    prefill_only = any(not rej and m == 0 for rej, m in want)
    try:
      got = sim._request_tokens(records, sim._lengths(cfg))
    except ValueError as e:
      if not prefill_only:
        print(f"DIFFERENT: {cfg} refused without a prefill-only request: {e}")
        return 1
      counts["refused"] += 1
      continue
    if prefill_only:
      print(f"DIFFERENT: {cfg} has a prefill-only request, not refused")
      return 1
    _, outputs, _, _, rejected = got
    for i, (rej, m) in enumerate(want):
      p, mt = len(records[i]["input_tok_ids"]), records[i]["output_toks"]
      mine = (bool(rejected[i]), 0 if rejected[i] else len(outputs[i]))
      if mine != (rej, 0 if rej else m):
        print(f"DIFFERENT: {cfg}, prompt {p}, max_tokens {mt}: SGLang "
              f"(rejected, outputs) {(rej, m)}, prefixjax {mine}")  # fmt: skip
        return 1
      counts["requests"] += 1
      if rej:
        counts["rejected"] += 1
      elif m < min(mt, max_req_len - p - 1):
        counts["by_pool"] += 1
      elif m < mt:
        counts["by_context"] += 1
  print(
    f"{args.configs} configurations ({counts['refused']} refused for a "
    f"prefill-only request), {counts['requests']} requests: "
    f"{counts['rejected']} rejected, {counts['by_context']} clipped by the "
    f"context, {counts['by_pool']} by the pool bound: ALL EQUAL"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
