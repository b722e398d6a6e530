# Solutions for labs/07-attention/paged-attention-gather.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution slot-of
def slot_of(table_row, pos, P):
    page = table_row[pos // P].long()          # logical page pos // P -> physical page
    return page * P + pos % P

# %% wrong slot-of: reads the table one entry too far (logical page p // P + 1)
def slot_of(table_row, pos, P):
    page = table_row[(pos // P + 1).clamp(max=len(table_row) - 1)].long()
    return page * P + pos % P

# %% wrong slot-of: takes the logical page as the physical one (ignores the table)
def slot_of(table_row, pos, P):
    return (pos // P).long() * P + pos % P

# %% solution gather
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = -(-length // P)                                      # pages the sequence uses
    chunks = [pages[int(table_row[i])] for i in range(n)]    # each (Hkv, P, D), in logical order
    return torch.cat(chunks, dim=1)[:, :length]

# %% wrong gather: off-by-one page index (starts at table entry 1)
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = -(-length // P)
    chunks = [pages[int(table_row[min(i + 1, len(table_row) - 1)])] for i in range(n)]
    return torch.cat(chunks, dim=1)[:, :length]

# %% wrong gather: one page too few (floor instead of ceil), the tail is padded with zeros
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = length // P
    out = torch.zeros(pages.shape[1], length, pages.shape[3])
    if n:
        out[:, :n * P] = torch.cat([pages[int(table_row[i])] for i in range(n)], dim=1)
    return out
