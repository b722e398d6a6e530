"""Exact emulations of PTX data-movement and tensor-core instructions (ldmatrix, mma.sync, cp.async),
derived from the fragment layouts and group semantics in the PTX ISA."""
