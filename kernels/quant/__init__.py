"""Quantization: number formats (FP8, int8/int4), their scaling rules, and the matmuls that consume
them. Import from the modules (kernels.quant.fp8, ...); this package re-exports nothing, so two
chapters can grow it side by side."""
