"""`prepare`: text -> shards -> tokens -> text exactly, splits, shard sizes, bad input, the CLI."""

import json

import numpy as np
import pytest

from kiln.cli import main as kiln_main
from kiln.data.corpus import bundled_text
from kiln.data.loader import ShardLoader
from kiln.data.prepare import prepare
from kiln.data.shards import open_shard
from kiln.data.tokenizer import load_tokenizer
from kiln.errors import ConfigError, DataError

TEXT = bundled_text()
EOT = "<|endoftext|>"


def corpus_slices(rng, count, size):
    starts = rng.integers(0, len(TEXT) - size, size=count)
    return [TEXT[s:s + size] for s in starts]


def split_tokens(out, split):
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([open_shard(out / name) for name in meta["splits"][split]["shards"]])


def test_text_to_shards_to_text_is_exact(tmp_path):
    rng = np.random.default_rng()
    docs = corpus_slices(rng, 4, 30_000)
    docs[1] = docs[1].replace("\n", "\r\n") + " é漢🙂"
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "sub" / "b.md").write_bytes(docs[1].encode("utf-8"))
    (tmp_path / "dir" / "c.txt").write_text(docs[2], encoding="utf-8")
    (tmp_path / "dir" / ".hidden").write_text("not read")
    records = [docs[3][:10_000], "", docs[3][10_000:]]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(records)) + "\n")
    done = prepare([tmp_path / "a.txt", tmp_path / "dir", tmp_path / "d.jsonl"], tmp_path / "out",
                   tokenizer="bytes", val_fraction=0, progress=False)
    in_order = [docs[0], docs[2], docs[1], *records]  # a folder is read in sorted path order: c.txt, sub/b.md
    assert done.documents == 6 and done.vocab_size == 257 and done.padded_vocab_size == 320
    tokens = split_tokens(tmp_path / "out", "train")
    assert tokens.dtype == np.uint16 and done.tokens == {"train": len(tokens), "val": 0}
    tok = load_tokenizer(tmp_path / "out")
    assert tok.decode(tokens.tolist()) == "".join(EOT + d for d in in_order)


@pytest.fixture(scope="module")
def bpe_runs(tmp_path_factory):
    """The same BPE preparation with one worker and with two."""
    root = tmp_path_factory.mktemp("bpe")
    docs = corpus_slices(np.random.default_rng(), 3, 40_000)
    for i, d in enumerate(docs):
        (root / f"doc{i}.txt").write_text(d)
    runs = [prepare([root / f"doc{i}.txt" for i in range(3)], root / f"out{w}", tokenizer="bpe", vocab_size=700,
                    val_fraction=0, shard_tokens=6000, workers=w, progress=False) for w in (1, 2)]
    return docs, runs


def test_bpe_shards_hold_the_whole_documents_tokens(bpe_runs):
    docs, (done, _) = bpe_runs
    tok = load_tokenizer(done.out_dir)
    meta = json.loads((done.out_dir / "meta.json").read_text())
    assert (meta["vocab_size"], meta["padded_vocab_size"], meta["eot_id"]) == (700, 704, 0)
    assert (done.vocab_size, done.padded_vocab_size) == (700, 704)
    expected = [t for d in docs for t in [tok.eot_id, *tok.encode(d)]]  # each document encoded whole
    tokens = split_tokens(done.out_dir, "train")
    assert tokens.tolist() == expected  # cutting documents into pieces changed no token
    assert tok.decode(tokens.tolist()) == "".join(EOT + d for d in docs)


def test_workers_do_not_change_the_output(bpe_runs):
    _, (one, two) = bpe_runs
    assert one.shards == two.shards and one.tokens == two.tokens
    for name in ["meta.json", *one.shards["train"]]:
        if name == "meta.json":
            assert json.loads((one.out_dir / name).read_text())["splits"] == \
                json.loads((two.out_dir / name).read_text())["splits"]
        else:
            assert (one.out_dir / name).read_bytes() == (two.out_dir / name).read_bytes()


def test_shards_hold_shard_tokens_and_the_last_the_rest(bpe_runs):
    _, (done, _) = bpe_runs
    sizes = [len(open_shard(done.out_dir / n)) for n in done.shards["train"]]
    assert len(sizes) >= 3 and sizes[:-1] == [6000] * (len(sizes) - 1)
    assert 3000 <= sizes[-1] < 9000 and sum(sizes) == done.tokens["train"]


