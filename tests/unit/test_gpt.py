import torch

from turbotrain.parts.models.gpt import GPT, GPTConfig, causal_mask, clear_mask_cache, mask_cache_size
from turbotrain.parts.models.gpt import model as gpt
from turbotrain.parts.models.loss import chunked_cross_entropy


def test_mask_cache_hits_per_length_device_dtype_and_clears():
    clear_mask_cache()
    a = causal_mask(8, torch.device("cpu"), torch.float32)
    assert causal_mask(8, torch.device("cpu"), torch.float32) is a  # hit: same object, built once
    assert causal_mask(8, torch.device("cpu"), torch.bfloat16) is not a
    assert causal_mask(9, torch.device("cpu"), torch.float32).shape == (9, 9)
    assert mask_cache_size() == 3
    assert a[0, 1] == float("-inf") and a[1, 0] == 0 and a[3, 3] == 0
    clear_mask_cache()
    assert mask_cache_size() == 0


def test_masked_forward_builds_the_mask_once(monkeypatch):
    clear_mask_cache()
    built = []
    real_full = torch.full
    monkeypatch.setattr(gpt.torch, "full", lambda *a, **k: built.append(a) or real_full(*a, **k))
    model = GPT(GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, block_size=16, attention="masked"))
    idx = torch.randint(32, (2, 12))
    model(idx)
    model(idx)
    assert len(built) == 1  # two layers x two forwards, one mask


def test_sdpa_path_equals_explicit_mask_path():
    torch.manual_seed(0)
    sdpa = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, block_size=16, attention="sdpa"))
    masked = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, block_size=16, attention="masked"))
    masked.load_state_dict(sdpa.state_dict())
    idx = torch.randint(64, (3, 16))
    torch.testing.assert_close(sdpa(idx), masked(idx), atol=1e-5, rtol=1e-5)
    # a user-supplied mask reaches the attention too
    custom = torch.zeros(16, 16).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(sdpa(idx, attn_mask=custom), sdpa(idx), atol=1e-5, rtol=1e-5)


def test_gpt2_small_size_and_tied_embeddings():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, n_layer=12, n_head=12, d_model=768, block_size=1024))
    assert model.lm_head.weight is model.wte.weight
    assert 123e6 < model.num_params(non_embedding=False) < 126e6


def test_flops_per_token_is_the_palm_formula():
    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, block_size=128))
    n = model.num_params()
    assert model.flops_per_token() == 6 * n + 12 * 4 * 4 * 32 * 128


def test_loss_starts_near_uniform_and_generate_extends():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, block_size=16))
    idx = torch.randint(256, (4, 16))
    loss = model(idx, torch.randint(256, (4, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3
    out = model.generate(idx[:1, :4], max_new_tokens=20)
    assert out.shape == (1, 24)


def test_chunked_loss_equals_the_full_loss_and_its_gradients():
    """The fused, chunked linear + cross-entropy is the same math as logits -> cross_entropy (fp32)."""
    cfg = dict(vocab_size=97, n_layer=2, n_head=2, d_model=32, block_size=24)
    torch.manual_seed(0)
    full = GPT(GPTConfig(**cfg))
    chunked = GPT(GPTConfig(**cfg, loss="chunked"))
    chunked.load_state_dict(full.state_dict())
    x, y = torch.randint(97, (3, 24)), torch.randint(97, (3, 24))
    a, b = full(x, y), chunked(x, y)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    a.backward()
    b.backward()
    for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(chunked(x, y), full(x, y), rtol=0, atol=1e-5)
    h, w, t = (
        torch.randn(10, 8, requires_grad=True),
        torch.randn(13, 8, requires_grad=True),
        torch.randint(13, (10,)),
    )
    loss = chunked_cross_entropy(h, w, t, chunk=3)  # 4 chunks, the last one short
    (gh, gw) = torch.autograd.grad(loss, (h, w))
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t)
    torch.testing.assert_close(loss, ref)
    for got, want in zip((gh, gw), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(got, want)


def test_a_preferred_sdpa_backend_falls_back_where_it_is_unavailable():
    """cuDNN attention does not exist on a CPU: preferring it still runs (the next backend) and
    computes the same attention."""
    torch.manual_seed(0)
    auto = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, block_size=8))
    cudnn = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, block_size=8, sdpa_backend="cudnn"))
    cudnn.load_state_dict(auto.state_dict())
    x = torch.randint(50, (2, 8))
    torch.testing.assert_close(cudnn(x, x), auto(x, x))
