"""kernels.softmax.topk: softmax fused with top-k, the PyTorch pass and the Triton kernel, against
torch.topk(torch.softmax(x)); the packed keys' order (ties, -inf, signed zeros); the kernel compiled
ahead of time for sm_90a at vocabulary widths as its own launch's job (no spills); and
kernels.softmax.log_softmax_ref against torch.log_softmax."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.inspect import compile_triton_many
from kernels.softmax import log_softmax_ref, softmax_ref
from kernels.softmax import topk as tk
from kernels.softmax.topk import softmax_topk, softmax_topk_ref
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf notices in the interpreter


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)   # continuous: no ties among the top k


def _want(x, k):
    return torch.topk(softmax_ref(x), k, dim=-1)


@pytest.mark.parametrize("shape,k,block", [((1, 1), 1, None), ((3, 7), 7, None), ((5, 1000), 5, None),
                                           ((2, 3, 300), 8, 64), ((2, 9), 9, 4), ((2, 40), 9, 16),
                                           ((3, 5000), 3, 1024), ((2, 600), 64, 256)])
def test_kernel_and_reference_match_topk_of_softmax(shape, k, block):
    x = _x(shape)
    want_p, want_i = _want(x, k)
    p, i = softmax_topk(nan_canary(x, rows=True), k, block_size=block)
    assert p.shape == want_p.shape and i.dtype == torch.int64
    assert torch.equal(i, want_i)
    assert_close(p, want_p, name=f"kernel {shape} k={k}")
    rp, ri = softmax_topk_ref(x, k, block=block or 128)
    assert torch.equal(ri, want_i)
    assert_close(rp, want_p, name=f"reference {shape} k={k}")


def test_fp16_and_large_logits():
    """Distinct fp16 logits from 30 to 42: exp(30) overflows fp16, so the shift by the max is what works."""
    g = torch.Generator().manual_seed(0)
    x = torch.stack([30 + torch.randperm(200, generator=g) * 0.0625 for _ in range(4)]).to(DEVICE, torch.float16)
    want_p, want_i = _want(x, 4)
    p, i = softmax_topk(x, 4, block_size=128)
    assert p.dtype == torch.float16
    assert torch.equal(i, want_i)
    assert_close(p, want_p, dtype=torch.float16, name="fp16")


def test_max_in_a_late_block():
    """The row's max arrives in the last block: the running sum must be rescaled and the top-k replaced."""
    x = torch.linspace(-5, 5, 3 * 400).reshape(3, 400).to(DEVICE)
    want_p, want_i = _want(x, 6)
    p, i = softmax_topk(x, 6, block_size=64)
    assert torch.equal(i, want_i)
    assert_close(p, want_p)


@pytest.mark.parametrize("k", [0, 8, 65, 2.0, True])
def test_bad_k_refused(k):
    with pytest.raises(ValueError, match="k must be"):
        softmax_topk(torch.ones(2, 7, device=DEVICE), k)


def test_ties_infinities_and_zeros_follow_a_stable_descending_sort():
    """The packed key orders by value, then by earlier column: equal logits (within a block and across
    blocks), -inf, -0 == +0, the largest finite float and denormals, against a stable sort."""
    tiny = torch.finfo(torch.float32).tiny / 4                         # a denormal
    pattern = torch.tensor([1.0, -0.0, float("-inf"), 0.0, -2.5, 1.0, tiny, -tiny, 3e38, -3e38, -2.5, 0.0])
    mostly_inf = torch.full((60,), float("-inf"))
    mostly_inf[[5, 33, 47]] = torch.tensor([0.0, -1.0, 0.0])          # the top 40 then holds 37 tied -inf
    x = torch.stack([pattern.repeat(5), (-pattern).clamp(max=3e38).repeat(5), mostly_inf]).to(DEVICE)  # (3, 60)
    x[1, 7] = float("-inf")
    k = 40
    want_i = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    p, i = softmax_topk(x, k, block_size=16)
    assert torch.equal(i, want_i)
    assert_close(p, softmax_ref(x).gather(-1, want_i))


def _raw_bits(x):
    """BROKEN order map: the float's bits as they are, so negative logits sort backwards."""
    return x.to(tl.int32, bitcast=True)


def test_unflipped_negative_keys_are_caught(monkeypatch):
    x = _x((3, 300)) - 20                                              # every logit negative
    want_p, want_i = _want(x, 5)
    monkeypatch.setattr(tk, "_order_key", triton.jit(_raw_bits))
    p, i = softmax_topk(x, 5, block_size=64)
    assert not torch.equal(i, want_i)
    with pytest.raises(MismatchError):
        assert_close(p, want_p)


