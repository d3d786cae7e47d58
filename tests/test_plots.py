"""Figures of replay results: what a reader of the paper can read off them.

The builders (``hit_rate_figure``, ``block_size_figure``,
``scheduler_figure``) are the figures the public savers write, so these tests
inspect the drawn figure itself: tick labels after a draw, legend entries,
styles, texts, the plotted data.
"""

import struct

import pytest

pytest.importorskip(
  "matplotlib", reason="plots need matplotlib: pip install 'prefixjax[plot]'"
)

from prefixjax import plots  # noqa: E402


def _capacities(rng, n, low=1.8, high=3.0):
  """``n`` distinct, roughly geometric capacities (random start and ratio)."""
  start = int(rng.integers(20, 2_000))
  ratio = float(rng.uniform(low, high))
  caps = sorted({int(round(start * ratio**k)) for k in range(n)})
  assert len(caps) == n
  return caps


def _rows(rng, policies, caps, *, underfilled=0, block_size=None):
  """Rising hit rates; the ``underfilled`` smallest capacities underfilled."""
  rows = []
  scale = float(rng.uniform(500, 5_000))
  for i, policy in enumerate(policies):
    for j, cap in enumerate(caps):
      row = dict(
        policy=policy,
        capacity_blocks=cap,
        hit_rate=float(0.4 * (1 - 0.5 ** (cap / scale)) * (1 + 0.02 * i)),
        mode="underfilled" if j < underfilled else "measured",
      )
      if block_size is not None:
        row["block_size"] = block_size
      rows.append(row)
  return rows


def _drawn(fig):
  fig.canvas.draw()
  return fig


def _labels(axis):
  return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


def _legend_texts(ax):
  return [t.get_text() for t in ax.get_legend().get_texts()]


def _caption(fig):
  """The figure's texts, lower-cased, on one line."""
  texts = (t.get_text().replace("\n", " ") for t in fig.texts)
  return " ".join(texts).lower()


@pytest.mark.parametrize(
  "value, label",
  [
    (5, "5"),
    (1_827, "1,827"),
    (9_100, "9,100"),
    (14_616, "14.6k"),
    (183_000, "183k"),
    (999_600, "1M"),
    (2_500_000, "2.5M"),
  ],
)
def test_count_labels_read_as_numbers(value, label):
  assert plots.count_label(value) == label


@pytest.mark.parametrize(
  "trace, stem",
  [
    ("data/mooncake_trace.jsonl", "mooncake_trace"),
    ("/x/conv.v2.jsonl.gz", "conv.v2"),
    ("lengths.csv", "lengths"),
  ],
)
def test_the_title_is_the_trace_stem(trace, stem):
  rows = [dict(policy="lru", capacity_blocks=8, hit_rate=0.1, mode="measured")]
  assert plots.hit_rate_figure(rows, trace=trace).axes[0].get_title() == stem


def test_x_ticks_sit_at_the_capacities_on_a_log_axis(rng):
  # Ratio over 2.2 and 4 or more points: the capacities span over a decade.
  caps = _capacities(rng, int(rng.integers(4, 9)), low=2.2)
  fig = _drawn(plots.hit_rate_figure(_rows(rng, ["lru"], caps)))
  ax = fig.axes[0]
  assert ax.get_xscale() == "log"
  assert _labels(ax.xaxis) == [plots.count_label(c) for c in caps]
  assert list(ax.get_xticks()) == caps
  assert ax.get_xlabel() == "cache capacity (blocks)"
  assert ax.get_ylabel() == "token hit rate (%)"


def test_capacities_within_a_decade_keep_a_linear_axis(rng):
  # Evenly spread (so none is thinned), all within one decade.
  start, step = int(rng.integers(100, 300)), int(rng.integers(100, 200))
  caps = [start + k * step for k in range(4)]
  fig = _drawn(plots.hit_rate_figure(_rows(rng, ["lru"], caps)))
  assert fig.axes[0].get_xscale() == "linear"
  assert _labels(fig.axes[0].xaxis) == [plots.count_label(c) for c in caps]


