"""kernels.model: the committed tiny GPT, its two paths (Triton kernels vs pure PyTorch), the KV cache,
the counting formulas, AdamW written out, and the batching."""
import kernels  # noqa: F401  (before triton, which torch.utils.flop_counter imports)
import copy
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels.model import data
from kernels.model.gpt import GPT, GPTConfig, KVCache, MODEL_DIR, count_parameters, forward_flops, load_pretrained
from kernels.model.train import adamw_update, evaluate, validation_slice
from kernels import runtime
from kernels.testing import assert_close

DEVICE = runtime.device()
METRICS = json.loads((MODEL_DIR / "metrics.json").read_text())


def _double(model):
    ref = GPT(model.config).double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return ref.eval()


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


def test_checkpoint_is_small_and_complete():
    for name in ("model.pt", "config.json", "train_log.csv", "metrics.json"):
        assert (MODEL_DIR / name).exists(), name
    assert (MODEL_DIR / "model.pt").stat().st_size < 10 * 2**20
    lines = (MODEL_DIR / "train_log.csv").read_text().splitlines()
    assert lines[0].startswith("step,tokens,train_loss,val_loss")
    assert len(lines) == METRICS["steps"] + 2          # header, step 0, one row per step


def test_checkpoint_reproduces_recorded_validation_loss(model):
    torch.set_num_threads(1)
    x, y = validation_slice(model.config)
    assert x.shape == (METRICS["val_slice"]["windows"], METRICS["val_slice"]["block_size"])
    loss = evaluate(model, x, y)
    assert abs(loss - METRICS["val_loss"]) < 1e-4, (loss, METRICS["val_loss"])
    # it learned something: far below the uniform guess ln 256 and the untrained model
    assert loss < 0.5 * METRICS["val_loss_initial"]


def test_kernel_path_matches_pure_pytorch(model):
    """Same logits from the Triton path and the PyTorch path, judged against a float64 run of the
    PyTorch path: the kernel path's error may be at most twice the fp32 PyTorch path's own."""
    idx = data.encode("ROMEO:\nBut soft, what light").view(1, -1)
    fast = copy.deepcopy(model).to(DEVICE)(idx.to(DEVICE), use_kernels=True).cpu()
    pure = model(idx)
    exact = _double(model)(idx)
    assert_close(fast, exact, dtype=torch.float32, baseline=pure, name="kernel-path logits")


def test_generation_with_and_without_cache_is_identical(model):
    prompt = torch.stack([data.encode("HAMLET:\nTo be"), data.encode("KING LEAR:\nNo")])
    no_cache = model.generate(prompt, 40, use_cache=False)
    cached = model.generate(prompt, 40, use_cache=True)
    assert torch.equal(no_cache, cached)


def test_generation_through_decode_attention_kernel(model):
    prompt = data.encode("OTHELLO:\n").view(1, -1)
    ref = model.generate(prompt, 3, use_cache=False)
    on_device = copy.deepcopy(model).to(DEVICE)
    assert torch.equal(on_device.generate(prompt.to(DEVICE), 3, use_cache=True, use_kernels=True).cpu(), ref)


def test_cached_decode_with_different_lengths_matches_full_forward(model):
    """Two sequences at different cache lengths, one decode step each, equal the full forward."""
    a, b = data.encode("MACBETH:\nIs this a dagger"), data.encode("JULIET:\nO")
    cache = KVCache.empty(model.config, 2)
    for i, seq in enumerate((a, b)):   # prefill each sequence into its own row of the cache
        one = KVCache([k[i: i + 1] for k in cache.k], [v[i: i + 1] for v in cache.v], cache.seqlens[i: i + 1])
        model(seq[:-1].view(1, -1), cache=one)
    assert cache.seqlens.tolist() == [len(a) - 1, len(b) - 1]
    step = model(torch.stack([a[-1:], b[-1:]]), cache=cache)[:, -1]
    full = torch.stack([model(a.view(1, -1))[0, -1], model(b.view(1, -1))[0, -1]])
    wide = _double(model)
    exact = torch.stack([wide(a.view(1, -1))[0, -1], wide(b.view(1, -1))[0, -1]])
    assert_close(step, exact, dtype=torch.float32, baseline=full, name="cached decode logits")


def test_cache_size_formula(model):
    cfg = model.config
    cache = KVCache.empty(cfg, batch=3)
    assert cache.nbytes() == 2 * cfg.n_layer * 3 * cfg.n_kv_head * cfg.block_size * cfg.head_dim * 4


def test_parameter_count_formula_matches_the_model(model):
    parts = count_parameters(model.config)
    assert parts["total"] == sum(p.numel() for p in model.parameters()) == METRICS["parameters"]
    assert parts["embedding"] == model.wte.weight.numel()


def test_flop_formula_matches_flop_counter():
    cfg = GPTConfig(n_layer=2)
    m = GPT(cfg)
    x = torch.randint(0, 256, (2, 48))
    with FlopCounterMode(display=False) as fwd:
        m(x)
    # the dense implementation computes the whole T x T score matrix: context = T for every query
    assert fwd.get_total_flops() == forward_flops(cfg, 96, context=48)["total"]
    with FlopCounterMode(display=False) as both:
        m(x).sum().backward()
    assert both.get_total_flops() == 3 * fwd.get_total_flops()      # backward = 2 x forward: the 6N rule


