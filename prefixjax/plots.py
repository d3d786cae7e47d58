"""Plots of replay results, sized and labelled for a paper.

matplotlib is a dependency (an environment without it gets an install
hint). The figures are built on a bare :class:`matplotlib.figure.Figure`
(no pyplot, no backend switch), so a notebook's backend is left alone.

Every series gets its own colour (Okabe-Ito, colour-blind safe), marker and
line style, in series order, so a series hidden under another still shows and
the figure reads in greyscale. The x axis is ticked at the measured values
themselves, thinned where labels would touch; the scheduler figure's is
categorical, its labels tilted where they would touch. The legend sits
outside every axes: right of a wide figure's axes and of their labels (a
twin axis's too), under a narrow one's x axis. A y axis in percent runs
from 0 to a little over the highest value, or 0-100 when every value is 0.
Raster output is 300 dpi; a ``.pdf`` or ``.svg`` path writes vector
output.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from matplotlib.axis import Axis
  from matplotlib.figure import Figure

__all__ = [
  "block_size_figure",
  "count_label",
  "hit_rate_figure",
  "plot_hit_rate_vs_block_size",
  "plot_hit_rates",
  "plot_routers",
  "plot_schedulers",
  "router_figure",
  "scheduler_figure",
]

DPI = 300
FIGSIZE = (6.4, 4.0)  # inches: a two-column figure width
SCHEDULER_FIGSIZE = (8.0, 3.6)  # two panels side by side, legend right
_COLORS = (
  "#0072B2",
  "#E69F00",
  "#009E73",
  "#D55E00",
  "#CC79A7",
  "#56B4E9",
  "#000000",
  "#F0E442",
)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# Five styles against eight markers: no (marker, style) pair repeats before
# the 40th series.
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))
_MAX_LABELS = 8
_COMPRESSED = {".gz", ".bz2", ".xz", ".zst", ".zip"}
# Reproducible vector files: no creation date in them.
_METADATA = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}


def plot_hit_rates(
  rows: Sequence[Mapping[str, Any]],
  path: str | os.PathLike[str],
  *,
  title: str | None = None,
  ceiling: float | None = None,
  trace: str | None = None,
  semantics: str | None = None,
  warmup_fraction: float | None = None,
  block_size: int | None = None,
  bytes_per_token: float | None = None,
  figsize: tuple[float, float] = FIGSIZE,
  also: Sequence[str] = (),
) -> list[str]:
  """Hit rate against cache capacity, one line per policy, saved to ``path``.

  Args:
    rows: point dicts as written by ``prefixjax replay --json`` (keys
      ``policy``, ``capacity_blocks``, ``hit_rate``, ``mode``). Underfilled
      points are drawn as crosses at 0, not joined to their curve.
    path: file to write; the format comes from the extension (``.png`` at
      300 dpi, ``.pdf`` and ``.svg`` as vectors).
    title: figure title; ``None`` names the trace, ``""`` draws none.
    ceiling: unbounded-cache hit rate, drawn as a labelled dashed line.
    trace: trace file name; its stem (no directory, no extension) titles
      the figure.
    semantics: the replay semantics (kvcache-sim, vllm, sglang), named in
      the caption.
    warmup_fraction: share of requests that only warm the cache; the
      caption names the measured window.
    block_size: tokens per block, named in the caption; adds a top axis in
      tokens. ``None`` takes it from the rows when they all agree.
    bytes_per_token: KV bytes per token; the top axis is then in GiB.
    figsize: figure size in inches.
    also: extra extensions (``("pdf",)``) written beside ``path``.

  Returns:
    The paths written, ``path`` first.

  Raises:
    ImportError: matplotlib is not installed (with the install hint).
    ValueError: no rows, an unknown figure format, or ``bytes_per_token``
      without a block size.
  """
  fig = hit_rate_figure(
    rows,
    title=title,
    ceiling=ceiling,
    trace=trace,
    semantics=semantics,
    warmup_fraction=warmup_fraction,
    block_size=block_size,
    bytes_per_token=bytes_per_token,
    figsize=figsize,
  )
  return _save(fig, path, also)


def plot_hit_rate_vs_block_size(
  rows: Sequence[Mapping[str, Any]],
  path: str | os.PathLike[str],
  *,
  title: str | None = None,
  trace: str | None = None,
  semantics: str | None = None,
  warmup_fraction: float | None = None,
  cache_tokens: int | None = None,
  figsize: tuple[float, float] = FIGSIZE,
  also: Sequence[str] = (),
) -> list[str]:
  """Hit rate and internal fragmentation against block size.

  Args:
    rows: point dicts with ``block_size`` and ``hit_rate``; optional
      ``policy`` (one line each; default one line), ``mode`` (as in
      :func:`plot_hit_rates`), ``fragmentation`` (share of allocated
      token slots left empty, drawn on a right-hand axis, averaged per block
      size) and ``capacity_blocks``.
    cache_tokens: the cache size the rows were replayed at, in tokens,
      named in the caption. ``None`` takes it from the rows when
      ``capacity_blocks * block_size`` is the same in all of them (else the
      caption names ``capacity_blocks`` when that is).
    path, title, trace, semantics, warmup_fraction, figsize, also: as in
      :func:`plot_hit_rates`.

  Returns:
    The paths written, ``path`` first.
  """
  fig = block_size_figure(
    rows,
    title=title,
    trace=trace,
    semantics=semantics,
    warmup_fraction=warmup_fraction,
    cache_tokens=cache_tokens,
    figsize=figsize,
  )
  return _save(fig, path, also)


def hit_rate_figure(
  rows: Sequence[Mapping[str, Any]],
  *,
  title: str | None = None,
  ceiling: float | None = None,
  trace: str | None = None,
  semantics: str | None = None,
  warmup_fraction: float | None = None,
  block_size: int | None = None,
  bytes_per_token: float | None = None,
  figsize: tuple[float, float] = FIGSIZE,
) -> Figure:
  """The figure :func:`plot_hit_rates` saves, to adjust before saving
  (same arguments but the path; a ``matplotlib.figure.Figure``)."""
  if not rows:
    raise ValueError("no rows to plot")
  if block_size is None:
    sizes = {r.get("block_size") for r in rows}
    if len(sizes) == 1 and None not in sizes:
      block_size = int(sizes.pop())
  if bytes_per_token is not None and block_size is None:
    raise ValueError("bytes_per_token needs a block_size")
  fig, ax = _new_figure(figsize)
  handles, underfilled = _draw_series(ax, rows, "capacity_blocks")
  if underfilled:
    handles.append(_underfilled_handle())
  peak = max([100 * r["hit_rate"] for r in rows] + [0.0])
  ceiling_label = None
  if ceiling is not None:
    label = f"unbounded cache {100 * ceiling:.1f}%"
    handles.append(
      ax.axhline(
        100 * ceiling,
        linestyle="--",
        linewidth=1.0,
        color="0.45",
        label=label,
        zorder=2,
      )
    )
    if ceiling > 0:  # at 0 it would sit on the markers; the legend says it
      ceiling_label = ax.text(
        0.99,
        100 * ceiling,
        label,
        transform=ax.get_yaxis_transform(),
        ha="right",
        va="bottom",
        fontsize=8,
        color="0.3",
      )
    peak = max(peak, 100 * ceiling)
  _note_if_empty(ax, rows, ceiling)
  _percent_axis(ax, peak)
  ax.set_xlabel("cache capacity (blocks)", fontsize=9)
  ax.set_ylabel("token hit rate (%)", fontsize=9)
  _legend(fig, ax, handles)

  capacities = [r["capacity_blocks"] for r in rows]
  top = None
  if block_size is not None:
    top = ax.twiny()
    if bytes_per_token is None:
      top.set_xlabel("cache capacity (tokens)", fontsize=9)
      top_label = lambda v: count_label(v * block_size)
    else:
      gib = block_size * bytes_per_token / 2**30
      top.set_xlabel("cache capacity (GiB)", fontsize=9)
      top_label = lambda v: _gib_label(v * gib)
  _set_x_scale(ax, capacities, decades=10)
  if top is not None:
    _set_x_scale(top, capacities, decades=10)
    top.set_xlim(ax.get_xlim())
    top.tick_params(labelsize=8)
  if title is None:
    title = _trace_stem(trace) if trace else ""
  if title:
    ax.set_title(title, fontsize=10)
  _caption(
    fig,
    block_size=block_size,
    bytes_per_token=bytes_per_token,
    warmup_fraction=warmup_fraction,
    semantics=semantics,
    underfilled=underfilled,
  )
  kept = _fit_ticks(fig, ax.xaxis, capacities, count_label)
  if top is not None:
    _fit_ticks(fig, top.xaxis, capacities, top_label, start=kept)
  _wrap_long_labels([ax])
  _settle_legend(fig)
  if ceiling_label is not None:
    _fit_inside(fig, ax, ceiling_label)
  return fig


def block_size_figure(
  rows: Sequence[Mapping[str, Any]],
  *,
  title: str | None = None,
  trace: str | None = None,
  semantics: str | None = None,
  warmup_fraction: float | None = None,
  cache_tokens: int | None = None,
  figsize: tuple[float, float] = FIGSIZE,
) -> Figure:
  """The figure :func:`plot_hit_rate_vs_block_size` saves."""
  if not rows:
    raise ValueError("no rows to plot")
  cache = _cache_size(rows, cache_tokens)
  fig, ax = _new_figure(figsize)
  handles, underfilled = _draw_series(
    ax, rows, "block_size", default="hit rate"
  )
  if underfilled:
    handles.append(_underfilled_handle())
  frag: dict[int, list[float]] = {}
  for r in rows:
    if r.get("fragmentation") is not None:
      frag.setdefault(r["block_size"], []).append(100 * r["fragmentation"])
  if frag:
    right = ax.twinx()
    xs = sorted(frag)
    ys = [sum(frag[x]) / len(frag[x]) for x in xs]
    style = _style(len(handles))
    style["color"] = "0.35"
    (line,) = right.plot(
      xs,
      ys,
      label="internal fragmentation",
      markerfacecolor="white",
      clip_on=False,
      zorder=3,
      **_LINE,
      **style,
    )
    handles.append(line)
    _percent_axis(right, max(ys))
    right.set_ylabel("internal fragmentation (%)", fontsize=9)
    right.tick_params(labelsize=8)
  peak = max([100 * r["hit_rate"] for r in rows] + [0.0])
  _note_if_empty(ax, rows, None)
  _percent_axis(ax, peak)
  ax.set_xlabel("block size (tokens)", fontsize=9)
  ax.set_ylabel("token hit rate (%)", fontsize=9)
  _legend(fig, ax, handles)
  sizes = [r["block_size"] for r in rows]
  _set_x_scale(ax, sizes, decades=4)
  if title is None:
    title = _trace_stem(trace) if trace else ""
  if title:
    ax.set_title(title, fontsize=10)
  _caption(
    fig,
    block_size=None,
    bytes_per_token=None,
    warmup_fraction=warmup_fraction,
    semantics=semantics,
    underfilled=underfilled,
    first=[cache] if cache else [],
  )
  _fit_ticks(fig, ax.xaxis, sizes, count_label)
  _wrap_long_labels(fig.axes)
  _settle_legend(fig)
  return fig


def plot_schedulers(
  rows: Sequence[Mapping[str, Any]],
  path: str | os.PathLike[str],
  *,
  series: str | None = None,
  title: str | None = None,
  trace: str | None = None,
  figsize: tuple[float, float] = SCHEDULER_FIGSIZE,
  also: Sequence[str] = (),
) -> list[str]:
  """TTFT p99 and throughput per scheduler, two panels, saved to ``path``.

  Args:
    rows: one dict per simulated configuration, with ``scheduler`` and the
      metrics ``ttft_s_p99`` and ``throughput_tokens_per_s`` (or, for runs
      without a clock in seconds, ``ttft_steps_p99`` and
      ``throughput_tokens_per_step``); other keys are ignored. Rows sharing
      the scheduler and the ``series`` value (seeds, say) are drawn as one
      marker at their mean with a bar from their min to their max.
    path: file to write, as in :func:`plot_hit_rates`.
    series: a row key (``"rate"``, ``"num_blocks"``): one series per
      distinct value, sorted, side by side at each scheduler. ``None``: one
      series.
    title: figure title; ``None`` names the trace, ``""`` draws none.
    trace: trace file name; its stem titles the figure.
    figsize: figure size in inches.
    also: extra extensions (``("pdf",)``) written beside ``path``.

  Returns:
    The paths written, ``path`` first.

  Raises:
    ImportError: matplotlib is not installed (with the install hint).
    ValueError: no rows, a row without ``scheduler``, a row without the
      ``series`` key, or an unknown figure format.
  """
  fig = scheduler_figure(
    rows, series=series, title=title, trace=trace, figsize=figsize
  )
  return _save(fig, path, also)


def scheduler_figure(
  rows: Sequence[Mapping[str, Any]],
  *,
  series: str | None = None,
  title: str | None = None,
  trace: str | None = None,
  figsize: tuple[float, float] = SCHEDULER_FIGSIZE,
) -> Figure:
  """The figure :func:`plot_schedulers` saves: the TTFT panel on the left,
  the throughput panel on the right.

  The unit is seconds unless some row has a metric in steps but not in
  seconds (a run without a clock); then both panels are in steps, for every
  row, and the caption says so.
  """
  if not rows:
    raise ValueError("no rows to plot")
  nameless = [i for i, r in enumerate(rows) if r.get("scheduler") is None]
  if nameless:
    raise ValueError(f"rows without a 'scheduler': {_indices(nameless)}")
  if series is not None:
    missing = [i for i, r in enumerate(rows) if r.get(series) is None]
    if missing:
      raise ValueError(
        f"series {series!r}: rows without that key: {_indices(missing)}"
      )
  seconds = _in_seconds(rows)
  unit = "s" if seconds else "step"
  panels = (
    (
      "ttft_s_p99" if seconds else "ttft_steps_p99",
      "TTFT p99, lower is better",
      "TTFT p99 (s)" if seconds else "TTFT p99 (steps)",
    ),
    (
      "throughput_tokens_per_s" if seconds else "throughput_tokens_per_step",
      "throughput, higher is better",
      f"throughput (output tokens/{unit})",
    ),
  )
  from matplotlib.ticker import FuncFormatter

  names = list(dict.fromkeys(r["scheduler"] for r in rows))
  where = {name: i for i, name in enumerate(names)}
  values = [None] if series is None else _sorted({r[series] for r in rows})
  # Side by side within 0.6 of the 1.0 between schedulers.
  step = min(0.15, 0.6 / len(values))
  fig, axes = _panels(figsize, len(panels))
  runs: list[int] = []
  for ax, (key, panel_title, ylabel) in zip(axes, panels, strict=True):
    peak = 0.0
    for j, value in enumerate(values):
      groups: dict[Any, list[float]] = {}
      for r in rows:
        if (series is None or r[series] == value) and r.get(key) is not None:
          groups.setdefault(r["scheduler"], []).append(float(r[key]))
      if not groups:
        continue
      offset = (j - (len(values) - 1) / 2) * step
      xs = [where[name] + offset for name in groups]
      means = [sum(ys) / len(ys) for ys in groups.values()]
      lows = [min(ys) for ys in groups.values()]
      highs = [max(ys) for ys in groups.values()]
      runs += [len(ys) for ys in groups.values()]
      style = _style(j)
      ax.errorbar(
        xs,
        means,
        yerr=[
          [m - lo for m, lo in zip(means, lows, strict=True)],
          [hi - m for m, hi in zip(means, highs, strict=True)],
        ],
        color=style["color"],
        marker=style["marker"],
        linestyle="none",
        capsize=2.5,
        elinewidth=1.0,
        markersize=_LINE["markersize"],
        clip_on=False,
        zorder=3,
      )
      peak = max(peak, *highs)
    if not ax.containers:
      ax.text(
        0.5,
        0.5,
        "no data",
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=9,
        color="0.3",
      )
    ax.set_ylim(0, 1.15 * peak if peak > 0 else 1.0)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.xaxis.grid(False)
    ax.set_xticks(range(len(names)), [str(name) for name in names])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: count_label(v)))
    ax.set_title(panel_title, fontsize=9)
    ax.set_xlabel("scheduler", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
  if series is not None:
    _legend(
      fig,
      axes[-1],
      [_series_handle(series, v, j) for j, v in enumerate(values)],
    )
  if title is None:
    title = _trace_stem(trace) if trace else ""
  if title:
    fig.suptitle(title, fontsize=10)
  notes = []
  if runs and max(runs) > 1:
    n = f"{min(runs)}-{max(runs)}" if min(runs) < max(runs) else f"{max(runs)}"
    notes.append(f"markers: mean of {n} runs, bars: min to max")
  if not seconds and runs:
    notes.append("in scheduler steps: a run had no clock in seconds")
  _caption(fig, notes=notes)
  _fit_category_labels(fig, axes)
  _settle_legend(fig)
  return fig


_LINE = {"linewidth": 1.4, "markersize": 5}


def plot_routers(
  rows: Sequence[Mapping[str, Any]],
  path: str | os.PathLike[str],
  *,
  title: str | None = None,
  trace: str | None = None,
  figsize: tuple[float, float] = (6.4, 4.0),
  also: Sequence[str] = (),
) -> list[str]:
  """Hit rate against load imbalance, one marker per router and mode.

  Args:
    rows: one dict per cluster run with ``router``, ``route_mode``
      (``"exact"`` filled markers, ``"approximate"`` hollow),
      ``token_hit_rate`` and ``imbalance`` (max over mean of the
      replicas' computed tokens); rows sharing router and mode are drawn at
      their mean with min-max bars.
    path, title, trace, figsize, also: as :func:`plot_schedulers`.

  Returns:
    The paths written, ``path`` first.

  Raises:
    ValueError: no rows, or a row without those keys.
  """
  fig = router_figure(rows, title=title, trace=trace, figsize=figsize)
  return _save(fig, path, also)


def router_figure(
  rows: Sequence[Mapping[str, Any]],
  *,
  title: str | None = None,
  trace: str | None = None,
  figsize: tuple[float, float] = (6.4, 4.0),
) -> Figure:
  """The figure :func:`plot_routers` saves."""
  if not rows:
    raise ValueError("no rows to plot")
  for i, r in enumerate(rows):
    for key in ("router", "route_mode", "token_hit_rate", "imbalance"):
      if r.get(key) is None:
        raise ValueError(f"row {i} has no {key!r}")
  fig, (ax,) = _panels(figsize, 1)
  routers = _sorted({r["router"] for r in rows})
  handles = []
  from matplotlib.lines import Line2D

  for i, name in enumerate(routers):
    style = _style(i)
    for mode in ("exact", "approximate"):
      part = [
        r for r in rows if r["router"] == name and r["route_mode"] == mode
      ]
      if not part:
        continue
      x = [float(r["imbalance"]) for r in part]
      y = [float(r["token_hit_rate"]) for r in part]
      mx, my = sum(x) / len(x), sum(y) / len(y)
      face = style["color"] if mode == "exact" else "none"
      spread = len(part) > 1
      ax.errorbar(
        [mx],
        [my],
        xerr=[[mx - min(x)], [max(x) - mx]] if spread else None,
        yerr=[[my - min(y)], [max(y) - my]] if spread else None,
        fmt=style["marker"],
        color=style["color"],
        markerfacecolor=face,
        markersize=8,
        capsize=3,
        linewidth=1,
      )
      handles.append(
        Line2D(
          [],
          [],
          linestyle="none",
          marker=style["marker"],
          color=style["color"],
          markerfacecolor=face,
          label=f"{name} ({mode})",
        )
      )
  ax.set_xlabel("load imbalance (max / mean computed tokens)", fontsize=9)
  ax.set_ylabel("token hit rate", fontsize=9)
  if title is None and trace is not None:
    title = f"routers on {_trace_stem(trace)}"
  if title:
    ax.set_title(title, fontsize=10)
  _legend(fig, ax, handles)
  fig.draw_without_rendering()
  _wrap_long_labels([ax])
  _settle_legend(fig)
  return fig


def _new_figure(figsize: tuple[float, float]):
  fig, (ax,) = _panels(figsize, 1)
  return fig, ax


def _panels(figsize: tuple[float, float], n: int):
  """A bare figure with ``n`` axes side by side (constrained layout)."""
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError(
      "plots need matplotlib: pip install 'prefixjax[plot]'"
    ) from err
  fig = Figure(figsize=figsize, layout="constrained")
  FigureCanvasAgg(fig)
  axes = [fig.add_subplot(1, n, i + 1) for i in range(n)]
  for ax in axes:
    ax.tick_params(labelsize=8)
    ax.grid(True, which="major", alpha=0.3, linewidth=0.6)
  return fig, axes


def _legend(fig, ax, handles) -> None:
  """Outside every axes, so it covers no data and no axis: a figure legend
  right of everything in a wide figure (past a twin axis's tick labels and
  label too: constrained layout makes room for it beside all the axes' own
  decorations), under the x axis of a narrow one (under 5 inches; in one
  column where two would be wider than the figure), moved clear of its
  labels by :func:`_settle_legend`."""
  if fig.get_figwidth() >= 5:
    fig.legend(
      handles=handles,
      loc="outside right upper",
      frameon=False,
      fontsize=8,
    )
    return
  for ncols in (2, 1):
    legend = ax.legend(
      handles=handles,
      loc="upper center",
      bbox_to_anchor=(0.5, 0.0),
      bbox_transform=_below(fig, ax, _BELOW_POINTS),
      borderaxespad=0.0,
      frameon=False,
      fontsize=8,
      ncols=ncols,
    )
    # Measured before any layout, which a legend wider than the figure
    # would make fail; long labels go in one column.
    width = legend.get_window_extent(fig.canvas.get_renderer()).width
    if width <= 0.95 * fig.bbox.width:
      return


# A first guess at the height of the x axis's labels under the axes (one
# line of tick labels and the axis label), corrected by _settle_legend.
_BELOW_POINTS = 36.0


def _below(fig, ax, points: float):
  """Axes coordinates moved down by ``points``."""
  from matplotlib.transforms import offset_copy

  return offset_copy(ax.transAxes, fig=fig, y=-points, units="points")


def _settle_legend(fig) -> None:
  """Moves a legend under an axes to just below that axes' x tick labels
  and x label, measured once the figure is laid out (tilted labels are
  taller than a guess)."""
  for ax in fig.axes:
    legend = ax.get_legend()
    if legend is None or fig.get_figwidth() >= 5:
      continue
    for _ in range(2):  # the layout moves the axes, not their labels' size
      fig.draw_without_rendering()
      boxes = [ax.xaxis.get_tightbbox(), ax.bbox]
      low = min(b.y0 for b in boxes if b is not None)
      points = (ax.bbox.y0 - low) * 72 / fig.dpi + 6
      legend.set_bbox_to_anchor((0.5, 0.0), transform=_below(fig, ax, points))


def _style(i: int) -> dict:
  """Colour, marker and line style of the ``i``-th series."""
  return {
    "color": _COLORS[i % len(_COLORS)],
    "marker": _MARKERS[i % len(_MARKERS)],
    "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
  }


def _draw_series(ax, rows, xkey: str, default: str = "") -> tuple[list, bool]:
  """One line per ``policy``; underfilled points as crosses at 0."""
  names = list(dict.fromkeys(r.get("policy", default) for r in rows))
  handles, underfilled = [], False
  for i, name in enumerate(names):
    style = _style(i)
    points = sorted(
      (r[xkey], 100 * r["hit_rate"], r.get("mode", "measured"))
      for r in rows
      if r.get("policy", default) == name
    )
    xs = [x for x, _, mode in points if mode != "underfilled"]
    ys = [y for _, y, mode in points if mode != "underfilled"]
    # Each series' markers a size larger than the next one's, so a series
    # with the same points as a later one (fifo and lru_leaf on a trace
    # with little reuse) still shows around it instead of hiding under it.
    line_kw = {
      **_LINE,
      "markersize": _LINE["markersize"] + 1.5 * (len(names) - 1 - i),
    }
    if xs:
      (line,) = ax.plot(
        xs, ys, label=str(name), clip_on=False, zorder=3, **line_kw, **style
      )
    else:
      # Only a legend entry: an empty unclipped line in the axes has an
      # infinite extent, and the layout then collapses the axes.
      from matplotlib.lines import Line2D

      line = Line2D([], [], label=str(name), **line_kw, **style)
    handles.append(line)
    under = [x for x, _, mode in points if mode == "underfilled"]
    if under:
      # An underfilled cache reports 0 hits (as kvcache-simulator does).
      underfilled = True
      ax.plot(
        under,
        [0.0] * len(under),
        linestyle="none",
        marker="x",
        markersize=6,
        color=style["color"],
        clip_on=False,
        zorder=4,
      )
  return handles, underfilled


def _underfilled_handle():
  from matplotlib.lines import Line2D

  return Line2D(
    [],
    [],
    linestyle="none",
    marker="x",
    markersize=6,
    color="0.3",
    label="underfilled (reported 0)",
  )


# Units of the series keys a sweep draws (the rest are counts of what
# their names say).
_SERIES_UNITS = {"rate": " req/s"}


def _series_handle(key: str, value, i: int):
  """Legend entry of the ``i``-th series, ``key = value`` (and its unit)."""
  from matplotlib.lines import Line2D

  style = _style(i)
  if isinstance(value, float) and not isinstance(value, bool):
    shown = f"{value:g}"
  else:
    shown = str(value)
  shown += _SERIES_UNITS.get(key, "")
  return Line2D(
    [],
    [],
    linestyle="none",
    marker=style["marker"],
    markersize=_LINE["markersize"],
    color=style["color"],
    label=f"{key} = {shown}",
  )


def _in_seconds(rows: Sequence[Mapping[str, Any]]) -> bool:
  """Seconds unless a row has a metric in steps only (no clock), or no row
  has one in seconds."""
  pairs = (
    ("ttft_s_p99", "ttft_steps_p99"),
    ("throughput_tokens_per_s", "throughput_tokens_per_step"),
  )
  clockless = any(
    r.get(s) is None and r.get(t) is not None for r in rows for s, t in pairs
  )
  timed = any(r.get(s) is not None for r in rows for s, _ in pairs)
  return timed and not clockless


def _sorted(values) -> list:
  """Sorted; by text where the values do not compare (mixed types)."""
  try:
    return sorted(values)
  except TypeError:
    return sorted(values, key=str)


def _indices(indices: Sequence[int], at_most: int = 5) -> str:
  shown = ", ".join(str(i) for i in indices[:at_most])
  more = len(indices) - at_most
  return shown + (f" and {more} more" if more > 0 else "")


def _fit_category_labels(fig, axes) -> None:
  """Tilts the x labels where two would touch (30 degrees, or steeper until
  the slanted lines clear each other, up to 90) and breaks a y label taller
  than its axes before its parenthesis."""
  fig.draw_without_rendering()
  pad = 0.6 * 8 * fig.dpi / 72  # a little over half a label font's em
  slope = 0.0  # the least sine of the tilt that keeps the lines apart
  for ax in axes:
    texts = [t for t in ax.get_xticklabels() if t.get_text()]
    boxes = sorted((b.x0, b.x1) for b in (t.get_window_extent() for t in texts))
    if all(
      b0 >= a1 + pad
      for (_, a1), (b0, _) in zip(boxes[:-1], boxes[1:], strict=True)
    ):
      continue
    # Slanted labels are parallel lines: apart by (tick spacing) * sin(tilt).
    gap = ax.bbox.width / len(texts)
    height = 1.4 * texts[0].get_fontsize() * fig.dpi / 72
    slope = max(slope, height / gap)
  if slope:
    angle = next(
      (a for a in (30, 45, 60) if math.sin(math.radians(a)) >= slope), 90
    )
    for ax in axes:
      ax.set_xticks(
        ax.get_xticks(),
        [t.get_text() for t in ax.get_xticklabels()],
        rotation=angle,
        ha="right",
        va="center" if angle == 90 else "top",
        rotation_mode="anchor",
      )
    fig.draw_without_rendering()  # the axes are shorter now
  _wrap_long_labels(axes)


def _wrap_long_labels(axes) -> None:
  """Breaks a y label taller than its axes, or an x label wider than its
  axes, before its parenthesis (the figure must have been drawn)."""
  for ax in axes:
    for label, size, room in (
      (ax.yaxis.label, lambda box: box.height, ax.bbox.height),
      (ax.xaxis.label, lambda box: box.width, ax.bbox.width),
    ):
      text = label.get_text()
      if " (" in text and size(label.get_window_extent()) > room:
        label.set_text(text.replace(" (", "\n(", 1))


def _fit_inside(fig, ax, text) -> None:
  """Raises the top of ``ax``'s y axis until ``text`` (drawn above a line
  in data coordinates) clears the axes' top edge."""
  for _ in range(3):
    fig.draw_without_rendering()
    over = text.get_window_extent().y1 + 2 - ax.bbox.y1
    if over <= 0:
      return
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + over * (high - low) / ax.bbox.height)


