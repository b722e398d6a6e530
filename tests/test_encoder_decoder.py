"""kernels.model.encoder_decoder: the 2017 post-LN encoder-decoder against torch.nn.Transformer, and its properties."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch
import torch.nn as nn

from kernels.model.encoder_decoder import EncoderDecoder, EncoderLayer, sinusoidal_positions, sinusoidal_shift
from kernels.testing import MismatchError, assert_close

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
C, H, FF, L = 32, 4, 72, 2


def _pair(seed=0):
    torch.manual_seed(seed)
    theirs = nn.Transformer(C, H, L, L, FF, dropout=0.1, batch_first=True).eval()
    ours = EncoderDecoder(41, C, H, FF, L, dropout=0.1, final_norm=True).load_torch(theirs).eval()
    return ours, theirs


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randn(3, 7, C, generator=g), torch.randn(3, 5, C, generator=g)
    src_pad = torch.zeros(3, 7, dtype=torch.bool)
    src_pad[1, 5:], src_pad[2, 2:] = True, True
    return src, tgt, src_pad


def _torch_out(theirs, src, tgt, src_pad):
    mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    return theirs(src, tgt, tgt_mask=mask, tgt_is_causal=True, src_key_padding_mask=src_pad,
                  memory_key_padding_mask=src_pad)


def test_matches_torch_transformer_with_the_same_weights():
    ours, theirs = _pair()
    src, tgt, src_pad = _inputs()
    with torch.no_grad():
        got = ours.run_decoder(tgt, ours.run_encoder(src, src_pad), None, src_pad)
        want = _torch_out(theirs, src, tgt, src_pad)
    assert_close(got, want.double(), dtype=torch.float32)


def test_pre_ln_layer_is_caught():
    """A pre-LN torch layer is refused; and the same weights run pre-LN give another function."""
    torch.manual_seed(0)
    pre = nn.TransformerEncoderLayer(C, H, FF, dropout=0.0, batch_first=True, norm_first=True)
    with pytest.raises(ValueError, match="pre-LN"):
        EncoderLayer(C, H, FF, 0.0).load_torch(pre)
    post = nn.TransformerEncoderLayer(C, H, FF, dropout=0.0, batch_first=True).eval()
    ours = EncoderLayer(C, H, FF, 0.0).load_torch(post).eval()
    pre.load_state_dict(post.state_dict())
    x = torch.randn(2, 6, C)
    with torch.no_grad():
        assert_close(ours(x), post(x).double(), dtype=torch.float32)
        with pytest.raises(MismatchError):
            assert_close(ours(x), pre.eval()(x).double(), dtype=torch.float32)


def test_decoder_is_causal_and_cross_attention_sees_the_whole_source():
    ours, _ = _pair()
    src, tgt, _ = _inputs()
    with torch.no_grad():
        base = ours.run_decoder(tgt, ours.run_encoder(src))
        tgt2 = tgt.clone()
        tgt2[:, 3] += 1.0                                    # change target token 3
        out2 = ours.run_decoder(tgt2, ours.run_encoder(src))
        src2 = src.clone()
        src2[:, -1] += 1.0                                   # change the last source token
        out3 = ours.run_decoder(tgt, ours.run_encoder(src2))
    assert torch.equal(out2[:, :3], base[:, :3]) and not torch.allclose(out2[:, 3:], base[:, 3:])
    assert ((out3[:, 0] - base[:, 0]).abs().amax(-1) > 1e-3).all()   # target 0 already sees source token 6


def test_source_padding_is_ignored():
    ours, _ = _pair()
    src, tgt, src_pad = _inputs()
    with torch.no_grad():
        base = ours.run_decoder(tgt, ours.run_encoder(src, src_pad), None, src_pad)
        src2 = src.masked_fill(src_pad[..., None], 1e3)       # garbage in the padded slots
        out = ours.run_decoder(tgt, ours.run_encoder(src2, src_pad), None, src_pad)
    assert_close(out, base.double(), dtype=torch.float32)


def test_sinusoidal_positions_shift_by_one_matrix():
    pe = sinusoidal_positions(300, 64).double()
    for k in (1, 7, 50):
        m = sinusoidal_shift(k, 64)
        assert_close(pe[:-k] @ m.T, pe[k:], dtype=torch.float32)
    assert pe[0, 0::2].abs().max() == 0 and (pe[0, 1::2] == 1).all()
    # a learned (random) table has no such matrix: the least-squares fit from positions 0..199 fails at 200..299
    table = torch.randn(300, 64, dtype=torch.float64)
    m = torch.linalg.lstsq(table[:199], table[1:200]).solution.T
    with pytest.raises(MismatchError):
        assert_close(table[199:-1] @ m.T, table[200:], dtype=torch.float32)


def test_embedding_scale_and_tied_output():
    ours, _ = _pair()
    ours.eval()
    ids = torch.tensor([[3, 4, 5]])
    x = ours.embed_tokens(ids)
    assert_close(x, (ours.embed.weight[ids] * C ** 0.5 + sinusoidal_positions(3, C)).double(), dtype=torch.float32)
    logits = ours(ids, ids)
    assert logits.shape == (1, 3, 41)
    y = ours.run_decoder(ours.embed_tokens(ids), ours.run_encoder(ours.embed_tokens(ids)))
    assert_close(logits, (y @ ours.embed.weight.T).double(), dtype=torch.float32)


def test_dropout_only_in_training():
    ours, _ = _pair()
    ids = torch.tensor([[3, 4, 5, 6]])
    ours.train()
    torch.manual_seed(0)
    a = ours(ids, ids)
    b = ours(ids, ids)
    assert not torch.equal(a, b)
    ours.eval()
    assert torch.equal(ours(ids, ids), ours(ids, ids))


def test_bad_input_refused():
    with pytest.raises(ValueError, match="even"):
        sinusoidal_positions(4, 7)
    m = EncoderDecoder(10, 8, 2, 16, 1, max_len=4)
    with pytest.raises(ValueError, match="src"):
        m(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len"):
        m(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="final_norm"):
        m.load_torch(nn.Transformer(8, 2, 1, 1, 16, batch_first=True))
