# Solutions for labs/07-attention/paged-attention-gather.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution slot-of
def slot_of(table, pos, P):
    page = table.gather(1, pos // P).long()    # (B, T): sequence b's logical page pos // P -> physical page
    return page * P + pos % P

# %% wrong slot-of: reads the table one entry too far (logical page p // P + 1) | hint: off by one page
def slot_of(table, pos, P):
    page = table.gather(1, (pos // P + 1).clamp(max=table.shape[1] - 1)).long()
    return page * P + pos % P

# %% wrong slot-of: takes the logical page as the physical one (ignores the table) | hint: ignores the block table
def slot_of(table, pos, P):
    return (pos // P).long() * P + pos % P

# %% wrong slot-of: indexes the first row for every sequence (table[0][pos // P]) | hint: sequence b's pages are in row b
def slot_of(table, pos, P):
    return table[0][pos // P].long() * P + pos % P

# %% wrong slot-of: returns the table's int32 (no .long(), the product can pass 2**31) | hint: result is int32
def slot_of(table, pos, P):
    return table.gather(1, pos // P) * P + (pos % P).int()

# %% wrong slot-of: calls the check's reference | hint: write it yourself
def slot_of(table, pos, P):
    return slot_ref(table, pos, P)

# %% solution gather
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = -(-length // P)                                      # pages the sequence uses
    chunks = [pages[int(table_row[i])] for i in range(n)]    # each (Hkv, P, D), in logical order
    return torch.cat(chunks, dim=1)[:, :length]

# %% wrong gather: off-by-one page index (starts at table entry 1) | hint: off by one page
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = -(-length // P)
    chunks = [pages[int(table_row[min(i + 1, len(table_row) - 1)])] for i in range(n)]
    return torch.cat(chunks, dim=1)[:, :length]

# %% wrong gather: one page too few (floor instead of ceil), the tail is padded with zeros | hint: ceil(length / P) pages
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = length // P
    out = torch.zeros(pages.shape[1], length, pages.shape[3])
    if n:
        out[:, :n * P] = torch.cat([pages[int(table_row[i])] for i in range(n)], dim=1)
    return out

# %% wrong gather: the last page is not cut at length (returns whole pages) | hint: cut the last page at length
def gather_kv(pages, table_row, length):
    P = pages.shape[2]
    n = -(-length // P)
    return torch.cat([pages[int(table_row[i])] for i in range(n)], dim=1)

# %% wrong gather: calls the course's gather | hint: write it yourself
def gather_kv(pages, table_row, length):
    from kernels.attention.paged import gather_pages
    return gather_pages(pages, table_row, length)