def _cache_size(rows, cache_tokens: int | None) -> str | None:
  """The caption's words for the cache a block-size figure was drawn at."""
  blocks = {r.get("capacity_blocks") for r in rows}
  if cache_tokens is None and None not in blocks:
    tokens = {r["capacity_blocks"] * r["block_size"] for r in rows}
    if len(tokens) == 1:
      cache_tokens = tokens.pop()
  if cache_tokens is not None:
    text = f"cache of {cache_tokens:,} tokens at every block size"
    if None not in blocks and len(blocks) > 1:
      text += f" ({min(blocks):,} to {max(blocks):,} blocks)"
    return text
  if len(blocks) == 1 and None not in blocks:
    return f"cache of {blocks.pop():,} blocks at every block size"
  return None


def _percent_axis(ax, peak: float) -> None:
  """A y axis in percent from 0 to a little over ``peak``; with nothing
  above 0 the whole 0-100 scale, whose ticks read as percentages (a 0-1
  axis labelled % reads as fractions)."""
  ax.set_ylim(0, 1.15 * peak if peak > 0 else 100.0)


def _note_if_empty(ax, rows, ceiling: float | None) -> None:
  """Says why an all-zero plot is flat, in the middle of the axes."""
  measured = [r for r in rows if r.get("mode", "measured") != "underfilled"]
  if not measured:
    note = "every point underfilled"
  elif any(r["hit_rate"] > 0 for r in measured):
    return
  elif not ceiling:
    note = "no hits: the trace shares no prefix"
  else:
    note = "no hits at these capacities"
  ax.text(
    0.5,
    0.5,
    note,
    transform=ax.transAxes,
    ha="center",
    va="center",
    fontsize=9,
    color="0.3",
  )


