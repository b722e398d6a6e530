"""Position embeddings: RoPE (fused Triton rotation of q and k), its scaling rules past the
training length, ALiBi slopes and biases, 2D/3D (axial, M-RoPE) positions, and a runner that
evaluates the course's tiny GPT at chosen positions and frequencies."""
from kernels.position.rope import rope, rope_cos_sin, rope_frequencies, rope_ref

__all__ = ["rope", "rope_cos_sin", "rope_frequencies", "rope_ref"]
