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


def _legend(fig):
  """The figure's one legend: a figure legend (wide figures) or the legend
  of one of its axes (narrow ones)."""
  legends = list(fig.legends)
  legends += [ax.get_legend() for ax in fig.axes if ax.get_legend()]
  assert len(legends) == 1, legends
  return legends[0]


def _legend_texts(fig):
  return [t.get_text() for t in _legend(fig).get_texts()]


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
    ("/d/llama-3.1-8b-300-sps10.jsonl", "llama-3.1-8b-300-sps10"),
    # A trace's name without its extension (as the CLI passes it).
    ("llama-3.1-8b-300-sps10", "llama-3.1-8b-300-sps10"),
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
  legend = _legend(fig)
  texts = _legend_texts(fig)
  assert texts == policies + ["underfilled (reported 0)"]
  series = legend.legend_handles[:k]
  assert len({h.get_marker() for h in series}) == k
  assert len({h.get_color() for h in series}) == k
  first = series[:4]
  assert len({h.get_linestyle() for h in first}) == len(first)
  # Series order fixes the style: the same rows draw the same figure.
  again = plots.hit_rate_figure(_rows(rng, policies, caps, underfilled=1))
  again_series = _legend(again).legend_handles[:k]
  assert [h.get_marker() for h in again_series] == [
    h.get_marker() for h in series
  ]


def test_equal_series_stay_visible_one_around_the_other(rng):
  """Two policies with the very same points (fifo and lru_leaf on a trace
  with little reuse): the earlier one's markers are drawn larger, so each
  point shows both."""
  caps = _capacities(rng, int(rng.integers(3, 7)))
  k = int(rng.integers(2, 5))
  same = _rows(rng, ["a"], caps)
  rows = [dict(r, policy=f"p{i}") for i in range(k) for r in same]
  fig = plots.hit_rate_figure(rows)
  lines = [h for h in _legend(fig).legend_handles if h.get_label() != ""]
  drawn = [
    line
    for line in fig.axes[0].get_lines()
    if line.get_label() in {f"p{i}" for i in range(k)}
  ]
  assert [line.get_label() for line in drawn] == [f"p{i}" for i in range(k)]
  assert all(
    (line.get_xdata() == drawn[0].get_xdata()).all()
    and (line.get_ydata() == drawn[0].get_ydata()).all()
    for line in drawn
  )
  sizes = [line.get_markersize() for line in drawn]
  assert all(a > b for a, b in zip(sizes[:-1], sizes[1:], strict=True)), sizes
  assert len(lines) >= k


def test_the_ceiling_is_a_labelled_dashed_line(rng):
  ceiling = float(rng.uniform(0.2, 0.6))
  caps = _capacities(rng, 4)
  fig = plots.hit_rate_figure(
    _rows(rng, ["lru", "fifo"], caps), ceiling=ceiling
  )
  ax = fig.axes[0]
  label = f"unbounded cache {100 * ceiling:.1f}%"
  assert label in [t.get_text() for t in ax.texts]
  assert _legend_texts(fig)[-1] == label
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
    ("measured", 0.0, "no hits: the trace shares no prefix"),
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
  if ceiling:
    # Room above the ceiling for its label (raised if the label needs it).
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1.15 * 100 * ceiling
  else:
    # Nothing to scale to: the whole 0-100% scale, not a 0-1 one.
    assert ax.get_ylim() == pytest.approx((0.0, 100.0))
    _assert_percent_ticks(ax.yaxis, up_to=100)
    # A zero ceiling is named in the legend, not written over the markers.
    assert len(ax.texts) == 1
  if modes == "measured":
    assert all(set(ln.get_ydata()) <= {0.0} for ln in ax.lines[:2])


def _assert_percent_ticks(axis, up_to):
  """The tick labels of a y axis labelled (%) read as percentages: whole
  numbers from 0 up to ``up_to`` (a 0-1 axis would read as fractions)."""
  assert axis.get_label_text().replace("\n", " ").endswith("(%)")
  shown = [
    float(t.get_text().replace("\N{MINUS SIGN}", "-"))
    for t in axis.get_ticklabels()
    if t.get_text()
  ]
  low, high = axis.axes.get_ylim()
  inside = [v for v in shown if low <= v <= high]
  assert len(inside) >= 3, shown
  assert min(inside) == 0 and max(inside) == up_to, shown
  assert all(v == round(v) for v in inside), shown