@triton.jit
def _last_block_only_kernel(x_ptr, p_ptr, i_ptr, n_cols, stride_x, k, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.full((), 0.0, tl.float32)
    top = tl.full((BLOCK_K,), -2**63, tl.int64)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        top = tl.topk(tl.where(c < n_cols, tk._pack(x, c), -2**63), BLOCK_K)   # BROKEN: replaced, not merged
    v, col = tk._unpack(top)
    tl.store(p_ptr + row * k + ks, tl.exp(v - m) / l, mask=ks < k)
    tl.store(i_ptr + row * k + ks, col, mask=ks < k)


def test_broken_merge_is_caught(monkeypatch):
    x = _x((4, 300))
    want_p, want_i = _want(x, 5)
    monkeypatch.setattr(tk, "_softmax_topk_kernel", _last_block_only_kernel)
    p, i = softmax_topk(x, 5, block_size=64)
    with pytest.raises(MismatchError):
        assert_close(p, want_p)
    assert not torch.equal(i, want_i)


def test_launch_rule():
    assert tk.topk_launch(128256, 50) == tk.TopkLaunch(block_n=2048, block_k=64, num_warps=8)
    assert tk.topk_launch(7, 1) == tk.TopkLaunch(block_n=8, block_k=2, num_warps=1)
    assert tk.topk_launch(300, 9, block_size=4).block_n == 16             # a block holds the running keys
    with pytest.raises(ValueError, match="block_size"):
        softmax_topk(torch.ones(2, 7, device=DEVICE), 2, block_size=3)


# ------------------------------------------------------------------------------------ ahead of time, sm_90a

def test_vocabulary_widths_compile_without_spills():
    """Mistral-7B's 32000, Llama 3's 128256 and Qwen2.5-0.5B's 151936 columns, k in (1, 50, MAX_K),
    fp16 and bf16, each the job of the launcher's own launch over 64 rows (every width past 2048
    columns gets the same launch, and k is an argument: 50 and 64 share one kernel): no STL/LDL, no
    stack frame. The same kernel at the softmax launch rule's 16384 columns and 32 warps (64 registers
    a thread) spills, which shows the check can fail. One compile for all (about 20 s)."""
    jobs = {}
    for n in (32000, 128256, 151936):
        for k in (1, 50, tk.MAX_K):
            for dtype in (torch.float16, torch.bfloat16):
                jobs.setdefault((tk.topk_launch(n, k), dtype), tk.launch_job(n, k, dtype))
    assert len(jobs) == 4                                                 # (block_k 2 or 64) x 2 dtypes
    oversized = tk.launch_job(128256, tk.MAX_K, torch.float16,
                              launch=tk.TopkLaunch(block_n=16384, block_k=64, num_warps=32))
    *builds, old = [b["sm90"] for b in compile_triton_many([*jobs.values(), oversized], archs=("sm90",))]
    for (lc, dtype), b in zip(jobs, builds):
        assert (b.spills, b.metadata["stack_bytes"]) == (0, 0), f"{lc} {dtype}: {b.spills} STL+LDL"
    assert old.spills > 0 and old.metadata["stack_bytes"] > 0


def test_every_k_of_one_list_width_is_one_kernel_on_a_gpu():
    """k is not specialised (do_not_specialize): a GPU launch with k = 50 and one with k = 64 compile
    the same kernel, and k = 1 stays an argument instead of becoming a constant; the strides and the
    row length, divisible by 16, carry Triton's hint as in any launch."""
    spec = {k: tk.launch_job(128256, k).spec() for k in (33, 50, 64)}
    assert spec[33] == spec[50] == spec[64]
    one = tk.launch_job(128256, 1)
    assert "k: i32\n" in one.specialization() + "\n" and "n_cols: i32 %16" in one.specialization()
    assert one.signature["k"] == "i32" and one.grid == (64,)


def test_compile_jobs_are_the_launch_at_llama3_vocabulary():
    """compile_jobs(): the launches of sampling from 128256 columns, 64 rows a batch, k = 1 and 50."""
    jobs = tk.compile_jobs()
    assert len(jobs) == 2
    for label, job in jobs.items():
        assert job.attrs and job.grid == (64,), label
        assert job.constexprs["BLOCK_N"] == tk.MAX_BLOCK and job.num_warps == tk.MAX_WARPS, label
        assert "stride_x: i32 %16" in job.specialization(), label
    assert [job.constexprs["BLOCK_K"] for job in jobs.values()] == [2, 64]


# ---------------------------------------------------------------------------------------------- log-softmax

def test_log_softmax_reference():
    x = _x((3, 5, 301), torch.float64)
    assert_close(log_softmax_ref(x), torch.log_softmax(x, -1), name="log_softmax")
    assert_close(log_softmax_ref(x, dim=1), torch.log_softmax(x, 1), name="log_softmax dim=1")
    rows = torch.tensor([[0.0, -200.0, -1e4], [float("-inf")] * 3])
    got, want = log_softmax_ref(rows), torch.log_softmax(rows, -1)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    assert_close(got[0], want[0])
    assert torch.isneginf(torch.log(torch.softmax(rows[0], -1))).any()     # the composed form loses them