@pytest.mark.parametrize("figsize", [plots.FIGSIZE, (3.5, 2.8)])
def test_many_capacities_are_thinned_so_labels_do_not_touch(rng, figsize):
  caps = _capacities(rng, int(rng.integers(15, 40)), low=1.3, high=1.6)
  fig = plots.hit_rate_figure(_rows(rng, ["lru"], caps), figsize=figsize)
  ax = _drawn(fig).axes[0]
  shown = [t for t in ax.get_xticklabels() if t.get_text()]
  texts = [t.get_text() for t in shown]
  assert 2 <= len(texts) <= 8
  assert texts[0] == plots.count_label(caps[0])
  assert texts[-1] == plots.count_label(caps[-1])
  assert set(texts) <= {plots.count_label(c) for c in caps}
  boxes = [t.get_window_extent() for t in shown]
  boxes = sorted((b.x0, b.x1) for b in boxes)
  assert all(
    a1 < b0 for (_, a1), (b0, _) in zip(boxes[:-1], boxes[1:], strict=True)
  )
  # The unlabelled capacities stay as minor ticks.
  ticks = set(ax.get_xticks()) | set(ax.xaxis.get_minorticklocs())
  assert ticks == set(caps)


def test_every_series_has_its_own_marker_line_style_and_colour(rng):
  k = int(rng.integers(2, 9))
  policies = [f"policy{i}" for i in rng.permutation(k)]
  caps = _capacities(rng, 5)
  fig = plots.hit_rate_figure(_rows(rng, policies, caps, underfilled=1))
  ax = fig.axes[0]
  legend = ax.get_legend()
  texts = _legend_texts(ax)
  assert texts == policies + ["underfilled (reported 0)"]
  series = legend.legend_handles[:k]
  assert len({h.get_marker() for h in series}) == k
  assert len({h.get_color() for h in series}) == k
  first = series[:4]
  assert len({h.get_linestyle() for h in first}) == len(first)
  # Series order fixes the style: the same rows draw the same figure.
  again = plots.hit_rate_figure(_rows(rng, policies, caps, underfilled=1))
  again_series = again.axes[0].get_legend().legend_handles[:k]
  assert [h.get_marker() for h in again_series] == [
    h.get_marker() for h in series
  ]


def test_the_ceiling_is_a_labelled_dashed_line(rng):
  ceiling = float(rng.uniform(0.2, 0.6))
  caps = _capacities(rng, 4)
  fig = plots.hit_rate_figure(
    _rows(rng, ["lru", "fifo"], caps), ceiling=ceiling
  )
  ax = fig.axes[0]
  label = f"unbounded cache {100 * ceiling:.1f}%"
  assert label in [t.get_text() for t in ax.texts]
  assert _legend_texts(ax)[-1] == label
  (line,) = [ln for ln in ax.lines if ln.get_label() == label]
  assert line.get_linestyle() == "--"
  assert list(line.get_ydata()) == pytest.approx([100 * ceiling] * 2)
  assert ax.get_ylim()[1] > 100 * ceiling


def test_title_and_caption_say_trace_block_size_window_and_semantics(rng):
  name = f"trace{int(rng.integers(1_000))}"
  block_size = int(rng.choice([8, 16, 32, 64]))
  warmup = float(rng.choice([0.25, 0.5, 0.8]))
  semantics = str(rng.choice(["vllm", "sglang", "kvcache-sim"]))
  caps = _capacities(rng, 4, low=2.2)
  fig = _drawn(
    plots.hit_rate_figure(
      _rows(rng, ["lru"], caps),
      trace=f"/data/{name}.jsonl",
      semantics=semantics,
      warmup_fraction=warmup,
      block_size=block_size,
    )
  )
  ax, top = fig.axes
  assert ax.get_title() == name
  caption = _caption(fig)
  assert f"block size {block_size} tokens" in caption
  assert f"hits over the last {100 * (1 - warmup):g}% of requests" in caption
  assert f"{semantics} semantics" in caption
  # The top axis reads the same capacities in tokens.
  assert top.get_xlabel() == "cache capacity (tokens)"
  assert _labels(top.xaxis) == [plots.count_label(c * block_size) for c in caps]
  assert top.get_xlim() == pytest.approx(ax.get_xlim())
  titled = plots.hit_rate_figure(_rows(rng, ["lru"], caps), title="mine")
  assert titled.axes[0].get_title() == "mine"


