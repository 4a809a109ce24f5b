"""Interchange with Hugging Face transformers: a small random GPT-2 made here gives the same logits
in both frameworks, after import (HF -> kiln), export (kiln -> HF) and through the CLI."""

import json
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.checkpoint import CheckpointError, export_hf, import_hf  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.nn import GPT, GPTConfig  # noqa: E402
from kiln.train import TrainConfig, Trainer, load_run  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


def random_hf_gpt2(folder, vocab=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie=True):
    """A GPT2LMHeadModel with random weights, biases and LayerNorm gains (so none is trivial), saved."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def kiln_logits(model, ids):
    model.eval()
    return model(kiln.tensor(ids))[0].numpy()


def assert_close(got, want):
    scale = np.abs(want).max()
    assert scale > 0.1  # logits of a random model, not zeros
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("tie", [True, False])
def test_import_gives_the_same_logits(tmp_path, tie):
    hf = random_hf_gpt2(tmp_path / "hf", tie=tie)
    ids = np.random.default_rng().integers(0, 97, (3, 20))
    model = import_hf(tmp_path / "hf")
    assert model.config.tie_weights is tie and model.config.vocab_size == 97
    assert_close(kiln_logits(model, ids), hf_logits(hf, ids))
    padded = import_hf(tmp_path / "hf", pad_vocab_to=64)  # 97 -> 128 rows, the real ones unchanged
    assert padded.config.vocab_size == 128
    assert_close(kiln_logits(padded, ids)[..., :97], hf_logits(hf, ids))


@pytest.mark.parametrize("bias,tie", [(True, True), (False, True), (True, False)])
def test_export_gives_the_same_logits_in_transformers(tmp_path, bias, tie):
    from transformers import GPT2LMHeadModel
    seed = int(np.random.SeedSequence().entropy % 2**31)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=bias, tie_weights=tie)
    model = GPT(cfg, generator=kiln.Generator(seed))
    for _, p in model.named_parameters():  # non-trivial LayerNorms and biases
        p.data += np.random.default_rng(seed).standard_normal(p.shape).astype(np.float32) * 0.05
    ids = np.random.default_rng().integers(0, 100, (2, 24))
    want = kiln_logits(model, ids)
    export_hf(model, tmp_path / "padded")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "padded").eval()
    assert json.loads((tmp_path / "padded" / "config.json").read_text())["vocab_size"] == 128
    assert_close(hf_logits(hf, ids), want)
    export_hf(model, tmp_path / "sliced", vocab_size=100)  # the tokenizer's size: rows sliced
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "sliced").eval()
    assert hf.config.vocab_size == 100
    assert_close(hf_logits(hf, ids), want[..., :100])
    back = dict(import_hf(tmp_path / "padded").named_parameters())  # and the round trip is lossless
    mine = dict(model.named_parameters())
    for name, q in back.items():
        want = mine[name].numpy() if name in mine else np.zeros(q.shape, np.float32)  # bias=False: zeros
        assert np.array_equal(q.numpy(), want), name


def test_cli_export_and_import_of_a_trained_run(tmp_path, capsys):
    from transformers import GPT2LMHeadModel
    Trainer(TrainConfig(model_overrides={"n_layer": 1, "n_embd": 32, "block_size": 32}, batch_size=4,
                        device="cpu", progress=False, max_steps=3, eval_interval=3, eval_iters=2,
                        sample_tokens=0, out_dir=str(tmp_path), run_name="r")).fit()
    model, _, _ = load_run(tmp_path / "r")
    ids = np.random.default_rng().integers(0, 256, (2, 16))
    assert main(["export", str(tmp_path / "r"), "--format", "hf", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert_close(hf_logits(hf, ids), kiln_logits(model, ids))
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert "--init-from" in capsys.readouterr().out
    back, tok, _ = load_run(tmp_path / "back")  # the kiln tokenizer travelled along
    assert tok.decode(tok.encode("kiln")) == "kiln"
    for (name, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        assert np.array_equal(q.numpy(), p.numpy()), name
    assert main(["export", str(tmp_path / "r"), "--format", "onnx", str(tmp_path / "x")]) == 2
    assert "allowed: hf" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_fine_tuning_starts_from_the_imported_weights(tmp_path):
    """init_from an HF folder: the first step's loss is transformers' loss on the same batch."""
    from kiln.data.corpus import bundled_dataset
    from kiln.data.loader import ShardLoader
    vocab = json.loads((bundled_dataset() / "meta.json").read_text()).get("padded_vocab_size") or 256
    hf = random_hf_gpt2(tmp_path / "hf", vocab=vocab, n_positions=64)
    cfg = TrainConfig(init_from=str(tmp_path / "hf"), batch_size=4, seq_len=32, device="cpu",
                      progress=False, max_steps=2, eval_interval=2, eval_iters=2, sample_tokens=0,
                      out_dir=str(tmp_path), run_name="ft")
    trainer = Trainer(cfg)
    assert trainer.model_config.n_embd == 32 and trainer.model_config.block_size == 64
    x, y = ShardLoader(trainer.data_dir, "train", batch_size=4, seq_len=32, seed=cfg.seed).next_batch()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(torch.tensor(x)).logits.reshape(-1, vocab),
                                                 torch.tensor(y).reshape(-1)).item()
    assert trainer.train_step()["loss"] == pytest.approx(want, rel=1e-6)


def test_bad_hf_folders_are_clear_errors(tmp_path):
    random_hf_gpt2(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(CheckpointError, match="activation_function 'relu'.*allowed gelu_new"):
        import_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(CheckpointError, match="do not match its config.json"):
        import_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama'; kiln imports 'gpt2'"):
        import_hf(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "pytorch_model.bin")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="safetensors only"):
        import_hf(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="no config.json"):
        import_hf(tmp_path / "nothing")