def test_validation_split_takes_whole_pieces_up_to_the_fraction(tmp_path):
    rng = np.random.default_rng()
    docs = [f"{i}: {s}" for i, s in enumerate(corpus_slices(rng, 300, int(rng.integers(200, 2000))))]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    done = prepare([tmp_path / "docs.jsonl"], tmp_path / "out", tokenizer="bytes", val_fraction=0.2,
                   text_field="body", progress=False)
    tok = load_tokenizer(tmp_path / "out")
    seen = {split: tok.decode(split_tokens(tmp_path / "out", split).tolist()).split(EOT)[1:] for split in ("train", "val")}
    assert sorted(seen["train"] + seen["val"]) == sorted(docs)  # every document once, in one split
    for split in seen:  # each split keeps the input order
        assert [docs.index(d) for d in seen[split]] == sorted(docs.index(d) for d in seen[split])
    share = done.tokens["val"] / (done.tokens["val"] + done.tokens["train"])
    assert 0.2 - 2100 / done.tokens["train"] < share <= 0.2


def test_prepared_folder_feeds_the_loader(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT[:120_000])
    prepare(tmp_path / "t.txt", tmp_path / "out", tokenizer="bytes", progress=False)
    for split in ("train", "val"):
        loader = ShardLoader(tmp_path / "out", split=split, batch_size=2, seq_len=64)
        x, y = loader.next_batch()
        tokens = split_tokens(tmp_path / "out", split)
        assert loader.vocab_size == 257
        np.testing.assert_array_equal(x.ravel(), tokens[:128])
        np.testing.assert_array_equal(y.ravel(), tokens[1:129])


def test_cli_arguments_run_prepare(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT[:60_000])
    assert kiln_main(["prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "out"), "--vocab-size", "300",
                      "--val-fraction", "0.25", "--shard-tokens", "5000", "--workers", "1", "--no-progress"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["shard_tokens"] == 5000
    printed = capsys.readouterr().out
    assert f"train: {meta['splits']['train']['tokens']:,} tokens" in printed
    assert kiln_main(["prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "again"), "--tokenizer",
                      str(tmp_path / "out" / "tokenizer.json"), "--val-fraction", "0", "--no-progress"]) == 0
    # a saved tokenizer.json is reused as is
    tok = load_tokenizer(tmp_path / "out")
    assert split_tokens(tmp_path / "again", "train").tolist() == [tok.eot_id, *tok.encode(TEXT[:60_000])]


def test_bad_inputs_raise_naming_file_and_fault(tmp_path):
    def run(inputs, **kwargs):
        return prepare(inputs, tmp_path / "out", tokenizer=kwargs.pop("tokenizer", "bytes"), progress=False,
                       overwrite=True, **kwargs)

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"content": "x"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp_path / "ok.txt").write_text("A small document.\n")
    cases = [
        (tmp_path / "nope.txt", "nope.txt: no such input file"),
        (tmp_path / "empty.txt", "the inputs hold no text: .*empty.txt is empty"),
        (tmp_path / "empty_dir", "empty_dir: the input folder holds no files"),
        (tmp_path / "latin1.txt", "latin1.txt: not UTF-8 text"),
        (tmp_path / "nofield.jsonl", r"nofield.jsonl:2: no string field 'text' \(the record has \['content'\]\)"),
        (tmp_path / "broken.jsonl", "broken.jsonl:2: not a JSON record"),
    ]
    for path, fault in cases:
        with pytest.raises(DataError, match=fault):
            run([path], val_fraction=0)
    with pytest.raises(DataError, match="val_fraction=0.1 put no text in validation"):
        run([tmp_path / "ok.txt"], val_fraction=0.1)
    for kwargs, fault in [(dict(tokenizer="bpe"), "needs vocab_size"),
                          (dict(vocab_size=500), "applies only to tokenizer='bpe'"),
                          (dict(tokenizer="gpt9"), "tokenizer='gpt9': allowed are 'bytes', 'bpe'"),
                          (dict(val_fraction=1.0), "0 <= val_fraction < 1"),
                          (dict(shard_tokens=0), "shard_tokens=0"),
                          (dict(workers=0), "workers=0")]:
        with pytest.raises(ConfigError, match=fault):
            run([tmp_path / "ok.txt"], **kwargs)


def test_an_earlier_run_is_not_mixed_in(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT[:50_000])
    prepare(tmp_path / "t.txt", tmp_path / "out", tokenizer="bytes", val_fraction=0, shard_tokens=4000, progress=False)
    assert (tmp_path / "out" / "train_000011.bin").exists()
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare(tmp_path / "t.txt", tmp_path / "out", tokenizer="bytes", progress=False)
    done = prepare(tmp_path / "t.txt", tmp_path / "out", tokenizer="bpe", vocab_size=400, val_fraction=0,
                   progress=False, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "tokenizer.json", "train_000000.bin"]
    assert load_tokenizer(tmp_path / "out").vocab_size == done.vocab_size == 400
