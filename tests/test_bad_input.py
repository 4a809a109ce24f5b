"""Bad input, hostile files and interrupted work (issue 11): each ends in a `kiln: error:` naming the
bad value (exit 2, no traceback) or a loud fallback, and nothing half-written is left behind."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main

TINY = ["--device", "cpu", "--steps", "2", "--eval-interval", "2", "--batch-size", "2", "--seq-len", "16",
        "--set", "n_layer=1", "--set", "n_embd=16", "--set", "n_head=2", "--no-progress"]


def cli(capsys, *argv):
    """(exit status, stdout, stderr) of `kiln argv...` run in this process."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# 1 ------------------------------------------------------------------ model settings are type-checked
@pytest.mark.parametrize("setting,message", [
    ("dropout=abc", "model.dropout must be a number, got 'abc'"),
    ("bias=maybe", "model.bias must be true or false, got 'maybe'"),
    ("tie_weights=maybe", "model.tie_weights must be true or false, got 'maybe'"),
    ("n_layer=true", "model.n_layer must be a positive integer, got True"),
    ("n_embd=1.5", "model.n_embd must be a positive integer, got 1.5"),
])
def test_model_settings_are_type_checked(tmp_path, capsys, setting, message):
    code, _, err = cli(capsys, "train", "--set", setting, "--out", tmp_path / "runs")
    assert code == 2 and message in err, err
    assert not (tmp_path / "runs").exists()


def test_model_settings_of_the_right_type_pass():
    from kiln.nn import GPTConfig, preset
    cfg = preset("tiny", dropout=0, bias=False, n_layer=2)  # an int is a fine float
    assert cfg.dropout == 0 and cfg.bias is False and cfg.n_layer == 2
    with pytest.raises(Exception, match="model.vocab_size must be a positive integer, got 256.0"):
        GPTConfig(vocab_size=256.0)


# 2 ------------------------------------------------------------------ a damaged meta.json
def prepared(tmp_path, name="data", text=None):
    """A small byte-level data folder made by `kiln prepare`."""
    from kiln.data.prepare import prepare
    rng = np.random.default_rng(0)
    words = ["the", "model", "reads", "a", "token", "shard", "and", "learns", "from", "it"]
    src = tmp_path / f"{name}.txt"
    src.write_text(text or "".join(" ".join(rng.choice(words, 12)) + "\n" for _ in range(4000)))
    prepare([src], tmp_path / name, tokenizer="bytes", val_fraction=0.1, progress=False)
    return tmp_path / name


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe{", "not UTF-8 JSON"),
    (b"[1, 2]", "holds a list, not an object"),
    (b'{"splits": []}', "'splits' must map train and val to their shards"),
    (b'{"splits": {"train": {"shards": "x.bin"}}}', "must map train and val to their shards"),
])
def test_a_damaged_meta_json_is_an_error_naming_it(tmp_path, capsys, content, message):
    data = prepared(tmp_path)
    (data / "meta.json").write_bytes(content)
    code, _, err = cli(capsys, "train", "--data", data, "--out", tmp_path / "runs", *TINY)
    assert code == 2 and "meta.json" in err and message in err, err


# 3 ------------------------------------------------------------------ an output path that is a file
def test_train_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    code, _, err = cli(capsys, "train", "--out", tmp_path / "f", *TINY)
    assert code == 2 and "--out" in err and "is a file" in err, err
    assert (tmp_path / "f").read_text() == "mine"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One small finished run folder, trained once for this file."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", "--out", str(out), "--name", "run", *TINY]) == 0
    return out / "run"


