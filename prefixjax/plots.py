"""Plots of replay results.

matplotlib is optional: ``pip install prefixjax[plot]``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plot_hit_rates"]


def plot_hit_rates(
  rows: Sequence[dict],
  path: str,
  *,
  title: str = "",
  ceiling: float | None = None,
) -> None:
  """Hit rate against cache capacity, one line per policy, saved to ``path``.

  Args:
    rows: point dicts as written by ``prefixjax replay --json`` (keys
      ``policy``, ``capacity_blocks``, ``hit_rate``, ``mode``).
    path: image file to write (format from the extension, e.g. ``.png``).
    title: figure title.
    ceiling: unbounded-cache hit rate, drawn as a dashed line.

  Raises:
    ImportError: matplotlib is not installed (with the install hint).
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError(
      "plots need matplotlib: pip install 'prefixjax[plot]'"
    ) from err
  fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
  for policy in dict.fromkeys(r["policy"] for r in rows):
    points = sorted(
      (r["capacity_blocks"], r["hit_rate"], r["mode"])
      for r in rows
      if r["policy"] == policy
    )
    measured = [(x, 100 * y) for x, y, mode in points if mode != "underfilled"]
    under = [x for x, _, mode in points if mode == "underfilled"]
    xs_ys = list(zip(*measured, strict=True)) or [(), ()]
    (line,) = ax.plot(*xs_ys, marker="o", label=policy)
    if under:
      # An underfilled cache reports 0 hits (as kvcache-simulator does):
      # marked on the axis, not joined to the curve.
      ax.scatter(
        under,
        [0] * len(under),
        marker="x",
        color=line.get_color(),
        label=f"{policy}: underfilled",
        clip_on=False,
      )
  if ceiling is not None:
    ax.axhline(100 * ceiling, linestyle="--", color="gray", label="unbounded")
  ax.set_xscale("log")
  # Label decades only: minor labels on a log axis overlap.
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.set_xlabel("cache capacity (blocks)")
  ax.set_ylabel("token hit rate (%)")
  ax.set_ylim(bottom=0)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  if title:
    ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
