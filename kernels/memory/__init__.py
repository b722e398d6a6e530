"""Memory-bound kernels and the roofline arithmetic of the memory-hierarchy chapter."""