def _set_x_scale(ax, values: Sequence[float], decades: float) -> None:
  """Log scale when the positive values span more than ``decades`` (a ratio);
  symlog when 0 is among them too (0 then sits left of the smallest one)."""
  positive = [v for v in values if v > 0]
  if len(positive) < 2 or max(positive) <= decades * min(positive):
    return
  if len(positive) == len(values):
    ax.set_xscale("log")
  else:
    ax.set_xscale("symlog", linthresh=min(positive), linscale=0.4)
    # Autoscale's margin reaches far into the negative side: a small one.
    ax.set_xlim(left=-0.15 * min(positive))


def _fit_ticks(
  fig,
  axis: Axis,
  values: Sequence[float],
  label: Callable[[float], str],
  *,
  start: Sequence[float] | None = None,
) -> list[float]:
  """Labelled ticks at ``values``, thinned until no two labels touch.

  Lays the figure out, measures the labels, keeps the first and the last and,
  greedily, each one clear of the last kept (and at most ``_MAX_LABELS``
  spread over the axis); the rest stay as unlabelled minor ticks. Returns the
  labelled values.
  """
  from matplotlib.ticker import (
    FixedLocator,
    FuncFormatter,
    NullFormatter,
  )

  values = sorted(set(values))
  kept = sorted(set(start)) if start is not None else values
  axis.set_major_formatter(FuncFormatter(lambda v, _pos: label(v)))
  axis.set_minor_formatter(NullFormatter())
  pad = 0.6 * 8 * fig.dpi / 72  # a little over half a label font's em
  for _ in range(4):
    axis.set_major_locator(FixedLocator(kept))
    axis.set_minor_locator(FixedLocator([v for v in values if v not in kept]))
    fig.draw_without_rendering()
    spans = {}
    for tick in axis.get_major_ticks():
      text = tick.label1 if tick.label1.get_visible() else tick.label2
      if text.get_visible() and text.get_text():
        box = text.get_window_extent()
        spans[tick.get_loc()] = (box.x0, box.x1)
    if len(spans) != len(kept):
      break  # a tick outside the view: leave the labels as they are
    min_gap = 0.0
    if len(kept) > _MAX_LABELS:
      min_gap = axis.axes.bbox.width / _MAX_LABELS
    thinned = _spread([spans[v] for v in kept], pad, min_gap)
    if len(thinned) == len(kept):
      break
    kept = [kept[i] for i in thinned]
  return kept