def test_bytes_per_token_puts_gib_on_the_top_axis(rng):
  caps = _capacities(rng, 4, low=2.2)
  per_token = float(rng.choice([32_768, 131_072, 163_840]))
  rows = _rows(rng, ["lru"], caps, block_size=16)  # block size from the rows
  fig = _drawn(plots.hit_rate_figure(rows, bytes_per_token=per_token))
  ax, top = fig.axes
  assert top.get_xlabel() == "cache capacity (GiB)"
  gib = [c * 16 * per_token / 2**30 for c in caps]
  assert [float(t.replace(",", "")) for t in _labels(top.xaxis)] == (
    pytest.approx(gib, rel=5e-3)
  )
  assert "block size 16 tokens" in _caption(fig)
  with pytest.raises(ValueError, match="bytes_per_token needs a block_size"):
    plots.hit_rate_figure(_rows(rng, ["lru"], caps), bytes_per_token=1.0)


def test_without_block_size_there_is_no_token_axis_nor_caption(rng):
  fig = plots.hit_rate_figure(_rows(rng, ["lru"], _capacities(rng, 3)))
  assert len(fig.axes) == 1 and not fig.texts


def _png_chunks(data):
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  pos, chunks = 8, {}
  while pos < len(data):
    (size,) = struct.unpack(">I", data[pos : pos + 4])
    kind = data[pos + 4 : pos + 8]
    chunks.setdefault(kind, data[pos + 8 : pos + 8 + size])
    pos += 12 + size
  return chunks


@pytest.mark.parametrize("figsize", [plots.FIGSIZE, (3.5, 2.6)])
def test_png_is_300_dpi(tmp_path, rng, figsize):
  path = tmp_path / "hits.png"
  rows = _rows(rng, ["lru", "fifo"], _capacities(rng, 5), block_size=16)
  written = plots.plot_hit_rates(rows, path, figsize=figsize)
  assert written == [str(path)]
  chunks = _png_chunks(path.read_bytes())
  width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
  assert (width, height) == (round(figsize[0] * 300), round(figsize[1] * 300))
  x, y, unit = struct.unpack(">IIB", chunks[b"pHYs"])
  assert unit == 1 and x == y == round(300 / 0.0254)


def test_vector_formats_from_the_extension_and_also(tmp_path, rng):
  rows = _rows(rng, ["lru"], _capacities(rng, 4))
  png = tmp_path / "hits.png"
  written = plots.plot_hit_rates(rows, str(png), also=("pdf", ".svg"))
  assert written == [
    str(png),
    str(png.with_suffix(".pdf")),
    str(png.with_suffix(".svg")),
  ]
  assert png.with_suffix(".pdf").read_bytes().startswith(b"%PDF")
  assert b"<svg" in png.with_suffix(".svg").read_bytes()[:1_000]
  pdf = tmp_path / "only.pdf"
  assert plots.plot_hit_rates(rows, pdf) == [str(pdf)]
  assert pdf.read_bytes().startswith(b"%PDF")


def test_an_unknown_format_writes_nothing(tmp_path, rng):
  rows = _rows(rng, ["lru"], _capacities(rng, 3))
  png = tmp_path / "hits.png"
  with pytest.raises(ValueError, match="unknown figure format 'xyz'"):
    plots.plot_hit_rates(rows, png, also=("xyz",))
  assert not png.exists()


@pytest.mark.parametrize(
  "modes, ceiling, note",
  [
    ("measured", None, "no hits: the trace shares no prefix"),
    ("underfilled", None, "every point underfilled"),
    ("measured", 0.3, "no hits at these capacities"),
  ],
)
def test_an_all_zero_trace_says_why_it_is_flat(rng, modes, ceiling, note):
  caps = _capacities(rng, int(rng.integers(2, 6)))
  rows = [
    dict(policy=p, capacity_blocks=c, hit_rate=0.0, mode=modes)
    for p in ("lru", "fifo")
    for c in caps
  ]
  fig = _drawn(plots.hit_rate_figure(rows, ceiling=ceiling))
  ax = fig.axes[0]
  assert note in [t.get_text() for t in ax.texts]
  top = 1.0 if ceiling is None else 1.15 * 100 * ceiling
  assert ax.get_ylim() == pytest.approx((0.0, top))
  if modes == "measured":
    assert all(set(ln.get_ydata()) <= {0.0} for ln in ax.lines[:2])


def test_a_trace_with_hits_has_no_note(rng):
  fig = plots.hit_rate_figure(_rows(rng, ["lru"], _capacities(rng, 3)))
  assert not fig.axes[0].texts


