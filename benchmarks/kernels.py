"""Benchmark of the pallas_kernels package: correctness, then speed.

Run ``python benchmarks/kernels.py`` on an accelerator (full sizes) or
anywhere with ``--tiny``; on a CPU it always runs tiny sizes, times the
reference variant (the one ``backend=None`` picks there) and says so, and
additionally checks both Pallas variants in interpret mode.

What it does:

1. Correctness at the chosen size: every kernel through the dispatcher's
   default backend against the plain-jnp reference (bf16 tolerance 2e-2;
   copies must be exact).
2. HBM bandwidth: a large device-to-device copy (``-x`` over a 2 GiB
   buffer; reads and writes counted).
3. Timing: each kernel is jitted (so the wrappers' host-side checks are out
   of the loop); ``--reps`` repetitions of ``--inner`` back-to-back calls,
   median per call. Inputs rotate over ``--rotate`` copies (different q,
   permuted page ids over a pool larger than L2) so caches are not reused.
   Pool-updating kernels donate and thread their pools, so no pool copy is
   timed.
4. Bytes model (unique pages counted once): decode reads K and V of every
   page the requests touch, plus q and o; shared-prefix counts each group's
   prefix pages once; prefill counts each sequence's pages once (tile
   re-reads not counted: the figure is a lower bound on traffic); write_kv
   and copy_blocks count what they read and write. Achieved GB/s = bytes /
   time, and the fraction of the measured HBM bandwidth.
5. Ratios: shared-prefix vs naive paged decode over the concatenated tables
   (B=64 sharing P=4096, S=256, GQA 4:1; the bytes ratio is 13.6x), and
   paged decode vs JAX's own Pallas paged attention for the platform (64
   requests x 4K tokens), plus a group-size sweep that the shared-prefix
   dispatch rule should follow.

Prints a compact table at the end; ``--json OUT`` writes the rows too.
``--gpu-variant mosaic`` times the Mosaic GPU port of the attention kernels
instead of the Triton-style variants (``pallas_kernels.set_gpu_variant``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk

FULL = {
  "batch": 64,
  "context": 4096,
  "num_q_heads": 32,
  "num_kv_heads": 8,
  "head_dim": 128,
  "page_size": 16,
  "prefix": 4096,
  "suffix": 256,
  "prefill_seqs": 8,
  "prefill_new": 512,
  "prefill_cached": 1536,
  "copies": 1024,
  "dtype": "bfloat16",
}
TINY = {
  "batch": 4,
  "context": 64,
  "num_q_heads": 4,
  "num_kv_heads": 1,
  "head_dim": 32,
  "page_size": 8,
  "prefix": 32,
  "suffix": 16,
  "prefill_seqs": 2,
  "prefill_new": 8,
  "prefill_cached": 8,
  "copies": 4,
  "dtype": "float32",
}


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="tiny sizes")
  parser.add_argument(
    "--backend",
    default=None,
    choices=[None, *pk.BACKENDS],
    help="variant to time (default: the dispatcher's choice)",
  )
  parser.add_argument(
    "--gpu-variant",
    default=None,
    choices=pk.GPU_VARIANTS,
    help="implementation of backend='pallas_gpu' (default: "
    "PALLAS_KERNELS_GPU_VARIANT, else triton); mosaic serves the attention "
    "kernels through Mosaic GPU",
  )
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--inner", type=int, default=None)
  parser.add_argument("--rotate", type=int, default=4)
  parser.add_argument("--json", default=None, help="write rows to this file")
  return parser.parse_args(argv)


# --- inputs ------------------------------------------------------------------


def pool(key, num_pages, cfg):
  dtype = jnp.dtype(cfg["dtype"])
  shape = (cfg["num_kv_heads"], num_pages, cfg["page_size"], cfg["head_dim"])
  k_key, v_key = jax.random.split(key)
  return (
    jax.random.normal(k_key, shape, jnp.float32).astype(dtype),
    jax.random.normal(v_key, shape, jnp.float32).astype(dtype),
  )


def queries(key, rows, cfg):
  shape = (rows, cfg["num_q_heads"], cfg["head_dim"])
  return jax.random.normal(key, shape, jnp.float32).astype(cfg["dtype"])


def page_ids(key, num, num_pages):
  """``num`` distinct page ids in ``[1, num_pages)``, shuffled."""
  perm = jax.random.permutation(key, jnp.arange(1, num_pages, dtype=jnp.int32))
  return perm[:num]


def page_bytes(cfg):
  item = jnp.dtype(cfg["dtype"]).itemsize
  return 2 * cfg["num_kv_heads"] * cfg["page_size"] * cfg["head_dim"] * item


def qo_bytes(rows, cfg):
  item = jnp.dtype(cfg["dtype"]).itemsize
  return 2 * rows * cfg["num_q_heads"] * cfg["head_dim"] * item


# --- timing ------------------------------------------------------------------


def time_call(fn, arg_sets, reps, inner, thread=None):
  """Median seconds per call; ``thread(out, args) -> args`` feeds outputs."""
  args = arg_sets[0]
  out = fn(*args)
  jax.block_until_ready(out)
  if thread is not None:
    args = thread(out, args)
  samples = []
  for rep in range(reps):
    start = time.perf_counter()
    for i in range(inner):
      if thread is None:
        args = arg_sets[(rep * inner + i) % len(arg_sets)]
      out = fn(*args)
      if thread is not None:
        args = thread(out, args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / inner)
  return statistics.median(samples)


def hbm_bandwidth(tiny, reps):
  """Bytes/s of a large device-to-device copy (``-x``: read + write)."""
  num = (1 << 20) if tiny else (1 << 29)  # 4 MiB or 2 GiB of float32.
  x = jnp.ones((num,), jnp.float32)
  negate = jax.jit(lambda x: -x)
  seconds = time_call(negate, [(x,)], reps, 3)
  return 2 * 4 * num / seconds


# --- checks ------------------------------------------------------------------


def max_diff(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.max(jnp.abs(a - b)))


def check(name, got, want, tol, failures):
  diff = max_diff(got, want)
  ok = diff <= tol and not bool(jnp.isnan(jnp.asarray(got, jnp.float32)).any())
  print(f"  check {name:<32} max|diff|={diff:.2e} (tol {tol:.0e})", end="")
  print(" ok" if ok else " FAIL")
  if not ok:
    failures.append(name)


# --- cases -------------------------------------------------------------------


def decode_inputs(key, cfg, batch, context):
  pages_per_seq = -(-context // cfg["page_size"])
  num_pages = batch * pages_per_seq + 1
  keys = jax.random.split(key, 3)
  k_pages, v_pages = pool(keys[0], num_pages, cfg)
  tables = page_ids(keys[1], batch * pages_per_seq, num_pages)
  tables = tables.reshape(batch, pages_per_seq)
  lengths = jnp.full((batch,), context, jnp.int32)
  q = queries(keys[2], batch, cfg)
  return q, k_pages, v_pages, tables, lengths


def shared_inputs(key, cfg):
  page_size = cfg["page_size"]
  batch = cfg["batch"]
  prefix_pages = cfg["prefix"] // page_size
  suffix_pages = -(-cfg["suffix"] // page_size)
  num_pages = prefix_pages + batch * suffix_pages + 1
  keys = jax.random.split(key, 3)
  k_pages, v_pages = pool(keys[0], num_pages, cfg)
  ids = page_ids(keys[1], num_pages - 1, num_pages)
  prefix_tables = ids[:prefix_pages][None, :]
  suffix_tables = ids[prefix_pages:].reshape(batch, suffix_pages)
  args = (
    queries(keys[2], batch, cfg),
    k_pages,
    v_pages,
    prefix_tables,
    jnp.array([cfg["prefix"]], jnp.int32),
    jnp.zeros((batch,), jnp.int32),
    suffix_tables,
    jnp.full((batch,), cfg["suffix"], jnp.int32),
  )
  tables, lengths = pk.concat_block_tables(*args[3:], page_size=page_size)
  naive = (args[0], k_pages, v_pages, tables, lengths)
  return args, naive


def prefill_inputs(key, cfg):
  seqs, new = cfg["prefill_seqs"], cfg["prefill_new"]
  context = new + cfg["prefill_cached"]
  _, k_pages, v_pages, tables, lengths = decode_inputs(key, cfg, seqs, context)
  cu = jnp.arange(seqs + 1, dtype=jnp.int32) * new
  q = queries(jax.random.fold_in(key, 1), seqs * new, cfg)
  return q, k_pages, v_pages, tables, lengths, cu


def rotations(make, key, count):
  return [make(jax.random.fold_in(key, i)) for i in range(count)]


def main(argv=None):
  args = parse_args(argv)
  platform = jax.default_backend()
  on_accelerator = platform in ("gpu", "tpu")
  tiny = args.tiny or not on_accelerator
  cfg = TINY if tiny else FULL
  reps = args.reps or (3 if tiny else 20)
  inner = args.inner or (2 if tiny else 10)
  rotate = 1 if tiny else args.rotate
  if args.gpu_variant is not None:
    pk.set_gpu_variant(args.gpu_variant)
  backend, interpret = pk.resolve_backend(
    args.backend, False, kernel="benchmark"
  )
  device = jax.devices()[0]
  print(f"jax {jax.__version__}, device {device.device_kind} ({platform})")
  if not on_accelerator:
    print(
      "No accelerator: tiny sizes only, timing the reference variant; "
      "these numbers say nothing about kernel speed."
    )
  print(
    f"backend={backend} (GPU variant {pk.current_gpu_variant()}), "
    f"sizes={'tiny' if tiny else 'full'}: {cfg}"
  )
  call = functools.partial(dict, backend=backend, interpret=interpret)
  key = jax.random.key(0)
  failures = []
  tol = 2e-2 if cfg["dtype"] == "bfloat16" else 2e-5

  # 1. Correctness at this size.
  print("correctness:")
  decode = decode_inputs(key, cfg, cfg["batch"], cfg["context"])
  check(
    "paged_attention",
    pk.paged_attention(*decode, **call()),
    pk.paged_attention(*decode, backend="reference"),
    tol,
    failures,
  )
  shared, naive = shared_inputs(key, cfg)
  check(
    "shared_prefix_attention",
    pk.shared_prefix_attention(*shared, **call()),
    pk.paged_attention(*naive, backend="reference"),
    tol,
    failures,
  )
  prefill = prefill_inputs(key, cfg)
  check(
    "prefill_attention",
    pk.prefill_attention(*prefill, **call()),
    pk.prefill_attention(*prefill, backend="reference"),
    tol,
    failures,
  )
  o_a, lse_a = pk.paged_attention(*decode, return_lse=True, **call())
  o_b, lse_b = pk.paged_attention(*naive, return_lse=True, **call())
  check(
    "merge_attention_states",
    pk.merge_attention_states(o_a, lse_a, o_b, lse_b, **call())[0],
    pk.merge_attention_states(o_a, lse_a, o_b, lse_b, backend="reference")[0],
    tol,
    failures,
  )
  num_pages = decode[1].shape[1]
  slots = page_ids(key, cfg["batch"], num_pages * cfg["page_size"])
  new = jnp.zeros((cfg["batch"], cfg["num_kv_heads"], cfg["head_dim"]))
  new = new.astype(cfg["dtype"])
  write_args = (decode[1], decode[2], new, new, slots)
  check(
    "write_kv",
    pk.write_kv(*write_args, **call())[0],
    pk.write_kv(*write_args, backend="reference")[0],
    0.0,
    failures,
  )
  ids = page_ids(key, 2 * cfg["copies"], num_pages)
  copy_args = (decode[1], decode[2], ids[: cfg["copies"]], ids[cfg["copies"] :])
  check(
    "copy_blocks",
    pk.copy_blocks(*copy_args, **call())[0],
    pk.copy_blocks(*copy_args, backend="reference")[0],
    0.0,
    failures,
  )
  if not on_accelerator:
    for variant in ("pallas_tpu", "pallas_gpu"):
      check(
        f"paged_attention[{variant}, interpret]",
        pk.paged_attention(*decode, backend=variant, interpret=True),
        pk.paged_attention(*decode, backend="reference"),
        tol,
        failures,
      )
      check(
        f"shared_prefix[{variant}, interpret]",
        pk.shared_prefix_attention(*shared, backend=variant, interpret=True),
        pk.paged_attention(*naive, backend="reference"),
        tol,
        failures,
      )

  # 2. HBM bandwidth.
  bandwidth = hbm_bandwidth(tiny, reps)
  print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s")

  # 3./4. Timing with the bytes model.
  rows = []

  def record(name, seconds, nbytes, note=""):
    rows.append(
      {
        "kernel": name,
        "us": seconds * 1e6,
        "bytes": nbytes,
        "GB/s": nbytes / seconds / 1e9,
        "frac_hbm": nbytes / seconds / bandwidth,
        "note": note,
      }
    )

  paged_fn = jax.jit(functools.partial(pk.paged_attention, **call()))
  decode_sets = rotations(
    lambda k: decode_inputs(k, cfg, cfg["batch"], cfg["context"]), key, rotate
  )
  pages_read = cfg["batch"] * -(-cfg["context"] // cfg["page_size"])
  decode_bytes = pages_read * page_bytes(cfg) + qo_bytes(cfg["batch"], cfg)
  paged_s = time_call(paged_fn, decode_sets, reps, inner)
  record(
    "paged_attention",
    paged_s,
    decode_bytes,
    f"B={cfg['batch']} x {cfg['context']} tokens",
  )

  shared_sets = rotations(lambda k: shared_inputs(k, cfg), key, rotate)
  shared_fn = jax.jit(
    functools.partial(
      pk.shared_prefix_attention, max_group_size=cfg["batch"], **call()
    )
  )
  shared_s = time_call(shared_fn, [s for s, _ in shared_sets], reps, inner)
  unique_pages = cfg["prefix"] // cfg["page_size"] + cfg["batch"] * -(
    -cfg["suffix"] // cfg["page_size"]
  )
  record(
    "shared_prefix_attention",
    shared_s,
    unique_pages * page_bytes(cfg) + qo_bytes(cfg["batch"], cfg),
    f"1 group of {cfg['batch']}, P={cfg['prefix']}, S={cfg['suffix']}",
  )
  naive_s = time_call(paged_fn, [n for _, n in shared_sets], reps, inner)
  naive_pages = cfg["batch"] * (
    (cfg["prefix"] + cfg["suffix"]) // cfg["page_size"]
  )
  record(
    "naive paged (same requests)",
    naive_s,
    naive_pages * page_bytes(cfg) + qo_bytes(cfg["batch"], cfg),
    "paged_attention on concatenated tables",
  )

  prefill_fn = jax.jit(functools.partial(pk.prefill_attention, **call()))
  prefill_sets = rotations(lambda k: prefill_inputs(k, cfg), key, rotate)
  prefill_s = time_call(prefill_fn, prefill_sets, reps, inner)
  context = cfg["prefill_new"] + cfg["prefill_cached"]
  prefill_pages = cfg["prefill_seqs"] * -(-context // cfg["page_size"])
  record(
    "prefill_attention",
    prefill_s,
    prefill_pages * page_bytes(cfg)
    + qo_bytes(cfg["prefill_seqs"] * cfg["prefill_new"], cfg),
    "unique pages once (lower bound)",
  )

  merge_fn = jax.jit(functools.partial(pk.merge_attention_states, **call()))
  merge_sets = [(o_a, lse_a, o_b, lse_b)]
  merge_s = time_call(merge_fn, merge_sets, reps, inner)
  lse_bytes = 4 * cfg["batch"] * cfg["num_q_heads"]
  record(
    "merge_attention_states",
    merge_s,
    3 * (qo_bytes(cfg["batch"], cfg) // 2 + lse_bytes),
    "small: launch-bound",
  )

  def donated(fn):
    return jax.jit(fn, donate_argnums=(0, 1))

  def thread_pools(out, args):
    return (*out, *args[2:])

  write_fn = donated(functools.partial(pk.write_kv, **call()))
  item = jnp.dtype(cfg["dtype"]).itemsize
  row_bytes = cfg["num_kv_heads"] * cfg["head_dim"] * item
  write_pools = (jnp.copy(decode[1]), jnp.copy(decode[2]))
  write_s = time_call(
    write_fn, [(*write_pools, *write_args[2:])], reps, inner, thread_pools
  )
  record("write_kv", write_s, 4 * cfg["batch"] * row_bytes, "scatter")
  copy_fn = donated(functools.partial(pk.copy_blocks, **call()))
  copy_pools = (jnp.copy(decode[1]), jnp.copy(decode[2]))
  copy_s = time_call(
    copy_fn, [(*copy_pools, *copy_args[2:])], reps, inner, thread_pools
  )
  record(
    "copy_blocks",
    copy_s,
    2 * cfg["copies"] * page_bytes(cfg),
    f"{cfg['copies']} pages",
  )

  # 5. Ratios.
  ratios = {"shared_vs_naive": naive_s / shared_s}
  jax_s = jax_paged_attention_seconds(platform, decode_sets, reps, inner)
  if jax_s is not None:
    record("jax paged_attention", jax_s, decode_bytes, "JAX's own op")
    ratios["paged_vs_jax"] = jax_s / paged_s
  sweep = group_size_sweep(cfg, key, reps, inner, call, paged_fn)

  print()
  print(f"{'kernel':<30}{'us':>12}{'GB/s':>10}{'HBM':>7}  note")
  for row in rows:
    print(
      f"{row['kernel']:<30}{row['us']:>12.1f}{row['GB/s']:>10.1f}"
      f"{row['frac_hbm']:>7.0%}  {row['note']}"
    )
  bytes_ratio = naive_pages / unique_pages
  print(
    f"shared-prefix vs naive: {ratios['shared_vs_naive']:.2f}x faster "
    f"(bytes ratio {bytes_ratio:.1f}x)"
  )
  if "paged_vs_jax" in ratios:
    print(
      f"paged decode vs JAX's paged attention: {ratios['paged_vs_jax']:.2f}x"
    )
  else:
    print("paged decode vs JAX's paged attention: n/a on this platform")
  print("group-size sweep (shared / naive time; < 1 means shared is faster):")
  for size, ratio in sweep.items():
    shared, _ = shared_inputs(key, dict(cfg, batch=size))
    picks = bool(
      pk.prefer_shared_prefix(
        shared[5], shared[4], shared[7], page_size=cfg["page_size"]
      )
    )
    verdict = "rule picks shared" if picks else "rule picks naive"
    if picks and ratio > 1.0 and not on_accelerator:
      verdict += "  (reference timing on CPU: not judged)"
    elif picks and ratio > 1.0:
      verdict += "  <-- RULE WRONG: shared measured slower"
      failures.append(f"prefer_shared_prefix(group of {size})")
    print(f"  group of {size:>3}: {ratio:.2f}  {verdict}")
  if failures:
    print(f"CORRECTNESS FAILURES: {failures}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "jax": jax.__version__,
          "device": device.device_kind,
          "platform": platform,
          "backend": backend,
          "gpu_variant": pk.current_gpu_variant(),
          "sizes": cfg,
          "hbm_bytes_per_s": bandwidth,
          "rows": rows,
          "ratios": ratios,
          "group_sweep": sweep,
          "failures": failures,
        },
        f,
        indent=2,
      )
  return 1 if failures else 0


def jax_paged_attention_seconds(platform, decode_sets, reps, inner):
  """JAX's own Pallas paged attention on this platform, or None."""
  try:
    if platform == "tpu":
      from jax.experimental.pallas.ops.tpu.paged_attention import (
        paged_attention,
      )

      def run(q, k, v, tables, lengths):
        scale = q.shape[-1] ** -0.5
        return paged_attention(
          q * jnp.asarray(scale, q.dtype),
          k,
          v,
          lengths,
          tables,
          pages_per_compute_block=8,
        )
    elif platform == "gpu":
      from jax.experimental.pallas.ops.gpu.paged_attention import (
        paged_attention,
      )

      def run(q, k, v, tables, lengths):
        scale = q.shape[-1] ** -0.5
        return paged_attention(
          q * jnp.asarray(scale, q.dtype), k, v, tables, lengths
        )
    else:
      return None
    return time_call(jax.jit(run), decode_sets, reps, inner)
  except Exception as error:  # noqa: BLE001 - report, do not abort.
    print(f"JAX's paged attention did not run: {error!r:.200}")
    return None


def group_size_sweep(cfg, key, reps, inner, call, paged_fn):
  """Shared/naive time ratio for groups of 1, 2, 4, ... requests."""
  results = {}
  size = 1
  while size <= cfg["batch"]:
    sub = dict(cfg, batch=size)
    shared, naive = shared_inputs(key, sub)
    fn = jax.jit(
      functools.partial(
        pk.shared_prefix_attention, max_group_size=size, **call()
      )
    )
    results[size] = time_call(fn, [shared], reps, inner) / time_call(
      paged_fn, [naive], reps, inner
    )
    size *= 4 if size < cfg["batch"] // 4 else 2
  return results


if __name__ == "__main__":
  sys.exit(main())