def _spread(
  spans: Sequence[tuple[float, float]], pad: float, min_gap: float
) -> list[int]:
  """Indices of labels (left, right extents, in axis order) to keep."""

  def clear(i: int, j: int) -> bool:
    (a0, a1), (b0, b1) = spans[i], spans[j]
    centre_gap = (b0 + b1) / 2 - (a0 + a1) / 2
    return b0 >= a1 + pad and centre_gap >= min_gap

  keep = [0]
  for j in range(1, len(spans)):
    if clear(keep[-1], j):
      keep.append(j)
  last = len(spans) - 1
  if keep[-1] != last:
    while len(keep) > 1 and not clear(keep[-1], last):
      keep.pop()
    keep.append(last)
  return keep


def count_label(value: float) -> str:
  """``1,827`` below ten thousand, then ``18.3k``, ``0.9M`` style."""
  if value < 10_000:
    return f"{value:,.0f}" if value == round(value) else f"{value:.3g}"
  for unit, scale in (("k", 1e3), ("M", 1e6), ("B", 1e9)):
    mantissa = float(f"{value / scale:.3g}")
    if mantissa < 1000 or unit == "B":
      return f"{mantissa:g}{unit}"
  raise AssertionError("unreachable")  # pragma: no cover


def _gib_label(value: float) -> str:
  return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _trace_stem(trace: str) -> str:
  """``data/mooncake_trace.jsonl.gz`` -> ``mooncake_trace``; a name with no
  extension stays whole (``llama-3.1-8b`` keeps its ``.1-8b``)."""
  path = pathlib.PurePath(trace)
  while path.suffix.lower() in _COMPRESSED:
    path = path.with_suffix("")
  if re.fullmatch(r"\.[A-Za-z][A-Za-z0-9]{0,7}", path.suffix):
    return path.stem
  return path.name


