"""Tokenizers: exact round trips, and BPE ids against tiktoken's algorithm written out here."""

import base64
import json

import numpy as np
import pytest

from kiln.data.corpus import bundled_text
from kiln.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, padded_vocab_size
from kiln.errors import ConfigError, DataError

regex = pytest.importorskip("regex")  # \p{L} for the reference pre-tokenizer (installed with transformers)

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TEXT = bundled_text()


def gpt2_byte_chars():
    """GPT-2's encoder.py bytes_to_unicode, as a list indexed by byte."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiktoken_encode(ranks, text):
    """tiktoken's BPE: split by GPT-2's regex, then merge the lowest-ranked adjacent pair, leftmost first."""
    ids = []
    for chunk in regex.findall(GPT2_REGEX, text):
        parts = [bytes([b]) for b in chunk.encode()]
        while True:
            pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def random_text(rng, n=3000):
    """A random slice of the corpus with random non-ASCII characters (accents, CJK, emoji, CRLF) mixed in."""
    start = int(rng.integers(0, len(TEXT) - n))
    chars = list(TEXT[start:start + n])
    extras = ["é", "ß", "漢字", "🙂", "\r\n", "\u0301", "  ", "\t", "<|endoftext|>"]
    for i in rng.integers(0, len(chars), size=40):
        chars[i] = extras[int(rng.integers(len(extras)))]
    return "".join(chars)


@pytest.fixture(scope="module")
def trained():
    return BPETokenizer.train([TEXT[:150_000]], vocab_size=1000)


def ranks_of(bpe):
    """The trained vocabulary as tiktoken ranks: token bytes -> id."""
    unbyte = {c: b for b, c in enumerate(gpt2_byte_chars())}
    vocab = json.loads(bpe._hf.to_str())["model"]["vocab"]
    return {bytes(unbyte[c] for c in token): i for token, i in vocab.items() if token != "<|endoftext|>"}


def test_padded_vocab_size():
    assert padded_vocab_size(50257) == 50304
    assert [padded_vocab_size(n) for n in (1, 64, 65, 257)] == [64, 64, 128, 320]
    assert padded_vocab_size(100, multiple=128) == 128
    for bad in ((0, 64), (10, 0)):
        with pytest.raises(ConfigError, match="at least 1"):
            padded_vocab_size(*bad)


def test_bytes_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng()
    tok = ByteTokenizer()
    text = random_text(rng)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.eot_id, *ids]) == "<|endoftext|>" + text
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, ByteTokenizer) and again.encode(text) == ids and again.vocab_size == 257


def test_trained_bpe_matches_tiktoken_algorithm_and_round_trips(trained, tmp_path):
    rng = np.random.default_rng()
    assert trained.vocab_size == 1000 and trained.eot_id == 0
    ranks = ranks_of(trained)
    for _ in range(3):
        text = random_text(rng)
        ids = trained.encode(text)
        assert ids == tiktoken_encode(ranks, text)
        assert trained.decode(ids) == text
        assert len(ids) < 0.6 * len(text.encode())  # it compresses the English it was trained on
    trained.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.vocab_size == 1000 and again.encode(text) == ids


def test_literal_end_of_text_in_a_document_is_ordinary_text(trained):
    text = "a <|endoftext|> b"
    for tok in (trained, ByteTokenizer()):
        ids = tok.encode(text)
        assert tok.eot_id not in ids
        assert tok.decode(ids) == text


def write_tiktoken(path, ranks):
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))


def test_tiktoken_file_loads_with_the_recovered_merges(trained, tmp_path):
    rng = np.random.default_rng()
    ranks = {token: i - 1 for token, i in ranks_of(trained).items()}  # ranks 0..998, as tiktoken files have
    write_tiktoken(tmp_path / "small.tiktoken", ranks)
    tok = load_tokenizer(tmp_path / "small.tiktoken")
    assert tok.vocab_size == 1000 and tok.eot_id == 999  # end-of-text after the last rank, as GPT-2's 50256
    assert json.loads(tok._hf.to_str())["model"]["merges"] == json.loads(trained._hf.to_str())["model"]["merges"]
    for _ in range(3):
        text = random_text(rng)
        ids = tok.encode(text)
        assert ids == tiktoken_encode(ranks, text)
        assert ids == [i - 1 for i in trained.encode(text)]
        assert tok.decode(ids) == text
    tok.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").encode(text) == ids


def test_tiktoken_hand_made_ranks(tmp_path):
    ranks = {bytes([b]): b for b in range(256)} | {b"he": 256, b"ll": 257, b"hell": 258, b" hell": 259}
    write_tiktoken(tmp_path / "tiny.tiktoken", ranks)
    tok = load_tokenizer(tmp_path / "tiny.tiktoken")
    # "hello": he+ll -> hell, o; " hello" starts a chunk with its space: " "+hell -> " hell", o
    assert tok.encode("hello hello!") == [258, 111, 259, 111, 33]
    assert tok.vocab_size == 261 and tok.decode([258, 111, 260]) == "hello<|endoftext|>"


@pytest.mark.parametrize("lines, fault", [
    (["!!! 0"], ":1: expected '<base64 token> <rank>'"),
    (["IQ=="], ":1: expected"),
    (["IQ== x"], ":1: expected"),
    (["IQ== 0", "IQ== 1"], ":2: token b'!' is empty or listed twice"),
    ([f"{base64.b64encode(bytes([b])).decode()} {b + 1}" for b in range(256)], "rank 0 is missing"),
    ([f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(255)], "byte 0xff has no token"),
    ([], "holds no token ranks"),
])
def test_bad_tiktoken_files_raise(tmp_path, lines, fault):
    path = tmp_path / "bad.tiktoken"
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=fault) as caught:
        load_tokenizer(path)
    assert str(path) in str(caught.value)


def test_tiktoken_rank_that_is_not_a_merge_raises(tmp_path):
    ranks = {bytes([b]): b for b in range(256)} | {b"abc": 256}  # no "ab" or "bc" to merge from
    write_tiktoken(tmp_path / "x.tiktoken", ranks)
    with pytest.raises(DataError, match="b'abc' of rank 256 is not one merge"):
        load_tokenizer(tmp_path / "x.tiktoken")


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(DataError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a tokenizer.json"):
        load_tokenizer(tmp_path)


def test_decode_refuses_ids_outside_the_vocabulary(trained):
    for tok in (trained, ByteTokenizer()):
        with pytest.raises(DataError, match=f"token id {tok.vocab_size} is outside the vocabulary"):
            tok.decode([1, tok.vocab_size])


def test_bpe_needs_room_for_bytes_and_end_of_text():
    with pytest.raises(ConfigError, match="vocab_size=256"):
        BPETokenizer.train(["some text"], vocab_size=256)