def test_an_all_zero_block_size_figure_is_in_percent_on_both_axes(rng):
  sizes = [4, 8, 16, 32]
  rows = [
    dict(policy=p, block_size=b, hit_rate=0.0, fragmentation=0.0)
    for p in ("lru", "fifo")
    for b in sizes
  ]
  fig = _drawn(plots.block_size_figure(rows))
  ax, right = fig.axes
  assert "no hits: the trace shares no prefix" in [
    t.get_text() for t in ax.texts
  ]
  for axes in (ax, right):
    assert axes.get_ylim() == pytest.approx((0.0, 100.0))
    _assert_percent_ticks(axes.yaxis, up_to=100)


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
  assert _legend_texts(fig) == policies + ["internal fragmentation"]
  handles = _legend(fig).legend_handles
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
  assert _legend_texts(fig) == ["hit rate"]


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
  assert _legend_texts(fig) == [
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
  assert _legend_texts(fig) == [f"rate = {r} req/s" for r in sorted(rates)]
  handles = _legend(fig).legend_handles
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
  assert not fig.legends and not any(a.get_legend() for a in fig.axes)
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


def _router_rows(routers):
  return [
    dict(
      router=name,
      route_mode=mode,
      token_hit_rate=0.3 + 0.05 * i + (0.01 if mode == "exact" else 0.0),
      imbalance=1.1 + 0.1 * i,
    )
    for i, name in enumerate(routers)
    for mode in ("exact", "approximate")
  ]


def _block_size_rows(policies, sizes, cache_tokens):
  return [
    dict(
      policy=p,
      block_size=b,
      capacity_blocks=cache_tokens // b,
      hit_rate=0.5 - 0.05 * i - 0.01 * b**0.5,
      fragmentation=b / 900,
      mode="measured",
    )
    for i, p in enumerate(policies)
    for b in sizes
  ]


def _figure(kind, figsize, rng):
  """A figure of each kind, with a legend (the twin-axis kinds have their
  twin: the top token axis, the right fragmentation axis)."""
  policies = ["fifo", "lru_leaf", "belady_leaf"]
  if kind == "hit_rate":
    rows = _rows(rng, policies, _capacities(rng, 5, low=2.2), block_size=16)
    return plots.hit_rate_figure(
      rows,
      ceiling=0.45,
      trace="trace.jsonl",
      semantics="kvcache-sim",
      warmup_fraction=0.25,
      figsize=figsize,
    )
  if kind == "hit_rate_zero":
    rows = [
      dict(r, hit_rate=0.0)
      for r in _rows(rng, policies, _capacities(rng, 4), block_size=16)
    ]
    return plots.hit_rate_figure(
      rows, ceiling=0.0, trace="azure.csv", figsize=figsize
    )
  if kind == "hit_rate_underfilled":
    rows = [
      dict(r, hit_rate=0.0, mode="underfilled")
      for r in _rows(rng, policies, _capacities(rng, 2), block_size=16)
    ]
    return plots.hit_rate_figure(
      rows,
      ceiling=0.45,
      trace="trace.jsonl",
      semantics="kvcache-sim",
      warmup_fraction=0.0,
      figsize=figsize,
    )
  if kind == "block_size":
    rows = _block_size_rows(policies, [4, 8, 16, 32, 64], 8192)
    return plots.block_size_figure(
      rows,
      trace="trace.jsonl",
      semantics="kvcache-sim",
      warmup_fraction=0.25,
      figsize=figsize,
    )
  if kind == "schedulers":
    rows = _scheduler_rows(rng, ["fcfs", "lpm", "dfs", "fair"], [8, 32], 2)
    return plots.scheduler_figure(
      rows, series="rate", trace="t.jsonl", figsize=figsize
    )
  if kind == "schedulers_long_names":
    names = [f"scheduler_with_a_long_name_{i}" for i in range(6)]
    rows = _scheduler_rows(rng, names, [8, 32], 1)
    return plots.scheduler_figure(rows, series="rate", figsize=figsize)
  assert kind == "routers"
  rows = _router_rows(["round_robin", "cache_aware", "e2", "llm_d"])
  return plots.router_figure(rows, trace="t.jsonl", figsize=figsize)


def _intersect(a, b, tolerance=0.5):
  """Whether two window extents share more than a hairline."""
  return (
    min(a.x1, b.x1) - max(a.x0, b.x0) > tolerance
    and min(a.y1, b.y1) - max(a.y0, b.y0) > tolerance
  )


def _decorations(fig):
  """``(what, window extent)`` of everything the legend must not cover:
  each axes' plot area, its x and y axis (tick labels and axis label, of
  twin axes too), its title, the figure's title and caption."""
  out = []
  for i, ax in enumerate(fig.axes):
    out.append((f"axes {i} plot area", ax.bbox))
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
      box = axis.get_tightbbox()
      if box is not None and box.width > 0 and box.height > 0:
        out.append((f"axes {i} {name} axis ({axis.get_label_text()})", box))
    if ax.title.get_text():
      out.append((f"axes {i} title", ax.title.get_window_extent()))
  for text in fig.texts:
    out.append(
      (f"figure text {text.get_text()[:30]!r}", text.get_window_extent())
    )
  if fig._suptitle is not None and fig._suptitle.get_text():
    out.append(("suptitle", fig._suptitle.get_window_extent()))
  return out


KINDS = [
  "hit_rate",
  "hit_rate_zero",
  "hit_rate_underfilled",
  "block_size",
  "schedulers",
  "schedulers_long_names",
  "routers",
]


@pytest.mark.parametrize("figsize", ["wide", "narrow"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_legend_covers_no_axis_label_tick_label_or_caption(
  rng, kind, figsize
):
  size = {
    "wide": plots.SCHEDULER_FIGSIZE if "schedulers" in kind else plots.FIGSIZE,
    "narrow": (4.5, 3.6) if "schedulers" in kind else (3.5, 2.8),
  }[figsize]
  fig = _drawn(_figure(kind, size, rng))
  legend = _legend(fig).get_window_extent()
  for what, box in _decorations(fig):
    assert not _intersect(legend, box), f"the legend covers the {what}"
  # Nothing collapses the plot (a collapsed one is a few points high).
  share = 0.3 if figsize == "wide" else 0.12
  assert fig.axes[0].bbox.height > share * fig.bbox.height
  # Nothing is cut off at the figure's edges.
  for what, box in [("legend", legend), *_decorations(fig)]:
    assert box.x0 >= -1 and box.y0 >= -1, what
    assert box.x1 <= fig.bbox.x1 + 1 and box.y1 <= fig.bbox.y1 + 1, what


@pytest.mark.parametrize("figsize", [plots.FIGSIZE, (3.5, 2.8)])
def test_the_legend_clears_the_right_fragmentation_axis(figsize):
  rows = _block_size_rows(["fifo", "lru_leaf"], [16, 32], 2048)
  fig = _drawn(plots.block_size_figure(rows, figsize=figsize))
  ax, right = fig.axes
  legend = _legend(fig).get_window_extent()
  labels = [t for t in right.yaxis.get_ticklabels() if t.get_text()]
  assert len(labels) >= 3
  for text in [*labels, right.yaxis.label]:
    box = text.get_window_extent()
    assert not _intersect(legend, box), text.get_text()
  # On two lines where the axes is too short for one.
  label = right.get_ylabel().replace("\n", " ")
  assert label == "internal fragmentation (%)"


def test_the_block_size_figure_names_its_cache_size(rng):
  tokens = int(rng.choice([1024, 2048, 8192]))
  rows = _block_size_rows(["fifo"], [4, 8, 16], tokens)
  caption = _caption(plots.block_size_figure(rows))
  blocks = f"({tokens // 16:,} to {tokens // 4:,} blocks)"
  assert f"cache of {tokens:,} tokens at every block size {blocks}" in caption
  # Rows without capacities: the caller says the size.
  bare = [{k: v for k, v in r.items() if k != "capacity_blocks"} for r in rows]
  assert "cache of" not in _caption(plots.block_size_figure(bare))
  named = plots.block_size_figure(bare, cache_tokens=tokens)
  assert f"cache of {tokens:,} tokens at every block size" in _caption(named)
  # The same number of blocks at every size: the caption says blocks.
  same = [dict(r, capacity_blocks=64) for r in bare]
  assert "cache of 64 blocks at every block size" in _caption(
    plots.block_size_figure(same)
  )
