"""The figures of a sweep's rows (300 dpi PNG plus PDF each).

* ``hit_rate_<workload>_<semantics>_k<K>``: hit rate against capacity, one
  line per policy, the unbounded-cache ceiling dashed (kvcache-sim), for
  every replay slice with two or more capacities;
* ``block_size_<workload>_<semantics>_<T>tokens``: hit rate and internal
  fragmentation against block size at a cache of ``T`` tokens (capacity
  times block size, named in the caption), for every replay slice with two
  or more block sizes;
* ``schedulers_<workload>`` (``..._<semantics>`` when a sweep simulates
  both vllm and sglang semantics): TTFT p99 and throughput per scheduler
  (means over the other fields, min-max bars), for simulate rows with two
  or more schedulers; one series per value of the first field that varies among
  ``rate``, ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``;
* ``routers_<workload>``: hit rate against load imbalance per router and
  route mode (exact filled, approximate hollow), for routed simulate rows
  with two or more routers.

A workload swept over several seeds gets one replay figure per seed
(``<workload>_seed<S>`` in the names above); the scheduler and router
figures pool its seeds (markers at the mean, bars from min to max). A
policy with ``policy_params`` other than ``{}`` is its own series, named
with them.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from prefixjax import plots

__all__ = ["sweep_plots"]

_SERIES = ("rate", "num_blocks", "max_num_seqs", "max_num_batched_tokens")


def _slug(*parts) -> str:
  return "_".join(re.sub(r"[^A-Za-z0-9.]+", "-", str(p)) for p in parts)


def _slices(rows, keys):
  out: dict[tuple, list] = {}
  for r in rows:
    out.setdefault(tuple(r.get(k) for k in keys), []).append(r)
  return out


def _policy_label(r) -> str:
  """A replay row's series: its policy, with its parameters if any."""
  params = json.loads(r.get("policy_params") or "{}")
  if not params:
    return r["policy"]
  shown = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
  return f"{r['policy']} ({shown})"


def _replay_point(r) -> dict[str, Any]:
  """A replay row in the point dicts of :mod:`prefixjax.plots`."""
  return {
    "policy": _policy_label(r),
    "capacity_blocks": r["capacity"],
    "block_size": r["block_size"],
    "hit_rate": r["hit_rate"],
    "fragmentation": r["internal_fragmentation"],
    "mode": "underfilled" if r["underfilled"] else "measured",
  }


def _trace_label(spec, workload: str) -> str:
  w = spec.workloads.get(workload) if spec is not None else None
  if w is not None and w.trace is not None:
    return w.trace
  return workload


def sweep_plots(
  rows: Sequence[dict[str, Any]], folder: pathlib.Path, spec=None
) -> list[str]:
  """Draws every figure the rows support into ``folder``; the paths."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  written: list[str] = []
  replay = [r for r in rows if r["mode"] == "replay"]
  seeds: dict[str, set] = {}
  for r in rows:
    seeds.setdefault(r["workload"], set()).add(r.get("workload_seed"))

  def name(w, seed) -> tuple:
    """The workload's part of a file name: with its seed if it has
    several."""
    return (w, f"seed{seed}") if len(seeds[w]) > 1 else (w,)

  def title(w, seed) -> str:
    """The figure's trace label: with the seed if the workload has
    several."""
    return f"{w} (seed {seed})" if len(seeds[w]) > 1 else _trace_label(spec, w)

  for (w, seed, sem, k, warm), part in _slices(
    replay,
    ("workload", "workload_seed", "semantics", "block_size", "warmup_fraction"),
  ).items():
    if len({r["capacity"] for r in part}) < 2:
      continue
    ceiling = part[0].get("ceiling_hit_rate")
    written += plots.plot_hit_rates(
      [_replay_point(r) for r in part],
      folder / f"hit_rate_{_slug(*name(w, seed), sem)}_k{k}.png",
      ceiling=ceiling,
      trace=title(w, seed),
      semantics=sem,
      warmup_fraction=warm,
      also=("pdf",),
    )
  tokens = [
    dict(r, cached_tokens=r["capacity"] * r["block_size"]) for r in replay
  ]
  for (w, seed, sem, c, warm), part in _slices(
    tokens,
    (
      "workload",
      "workload_seed",
      "semantics",
      "cached_tokens",
      "warmup_fraction",
    ),
  ).items():
    if len({r["block_size"] for r in part}) < 2:
      continue
    written += plots.plot_hit_rate_vs_block_size(
      [_replay_point(r) for r in part],
      folder / f"block_size_{_slug(*name(w, seed), sem)}_{c}tokens.png",
      trace=title(w, seed),
      semantics=sem,
      warmup_fraction=warm,
      cache_tokens=c,
      also=("pdf",),
    )
  simulated = [
    r for r in rows if r["mode"] == "simulate" and r.get("router") is None
  ]
  routed = [r for r in rows if r["mode"] == "simulate" and r.get("router")]
  for (w,), part in _slices(routed, ("workload",)).items():
    if len({r["router"] for r in part}) < 2:
      continue
    written += plots.plot_routers(
      part,
      folder / f"routers_{_slug(w)}.png",
      trace=_trace_label(spec, w),
      also=("pdf",),
    )
  sems = {r.get("semantics", "vllm") for r in simulated}
  for (w, sem), part in _slices(simulated, ("workload", "semantics")).items():
    if len({r["scheduler"] for r in part}) < 2:
      continue
    series = next((k for k in _SERIES if len({r[k] for r in part}) > 1), None)
    name = f"schedulers_{_slug(w)}"
    label = _trace_label(spec, w)
    if len(sems) > 1:  # one figure per semantics
      name += f"_{_slug(sem)}"
      label = f"{label}, {sem} semantics"
    written += plots.plot_schedulers(
      part,
      folder / f"{name}.png",
      series=series,
      trace=label,
      also=("pdf",),
    )
  return written
