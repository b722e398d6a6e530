"""The course's tiny GPT: its config and modules (gpt), text and batches (data), training (train)."""
from kernels.model.gpt import GPT, GPTConfig, KVCache, count_parameters, forward_flops, load_pretrained
