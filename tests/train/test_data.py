"""Every --data format trains; readers agree on the tokens; the loader position is exact."""

import json

import numpy as np
import pytest

from megatrain.train import data, tokenizer

from _train_helpers import rows, train

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 8


def _make(kind: str, folder):
    folder.mkdir()
    ids = np.frombuffer(TEXT.encode(), dtype=np.uint8)
    if kind == "txt":
        (folder / "a.txt").write_text(TEXT)
        return folder / "a.txt"
    if kind == "folder":
        (folder / "sub").mkdir()
        (folder / "b.txt").write_text(TEXT[:300])
        (folder / "sub" / "c.txt").write_text(TEXT[300:])
        (folder / "ignored.md").write_text("not text data")
        return folder
    if kind == "jsonl":
        with open(folder / "d.jsonl", "w") as fh:
            for line in TEXT.splitlines():
                fh.write(json.dumps({"text": line, "id": 1}) + "\n")
        return folder / "d.jsonl"
    if kind == "bin16":
        ids.astype(np.uint16).tofile(folder / "ids.bin")
        return folder / "ids.bin"
    if kind == "bin32":
        ids.astype(np.uint32).tofile(folder / "ids.bin")
        return folder / "ids.bin"
    if kind == "npy":
        np.save(folder / "ids.npy", ids.astype(np.int32))
        return folder / "ids.npy"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["txt", "folder", "jsonl", "bin16", "bin32", "npy"])
def test_each_data_format_trains(tmp_path, kind):
    path = _make(kind, tmp_path / "data")
    extra = ["--data-dtype", "uint32"] if kind == "bin32" else []
    out = tmp_path / "run"
    assert train("--steps", "2", "--data", str(path), "--out", str(out), *extra) == 0
    assert [r["step"] for r in rows(out)] == [1, 2]


def test_readers_agree(tmp_path):
    tok = tokenizer.ByteTokenizer()
    expect = np.frombuffer(TEXT.encode(), dtype=np.uint8)
    for kind in ("txt", "bin16", "npy"):
        got = data.load_tokens(data.describe(_make(kind, tmp_path / kind)), tok, 256)
        assert np.array_equal(np.asarray(got, dtype=np.int64), expect), kind
    got = data.load_tokens(data.describe(_make("folder", tmp_path / "f")), tok, 256)
    assert tok.decode(got) == TEXT[:300] + "\n\n" + TEXT[300:]
    got = data.load_tokens(data.describe(_make("jsonl", tmp_path / "j")), tok, 256)
    assert tok.decode(got) == "\n\n".join(TEXT.splitlines())
    default = data.describe(None)
    assert default.path.name == "shakespeare.txt" and 100_000 < default.nbytes < 5_000_000


def test_bad_data_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(data.RefusedError, match="line 2"):
        data.load_tokens(data.describe(bad), tokenizer.ByteTokenizer(), 256)
    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 2, 300]))
    with pytest.raises(data.RefusedError, match="token id 300"):
        data.load_tokens(data.describe(big), tokenizer.ByteTokenizer(), 256)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(data.RefusedError, match="--data-dtype"):
        data.load_tokens(data.describe(odd), tokenizer.ByteTokenizer(), 256)
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.RefusedError, match="no .txt"):
        data.describe(tmp_path / "empty")
    assert train("--steps", "2", "--seq", "64", "--batch-tokens", "64", "--data", str(big),
                 "--out", str(tmp_path / "r")) == 2


def test_loader_position_round_trip():
    tokens = np.arange(1000) % 256
    a = data.TokenLoader(tokens, seq=16, batch=5, seed=3)
    seen = [a.next_batch() for _ in range(30)]         # crosses several epochs (62 windows)
    b = data.TokenLoader(tokens, seq=16, batch=5, seed=3)
    for _ in range(17):
        b.next_batch()
    c = data.TokenLoader(tokens, seq=16, batch=5, seed=3)
    c.load_state_dict(b.state_dict())
    for x, y in seen[17:]:
        cx, cy = c.next_batch()
        assert (cx == x).all() and (cy == y).all()
    x, y = seen[0]
    assert (x[:, 1:] == y[:, :-1]).all()                # labels are inputs shifted by one
    with pytest.raises(data.RefusedError, match="--seq"):
        data.TokenLoader(tokens[:10], seq=16, batch=1, seed=0)


class _FakeEncoding:
    def __init__(self, ids):
        self.ids = ids


class _FakeTokenizer:
    """Stands in for tokenizers.Tokenizer: one id per word, ids 0..99."""

    @classmethod
    def from_file(cls, path):
        return cls()

    def get_vocab_size(self, with_added_tokens=True):
        return 100

    def encode_batch(self, texts):
        return [_FakeEncoding([hash(w) % 100 for w in t.split()]) for t in texts]

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_hf_tokenizer_folder(tmp_path, monkeypatch):
    import sys
    import types

    from megatrain.train import checkpoint

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeTokenizer))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    (tok_dir / "tokenizer_config.json").write_text("{}")
    tok = tokenizer.load_tokenizer(tok_dir)
    assert tok.vocab_size == 100 and len(tok.encode("a b c")) == 3
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    out = tmp_path / "run"
    assert train("--steps", "2", "--seq", "16", "--batch-tokens", "32", "--tokenizer", str(tok_dir),
                 "--data", str(text), "--out", str(out)) == 0
    ckpt = checkpoint.latest_checkpoint(out)
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("name, payload", [
    ("latin1.txt", "café au lait".encode("latin-1")),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n'),
])
def test_non_utf8_text_is_refused_with_exit_2(tmp_path, capsys, name, payload):
    bad = tmp_path / name
    bad.write_bytes(payload)
    out = tmp_path / "r"
    assert train("--steps", "2", "--seq", "32", "--batch-tokens", "128", "--data", str(bad),
                 "--out", str(out)) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "not UTF-8 text" in last and str(bad) in last, err  # one clear line ...
    assert "Traceback" not in err  # ... not a traceback
    assert not (out / "metrics.jsonl").exists()
