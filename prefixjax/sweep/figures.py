"""The figures of a sweep's rows (300 dpi PNG plus PDF each).

* ``hit_rate_<workload>_<semantics>_k<K>``: hit rate against capacity, one
  line per policy, the unbounded-cache ceiling dashed (kvcache-sim), for
  every replay slice with two or more capacities;
* ``block_size_<workload>_<semantics>_<T>tokens``: hit rate and internal
  fragmentation against block size at a cache of ``T`` tokens (capacity
  times block size), for every replay slice with two or more block sizes;
* ``schedulers_<workload>`` (``..._<semantics>`` when a sweep simulates
  both vllm and sglang semantics): TTFT p99 and throughput per scheduler
  (means over the other fields, min-max bars), for simulate rows with two
  or more schedulers; one series per value of the first field that varies among
  ``rate``, ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``;
* ``routers_<workload>``: hit rate against load imbalance per router and
  route mode (exact filled, approximate hollow), for routed simulate rows
  with two or more routers.
"""

from __future__ import annotations

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
    out.setdefault(tuple(r[k] for k in keys), []).append(r)
  return out


def _replay_point(r) -> dict[str, Any]:
  """A replay row in the point dicts of :mod:`prefixjax.plots`."""
  return {
    "policy": r["policy"],
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
  for (w, sem, k, warm), part in _slices(
    replay, ("workload", "semantics", "block_size", "warmup_fraction")
  ).items():
    if len({r["capacity"] for r in part}) < 2:
      continue
    ceiling = part[0].get("ceiling_hit_rate")
    written += plots.plot_hit_rates(
      [_replay_point(r) for r in part],
      folder / f"hit_rate_{_slug(w, sem)}_k{k}.png",
      ceiling=ceiling,
      trace=_trace_label(spec, w),
      semantics=sem,
      warmup_fraction=warm,
      also=("pdf",),
    )
  tokens = [
    dict(r, cached_tokens=r["capacity"] * r["block_size"]) for r in replay
  ]
  for (w, sem, c, warm), part in _slices(
    tokens, ("workload", "semantics", "cached_tokens", "warmup_fraction")
  ).items():
    if len({r["block_size"] for r in part}) < 2:
      continue
    written += plots.plot_hit_rate_vs_block_size(
      [_replay_point(r) for r in part],
      folder / f"block_size_{_slug(w, sem)}_{c}tokens.png",
      trace=_trace_label(spec, w),
      semantics=sem,
      warmup_fraction=warm,
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
