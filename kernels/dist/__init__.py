"""Distributed parallelism: launching processes, collectives over send/recv, their cost model,
tensor parallelism and ZeRO/FSDP. Everything runs on ``torch.distributed``: gloo across CPU
processes here, NCCL across GPUs with the same code. Importing a module starts nothing."""
