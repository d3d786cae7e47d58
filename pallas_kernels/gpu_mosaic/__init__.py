"""Mosaic GPU variants (Hopper: TMA copies, WGMMA), behind the dispatcher.

JAX deprecates the Pallas Triton backend from jax 0.11.2 on; Mosaic GPU is
its successor. Only the attention kernels have a port so far
(:mod:`.paged_attention`, which serves decode, prefill and shared-prefix
attention through :func:`pallas_kernels.paged_attention.paged_flash`); the
data-movement kernels (KV write, block copy, state merge) stay on the
Triton-style variants. Selected with
:func:`pallas_kernels.set_gpu_variant` ``("mosaic")`` or the environment
variable ``PALLAS_KERNELS_GPU_VARIANT=mosaic``.

Checked on CPU only: in JAX's GPU interpret mode against the ``jnp``
reference, and by lowering for ``cuda`` with the CUDA plugin installed. Not
yet compiled or timed on a GPU.
"""