def test_adamw_written_out_matches_torch():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(7, 5, generator=g)
    q = p.clone().requires_grad_()
    opt = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 8):
        grad = torch.randn(7, 5, generator=g)
        q.grad = grad.clone()
        opt.step()
        adamw_update(p, grad, m, v, step, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        assert_close(p, q.detach(), name=f"AdamW step {step}")


def test_batches_have_shifted_targets():
    tokens = torch.arange(1000)
    x, y = data.get_batch(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)
    assert data.decode(data.encode("Thou art")) == "Thou art"


def test_bad_inputs(model):
    with pytest.raises(ValueError, match=r"\(B, T\) integer"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed block_size"):
        model.generate(torch.zeros(1, 100, dtype=torch.long), 40)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=130, n_head=4)


def test_training_rerun_reproduces_the_committed_log():
    """The committed checkpoint's training, re-run for its first steps with the committed recipe (same
    seed, batches, schedule over the full run, one thread), gives the untrained validation loss and the
    training losses of models/tiny-gpt/train_log.csv. The log is rounded to 5 decimals; the bound 1e-4
    leaves room for another CPU's summation order, and is far below the 0.05-0.16 a step moves the loss."""
    import csv

    from kernels.model import train

    logged = list(csv.DictReader(open(MODEL_DIR / "train_log.csv")))
    steps = 4
    _, rows = train.run(steps=steps, batch_size=METRICS["batch_size"], max_lr=METRICS["max_lr"],
                        min_lr=METRICS["min_lr"], warmup=METRICS["warmup"], weight_decay=METRICS["weight_decay"],
                        eval_every=METRICS["steps"], threads=METRICS["threads"], config=GPTConfig(),
                        schedule_steps=METRICS["steps"], progress=False)
    assert rows[0]["val_loss"] == pytest.approx(float(logged[0]["val_loss"]), abs=1e-4)
    again = [r["train_loss"] for r in rows[1:]]
    assert again == pytest.approx([float(r["train_loss"]) for r in logged[1: steps + 1]], abs=1e-4)
    assert [r["lr"] for r in rows[1:]] == pytest.approx([float(r["lr"]) for r in logged[1: steps + 1]], abs=1e-12)
    # The check can fail: with the peak rate doubled, step 2 (the first after an update) leaves the bound.
    _, off = train.run(steps=2, batch_size=METRICS["batch_size"], max_lr=2 * METRICS["max_lr"],
                       min_lr=METRICS["min_lr"], warmup=METRICS["warmup"], weight_decay=METRICS["weight_decay"],
                       eval_every=METRICS["steps"], threads=METRICS["threads"], config=GPTConfig(),
                       schedule_steps=METRICS["steps"], progress=False)
    assert off[2]["train_loss"] != pytest.approx(float(logged[2]["train_loss"]), abs=1e-4)


def test_optimizer_comparison_reproduces_its_logged_losses():
    """The committed optimizer comparison: a sweep of every optimizer, and the first three steps of
    each optimizer's best run re-run here give the logged training losses."""
    from kernels.model import optimizers

    results = json.loads(optimizers.RESULTS.read_text())
    assert {r["optimizer"] for r in results["runs"]} == set(optimizers.SWEEP)
    assert [r["peak_lr"] for r in results["runs"]] == [lr for lrs in optimizers.SWEEP.values() for lr in lrs]
    torch.set_num_threads(results["threads"])
    for name, best in optimizers.best_runs(results).items():
        again = optimizers.run(name, best["peak_lr"], steps=3, schedule_steps=results["steps"],
                               batch_size=results["batch_size"], eval_every=100, config=GPTConfig(), progress=False)
        assert again["train_loss"] == pytest.approx(best["train_loss"][:3], abs=1e-3), name


def test_optimizer_seed_runs_reproduce_their_logged_losses():
    """The committed seed spread: every optimizer's best rate again at other seeds, and the first three
    steps of each seed's AdamW run re-run here give the logged losses (and differ from the sweep's seed)."""
    from kernels.model import optimizers

    results = json.loads(optimizers.RESULTS.read_text())
    spread = json.loads(optimizers.SEED_RESULTS.read_text())
    best = optimizers.best_runs(results)
    assert len(spread["seeds"]) >= 2 and results["seed"] not in spread["seeds"]
    assert sorted((r["optimizer"], r["seed"]) for r in spread["runs"]) == sorted(
        (name, seed) for name in optimizers.SWEEP for seed in spread["seeds"])
    assert all(r["peak_lr"] == best[r["optimizer"]]["peak_lr"] for r in spread["runs"])
    torch.set_num_threads(spread["threads"])
    for seed in spread["seeds"]:
        logged = next(r for r in spread["runs"] if r["seed"] == seed and r["optimizer"] == "AdamW")
        again = optimizers.run("AdamW", logged["peak_lr"], steps=3, schedule_steps=spread["steps"],
                               batch_size=spread["batch_size"], eval_every=100, config=GPTConfig(),
                               progress=False, seed=seed)
        assert again["train_loss"] == pytest.approx(logged["train_loss"][:3], abs=1e-3), seed
        assert again["train_loss"][0] != pytest.approx(best["AdamW"]["train_loss"][0], abs=1e-3)


def test_unknown_optimizer_is_refused():
    from kernels.model import optimizers

    with pytest.raises(ValueError, match="unknown optimizer 'Lion'"):
        optimizers.make_optimizer("Lion", GPT(GPTConfig()), 1e-3)