def test_hit_rate_and_fragmentation_against_block_size(tmp_path, rng):
  sizes = sorted(
    rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256], size=5, replace=False)
  )
  sizes = [int(s) for s in sizes]
  k = int(rng.integers(1, 4))
  policies = [f"p{i}" for i in range(k)]
  mean_tokens = float(rng.uniform(200, 2_000))
  rows = [
    dict(
      policy=p,
      block_size=b,
      hit_rate=float(0.5 - 0.02 * i - 0.01 * b**0.5),
      fragmentation=b / 2 / mean_tokens,
      mode="measured",
    )
    for i, p in enumerate(policies)
    for b in sizes
  ]
  fig = _drawn(
    plots.block_size_figure(rows, trace="t.jsonl", semantics="sglang")
  )
  ax, right = fig.axes
  assert ax.get_xlabel() == "block size (tokens)"
  assert ax.get_ylabel() == "token hit rate (%)"
  assert right.get_ylabel() == "internal fragmentation (%)"
  assert ax.get_xscale() == "log"
  labels = _labels(ax.xaxis)
  assert labels == [str(s) for s in sizes]
  assert _legend_texts(ax) == policies + ["internal fragmentation"]
  handles = ax.get_legend().legend_handles
  assert len({h.get_marker() for h in handles}) == k + 1
  (frag,) = right.lines
  assert list(frag.get_ydata()) == pytest.approx(
    [100 * b / 2 / mean_tokens for b in sizes]
  )
  assert "sglang semantics" in _caption(fig)
  path = tmp_path / "block.png"
  assert plots.plot_hit_rate_vs_block_size(rows, path, also=("pdf",)) == [
    str(path),
    str(path.with_suffix(".pdf")),
  ]
  assert path.with_suffix(".pdf").read_bytes().startswith(b"%PDF")


def test_block_size_figure_without_fragmentation_has_one_axis(rng):
  rows = [dict(block_size=b, hit_rate=float(rng.uniform())) for b in (8, 16)]
  fig = plots.block_size_figure(rows)
  assert len(fig.axes) == 1
  assert _legend_texts(fig.axes[0]) == ["hit rate"]


def test_the_old_call_still_works(tmp_path):
  # As the CLI, experiments/serving_semantics.py and the notebook call it.
  rows = [
    dict(policy=p, capacity_blocks=c, hit_rate=r, mode=m)
    for p, c, r, m in [
      ("fifo", 10, 0.1, "underfilled"),
      ("fifo", 100, 0.3, "measured"),
      ("lru_leaf", 10, 0.2, "measured"),
      ("lru_leaf", 100, 0.4, "measured"),
      ("belady_leaf", 10, 0.0, "underfilled"),  # no measured point at all
    ]
  ]
  path = tmp_path / "hits.png"
  assert plots.plot_hit_rates(rows, str(path), title="t", ceiling=0.5) == [
    str(path)
  ]
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  fig = plots.hit_rate_figure(rows, title="t", ceiling=0.5)
  assert fig.axes[0].get_title() == "t"
  assert _legend_texts(fig.axes[0]) == [
    "fifo",
    "lru_leaf",
    "belady_leaf",
    "underfilled (reported 0)",
    "unbounded cache 50.0%",
  ]


def test_no_rows_is_an_error():
  with pytest.raises(ValueError, match="no rows"):
    plots.hit_rate_figure([])


def _scheduler_rows(rng, schedulers, rates, seeds):
  """One row per (scheduler, rate, seed), shuffled, with random metrics."""
  rows = [
    dict(
      scheduler=s,
      rate=r,
      seed=seed,
      num_blocks=int(rng.integers(100, 1_000)),  # a key to ignore
      ttft_s_p99=float(rng.uniform(0.05, 3.0)),
      throughput_tokens_per_s=float(rng.uniform(500, 30_000)),
      ttft_steps_p99=float(rng.uniform(5, 500)),
      throughput_tokens_per_step=float(rng.uniform(1, 20)),
    )
    for s in schedulers
    for r in rates
    for seed in range(seeds)
  ]
  return [rows[i] for i in rng.permutation(len(rows))]


