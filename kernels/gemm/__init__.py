"""Matrix multiplication: the reference and the tiled Triton kernels."""
