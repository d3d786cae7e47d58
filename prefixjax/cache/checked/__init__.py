"""Host-checked wrappers of the cache verbs: a separate, optional layer.

The verbs of :mod:`prefixjax.cache` are pure and traceable: they run under
``jit``, ``vmap`` and ``scan``, and report failures as status values. The
functions here take the same arguments, validate the concrete ones on the
host first (types, ranks, dtypes, ranges) and raise ``TypeError`` /
``ValueError`` naming the argument and its value, then call the verb. Use
them where arguments come from a user; use the verbs inside compiled code.

Example:
  >>> from prefixjax.cache import checked, paging
  >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
  ...                 max_blocks_per_seq=3)
  >>> s, r = checked.paging.allocate(s, 0, 6)
  >>> int(r.num_new_blocks)
  2
"""

from prefixjax.cache.checked import index, paging, prefix_cache

__all__ = ["index", "paging", "prefix_cache"]
