"""GPU Pallas variants (Triton-style lowering), isolated behind the dispatcher.

Every module here exposes ``*_unbatched`` functions with the same signature
as the TPU variant it mirrors, so :mod:`pallas_kernels._dispatch` can serve
a kernel from a Mosaic GPU port instead (JAX deprecated the Triton backend
in 0.11.2): :mod:`pallas_kernels.gpu_mosaic` ports the attention kernel,
chosen with ``pallas_kernels.set_gpu_variant("mosaic")``. Nothing here
imports ``jax.experimental.pallas.triton`` at import time; compiled runs get
their ``CompilerParams`` from
:func:`pallas_kernels._dispatch.gpu_compiler_params`, interpret runs
(``interpret=True``, the generic HLO interpreter) need no GPU at all.

On a real GPU the Triton lowering wants power-of-two block shapes: page size
and head dim must be powers of two there, and the query rows of a block are
padded to a power of two of at least 16 (``tl.dot``'s minimum).
"""
