# Solutions for labs/09-quantization/gptq-one-layer.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

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

# %% wrong gptq-columns: forgets the error feedback to later columns (this is round-to-nearest)
def gptq_layer(W, H, bits):
    s, z = row_grid(W, bits)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = round_column(W[:, j], s, z, bits)
    return Q

# %% wrong gptq-columns: uses the error unscaled by U[j, j]
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
