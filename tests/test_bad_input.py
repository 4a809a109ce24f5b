"""Bad input, hostile files and interrupted work (issue 11): each ends in a `kiln: error:` naming the
bad value (exit 2, no traceback) or a loud fallback, and nothing half-written is left behind."""

import json

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


def finished_run(tmp_path, capsys, name="run"):
    code, _, err = cli(capsys, "train", "--out", tmp_path, "--name", name, *TINY)
    assert code == 0, err
    return tmp_path / name


def test_export_to_a_file(tmp_path, capsys):
    run = finished_run(tmp_path, capsys)
    (tmp_path / "f").write_text("mine")
    code, _, err = cli(capsys, "export", run, tmp_path / "f")
    assert code == 2 and "is a file" in err, err
    assert (tmp_path / "f").read_text() == "mine"