@pytest.fixture
def finished_run(tmp_path, trained):
    """A copy of the finished run, this test's to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def test_export_to_a_file(tmp_path, capsys, finished_run):
    run = finished_run
    (tmp_path / "f").write_text("mine")
    code, _, err = cli(capsys, "export", run, tmp_path / "f")
    assert code == 2 and "is a file" in err, err
    assert (tmp_path / "f").read_text() == "mine"


# 4 ------------------------------------------------------------------ a damaged run folder
def _edit_config(run, edit):
    config = json.loads((run / "config.json").read_text())
    edit(config)
    (run / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage,message", [
    (lambda run: (run / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"),
     "model.safetensors: not a readable safetensors file"),
    (lambda run: _edit_config(run, lambda c: c.pop("model")), "config.json has no 'model' settings"),
    (lambda run: _edit_config(run, lambda c: c["model"].update(n_expert=8)), "unknown model settings ['n_expert']"),
    (lambda run: _edit_config(run, lambda c: c["model"].update(n_embd=4096, n_layer=5000, n_head=32)),
     "the weights do not fit the model's config: missing ['h.1."),  # before 5000 layers are allocated
    (lambda run: _edit_config(run, lambda c: c["model"].update(n_embd=32)),
     "wte.weight has shape (320, 16) in the file; the config needs (320, 32)"),
    (lambda run: (run / "config.json").write_bytes(b"\xff"), "config.json: not UTF-8 JSON"),
])
@pytest.mark.parametrize("command", ["sample", "export", "init-from"])
def test_a_damaged_run_folder_is_an_error_naming_the_damage(tmp_path, capsys, finished_run, damage, message,
                                                             command):
    run = finished_run
    damage(run)
    argv = {"sample": ["sample", run, "--tokens", "3"], "export": ["export", run, tmp_path / "hf"],
            "init-from": ["train", "--init-from", run, "--out", tmp_path / "r2", *TINY[:-9]]}[command]
    code, _, err = cli(capsys, *argv)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_parameter_shapes_are_the_models(bias, tie):
    from kiln.nn import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=77, block_size=9, n_layer=3, n_head=2, n_embd=6, bias=bias, tie_weights=tie)
    assert cfg.parameter_shapes() == {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}


# 5 ------------------------------------------------------------------ an HF config.json missing a size
@pytest.mark.parametrize("key", ["vocab_size", "n_positions", "n_layer", "n_head", "n_embd"])
def test_import_of_a_config_without_a_size(tmp_path, capsys, finished_run, key):
    assert cli(capsys, "export", finished_run, tmp_path / "hf")[0] == 0
    _edit_config(tmp_path / "hf", lambda c: c.pop(key))
    code, _, err = cli(capsys, "import", tmp_path / "hf", "--out", tmp_path / "imported")
    assert code == 2 and f"config.json has no {key!r}" in err, err
    assert not (tmp_path / "imported").exists()


# 6 ------------------------------------------------------------------ a crafted checkpoint table
def test_a_shape_whose_product_overflows_int64_is_a_corrupt_file_and_resume_falls_back(tmp_path):
    import struct

    from kiln.checkpoint import CheckpointFolder, format, save
    rng = np.random.default_rng()
    folder = CheckpointFolder(tmp_path)
    folder.prepare()
    states = {step: {"w": rng.standard_normal(4).astype(np.float32), "step": step} for step in (1, 2)}
    for step, state in states.items():
        folder.commit(save(folder.path_for(step), state))
    raw = folder.path_for(2).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8:8 + n])
    meta = table.pop("__metadata__")
    table["w"]["shape"] = [4, 2**62 + 1]  # 2**64 + 4 elements: 4 in int64 arithmetic
    meta["kiln.checksum"] = format._ZERO_SHA
    header = format._header(table, meta)
    assert len(header) == n
    meta["kiln.checksum"] = format._checksum(raw[:8], header, format._ZERO_SHA)  # a valid checksum
    folder.path_for(2).write_bytes(raw[:8] + format._header(table, meta) + raw[8 + n:])
    reports = []
    state, path = folder.load_latest(report=reports.append)
    assert path == folder.path_for(1) and np.array_equal(state["w"], states[1]["w"])
    assert "ckpt-00000002.kiln" in reports[0] and "inconsistent offsets" in reports[0], reports


def test_any_failure_to_load_one_checkpoint_falls_back(tmp_path, monkeypatch):
    from kiln.checkpoint import CheckpointFolder, run_folder, save
    folder = CheckpointFolder(tmp_path)
    folder.prepare()
    for step in (1, 2):
        folder.commit(save(folder.path_for(step), {"w": np.random.default_rng().standard_normal(3), "step": step}))
    real = run_folder.load

    def load(path):
        if path.name == "ckpt-00000002.kiln":
            raise ValueError("a failure no check foresaw")
        return real(path)

    monkeypatch.setattr(run_folder, "load", load)
    reports = []
    state, path = folder.load_latest(report=reports.append)
    assert path == folder.path_for(1) and state["step"] == 1
    assert "a failure no check foresaw" in reports[0]


# 7 ------------------------------------------------------------------ sample's numbers
@pytest.mark.parametrize("flag,value,message", [
    ("--tokens", -5, "max_new_tokens must be an integer >= 0, got -5"),
    ("--temperature", -1, "temperature must be >= 0 (0: always the likeliest token), got -1.0"),
    ("--top-k", 0, "top_k must be an integer >= 1 or None, got 0"),
])
def test_sample_refuses_bad_numbers(capsys, trained, flag, value, message):
    code, out, err = cli(capsys, "sample", trained, flag, value)
    assert code == 2 and message in err and out == "", err


# 8 ------------------------------------------------------------------ export keeps the user's files
def test_export_into_a_non_empty_folder_needs_overwrite(tmp_path, capsys, finished_run):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("mine")
    code, _, err = cli(capsys, "export", finished_run, out)
    assert code == 2 and "is not empty" in err and "--overwrite" in err, err
    assert (out / "config.json").read_text() == "mine" and not (out / "model.safetensors").exists()
    code, _, err = cli(capsys, "export", finished_run, out, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


def test_export_with_a_bad_vocab_size_writes_nothing(tmp_path, capsys, finished_run):
    code, _, err = cli(capsys, "export", finished_run, tmp_path / "hf", "--vocab-size", 100000)
    assert code == 2 and "export vocab_size 100000" in err, err
    assert not (tmp_path / "hf").exists()


# 9 ------------------------------------------------------------------ prepare: all or nothing
def test_a_failed_prepare_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("fine text\n" * 3000)
    (tmp_path / "b.txt").write_bytes(b"x" * 20_000 + b"\xff rest\n")
    code, _, err = cli(capsys, "prepare", tmp_path / "a.txt", tmp_path / "b.txt", "--out", tmp_path / "data",
                       "--tokenizer", "bytes", "--val-fraction", 0, "--shard-tokens", 1000, "--workers", 1,
                       "--no-progress")
    assert code == 2 and "b.txt: not UTF-8 text (invalid start byte at byte 20000)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_prepare_of_a_source_tree_skips_caches_and_binaries(tmp_path, capsys):
    tree = tmp_path / "pkg"
    for rel, content in [("pkg/__init__.py", b""), ("pkg/mod.py", b"def f():\n    return 1\n" * 500),
                         ("pkg/__pycache__/mod.cpython-311.pyc", b"\xa7\r\r\n\0\0\xff"),
                         (".git/objects/ab", b"x\x9c\xff"), ("logo.png", b"\x89PNG\r\n\x1a\n\0\0\xff"),
                         ("README.md", b"# pkg\n" * 300)]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(content)
    code, out, err = cli(capsys, "prepare", tree, "--out", tmp_path / "data", "--tokenizer", "bytes",
                         "--val-fraction", 0, "--workers", 1, "--no-progress")
    assert code == 0, err
    assert "skipped 2 hidden or cache folders, 1 binary files" in out, out
    from kiln.data.shards import open_shard
    text = bytes(int(t) for t in open_shard(tmp_path / "data" / "train_000000.bin") if t < 256)
    assert text == b"# pkg\n" * 300 + b"def f():\n    return 1\n" * 500  # README.md, then pkg/mod.py
    code, out, err = cli(capsys, "prepare", tree, "--out", tmp_path / "py", "--tokenizer", "bytes",
                         "--val-fraction", 0, "--workers", 1, "--no-progress", "--glob", "*.py")
    assert code == 0, err
    text = bytes(int(t) for t in open_shard(tmp_path / "py" / "train_000000.bin") if t < 256)
    assert text == b"def f():\n    return 1\n" * 500


def test_train_refuses_shards_without_meta_json_unless_told_the_vocabulary(tmp_path, capsys):
    data = prepared(tmp_path)
    (data / "meta.json").unlink()  # as an interrupted prepare of an older kiln left it
    code, _, err = cli(capsys, "train", "--data", data, "--out", tmp_path / "runs", *TINY)
    assert code == 2 and "has no meta.json" in err and "--vocab-size" in err, err
    code, _, err = cli(capsys, "train", "--data", data, "--out", tmp_path / "runs", "--vocab-size", 257, *TINY)
    assert code == 0, err


# 10 ----------------------------------------------------------------- bad token ids, found at the start
def test_a_bad_token_in_a_later_shard_is_found_when_the_data_is_opened(tmp_path, capsys):
    from kiln.data.loader import ShardLoader
    from kiln.data.prepare import prepare
    from kiln.data.shards import HEADER_BYTES
    (tmp_path / "t.txt").write_text("".join(f"line {i} of the text\n" for i in range(3000)))
    prepare([tmp_path / "t.txt"], tmp_path / "data", tokenizer="bytes", val_fraction=0, shard_tokens=20_000,
            progress=False)
    second = tmp_path / "data" / "train_000001.bin"
    raw = bytearray(second.read_bytes())
    at = int(np.random.default_rng().integers(0, 1000))
    raw[HEADER_BYTES + 2 * at:HEADER_BYTES + 2 * at + 2] = (300).to_bytes(2, "little")
    second.write_bytes(bytes(raw))
    with pytest.raises(Exception, match=f"train_000001.bin: token 300 at position {at} is outside the "
                                        "vocabulary 0..256"):
        ShardLoader(tmp_path / "data", "train", batch_size=2, seq_len=8)
    code, _, err = cli(capsys, "train", "--data", tmp_path / "data", "--out", tmp_path / "runs", *TINY)
    assert code == 2 and "train_000001.bin: token 300" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_data_error_mid_run_saves_a_checkpoint_first(tmp_path, monkeypatch):
    from kiln.errors import DataError
    from kiln.train import TrainConfig, Trainer
    cfg = TrainConfig(model_overrides={"n_layer": 1, "n_embd": 16, "n_head": 2}, batch_size=2, seq_len=16,
                      device="cpu", progress=False, max_steps=6, eval_interval=6, eval_iters=1, sample_tokens=0,
                      out_dir=str(tmp_path), run_name="r")
    trainer = Trainer(cfg)
    real = trainer.train_loader.next_batch

    def next_batch():
        if trainer.step == 3:
            raise DataError("shard.bin: changed while training")
        return real()

    monkeypatch.setattr(trainer.train_loader, "next_batch", next_batch)
    with pytest.raises(DataError, match="changed while training.*saved step 3.*--resume"):
        trainer.fit()
    resumed = Trainer.from_checkpoint(tmp_path / "r")
    assert resumed.step == 3 and resumed.fit()["steps"] == 6


# 11 ----------------------------------------------------------------- a second Ctrl-C says what was lost
@pytest.mark.parametrize("checkpoint_interval,message", [
    (0, "nothing was saved: 3 steps lost"),
    (2, "the newest checkpoint is step 2 (1 step lost)"),
])
def test_a_second_ctrl_c_says_what_was_saved(tmp_path, capsys, monkeypatch, checkpoint_interval, message):
    from kiln.train import Trainer
    real = Trainer.train_step

    def train_step(self, eager=False):
        if self.step == 3:
            raise KeyboardInterrupt  # what the second SIGINT raises inside the step
        return real(self, eager)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    code, _, err = cli(capsys, "train", "--out", tmp_path, "--name", "r", "--sync-checkpoint",
                       "--checkpoint-interval", checkpoint_interval, *TINY[:3], 10, *TINY[4:])
    assert code == 130 and "interrupted at step 3" in err and message in err, err


# 12 ----------------------------------------------------------------- temporary files of crashed saves
def test_prepare_removes_every_temporary_file_a_crashed_save_left(tmp_path):
    from kiln.checkpoint import CheckpointFolder
    folder = CheckpointFolder(tmp_path)
    left = [".latest.json.tmp-4242", ".ckpt-00000007.kiln.tmp-4242"]
    for name in left + ["ckpt-00000006.kiln", "latest.json"]:
        (tmp_path / name).write_bytes(b"x")
    folder.prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000006.kiln", "latest.json"]


# 13 ----------------------------------------------------------------- named files stay in their folder
@pytest.mark.parametrize("name", ["../outside/train_000000.bin", "/etc/passwd", "sub/../../x.bin"])
def test_meta_json_cannot_name_a_shard_outside_its_folder(tmp_path, capsys, name):
    data = prepared(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "train_000000.bin").write_bytes((data / "train_000000.bin").read_bytes())
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["train"]["shards"] = [name]
    (data / "meta.json").write_text(json.dumps(meta))
    code, _, err = cli(capsys, "train", "--data", data, "--out", tmp_path / "runs", *TINY)
    assert code == 2 and f"names {name!r}" in err and "inside" in err, err


@pytest.mark.parametrize("name", ["../elsewhere/model.safetensors", "/etc/passwd"])
def test_an_hf_index_cannot_name_weights_outside_its_folder(tmp_path, capsys, finished_run, name):
    assert cli(capsys, "export", finished_run, tmp_path / "elsewhere")[0] == 0
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((tmp_path / "elsewhere" / "config.json").read_text())
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"transformer.wte.weight": name}}))
    code, _, err = cli(capsys, "import", hf, "--out", tmp_path / "imported")
    assert code == 2 and f"names {name!r}" in err and "inside" in err, err


# 14 ----------------------------------------------------------------- the final weights carry a digest
@pytest.mark.parametrize("command", ["sample", "export"])
def test_a_flipped_byte_in_model_safetensors_is_found(tmp_path, capsys, finished_run, command):
    raw = bytearray((finished_run / "model.safetensors").read_bytes())
    at = len(raw) - 1 - int(np.random.default_rng().integers(0, 4000))  # inside some weight
    raw[at] ^= 0x01
    (finished_run / "model.safetensors").write_bytes(bytes(raw))
    argv = ["sample", finished_run, "--tokens", 3] if command == "sample" else ["export", finished_run, tmp_path / "hf"]
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "model.safetensors: checksum mismatch" in err, err


# 15 ----------------------------------------------------------------- a run without a tokenizer
def test_an_imported_run_without_a_tokenizer_exports_and_sample_says_why_not(tmp_path, capsys, finished_run):
    assert cli(capsys, "export", finished_run, tmp_path / "hf")[0] == 0
    for p in (tmp_path / "hf").glob("*tokenizer*"):
        p.unlink()
    assert cli(capsys, "import", tmp_path / "hf", "--out", tmp_path / "imported")[0] == 0
    code, _, err = cli(capsys, "export", tmp_path / "imported", tmp_path / "hf2")
    assert code == 0, err
    a, b = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "hf2"))
    assert a["n_embd"] == b["n_embd"] == 16 and a["vocab_size"] == b["vocab_size"]
    code, _, err = cli(capsys, "sample", tmp_path / "imported")
    assert code == 2 and "holds no tokenizer" in err and "tokenizer.json" in err, err


# 16 ----------------------------------------------------------------- the exported stop token
def test_export_writes_the_tokenizers_end_of_text_id(tmp_path, capsys, finished_run):
    assert cli(capsys, "export", finished_run, tmp_path / "hf")[0] == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 256  # the byte tokenizer's <|endoftext|>
    assert generation["bos_token_id"] == generation["eos_token_id"] == 256


def test_export_of_a_bpe_run_loads_in_transformers_with_its_stop_token(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kiln.checkpoint import export_hf
    from kiln.data.tokenizer import BPETokenizer
    from kiln.nn import GPT, GPTConfig
    rng = np.random.default_rng()
    words = ["alpha", "beta", "gamma", "delta", "omega", "kiln", "shard"]
    tok = BPETokenizer.train((" ".join(rng.choice(words, 30)) for _ in range(200)), 300)
    tok.save(tmp_path / "run")
    model = GPT(GPTConfig(vocab_size=320, block_size=16, n_layer=1, n_head=2, n_embd=8))
    export_hf(model, tmp_path / "hf", tokenizer_dir=tmp_path / "run")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == tok.eot_id
    assert hf_tok("alpha beta")["input_ids"] == tok.encode("alpha beta")
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert gen.eos_token_id == tok.eot_id


# 17 ----------------------------------------------------------------- llm.c shards; what an import carries
def test_train_on_shards_alone_with_vocab_size_or_a_tokenizer(tmp_path, capsys):
    data = prepared(tmp_path)
    (data / "meta.json").unlink()
    shutil.move(data / "bytes-tokenizer.json", tmp_path / "bytes-tokenizer.json")  # shards alone, as llm.c's
    code, out, err = cli(capsys, "train", "--data", data, "--vocab-size", 257, "--out", tmp_path, "--name", "a", *TINY)
    assert code == 0 and "no sample: the data has no tokenizer" in out, err
    code, out, err = cli(capsys, "train", "--data", data, "--tokenizer", tmp_path / "bytes-tokenizer.json",
                         "--out", tmp_path, "--name", "b", *TINY)
    assert code == 0 and "sample:\nThe " in out, err
    a, b = (json.loads((tmp_path / r / "summary.json").read_text()) for r in "ab")
    assert a["final_val_loss"] == b["final_val_loss"]  # the same vocabulary, model and batches


def test_import_says_which_dropout_it_carried(tmp_path, capsys, finished_run):
    assert cli(capsys, "export", finished_run, tmp_path / "hf")[0] == 0
    _edit_config(tmp_path / "hf", lambda c: c.update(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    code, out, err = cli(capsys, "import", tmp_path / "hf", "--out", tmp_path / "imported")
    assert code == 0, err
    assert "dropout 0.1 (resid_pdrop)" in out and "attn_pdrop 0.1 is not carried" in out, out
    assert "--set dropout=0" in out


# 18 ----------------------------------------------------------------- evaluation reads each window once
def test_evaluation_reads_each_validation_window_once_and_logs_its_tokens(tmp_path):
    from kiln.train import TrainConfig, Trainer
    data = prepared(tmp_path)
    val_tokens = json.loads((data / "meta.json").read_text())["splits"]["val"]["tokens"]
    cfg = TrainConfig(data=str(data), model_overrides={"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 128}, batch_size=16,
                      seq_len=128, device="cpu", progress=False, max_steps=1, eval_iters=20, sample_tokens=0,
                      out_dir=str(tmp_path / "runs"))
    trainer = Trainer(cfg)
    windows = (val_tokens - 1) // (16 * 128)
    assert 0 < windows < 20  # a split smaller than eval_iters batches
    seen = []
    real = trainer.val_loader.next_batch

    def next_batch():
        x, y = real()
        seen.append(x.tobytes())
        return x, y

    trainer.val_loader.next_batch = next_batch
    s = trainer.fit()
    assert len(seen) == len(set(seen)) == windows
    row = json.loads((tmp_path / "runs" / s["run_dir"].split("/")[-1] / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["val_tokens"] == windows * 16 * 128


# 19 ----------------------------------------------------------------- where the vocabulary came from
def test_train_says_where_the_vocabulary_came_from(tmp_path, capsys):
    code, out, err = cli(capsys, "train", "--out", tmp_path, *TINY)
    assert code == 0, err
    assert "model vocab_size 320: the data's 257 tokens (" in out and "meta.json) padded to a multiple of 64, " \
        "not the preset's 256" in out, out


# 20 ----------------------------------------------------------------- a preset carries its recipe
def test_a_preset_carries_its_training_recipe_and_flags_override_it():
    from kiln.cli import build_parser
    from kiln.train import TrainConfig
    gpt2 = TrainConfig(model="gpt2-124m")  # the paper's Table 1
    assert (gpt2.lr, gpt2.min_lr, gpt2.warmup_steps, gpt2.max_steps, gpt2.global_batch) == \
        (6e-4, 6e-5, 715, 19_073, 524_288)
    assert (gpt2.weight_decay, gpt2.betas, gpt2.grad_clip) == (0.1, (0.9, 0.95), 1.0)
    assert TrainConfig(model="gpt2-2.4b").batch_size == 2 and TrainConfig(model="gpt2-2.4b").global_batch == 524_288
    tiny = TrainConfig()
    assert (tiny.lr, tiny.warmup_steps, tiny.global_batch, tiny.batch_size) == (2e-3, 40, None, 16)
    args = vars(build_parser().parse_args(["train", "--config", "gpt2-124m", "--lr", "3e-4", "--warmup-steps", "100"]))
    cfg = TrainConfig(**{k: v for k, v in args.items() if k in ("model", "lr", "warmup_steps") and v is not None})
    assert (cfg.lr, cfg.warmup_steps, cfg.max_steps) == (3e-4, 100, 19_073)
    assert abs(cfg.min_lr - 3e-5) < 1e-15  # the recipe's lr/10
    assert TrainConfig(model="gpt2-124m", grad_accum=4).global_batch is None  # grad_accum given: no global batch


def test_train_prints_its_recipe(tmp_path, capsys):
    code, out, err = cli(capsys, "train", "--out", tmp_path, *TINY)
    assert code == 0 and "recipe of tiny (flags override it): lr 0.002 -> 0.0002 (cosine), 40 warm-up steps, " \
        "2 steps" in out, out
