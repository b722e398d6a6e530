"""Gated MLPs: the GLU family's fused elementwise kernels and the LLaMA MLP (:mod:`.gated`).

This package re-exports the public names of its modules."""
from kernels.mlp.gated import (
    LlamaMLP, geglu, geglu_ref, llama_hidden_size, llama_mlp_ref, mlp_parameters, reglu, reglu_ref, swiglu,
    swiglu_fused, swiglu_fused_ref, swiglu_ref,
)

__all__ = ["LlamaMLP", "geglu", "geglu_ref", "llama_hidden_size", "llama_mlp_ref", "mlp_parameters", "reglu",
           "reglu_ref", "swiglu", "swiglu_fused", "swiglu_fused_ref", "swiglu_ref"]
