"""The Llama-style family (issue 42 item 4): grouped-query attention, rotary positions, tied or
untied embeddings, its FLOPs, its settings' rules."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from turbotrain import load_config
from turbotrain.app.bench.workloads import flops_per_step, resolve_workload
from turbotrain.base.errors import ConfigError
from turbotrain.parts.models import spec_for
from turbotrain.parts.models.build import build_named
from turbotrain.parts.models.llama import Llama, LlamaConfig, apply_rotary, rotary_angles
from turbotrain.parts.models.llama.model import Attention

SMALL = LlamaConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48, block_size=16)


def test_grouped_query_attention_shares_each_key_value_head_among_its_query_heads():
    torch.manual_seed(0)
    attn = Attention(SMALL)
    assert attn.q.weight.shape == (32, 32) and attn.kv.weight.shape == (2 * 2 * 8, 32)  # 2 kv heads of 8
    x = torch.randn(3, 10, 32)
    cos, sin = rotary_angles(10, 8, SMALL.rope_theta, x.device)
    y = attn(x, cos, sin)
    assert y.shape == (3, 10, 32)
    # by hand: each key/value head repeated for its 2 query heads, causal softmax attention
    q = apply_rotary(attn.q(x).view(3, 10, 4, 8).transpose(1, 2), cos, sin)
    k, v = attn.kv(x).view(3, 10, 2, 2, 8).permute(2, 0, 3, 1, 4)
    k, v = apply_rotary(k, cos, sin).repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(3, 10, 32))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_rotary_scores_depend_only_on_the_distance_between_positions():
    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)
    cos, sin = rotary_angles(40, 16, 10000.0, torch.device("cpu"))
    qs = apply_rotary(q.expand(1, 1, 40, 16), cos, sin)[0, 0]
    ks = apply_rotary(k.expand(1, 1, 40, 16), cos, sin)[0, 0]
    for m, n, shift in [(5, 2, 7), (9, 9, 30), (0, 12, 20)]:
        torch.testing.assert_close(qs[m] @ ks[n], qs[m + shift] @ ks[n + shift], atol=1e-4, rtol=1e-5)
    assert not torch.allclose(qs[5] @ ks[2], qs[5] @ ks[3])  # the distance does matter
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(40))  # a rotation keeps lengths
    torch.testing.assert_close(qs[0], q)  # position 0 is not turned


def test_tied_embeddings_share_storage_and_untied_ones_do_not():
    tied, untied = Llama(SMALL), Llama(LlamaConfig(**{**vars(SMALL), "tie_embeddings": False}))
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    n_tied, n_untied = (sum(p.numel() for p in m.parameters()) for m in (tied, untied))
    assert n_untied - n_tied == 64 * 32
    opt = torch.optim.SGD(tied.parameters(), lr=0.1)
    x = torch.randint(64, (2, 17))
    tied(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    assert torch.equal(tied.lm_head.weight, tied.wte.weight)  # one tensor, trained once
    assert set(tied.state_dict()) >= {"wte.weight", "lm_head.weight"}


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_counts_the_matmuls_torch_counts_and_the_attention(tie):
    """6N + 12 L H Q T per token: torch's FLOP counter sees the matmuls of a forward and backward
    (6 x the weights that multiply, the output layer once; an untied input embedding is a lookup);
    the formula adds the norms' few weights and attention's score and value matmuls (this CPU's
    SDPA kernel has no FLOP formula in the counter)."""
    model = Llama(LlamaConfig(**{**vars(SMALL), "tie_embeddings": tie}))
    x = torch.randint(64, (2, 17))
    with FlopCounterMode(display=False) as counter:
        model(x[:, :-1], x[:, 1:]).backward()
    tokens, norms = 2 * 16, (2 * 2 + 1) * 32
    matmul_weights = 2 * (32 * 32 + 2 * 2 * 8 * 32 + 32 * 32 + 32 * 96 + 48 * 32) + 64 * 32
    assert counter.get_total_flops() == 6 * matmul_weights * tokens
    attention = 12 * 2 * 4 * 8 * 16
    assert model.flops_per_token(16) == 6 * (matmul_weights + norms) + attention


def test_the_loss_at_initialisation_is_uniform_and_falls_when_trained():
    torch.manual_seed(0)
    model = Llama(SMALL)
    x = torch.randint(64, (8, 17))
    first = model(x[:, :-1], x[:, 1:])
    assert first.item() == pytest.approx(math.log(64), abs=0.15)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        opt.zero_grad()
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
    assert model(x[:, :-1], x[:, 1:]).item() < first.item() - 1.0
    masked = Llama(LlamaConfig(**{**vars(SMALL), "attention": "masked"}))
    masked.load_state_dict(model.state_dict())
    torch.testing.assert_close(masked(x[:, :-1]), model(x[:, :-1]), atol=1e-5, rtol=1e-5)  # same math


def test_the_preset_builds_through_its_spec_and_its_rules_are_one_line():
    c = load_config("llama-tiny")
    spec = spec_for(c)
    assert spec.name == "llama" and spec.generates and spec.seq_len(c) == 128
    model = spec.build_model(c, 256)
    assert isinstance(model, Llama) and model.cfg.n_kv_head == 2 and model.cfg.ffn_hidden == 384
    assert spec.weight_count(c) <= sum(p.numel() for p in model.parameters())
    x, y = spec.random_batch(c, 256, torch.device("cpu"))(3)
    assert x.shape == y.shape == (3, 128)
    with pytest.raises(ConfigError, match="llama.n_kv_head = 3 must divide model.n_head = 4"):
        load_config("llama-tiny", {"llama": {"n_kv_head": "3"}})
    with pytest.raises(ConfigError, match="llama.n_kv_head configure model.arch = 'llama'"):
        load_config("gpt-tiny", {"llama": {"n_kv_head": "2"}})
    big = load_config("llama-125m")
    with torch.device("meta"):
        params = sum(p.numel() for p in spec_for(big).build_model(big, 50304).parameters())
    assert 115e6 < params < 130e6  # beside GPT-2 small's 124M


def test_scaled_dot_product_attention_is_called_causal_with_grouped_heads(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    Llama(SMALL)(torch.randint(64, (1, 8)))
    assert len(calls) == 2 and all(c["is_causal"] and c["enable_gqa"] for c in calls)


def test_the_bench_workload_has_the_presets_shape_and_counts_flops_by_the_formula():
    big = load_config("llama-125m")
    with torch.device("meta"):
        preset = spec_for(big).build_model(big, 50304)
    for device in ("cuda", "cpu"):
        w = resolve_workload("llama", device)
        flops, how = flops_per_step(w)
        with torch.device("meta"):
            model = build_named("llama", w.model_kwargs)
        assert flops == model.flops_per_token(w.seq_len) * w.batch_size * w.seq_len and how.startswith("PaLM")
        if device == "cuda":  # the GPU plan's row is the 121M preset itself
            assert (
                model.cfg == preset.cfg and model.num_params(False) == preset.num_params(False) == 121_228_032
            )
