import numpy as np
import pytest

import kiln
from kiln.errors import ConfigError, KilnError, ShapeError
from kiln.nn import GPT, Linear, preset


def test_gpt_parameters_names_and_init():
    cfg = preset("tiny", n_layer=2)
    model = GPT(cfg, generator=kiln.Generator(0))
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and "lm_head.weight" not in names
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    std = np.std(model.h[0].attn.c_proj.weight.numpy())
    assert abs(std - 0.02 / np.sqrt(4)) < 0.001
    assert abs(np.std(model.h[0].mlp.c_fc.weight.numpy()) - 0.02) < 0.001
    untied = GPT(preset("tiny", n_layer=2, tie_weights=False))
    assert "lm_head.weight" in dict(untied.named_parameters())


def test_a_replaced_layer_keeps_its_place_in_the_parameter_order():
    model = GPT(preset("tiny", n_layer=2), generator=kiln.Generator(0))
    names = [n for n, _ in model.named_parameters()]
    model.wte = type(model.wte)(model.wte.weight.shape[0], model.wte.weight.shape[1])  # as tensor parallelism does
    model.h[0].attn.c_attn = Linear(128, 384)
    model.ln_f.weight = kiln.nn.module.Parameter(kiln.ones(128))
    assert [n for n, _ in model.named_parameters()] == names
    model.h[1].attn.c_proj = None  # another kind: gone from the order
    assert [n for n, _ in model.named_parameters()] == [n for n in names if not n.startswith("h.1.attn.c_proj")]


def test_presets_match_the_paper():
    m = preset("gpt2-124m")
    assert (m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd) == (50304, 1024, 12, 12, 768)
    big = preset("gpt2-2.4b")
    assert (big.n_layer, big.n_head, big.n_embd, big.n_embd // big.n_head) == (20, 24, 3072, 128)
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'"):
        preset("gpt5")
    with pytest.raises(ConfigError, match="multiple of model.n_head"):
        preset("tiny", n_head=3)


def test_state_dict_round_trip_and_strict_checks():
    a = GPT(preset("tiny", n_layer=1), generator=kiln.Generator(1))
    b = GPT(preset("tiny", n_layer=1), generator=kiln.Generator(2))
    b.load_state_dict(a.state_dict())
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)
    sd = a.state_dict()
    sd.pop("ln_f.bias")
    sd["extra"] = kiln.zeros(1)
    with pytest.raises(KilnError, match=r"missing keys \['ln_f.bias'\], unexpected keys \['extra'\]"):
        b.load_state_dict(sd)
    bad = a.state_dict()
    bad["wte.weight"] = kiln.zeros(3, 3)
    with pytest.raises(ShapeError, match="wte.weight"):
        b.load_state_dict(bad)


def test_train_eval_and_dtype_moves_keep_parameter_objects():
    m = GPT(preset("tiny", n_layer=1, dropout=0.1))
    params = list(m.parameters())
    m.eval()
    assert all(not mod.training for mod in m.modules())
    m.to(dtype="float64")
    assert all(p.dtype is kiln.float64 for p in m.parameters())
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    x = kiln.tensor(np.random.default_rng().integers(0, 256, (2, 8)))
    a, _ = m(x)
    b, _ = m(x)
    np.testing.assert_array_equal(a.numpy(), b.numpy())  # eval: dropout is off


def test_linear_layout_is_pytorchs():
    lin = Linear(3, 5)
    assert lin.weight.shape == (5, 3) and lin.bias.shape == (5,)


def test_bf16_compute_over_fp32_weights_tracks_fp32():
    cfg = preset("tiny", n_layer=2, vocab_size=64, block_size=16)
    model = GPT(cfg, generator=kiln.Generator(5))
    rng = np.random.default_rng()
    x, y = (kiln.tensor(rng.integers(0, 64, (2, 16))) for _ in range(2))
    _, ref = model(x, y)
    ref.backward()
    ref_grads = [p.grad.numpy().copy() for p in model.parameters()]
    model.zero_grad()
    model.compute_dtype = kiln.bfloat16
    logits, loss = model(x, y)
    loss.backward()
    assert logits is None and loss.dtype is kiln.float32  # the fused LM head makes no whole logits
    assert model(x)[0].dtype is kiln.bfloat16
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-2
    for p, g in zip(model.parameters(), ref_grads):
        assert p.grad.dtype is kiln.float32
        assert np.linalg.norm(p.grad.numpy() - g) <= 0.1 * np.linalg.norm(g) + 1e-6


def test_blocks_alone_give_the_fused_gpt_forward():
    """GPT.forward fuses each residual add with the LayerNorm after it (Block(x, h, next_ln));
    block(x) alone is the plain pre-norm block, and chaining those gives the same logits."""
    from kiln.nn import functional as F
    model = GPT(preset("tiny", n_layer=3, n_embd=32, block_size=8), generator=kiln.Generator(3)).to(dtype="float64")
    idx = kiln.tensor(np.random.default_rng(0).integers(0, 256, (2, 8)))
    logits, _ = model(idx)
    x = model.wte(idx) + model.wpe(kiln.arange(8))
    for b in model.h:
        alone = b(x)
        x = x + b.attn(b.ln_1(x))
        x = x + b.mlp(b.ln_2(x))
        np.testing.assert_array_equal(alone.numpy(), x.numpy())
    ref = F.linear(model.ln_f(x), model.wte.weight)
    np.testing.assert_array_equal(logits.numpy(), ref.numpy())
