"""RoPE on grids: axial 2D RoPE for image patches and 3D M-RoPE for text, images and video.

A token on a grid has several coordinates. Axial RoPE gives each coordinate its own share of the
D/2 rotation pairs: pair i belongs to axis a(i) and is rotated by p_{a(i)} theta_i, where p_a is the
token's coordinate along axis a. The score of a query at p and a key at p' is then a sum of terms
in (p_a - p'_a) theta_i: a function of the displacement vector p - p' only, which is translation
equivariance on the grid (the 1D argument of the RoPE chapter, once per axis).

* 2D, ViT-style (Qwen2-VL's vision encoder): pairs split in two halves, (row, column), with the
  same frequencies in each half: theta_i = base^(-2i/(D/2)), i < D/4, used once for rows, once
  for columns.
* 3D M-RoPE (Qwen2-VL's language model; Wang et al., 2024): the D/2 frequencies of plain RoPE,
  cut into contiguous sections (temporal, height, width); Qwen2-VL-7B uses [16, 24, 24] of its 64
  pairs. Text tokens get t = h = w = their index, which makes M-RoPE exactly 1D RoPE on text; an
  image's patches get (t0, t0 + row, t0 + col), a video's (t0 + frame, t0 + row, t0 + col), and the
  text after a visual block continues from the largest position used plus one.

The kernel is :func:`kernels.position.rope.rope` unchanged: its cos/sin tables have one row per
*position id*; here the tables get one row per *token* (row r holds the angles p_{a(i)}(r) theta_i
of token r), and the position ids passed to the kernel are 0..N-1.

Shapes: positions (A, N) integer coordinates of N tokens on A axes; inv_freq (D/2,); sections
(A,) summing to D/2; tables (N, D/2).
"""
from __future__ import annotations

import torch

from kernels import runtime
from kernels.position.rope import rope_frequencies

QWEN2_VL_SECTIONS = (16, 24, 24)      # Qwen2-VL-7B's mrope_section: pairs for (t, h, w) of 64


def axis_of_pair(sections) -> torch.Tensor:
    """(D/2,) the axis each pair belongs to: sections [2, 3] -> [0, 0, 1, 1, 1]."""
    return torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(list(sections)))


def nd_cos_sin(inv_freq: torch.Tensor, sections, positions: torch.Tensor, *, dtype=torch.float32, device=None):
    """Per-token tables (N, D/2): cos and sin of p_{a(i)} theta_i, pair i on axis a(i) by ``sections``."""
    sections = list(sections)
    if sum(sections) != inv_freq.shape[0]:
        raise ValueError(f"nd_cos_sin: sections {sections} must sum to D/2 = {inv_freq.shape[0]}")
    if positions.dim() != 2 or positions.shape[0] != len(sections):
        raise ValueError(f"nd_cos_sin: positions must be (axes, N) = ({len(sections)}, N), got {tuple(positions.shape)}")
    axis = axis_of_pair(sections)                                          # (D/2,)
    p = positions.double()[axis]                                           # (D/2, N): each pair's coordinate
    angles = (p * inv_freq.double()[:, None]).T                            # (N, D/2): p_{a(i)} theta_i
    device = device or runtime.device()
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def axial_2d_frequencies(dim: int, base: float = 10000.0) -> tuple[torch.Tensor, list[int]]:
    """ViT-style 2D RoPE: (D/2,) frequencies, the D/4 of a (D/2)-dim RoPE repeated for rows and columns."""
    if dim % 4:
        raise ValueError(f"axial_2d_frequencies: dim={dim} must be divisible by 4 (two axes of pairs)")
    half, _ = rope_frequencies(dim // 2, base)
    return torch.cat([half, half]), [dim // 4, dim // 4]


def grid_positions(h: int, w: int, t: int = 1, start: int = 0) -> torch.Tensor:
    """(3, t*h*w) coordinates (start + frame, start + row, start + col) of a t x h x w patch grid, raster order."""
    f, r, c = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([f.flatten(), r.flatten(), c.flatten()]) + start


def mrope_positions(segments) -> torch.Tensor:
    """(3, N) M-RoPE coordinates for a sequence of segments, Qwen2-VL's rule.

    ``segments``: ("text", n) or ("image", h, w) or ("video", t, h, w), in order. Text continues at
    one past the largest coordinate used so far; text tokens have t = h = w.
    """
    out, nxt = [], 0
    for seg in segments:
        kind = seg[0]
        if kind == "text":
            idx = torch.arange(seg[1]) + nxt
            pos = idx.expand(3, -1)
        elif kind in ("image", "video"):
            t, h, w = (1, *seg[1:]) if kind == "image" else seg[1:]
            pos = grid_positions(h, w, t, start=nxt)
        else:
            raise ValueError(f"mrope_positions: unknown segment {seg!r}; use 'text', 'image' or 'video'")
        out.append(pos)
        nxt = int(pos.max()) + 1
    return torch.cat(out, dim=1)