def _points(ax):
  """(x, y, low, high) of every marker drawn, one list per series."""
  series = []
  for container in ax.containers:
    line, _, (bars,) = container.lines
    spans = [(seg[0][1], seg[1][1]) for seg in bars.get_segments()]
    series.append(
      [
        (x, y, min(span), max(span))
        for x, y, span in zip(
          line.get_xdata(), line.get_ydata(), spans, strict=True
        )
      ]
    )
  return series


def test_scheduler_markers_are_the_mean_and_bars_the_min_and_max(rng):
  import numpy as np

  schedulers = [f"sched{i}" for i in rng.permutation(int(rng.integers(2, 6)))]
  rates = [int(r) for r in rng.choice(64, int(rng.integers(2, 5)), False) + 1]
  rows = _scheduler_rows(rng, schedulers, rates, int(rng.integers(2, 5)))
  # Some runs finished no request (no TTFT in either unit); one (scheduler,
  # rate) has no TTFT at all.
  gone = (str(rng.choice(schedulers)), int(rng.choice(rates)))
  for r in rows:
    if (r["scheduler"], r["rate"]) == gone or (
      r["seed"] > 0 and rng.uniform() < 0.3
    ):
      r["ttft_s_p99"] = r["ttft_steps_p99"] = None
  order = list(dict.fromkeys(r["scheduler"] for r in rows))
  fig = _drawn(plots.scheduler_figure(rows, series="rate"))
  left, right = fig.axes
  assert [t.get_text() for t in left.get_xticklabels()] == order
  assert _legend_texts(right) == [f"rate = {r}" for r in sorted(rates)]
  handles = right.get_legend().legend_handles
  assert len({h.get_marker() for h in handles}) == len(rates)
  assert len({h.get_color() for h in handles}) == len(rates)
  for ax, key in ((left, "ttft_s_p99"), (right, "throughput_tokens_per_s")):
    drawn = _points(ax)
    assert len(drawn) == len(rates)
    offsets = []
    for rate, points in zip(sorted(rates), drawn, strict=True):
      expected = {}
      for i, s in enumerate(order):
        ys = [
          r[key]
          for r in rows
          if r["scheduler"] == s and r["rate"] == rate and r[key] is not None
        ]
        if ys:
          expected[i] = (np.mean(ys), np.min(ys), np.max(ys))
      got = {round(x): (y, lo, hi) for x, y, lo, hi in points}
      assert sorted(got) == sorted(expected)
      for i, values in expected.items():
        assert got[i] == pytest.approx(values)
      # Each series sits a little beside the scheduler, the same for all.
      shifts = {round(x - round(x), 9) for x, *_ in points}
      assert len(shifts) == 1 and abs(shifts.pop()) < 0.4
      offsets.append(points[0][0] - round(points[0][0]))
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > max(
      hi for points in drawn for *_, hi in points
    )
  assert "mean of" in _caption(fig) and "min to max" in _caption(fig)


@pytest.mark.parametrize("clock", ["none", "all", "one_row_missing"])
def test_schedulers_without_a_clock_are_drawn_in_steps(rng, clock):
  schedulers = [f"s{i}" for i in range(int(rng.integers(1, 4)))]
  rows = _scheduler_rows(rng, schedulers, [1], 1)
  if clock == "none":
    for r in rows:
      r["ttft_s_p99"] = r["throughput_tokens_per_s"] = None
  elif clock == "one_row_missing":
    r = rows[int(rng.integers(len(rows)))]
    r["ttft_s_p99"] = r["throughput_tokens_per_s"] = None
  fig = plots.scheduler_figure(rows)
  left, right = fig.axes
  unit = "s" if clock == "all" else "steps"
  assert left.get_ylabel() == f"TTFT p99 ({unit})"
  assert right.get_ylabel() == "throughput (output tokens/{})".format(
    "s" if clock == "all" else "step"
  )
  keys = (
    ("ttft_s_p99", "throughput_tokens_per_s")
    if clock == "all"
    else ("ttft_steps_p99", "throughput_tokens_per_step")
  )
  for ax, key in zip((left, right), keys, strict=True):
    (points,) = _points(ax)  # one series: no series key given
    assert [y for _, y, *_ in points] == pytest.approx([r[key] for r in rows])
  assert right.get_legend() is None
  assert ("scheduler steps" in _caption(fig)) == (clock != "all")


