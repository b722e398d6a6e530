"""GPU benchmarks of the course's kernels; results land in benchmarks/results/."""
