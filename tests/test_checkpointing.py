"""Activation checkpointing (kernels.dist.checkpointing): what autograd saves in one GPT-3 layer, measured
with saved_tensors_hooks, against every row of Korthikanti et al.'s table (plus the LayerNorm statistics
it leaves out), exactly; the tiny GPT's own ledger; the matmul FLOPs recomputation adds. Single process:
the chapter emulates a tensor-parallel rank with shape stand-ins, it runs no collective. A dropout that
saves a bf16 mask and the full-recompute count that ignores sequence parallelism are caught."""
import pytest
import torch
import torch.nn.functional as F

from kernels.dist import checkpointing as ck
from kernels.model.gpt import load_pretrained

S, B, H, A = 8, 2, 32, 4           # tiny: s = 8 tokens, a = 4 heads; t = 2 ranks emulated
ROWS = [(1, False, "none"), (1, False, "selective"), (1, False, "full"), (2, False, "none"),
        (2, True, "none"), (2, False, "selective"), (2, True, "selective"), (2, False, "full"),
        (2, True, "full")]


@pytest.mark.parametrize("t,sp,rc", ROWS)
def test_measured_bytes_equal_the_table(t, sp, rc):
    got, _ = ck.paper_layer_saved(S, B, H, A, t=t, sp=sp, recompute=rc)
    assert got == ck.korthikanti_bytes(S, B, H, A, t=t, sp=sp, recompute=rc) + \
        ck.paper_layer_extra_bytes(S, B, t=t, sp=sp, recompute=rc)


def test_table_rows_by_hand():
    sbh, a_s_h = S * B * H, A * S / H
    assert ck.korthikanti_bytes(S, B, H, A) == sbh * (34 + 5 * a_s_h)
    assert ck.korthikanti_bytes(S, B, H, A, t=2) == sbh * (10 + 12 + 5 * a_s_h / 2)
    assert ck.korthikanti_bytes(S, B, H, A, t=2, sp=True, recompute="selective") == sbh * 17
    assert ck.korthikanti_bytes(S, B, H, A, t=2, recompute="full") == 2 * sbh          # replicated input
    assert ck.korthikanti_bytes(S, B, H, A, t=2, sp=True, recompute="full") == sbh      # 2 sbh / t


def test_full_recompute_that_ignores_sequence_parallelism_is_caught():
    got, _ = ck.paper_layer_saved(S, B, H, A, t=2, sp=True, recompute="full")
    assert got != 2 * S * B * H                                   # the old count, 2 sbh whatever t and sp


def test_a_dropout_that_saves_a_bf16_mask_is_caught(monkeypatch):
    monkeypatch.setattr(ck.PaperLayer, "_dropout", lambda self, x: F.dropout(x, self.p, True))
    got, _ = ck.paper_layer_saved(S, B, H, A)
    want = ck.korthikanti_bytes(S, B, H, A) + ck.paper_layer_extra_bytes(S, B)
    assert got == want + A * S * S * B + 2 * S * B * H            # 2-byte masks: a s^2 b + 2 sbh more


@pytest.mark.parametrize("rc", ck.RECOMPUTE)
def test_tiny_gpt_ledger(rc):
    model = load_pretrained().train()
    block, cfg = model.blocks[0], model.config
    x = torch.randn(B, S, cfg.d_model, generator=torch.Generator().manual_seed(0), requires_grad=True)
    pos = torch.arange(S)
    assert torch.equal(ck.tiny_block_forward(block, x, pos, rc), block(x, pos))
    got, _ = ck.saved_bytes(lambda: ck.tiny_block_forward(block, x, pos, rc), model.parameters())
    assert got == ck.tiny_gpt_layer_bytes(cfg, B, S, 4, rc)


def test_recompute_flops_are_counted():
    torch.manual_seed(0)
    layer = ck.PaperLayer(H, A).to(torch.bfloat16)
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    steps = {"none": lambda: layer(x).float().sum().backward(),
             "selective": lambda: layer(x, "selective").float().sum().backward(),
             "full": lambda: ck.checkpoint(layer, x, use_reentrant=False).float().sum().backward()}
    flops = {rc: ck.counted_flops(fn) for rc, fn in steps.items()}
    assert flops["none"] == 3 * ck.layer_flops(S, B, H)["forward"]
    for rc in ck.RECOMPUTE:
        assert flops[rc] - flops["none"] == ck.recompute_flops(S, B, H, rc), rc
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        late = ck.counted_flops(steps["selective"])
    assert late - flops["none"] == ck.recompute_flops(S, B, H, "selective", early_stop=False)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="recompute"):
        ck.korthikanti_bytes(S, B, H, A, recompute="half")
    with pytest.raises(ValueError, match="t must be"):
        ck.korthikanti_bytes(S, B, H, A, t=0)
    with pytest.raises(ValueError, match="a % t"):
        ck.PaperLayer(H, A, t=3)


def test_fused_attention_block_ledger_and_recompute_modules():
    """With fused attention (no scores saved) the attention core's recompute keeps exactly what the
    explicit block's selective recompute keeps; core_attn frees the output and the log-sum-exp,
    mlp frees SwiGLU's 4 s b F; the outputs equal the model's block; unknown modules are refused."""
    model = load_pretrained().train()
    cfg, blk = model.config, model.blocks[0]
    B, S = 3, 17
    x, pos = torch.randn(B, S, cfg.d_model, requires_grad=True), torch.arange(S)
    got = {m: ck.saved_bytes(lambda: ck.fused_block_forward(blk, x, pos, m), model.parameters())[0]
           for m in [(), ("core_attn",), ("mlp",)]}
    assert got[("core_attn",)] == ck.tiny_gpt_layer_bytes(cfg, B, S, 4, "selective")
    assert got[()] - got[("core_attn",)] == 4 * B * S * cfg.n_head * cfg.head_dim + 4 * B * cfg.n_head * S
    assert got[()] - got[("mlp",)] == 4 * 4 * B * S * cfg.d_ff
    y = ck.fused_block_forward(blk, x, pos, ("core_attn", "mlp"))
    assert float((y - blk(x, pos)).detach().abs().max()) < 1e-5
    with pytest.raises(ValueError, match="recompute_modules must be drawn from"):
        ck.fused_block_forward(blk, x, pos, ("attention",))
