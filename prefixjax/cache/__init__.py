"""The cache layer: paged KV-cache bookkeeping and prefix sharing, on device.

Every state here is a frozen pytree of fixed-shape arrays, and every verb is
a pure, traceable function ``state, args -> (new_state, result)``: it runs
under ``jit``, ``vmap`` and ``scan``, reports failures as a ``status`` value
and then leaves the state unchanged. These traceable verbs are the public
API; they take int32 scalars and arrays of the exact shapes their docstrings
give.

* :mod:`~prefixjax.cache.paging`: block tables, refcounts and the free
  queue (its types and verbs are also exported here).
* :mod:`~prefixjax.cache.prefix_cache`: the paging core plus an on-device
  index of block hashes (vLLM-style automatic prefix caching), with
  pluggable eviction :mod:`~prefixjax.cache.policies`.
* :mod:`~prefixjax.cache.hashing`, :mod:`~prefixjax.cache.index`,
  :mod:`~prefixjax.cache.victim_tree`: the chained block hashes, the
  on-device hash table and the victim tournament tree the prefix cache is
  built from; :mod:`~prefixjax.cache.bitmap`: hierarchical bitmaps over
  keys, for device-side replays.
* :mod:`prefixjax.cache.checked`: the host-checked layer, wrappers with the
  verbs' names that validate concrete arguments (raising ``TypeError`` /
  ``ValueError``) and convert or pad them before calling the verb. Use it
  where arguments come from a user, the verbs inside compiled code.

Nothing in this package imports :mod:`prefixjax.replay`.

Example:
  >>> from prefixjax import cache
  >>> s = cache.init_paging(num_blocks=8, block_size=4, max_seqs=2,
  ...                       max_blocks_per_seq=3)
  >>> s, r = cache.allocate(s, 0, 6)
  >>> s.block_tables[0].tolist(), cache.Status(int(r.status)).name
  ([1, 2, 0], 'OK')
"""

from prefixjax.cache import (
  bitmap,
  checked,
  hashing,
  index,
  paging,
  policies,
  prefix_cache,
  victim_tree,
)
from prefixjax.cache.paging import (
  NO_BLOCK,
  NULL_BLOCK,
  AllocateResult,
  AppendResult,
  BatchView,
  CopyResult,
  PagingState,
  ReleaseResult,
  Status,
  allocate,
  append,
  batch_view,
  check_invariants,
  copy_on_write,
  fork,
  release,
  slot_mapping,
)
from prefixjax.cache.paging import init as init_paging

__all__ = [
  "NO_BLOCK",
  "NULL_BLOCK",
  "AllocateResult",
  "AppendResult",
  "BatchView",
  "CopyResult",
  "PagingState",
  "ReleaseResult",
  "Status",
  "allocate",
  "append",
  "batch_view",
  "bitmap",
  "check_invariants",
  "checked",
  "copy_on_write",
  "fork",
  "hashing",
  "index",
  "init_paging",
  "paging",
  "policies",
  "prefix_cache",
  "release",
  "slot_mapping",
  "victim_tree",
]