def _caption(
  fig,
  *,
  block_size: int | None = None,
  bytes_per_token: float | None = None,
  warmup_fraction: float | None = None,
  semantics: str | None = None,
  underfilled: bool = False,
  notes: Sequence[str] = (),
  first: Sequence[str] = (),
) -> None:
  """Small text under the axes: ``first``, block size, measured window,
  semantics, then ``notes``."""
  parts = list(first)
  if block_size is not None:
    parts.append(f"block size {block_size} tokens")
  if bytes_per_token is not None:
    parts.append(f"{bytes_per_token / 1024:.3g} KiB of KV per token")
  if warmup_fraction is not None:
    if warmup_fraction == 0:
      parts.append("hits over all requests")
    else:
      measured = 100 * (1 - warmup_fraction)
      parts.append(
        f"hits over the last {measured:.3g}% of requests "
        f"(the first {100 * warmup_fraction:.3g}% warm the cache)"
      )
  if semantics is not None:
    parts.append(f"{semantics} semantics")
  if underfilled:
    parts.append("x: the cache never filled in the warm-up, reported as 0 hits")
  parts += notes
  if not parts:
    return
  text = "; ".join(parts) + "."
  text = text[0].upper() + text[1:]
  fontsize = 7.5
  width = int(fig.get_figwidth() * 72 / (0.5 * fontsize))
  lines = textwrap.wrap(text, width)
  fig.text(
    0.01,
    0.01,
    "\n".join(lines),
    ha="left",
    va="bottom",
    fontsize=fontsize,
    color="0.25",
  )
  height = (len(lines) * 1.3 * fontsize + 4) / (fig.get_figheight() * 72)
  fig.get_layout_engine().set(rect=(0, height + 0.01, 1, 0.99 - height))


def _save(fig, path, also: Sequence[str]) -> list[str]:
  """Writes ``path`` and its ``also`` siblings; checks every format first."""
  import matplotlib

  first = os.fspath(path)
  targets = [first]
  for ext in also:
    sibling = os.fspath(pathlib.Path(first).with_suffix("." + ext.lstrip(".")))
    if sibling not in targets:
      targets.append(sibling)
  kinds = fig.canvas.get_supported_filetypes()
  formats = []
  for target in targets:
    ext = os.path.splitext(target)[1].lower().lstrip(".")
    if ext not in kinds:
      raise ValueError(
        f"{target}: unknown figure format {ext or '(none)'!r}; "
        f"use one of {', '.join(sorted(kinds))}"
      )
    formats.append(ext)
  # TrueType fonts in PDF and PostScript: journals reject Type 3 fonts.
  with matplotlib.rc_context({"pdf.fonttype": 42, "ps.fonttype": 42}):
    for target, fmt in zip(targets, formats, strict=True):
      fig.savefig(target, format=fmt, dpi=DPI, metadata=_METADATA.get(fmt))
  return targets
