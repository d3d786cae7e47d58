#!/usr/bin/env python3
"""SGLang 0.5.23's default tree cache against the RadixCache we model.

prefixjax's SGLang semantics were written from, and checked against,
SGLang 0.5.23's ``mem_cache/radix_cache.py RadixCache``. But a default
0.5.23 server builds a ``UnifiedRadixCache`` (``mem_cache/registry.py
default_radix_cache_factory -> create_unified_radix_cache``, FULL
component for a full-attention model) with a Rust TreeCore
(``unified_cache/tree_core_registry.py``, env
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust``). This drives
the three, unmodified, side by side: ``RadixCache``, ``UnifiedRadixCache``
with the Python TreeCore and with the Rust one, each with its own SGLang
allocator and request pool, through the scheduler's own cache calls
(``mem_cache/common.py`` ``match_kv_cache``, ``checkpoint_kv_cache``,
``release_kv_cache``, ``touch_waiting_prefix``, ``evict_from_tree_cache``;
``mem_cache/allocation.py``; ``Req`` members compiled from
``schedule_batch.py``, as the oracle's ``SglSchedDriver`` does), random
requests from a small vocabulary sharing prefixes, several in flight, a
small pool, the normal and the overlap loop's order, and compares after
every operation: each match (page-aligned), ``evictable_size``,
``protected_size``, the allocator's free size and free-page order, the
tree's KV indices, every eviction call and each running request's
``req_to_token`` row. It stops a seed at the first difference and prints
it with the operations so far.

Run by hand in a scratch environment, never collected by pytest. Setup
(the oracle of the project's shared folder, plus the wheel's Rust module,
which ``setup.sh`` leaves out)::

  cp -r ../shared/oracle /tmp/oracle_sched
  (cd /tmp/oracle_sched && ./setup.sh)
  cd /tmp/oracle_sched && unzip -o wheels/sglang-0.5.23-*.whl \
      'sglang/srt/mem_cache/rust_tree_core/*' -d src
  /tmp/oracle_sched/venv/bin/python \
      tests/reference_models/sglang_unified_check.py \
      --oracle /tmp/oracle_sched --page-sizes 1 4 16 --seeds 0:250 --ops 250

``URC_PROFILE=long`` (bigger pools, longer sequences, up to 10 requests in
flight) and ``URC_LPM=1`` (unlimited matches of waiting requests, as
``calc_priority`` under ``lpm``) widen the draw. ``URC_SANITY_RADIX_POLICY
=fifo`` or ``URC_SANITY_RUST_EXTRA=1`` inject a fault, which the check
must report. Session 33 (2026-12-06, written by a helper): 1,200 seeds,
322,500 operations at page sizes 1, 4 and 16, all equal; both injected
faults reported within 60 steps. Not driven: batched calls (one request
per call here), aborts, eviction policies other than LRU, hierarchical
cache, SWA / mamba, sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys
import traceback
import types
from array import array
from typing import Optional


def _oracle_dir() -> str:
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--oracle", default="/tmp/oracle_sched")
  return os.path.abspath(pre.parse_known_args()[0].oracle)


ORA = _oracle_dir()
sys.path.insert(0, ORA)
sys.path.insert(0, os.path.join(ORA, "src"))
import harness_sglang_sched as H  # noqa: E402


def _setup():
  # Stubs optional deps, sglang.kernels, memory_pool, metrics_collector;
  # a bare sglang package.
  H.import_real_code(["sglang"])
  from types import SimpleNamespace

  import torch
  from sglang.srt.mem_cache import common as C
  from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
  from sglang.srt.utils.common import ceil_align

  serving = SimpleNamespace(strip_thinking_cache=False)
  sb_ns = dict(
    torch=torch,
    array=array,
    dataclasses=dataclasses,
    Optional=Optional,
    ComponentType=ComponentType,
    ceil_align=ceil_align,
    RetractionBackup=C.RetractionBackup,
    match_kv_cache=C.match_kv_cache,
    get_serving=lambda: serving,
    logger=logging.getLogger("sglang_req"),
  )
  RKI = H._sglang_source_members(
    "srt/managers/schedule_batch.py", ["ReqKvInfo"], ns=sb_ns
  )["ReqKvInfo"]
  # A stand-in for sglang.srt.managers.schedule_batch (its real import
  # drags in model configs and the openai protocol): only ReqKvInfo,
  # compiled from SGLang's source.
  sb = types.ModuleType("sglang.srt.managers.schedule_batch")
  sb.ReqKvInfo = RKI
  sys.modules["sglang.srt.managers.schedule_batch"] = sb
  import sglang.srt.mem_cache.unified_radix_cache as U

  return U, sb_ns, RKI


U, SB_NS, ReqKvInfo = _setup()
logging.disable(logging.WARNING)
import torch  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import (  # noqa: E402
  ComponentType,
)
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (  # noqa: E402
  select_tree_core_backend,
)

KINDS = ("radix", "urc_py", "urc_rust")
STATS = (
  "ops",
  "admitted",
  "hit_tokens",
  "evicted",
  "retracted",
  "refused",
  "finished",
)
LONG = os.environ.get("URC_PROFILE", "") == "long"
LPM = (
  os.environ.get("URC_LPM", "0") == "1"
)  # add unlimited waiting-queue matches (lpm policy)


class Engine(H.SglSchedDriver):
  """SglSchedDriver (real scheduler call order) with a pluggable tree class and
  several requests in flight."""

  def __init__(
    self, kind, num_tokens, ps, chunk, max_ctx, nrows=16, overlap_mode=False
  ):
    self.overlap_mode = overlap_mode
    super().__init__(
      num_tokens,
      ps,
      overlap=False,
      chunked_prefill_size=chunk,
      max_context_len=max_ctx,
      waiting_refresh=False,
    )
    self.kind = kind
    Base = self.Req

    class _Req2(Base):
      # fields of the real Req (schedule_batch.py:1112, :1264) that the
      # unified cache reads and the oracle's _Req lacks
      def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.session_id = None
        self.kv_rotation_base = None

    self.Req = _Req2
    Pool = type(self.pool)
    self.pool = Pool(nrows, max_ctx + 8)
    self.alloc.clear()
    common = dict(
      disable=False,
      req_to_token_pool=self.pool,
      token_to_kv_pool_allocator=self.alloc,
      page_size=ps,
      chunked_prefill_size=chunk,
    )
    if kind == "radix":
      pol = os.environ.get(
        "URC_SANITY_RADIX_POLICY", "lru"
      )  # sanity: a different policy must be caught
      self.tree = RadixCache(CacheInitParams(**common, eviction_policy=pol))
    else:
      p = CacheInitParams(
        **common,
        tree_components=(ComponentType.FULL,),
        tree_core_backend={"urc_py": "python", "urc_rust": "rust"}[kind],
      )
      assert (
        select_tree_core_backend(p)
        == {"urc_py": "python", "urc_rust": "rust"}[kind]
      )
      self.tree = U.UnifiedRadixCache(p)
    if kind == "urc_rust" and os.environ.get("URC_SANITY_RUST_EXTRA") == "1":
      # sanity fault injection: ask the Rust-core cache for one page more
      from sglang.srt.mem_cache.base_prefix_cache import EvictParams

      _real_efa = self.tree.evict_for_alloc
      self.tree.evict_for_alloc = lambda params, *a, **k: _real_efa(
        EvictParams(num_tokens=params.num_tokens + ps), *a, **k
      )
    # count evictions at the outermost evict/evict_for_alloc call
    self.evict_log = []
    tree = self.tree
    depth = [0]

    def wrap(name):
      real = getattr(tree, name)

      def f(params, *a, **k):
        depth[0] += 1
        try:
          res = real(params, *a, **k)
        finally:
          depth[0] -= 1
        if depth[0] == 0:
          self.evict_log.append(
            (name, int(params.num_tokens), int(res.num_tokens_evicted))
          )
        return res

      setattr(tree, name, f)

    wrap("evict")
    wrap("evict_for_alloc")
    self.running = {}

  # ---- ops (each is one scheduler-level action) --------------------------
  def op_admit(self, rid, prompt, outs, budget_reserve):
    """get_new_batch_prefill for one waiting request: match, PrefillAdder budget
    check under a temporary lock, lock, prepare_for_extend (chunked), then
    process_batch_result_prefill (checkpoint, or release when O == 1)."""
    C, tree, ps = self.C, self.tree, self.ps
    P = len(prompt)
    req = self.Req(rid, array("q", prompt), len(outs))
    req.init_next_round_input(tree)  # match_kv_cache(limit=P-1)
    hit = req.prefix_len
    tmp = tree.lock(req.last_node)
    room = self.alloc.available_size() + tree.evictable_size() - budget_reserve
    need = (P - hit) + min(len(outs), 4096) + ps
    tree.unlock(tmp)
    if need >= room:
      return ("refused", hit)
    ext = P - hit
    if self.chunk is not None and -(-ext // ps) * ps > self.chunk:
      ext = self.chunk // ps * ps
      ext = (hit + ext) // ps * ps - hit
    req.extend_end = hit + ext
    req.lock = tree.lock(req.last_node)
    self._alloc_extend(req)
    while req.extend_end < P:
      C.checkpoint_kv_cache(req, tree)
      req.init_next_round_input()
      room = int(self.alloc.available_size() + tree.evictable_size())
      rem = min(self.chunk, room) if room > 0 else self.chunk
      req.extend_end = req.prefix_len + min(P - req.prefix_len, rem)
      self._alloc_extend(req)
    req._outs = list(outs)
    if self.overlap_mode:
      # event_loop_overlap: the prefill result is processed after the next
      # batch (this request's first decode) has been scheduled
      req._pending = 1
      self.running[rid] = req
      return ("admitted_pending", hit)
    self._process_prefill(req, outs[0])
    if req.finished():
      return ("admitted_finished", hit)
    self.running[rid] = req
    return ("admitted", hit)

  def op_decode(self, rid):
    req = self.running[rid]
    ps = self.ps
    if self.overlap_mode:
      # schedule decode k+1 (if more tokens will be needed), then process
      # result k
      note = ""
      if len(req.output_ids) + req._pending < len(req._outs):
        need = ps if req.kv.kv_committed_len % ps == 0 else 0
        if self.alloc.check_decode_capacity(
          num_tokens=need, tree_cache=self.tree
        ):
          self._alloc_decode(req)
          req._pending += 1
        else:
          note = "no_capacity_skip_alloc"
      if req._pending == 0:
        return ("stalled", note)
      tok = req._outs[len(req.output_ids)]
      if len(req.output_ids) == 0:
        self._process_prefill(req, tok)
      else:
        self._process_decode(req, tok)
      req._pending -= 1
      if req.finished():
        del self.running[rid]
        return ("finished", len(req.output_ids), note)
      return ("decoded", len(req.output_ids), note)
    need = ps if req.kv.kv_committed_len % ps == 0 else 0
    if not self.alloc.check_decode_capacity(
      num_tokens=need, tree_cache=self.tree
    ):
      return ("no_capacity",)
    self._alloc_decode(req)
    self._process_decode(req, req._outs[len(req.output_ids)])
    if req.finished():
      del self.running[rid]
      return ("finished", len(req.output_ids))
    return ("decoded", len(req.output_ids))

  def op_retract(self, rid):
    """schedule_batch.py:2360 release_req (non-disagg): release_kv_cache(
    checkpoint=False), then evict_from_tree_cache(remaining *
    RETRACT_DECODE_STEPS)."""
    req = self.running.pop(rid)
    self.C.release_kv_cache(req, self.tree, checkpoint=False)
    n = len(self.running) * envs.SGLANG_RETRACT_DECODE_STEPS.get()
    self.C.evict_from_tree_cache(self.tree, n)
    return ("retracted", list(req.origin_input_ids) + list(req.output_ids))

  def op_touch(self, toks):
    """touch_waiting_prefix for a waiting request (common.py:215)."""
    req = self.Req("w", array("q", toks), 1)
    self.C.touch_waiting_prefix(req, self.tree)
    return ("touched",)

  def op_lpm_match(self, toks):
    """calc_priority under a cache-aware policy (e.g. --schedule-policy lpm):
    schedule_policy.py:356 match_kv_cache(r, tree_cache, prefix_ids) with no
    max_prefix_len, for a waiting request; no lock."""
    req = self.Req("w", array("q", toks), 1)
    m = self.C.match_kv_cache(req, self.tree, array("q", toks))
    return ("lpm_matched", int(m.device_prefix_len))

  # ---- observables --------------------------------------------------------
  def observe(self):
    a = self.alloc
    rows = {}
    for rid, r in sorted(self.running.items()):
      idx = r.kv.req_pool_idx
      rows[rid] = (
        r.prefix_len,
        r.kv.cache_protected_len,
        r.kv.kv_committed_len,
        r.kv.kv_allocated_len,
        tuple(self.pool.req_to_token[idx][: r.kv.kv_allocated_len].tolist()),
      )
    try:
      vals = self.tree.all_values_flatten()
    except ValueError:  # RadixCache: torch.cat of an empty tree
      vals = torch.empty((0,), dtype=torch.int64)
    return dict(
      available=int(a.available_size()),
      evictable=int(self.tree.evictable_size()),
      protected=int(self.tree.protected_size()),
      free_pages=tuple(a.free_pages.tolist()),
      release_pages=None
      if a.release_pages is None
      else tuple(a.release_pages.tolist()),
      free_group=None
      if getattr(a, "free_group", None) is None
      else len(a.free_group),
      tree_values=tuple(sorted(int(x) for x in vals.tolist())),
      evicts=tuple(self.evict_log),
      rows=rows,
    )


def gen_seq(rng, corpus, vocab, maxlen):
  """Prompt: often a prefix of an earlier sequence plus a fresh tail."""
  if corpus and rng.random() < 0.75:
    base = rng.choice(corpus)
    cut = rng.randint(0, len(base))
    seq = list(base[:cut])
  else:
    seq = []
  tail = rng.randint(1 if seq else 2, max(2, maxlen // 3))
  seq += [rng.randint(1, vocab) for _ in range(tail)]
  return seq[:maxlen]


def run_seed(seed, ps, n_ops, verbose=False):
  rng = random.Random(seed * 1000 + ps)
  vocab = rng.choice([2, 3, 5, 8])
  maxlen = (
    rng.choice([6, 12, 24, 40]) * max(1, ps // 2)
    if ps > 1
    else rng.choice([6, 12, 24, 40])
  )
  npages = rng.randint(6, 24)
  if LONG:  # bigger pools, longer sequences, more requests in flight
    maxlen *= 3
    npages = rng.randint(16, 64)
  pool_tokens = npages * ps
  pool_tokens = max(pool_tokens, ps * 4)
  maxlen = min(maxlen, pool_tokens // 2)
  maxlen = max(maxlen, 3)
  chunk = rng.choice(
    [None, None, 2 * ps if ps > 1 else 4, 4 * ps if ps > 1 else 8]
  )
  K = rng.randint(1, 5) if not LONG else rng.randint(2, 10)
  p_touch = rng.choice([0.0, 0.1])
  p_lpm = rng.choice([0.0, 0.0, 0.1]) if LPM else 0.0
  overlap = rng.random() < 0.5
  engines = [
    Engine(k, pool_tokens, ps, chunk, 4 * maxlen + 64, overlap_mode=overlap)
    for k in KINDS
  ]
  cfg = dict(
    overlap=overlap,
    p_lpm=p_lpm,
    seed=seed,
    ps=ps,
    vocab=vocab,
    maxlen=maxlen,
    pool_tokens=pool_tokens,
    chunk=chunk,
    K=K,
    p_touch=p_touch,
  )
  corpus = []
  hist = []
  waiting = []  # retracted requests to re-admit
  nid = 0
  stats = dict.fromkeys(STATS, 0)
  for step in range(n_ops):
    e0 = engines[0]
    r = rng.random()
    running = sorted(e0.running)
    if r < p_touch:
      op = ("touch", gen_seq(rng, corpus, vocab, maxlen))
    elif r < p_touch + p_lpm:
      op = ("lpm_match", gen_seq(rng, corpus, vocab, maxlen))
    elif running and (len(running) >= K or r < 0.55):
      rid = rng.choice(running)
      if rng.random() < 0.04 and not overlap:
        op = ("retract", rid)
      else:
        op = ("decode", rid)
    else:
      if waiting and rng.random() < 0.5:
        prompt, outs = waiting.pop(0)
      else:
        prompt = gen_seq(rng, corpus, vocab, maxlen)
        n_out = rng.randint(1, max(1, maxlen // 2))
        outs = [rng.randint(1, vocab) for _ in range(n_out)]
      reserve = sum(
        len(q._outs) - len(q.output_ids) for q in e0.running.values()
      )
      op = ("admit", f"r{nid}", prompt, outs, reserve)
      nid += 1
    results = []
    for e in engines:
      e.evict_log = []
      try:
        if op[0] == "admit":
          res = e.op_admit(*op[1:])
        elif op[0] == "decode":
          res = e.op_decode(op[1])
          if res[0] == "no_capacity":
            res = ("no_capacity",) + e.op_retract(op[1])
        elif op[0] == "retract":
          res = e.op_retract(op[1])
        elif op[0] == "lpm_match":
          res = e.op_lpm_match(op[1])
        else:
          res = e.op_touch(op[1])
        results.append((repr(res), e.observe(), res))
      except Exception as ex:  # noqa: BLE001
        results.append((f"EXC {type(ex).__name__}: {ex}", None, None))
        if verbose:
          traceback.print_exc()
    hist.append(op)
    stats["ops"] += 1
    # compare
    ref = results[0]
    for k, res in zip(KINDS[1:], results[1:], strict=True):
      if res[:2] != ref[:2]:
        return False, dict(
          cfg=cfg,
          step=step,
          op=op,
          kind=k,
          ref=ref,
          got=res,
          hist=hist,
          stats=stats,
        )
    if ref[0].startswith("EXC"):
      return None, dict(
        cfg=cfg, step=step, op=op, exc=ref[0], hist=hist, stats=stats
      )
    obs = ref[1]
    stats["evicted"] += sum(x[2] for x in obs["evicts"])
    res0 = ref[2]
    if op[0] == "admit":
      if res0[0] == "refused":
        stats["refused"] += 1
        waiting.append((op[2], op[3]))
      else:
        stats["admitted"] += 1
        stats["hit_tokens"] += res0[1]
        assert res0[1] % ps == 0, res0
        corpus.append(op[2] + op[3])
        if res0[0] == "admitted_finished":
          stats["finished"] += 1
    elif res0[0] in ("retracted", "no_capacity"):
      stats["retracted"] += 1
      seq = res0[-1]
      # re-queue: prompt = original prompt + produced outputs, remaining outputs
      waiting.append((seq, [1] * 1))
    elif res0[0] == "finished":
      stats["finished"] += 1
    if len(corpus) > 30:
      corpus.pop(0)
  return True, dict(cfg=cfg, stats=stats)


def fmt_fail(info):
  out = [
    f"DIFF cfg={info['cfg']} step={info['step']} kind={info['kind']}",
    f"  op={info['op']}",
  ]
  ref, got = info["ref"], info["got"]
  out.append(f"  radix result: {ref[0]}")
  out.append(f"  {info['kind']} result: {got[0]}")
  if ref[1] is not None and got[1] is not None:
    for key in ref[1]:
      if ref[1][key] != got[1][key]:
        out.append(
          f"  {key}: radix={ref[1][key]}  {info['kind']}={got[1][key]}"
        )
  out.append("  history:")
  for i, op in enumerate(info["hist"]):
    out.append(f"    {i}: {op}")
  return "\n".join(out)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--oracle",
    default="/tmp/oracle_sched",
    help="the oracle copy (setup.sh run, Rust module unzipped)",
  )
  ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 4, 16])
  ap.add_argument("--seeds", default="0:50")
  ap.add_argument("--ops", type=int, default=200)
  ap.add_argument("--stop-first", action="store_true")
  ap.add_argument("--verbose", action="store_true")
  ap.add_argument("--max-fail-print", type=int, default=2)
  args = ap.parse_args()
  a, b = map(int, args.seeds.split(":"))
  total = dict(seeds=0, equal=0, diff=0, exc=0)
  for ps in args.page_sizes:
    agg = dict.fromkeys(STATS, 0)
    nd = ne = 0
    printed = 0
    first_diff = {}
    for seed in range(a, b):
      ok, info = run_seed(seed, ps, args.ops, args.verbose)
      total["seeds"] += 1
      for k in agg:
        agg[k] += info["stats"][k]
      if ok is True:
        total["equal"] += 1
      elif ok is None:
        total["exc"] += 1
        ne += 1
        if printed < args.max_fail_print:
          print(
            f"EXC (same in all three) seed={seed} ps={ps}: {info['exc']}"
            f" at step {info['step']}"
          )
          printed += 1
      else:
        total["diff"] += 1
        nd += 1
        key = (info["kind"], info["op"][0])
        first_diff.setdefault(key, seed)
        if printed < args.max_fail_print:
          print(fmt_fail(info))
          printed += 1
        if args.stop_first:
          print(total)
          return
    print(
      f"ps={ps} seeds={b - a} diff={nd} exc_all={ne} agg={agg} "
      f"first_diff_by_kind_op={first_diff}",
      flush=True,
    )
  print("TOTAL", total)


if __name__ == "__main__":
  main()