def test_a_run_with_no_finished_request_keeps_the_seconds(rng):
  rows = _scheduler_rows(rng, ["fcfs", "sjf"], [1], 2)
  rows[0]["ttft_s_p99"] = rows[0]["ttft_steps_p99"] = None
  left, right = plots.scheduler_figure(rows).axes
  assert left.get_ylabel() == "TTFT p99 (s)"
  assert sum(len(p) for p in _points(left)) == 2  # two schedulers, pooled


def test_a_panel_without_data_says_so(rng):
  rows = _scheduler_rows(rng, ["fcfs", "sjf"], [1, 2], 2)
  for r in rows:
    r["throughput_tokens_per_s"] = r["throughput_tokens_per_step"] = None
  left, right = plots.scheduler_figure(rows, series="rate").axes
  assert [t.get_text() for t in right.texts] == ["no data"]
  assert not right.containers and not left.texts
  assert len(_points(left)) == 2


@pytest.mark.parametrize("count, figsize", [(6, (6, 3)), (12, (8, 4.5))])
def test_long_scheduler_names_are_tilted_so_they_do_not_touch(
  rng, count, figsize
):
  import math

  names = [f"scheduler_with_a_long_name_{i}" for i in range(count)]
  rows = _scheduler_rows(rng, names, [1], 1)
  long = [r["scheduler"] for r in rows]  # first-appearance order
  fig = _drawn(plots.scheduler_figure(rows, figsize=figsize))
  for ax in fig.axes:
    shown = ax.get_xticklabels()
    assert [t.get_text() for t in shown] == long
    (angle,) = {t.get_rotation() for t in shown}
    assert 30 <= angle <= 90
    # Slanted labels are parallel lines, (tick spacing) * sin(angle) apart:
    # more than a line of text.
    xs = ax.transData.transform([(x, 0) for x in ax.get_xticks()])[:, 0]
    spacing = min(b - a for a, b in zip(xs[:-1], xs[1:], strict=True))
    height = shown[0].get_fontsize() * fig.dpi / 72
    assert spacing * math.sin(math.radians(angle)) > 1.2 * height
    # The y label, on two lines if need be, stays inside the figure.
    box = ax.yaxis.label.get_window_extent()
    assert 0 <= box.y0 and box.y1 <= fig.bbox.height
  short = _drawn(
    plots.scheduler_figure(_scheduler_rows(rng, ["fcfs", "sjf"], [1], 1))
  )
  assert {t.get_rotation() for t in short.axes[0].get_xticklabels()} == {0}


def test_scheduler_title_is_the_trace_stem(rng):
  name = f"trace{int(rng.integers(1_000))}"
  rows = _scheduler_rows(rng, ["fcfs"], [1], 1)
  fig = plots.scheduler_figure(rows, trace=f"/data/{name}.jsonl.gz")
  assert fig.get_suptitle() == name
  assert (
    plots.scheduler_figure(rows, trace="t.jsonl", title="").get_suptitle() == ""
  )
  assert plots.scheduler_figure(rows, title="mine").get_suptitle() == "mine"


def test_plot_schedulers_writes_png_and_pdf(tmp_path, rng):
  rows = _scheduler_rows(rng, ["fcfs", "sjf", "lpm"], [2, 8], 3)
  path = tmp_path / "schedulers.png"
  written = plots.plot_schedulers(
    rows, path, series="rate", trace="mooncake.jsonl", also=("pdf",)
  )
  assert written == [str(path), str(path.with_suffix(".pdf"))]
  pdf = path.with_suffix(".pdf").read_bytes()
  assert pdf.startswith(b"%PDF")
  assert len(pdf) > 10_000 and path.stat().st_size > 10_000
  chunks = _png_chunks(path.read_bytes())
  width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
  assert (width, height) == (8 * 300, round(3.6 * 300))


@pytest.mark.parametrize(
  "rows, series, match",
  [
    ([], None, "no rows"),
    (
      [dict(scheduler="fcfs"), dict(policy="lru")],
      None,
      "rows without a 'scheduler': 1",
    ),
    (
      [dict(scheduler="fcfs", rate=1), dict(scheduler="sjf")],
      "rate",
      "series 'rate': rows without that key: 1",
    ),
  ],
)
def test_scheduler_figure_rejects_bad_rows(rows, series, match):
  with pytest.raises(ValueError, match=match):
    plots.scheduler_figure(rows, series=series)
