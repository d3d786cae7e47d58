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
    xs = [p[0] for p in points]
    ys = [100 * p[1] for p in points]
    (line,) = ax.plot(xs, ys, marker="o", label=policy)
    under = [
      (x, y)
      for x, y, p in zip(xs, ys, points, strict=True)
      if p[2] == "underfilled"
    ]
    if under:
      ax.scatter(*zip(*under, strict=True), marker="x", color=line.get_color())
  if ceiling is not None:
    ax.axhline(100 * ceiling, linestyle="--", color="gray", label="unbounded")
  ax.set_xscale("log")
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
