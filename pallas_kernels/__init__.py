"""Paged-KV attention kernels for prefixjax: reference, TPU and GPU Pallas.

Six public kernels take arrays, not cache state:

* :func:`paged_attention`: decode attention over block tables (with LSE).
* :func:`shared_prefix_attention`: decode where groups share prefix pages,
  each prefix page read once per group.
* :func:`merge_attention_states`: exact log-sum-exp merge of partials.
* :func:`prefill_attention`: ragged chunked causal prefill over cached pages.
* :func:`write_kv`: scatter new K/V rows into their slots.
* :func:`copy_blocks`: whole-page copies (copy-on-write).

Pages are ``[num_kv_heads, num_pages, page_size, head_dim]``. Every kernel
takes ``backend`` (``None``, ``"reference"``, ``"pallas_tpu"``,
``"pallas_gpu"``) and ``interpret``; see :mod:`pallas_kernels._dispatch` for
the choice rule and the jax-version notes (``set_gpu_variant("mosaic")``
serves ``"pallas_gpu"`` attention through Mosaic GPU instead of the
Triton-style lowering), and
:func:`prefer_shared_prefix` for when the shared-prefix path pays off.
``*_reference`` are the plain-jnp definitions the kernels are tested against.

The public functions check their arguments in Python before calling a jitted
implementation: shapes and dtypes always, and values (page ids, lengths,
slots, group ids) when the arrays are concrete. Under a caller's ``jit`` the
value checks are skipped (the arrays are tracers), so hot loops should call
the kernels inside ``jit``; eager calls pay a device-to-host copy of the
integer arguments for the checks. Inside ``jit`` the attention kernels turn
what those checks would refuse (page ids outside the pool in a used column,
lengths outside their tables, bad offsets or group ids, partial prefix
pages) into NaN rows for the requests concerned; the kernel reads page 0
in their place, so no copy leaves the pool. ``write_kv`` and
``copy_blocks`` drop out-of-range slots and pages.
"""

from pallas_kernels._dispatch import (
  BACKENDS,
  GPU_VARIANTS,
  SHARED_PREFIX_MIN_BYTES_RATIO,
  current_gpu_variant,
  prefer_shared_prefix,
  resolve_backend,
  set_gpu_variant,
)
from pallas_kernels.copy_blocks import copy_blocks, copy_blocks_reference
from pallas_kernels.merge_attention_states import (
  merge_attention_states,
  merge_attention_states_reference,
)
from pallas_kernels.paged_attention import (
  paged_attention,
  paged_attention_reference,
)
from pallas_kernels.prefill_attention import (
  prefill_attention,
  prefill_attention_reference,
)
from pallas_kernels.shared_prefix_attention import (
  concat_block_tables,
  shared_prefix_attention,
  shared_prefix_attention_reference,
)
from pallas_kernels.write_kv import write_kv, write_kv_reference

__all__ = [
  "BACKENDS",
  "GPU_VARIANTS",
  "SHARED_PREFIX_MIN_BYTES_RATIO",
  "concat_block_tables",
  "copy_blocks",
  "copy_blocks_reference",
  "current_gpu_variant",
  "merge_attention_states",
  "merge_attention_states_reference",
  "paged_attention",
  "paged_attention_reference",
  "prefer_shared_prefix",
  "prefill_attention",
  "prefill_attention_reference",
  "resolve_backend",
  "set_gpu_variant",
  "shared_prefix_attention",
  "shared_prefix_attention_reference",
  "write_kv",
  "write_kv_reference",
]
