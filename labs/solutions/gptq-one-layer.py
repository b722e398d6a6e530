# Solutions for labs/09-quantization/gptq-one-layer.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution gptq-columns
def gptq_layer(W, H, bits):
    U = hinv_cholesky(H)
    s, z = row_grid(W, bits)
    W = W.clone()
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = round_column(W[:, j], s, z, bits)
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j:] -= err[:, None] * U[j, j:][None, :]
    return Q

# %% wrong gptq-columns: forgets the error feedback to later columns (this is round-to-nearest) | hint: your Q is round-to-nearest
def gptq_layer(W, H, bits):
    s, z = row_grid(W, bits)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = round_column(W[:, j], s, z, bits)
    return Q

# %% wrong gptq-columns: uses the error unscaled by U[j, j] | hint: divided by U[j, j]
def gptq_layer(W, H, bits):
    U = hinv_cholesky(H)
    s, z = row_grid(W, bits)
    W = W.clone()
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = round_column(W[:, j], s, z, bits)
        err = W[:, j] - Q[:, j]
        W[:, j:] -= err[:, None] * U[j, j:][None, :]
    return Q

# %% wrong gptq-columns: works on W itself, not a copy (the caller's weights are overwritten) | hint: modified its input argument 0
def gptq_layer(W, H, bits):
    U = hinv_cholesky(H)
    s, z = row_grid(W, bits)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = round_column(W[:, j], s, z, bits)
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j:] -= err[:, None] * U[j, j:][None, :]
    return Q

# %% wrong gptq-columns: calls the course's GPTQ | hint: write it yourself
def gptq_layer(W, H, bits):
    from kernels.quant import gptq
    return gptq.gptq_quantize(W, H, bits, block_size=W.shape[1])
