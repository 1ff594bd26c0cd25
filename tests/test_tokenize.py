"""Token files (header, validation, nanoGPT's headerless .bin), the corpus and ``tierflow
tokenize`` end to end on a tiny corpus with a tiny trained BPE (the stdlib is only listed)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_error_line

from tierflow.cli.main import main
from tierflow.core.errors import TierflowError
from tierflow.data import TokenFile, collect, stdlib_corpus, write_tokens
from tierflow.data.tokenfile import HEADER_BYTES, MAGIC
from tierflow.data.tokenize import eval_indices, tokenize
from tierflow.data.tokenizer import EOT

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ---------------------------------------------------------------- token files

@pytest.mark.parametrize("vocab, dtype", [(300, np.uint16), (65536, np.uint16), (70000, np.uint32)])
def test_header_round_trip(tmp_path, vocab, dtype):
    tokens = np.arange(0, vocab, 7)
    path = tmp_path / "t.bin"
    assert write_tokens(path, tokens, vocab) == len(tokens)
    raw = path.read_bytes()
    end = HEADER_BYTES + len(tokens) * np.dtype(dtype).itemsize
    assert raw[:8] == MAGIC and len(raw) == end + (-end % 8) + 2 * 8  # + one document's bounds
    f = TokenFile.open(path)
    assert (len(f), f.vocab_size, f.tokens.dtype) == (len(tokens), vocab, dtype)
    assert not f.headerless
    assert np.array_equal(f.tokens, tokens)
    assert f.max_token() == tokens.max()
    f.check_vocab()
    window = f.window(3, 5)
    assert window.dtype == np.int64 and window.tolist() == tokens[3:8].tolist()
    rows = f.windows([7, 0, 7], 4)  # (3, 4), one open of the file
    assert rows.dtype == np.int64 and rows.shape == (3, 4)
    assert rows.tolist() == [tokens[7:11].tolist(), tokens[0:4].tolist(), tokens[7:11].tolist()]
    with pytest.raises(TierflowError, match=r"window \[" + str(len(tokens) - 2)):
        f.windows([0, len(tokens) - 2], 4)  # the second row runs past the end
    assert not list(tmp_path.glob(".*tmp*"))


def _rss_file_bytes() -> int:
    """This process's resident pages that belong to mapped files (RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


def test_reading_a_corpus_keeps_it_out_of_the_rss(tmp_path):
    """The id scan and the windows read the file, not its memory map: a 64 MiB corpus scanned
    whole adds almost nothing to the process's resident file pages (through the map it added
    all 64 MiB, which a run counted against --ram)."""
    tokens = np.arange(32 << 20, dtype=np.int64) % 50_000  # 32M uint16 ids: 64 MiB
    tokens[12_345_678] = 60_000
    write_tokens(tmp_path / "big.bin", tokens, 65536)
    f = TokenFile.open(tmp_path / "big.bin")
    before = _rss_file_bytes()
    assert f.max_token() == 60_000
    assert f.window(12_345_670, 10).tolist() == tokens[12_345_670:12_345_680].tolist()
    assert _rss_file_bytes() - before < 16 << 20


def test_max_token_is_read_again_when_the_file_changes(tmp_path):
    path = tmp_path / "t.bin"
    write_tokens(path, [1, 2, 3], 10)
    assert TokenFile.open(path).max_token() == 3
    write_tokens(path, [1, 2, 9, 4], 10)
    assert TokenFile.open(path).max_token() == 9


def test_file_truncated_while_in_use(tmp_path):
    path = tmp_path / "t.bin"
    write_tokens(path, list(range(100)), 100)
    f = TokenFile.open(path)
    os.truncate(path, HEADER_BYTES + 50 * 2)
    with pytest.raises(TierflowError, match="truncated while in use"):
        f.window(40, 20)


def test_write_accepts_ids_and_chunks(tmp_path):
    write_tokens(tmp_path / "a.bin", iter([1, 2, 3, np.int64(4)]), 10)
    write_tokens(tmp_path / "b.bin", [[1, 2], np.array([3]), [], 4], 10)
    for name in ("a.bin", "b.bin"):
        assert TokenFile.open(tmp_path / name).tokens.tolist() == [1, 2, 3, 4]


def test_empty_token_file(tmp_path):
    write_tokens(tmp_path / "e.bin", [], 10)
    f = TokenFile.open(tmp_path / "e.bin")
    assert len(f) == 0 and f.max_token() is None
    f.check_vocab()


def test_write_refuses_id_out_of_range_and_leaves_nothing(tmp_path):
    with pytest.raises(TierflowError, match=r"token id 10 .* \[0, 10\)"):
        write_tokens(tmp_path / "t.bin", [1, 10], 10)
    assert list(tmp_path.iterdir()) == []


def _written(tmp_path: Path, vocab: int = 300) -> Path:
    path = tmp_path / "t.bin"
    write_tokens(path, np.arange(100), vocab)
    return path


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_wrong_magic(tmp_path):
    path = _written(tmp_path)
    _patch(path, 0, b"NOTOKENS")
    with pytest.raises(TierflowError, match="wrong magic") as err:
        TokenFile.open(path)
    assert str(path) in str(err.value) and "fix:" in str(err.value)


def test_wrong_version(tmp_path):
    path = _written(tmp_path)
    _patch(path, 8, (7).to_bytes(4, "little"))
    with pytest.raises(TierflowError, match="format version 7.*reads versions 1, 2.*fix:"):
        TokenFile.open(path)


@pytest.mark.parametrize("change, what", [(-1, "is truncated"), (+2, "has trailing bytes")])
def test_size_disagrees_with_header(tmp_path, change, what):
    path = _written(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:change] if change < 0 else raw + b"\0" * change)
    with pytest.raises(TierflowError, match=f"{what}: its header promises 100 tokens.*fix:"):
        TokenFile.open(path)


def test_header_shorter_than_64_bytes(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(MAGIC + b"\1\0\0\0")
    with pytest.raises(TierflowError, match="shorter than its 64-byte header"):
        TokenFile.open(path)


def test_token_at_or_above_vocab(tmp_path):
    path = _written(tmp_path)
    _patch(path, HEADER_BYTES + 2 * 50, (300).to_bytes(2, "little"))  # id 300 == vocab
    f = TokenFile.open(path)
    with pytest.raises(TierflowError, match="token id 300, which is >= the vocab size 300.*fix:"):
        f.check_vocab()
    with pytest.raises(TierflowError, match="token id 99, which is >= the vocab size 50"):
        TokenFile.open(_written(tmp_path)).check_vocab(50)


def test_missing_file_and_window_outside(tmp_path):
    with pytest.raises(TierflowError, match="does not exist"):
        TokenFile.open(tmp_path / "nope.bin")
    with pytest.raises(TierflowError, match="holds 100 tokens.*outside"):
        TokenFile.open(_written(tmp_path)).window(90, 20)


def test_nanogpt_headerless_uint16(tmp_path):
    tokens = np.array([50256, 15496, 11, 995, 0, 65535], dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    f = TokenFile.open(path)
    assert f.headerless and f.vocab_size is None and f.tokens.tolist() == tokens.tolist()
    with pytest.raises(TierflowError, match="vocab size is unknown"):
        f.check_vocab()
    with pytest.raises(TierflowError, match="token id 65535"):
        f.check_vocab(50257)
    assert TokenFile.open(path, vocab_size=65536).vocab_size == 65536
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(TierflowError, match="truncated.*uint16"):
        TokenFile.open(path)


def test_text_file_is_not_taken_for_tokens(tmp_path):
    path = tmp_path / "notes.bin"
    path.write_text("hello world, this is text\n")
    with pytest.raises(TierflowError, match="wrong magic b'hello wo'"):
        TokenFile.open(path)
    assert TokenFile.open(path, headerless=True).headerless


# ---------------------------------------------------------------- corpus

def test_stdlib_corpus_lists_python_sources():
    files = stdlib_corpus()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    assert any(f.name == "os.py" for f in files)


def test_eval_split_is_seeded_and_never_all():
    chosen = eval_indices(1000, 0.01)
    assert chosen == eval_indices(1000, 0.01) and len(chosen) == 10 and max(chosen) < 1000
    assert len(eval_indices(3, 0.01)) == 1 and len(eval_indices(2, 0.9)) == 1
    assert eval_indices(1, 0.5) == set() and eval_indices(100, 0.0) == set()


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """Six small Python files, a text file and a binary file in a tree, plus a JSONL file."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "src" / "pkg").mkdir(parents=True)
    for i in range(6):
        (root / "src" / "pkg" / f"mod{i}.py").write_text(
            f"def add_{i}(x, y):\n    \"\"\"Add {i} to the sum.\"\"\"\n    return x + y + {i}\n")
    (root / "src" / "notes.txt").write_text("Tokens are the atoms of a language model.\n")
    (root / "src" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    (root / "src" / ".hidden").write_text("not collected\n")
    (root / "docs.jsonl").write_text(
        "\n".join(json.dumps({"body": f"json document number {i}", "id": i}) for i in range(4))
        + "\n\n" + json.dumps({"body": ""}) + "\n")
    return root


def test_collect_walks_skips_binary_and_reads_jsonl(corpus_dir):
    corpus = collect([corpus_dir / "src", corpus_dir / "docs.jsonl"], text_field="body")
    assert len(corpus.files) == 8 and [p.name for p in corpus.skipped] == ["logo.png"]
    docs = list(corpus.documents())
    assert len(docs) == 11 and docs[-1] == "json document number 3"
    with pytest.raises(TierflowError, match=r"docs.jsonl:1 has no field 'text' \(found: body, id"):
        collect([corpus_dir / "docs.jsonl"]).count_documents()
    with pytest.raises(TierflowError, match="logo.png is not text"):
        collect([corpus_dir / "src" / "logo.png"])


# ---------------------------------------------------------------- tokenize end to end

@pytest.fixture(scope="module")
def tokenized(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "data"
    result = tokenize([corpus_dir / "src", corpus_dir / "docs.jsonl"], out, vocab_size=300,
                      eval_fraction=0.2, text_field="body", log=io.StringIO())
    return out, result


def test_tokenize_function_writes_consistent_files(tokenized):
    out, result = tokenized
    assert (result.documents, result.train_documents, result.eval_documents) == (11, 9, 2)
    assert result.skipped_files == 1 and result.vocab_size <= 300
    train, ev = TokenFile.open(out / "train.bin"), TokenFile.open(out / "eval.bin")
    assert (len(train), len(ev)) == (result.train_tokens, result.eval_tokens) and len(ev) > 0
    assert train.vocab_size == ev.vocab_size == result.vocab_size
    train.check_vocab()
    eot_count = int((train.tokens == result.eot_id).sum() + (ev.tokens == result.eot_id).sum())
    assert eot_count == result.documents
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_tokens"] == len(train) and meta["tokenizer"]["kind"] == "trained"
    assert meta["eot_token"] == EOT and meta["dtype"] == "uint16"


def test_saved_tokenizer_loads_in_transformers(tokenized, corpus_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    out, result = tokenized
    hf = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    text = (corpus_dir / "src" / "pkg" / "mod3.py").read_text()
    assert hf.decode(hf.encode(text)) == text
    train = TokenFile.open(out / "train.bin")
    assert "def add_" in hf.decode(train.window(0, 40).tolist())
    auto = AutoTokenizer.from_pretrained(str(out))
    assert auto.eos_token == EOT and auto.eos_token_id == result.eot_id


def test_given_tokenizer_directory_is_used(tokenized, corpus_dir, tmp_path):
    out, result = tokenized
    again = tokenize([corpus_dir / "src"], tmp_path / "again", tokenizer=out, eval_fraction=0,
                     log=io.StringIO())
    assert again.vocab_size == result.vocab_size and again.tokenizer["kind"] == "file"
    assert again.eval_tokens == 0 and again.train_documents == 7


def test_single_document_is_split_by_tokens(tokenized, corpus_dir, tmp_path):
    out, _ = tokenized
    result = tokenize([corpus_dir / "src" / "notes.txt"], tmp_path / "one", tokenizer=out,
                      eval_fraction=0.25, log=io.StringIO())
    assert result.documents == 1 and result.eval_tokens > 0 and result.train_tokens > 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TIERFLOW_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_tokenize_end_to_end(corpus_dir, tmp_path):
    out = tmp_path / "cli"
    proc = run_cli("tokenize", str(corpus_dir / "src"), str(corpus_dir / "docs.jsonl"),
                   "--out", str(out), "--vocab-size", "300", "--eval-fraction", "0.1",
                   "--text-field", "body")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip().splitlines()
    assert len(summary) == 1 and "11 documents" in summary[0] and "vocab" in summary[0]
    assert "encoding 100%" in proc.stderr  # plain progress lines: stderr is not a terminal
    assert {p.name for p in out.iterdir()} == {"train.bin", "eval.bin", "tokenizer.json",
                                               "tokenizer_config.json", "meta.json"}
    assert len(TokenFile.open(out / "eval.bin")) > 0


def test_cli_missing_input_is_one_line_exit_2(tmp_path):
    proc = run_cli("tokenize", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierflow: error: INPUT ")
    assert "missing.txt does not exist" in lines[0] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra, fragments", [
    (["{file}", "--out", "{file}/sub"], ["--out", "is a file"]),
    (["{file}", "--out", "{tmp}/o", "--vocab-size", "100"], ["--vocab-size 100", "257"]),
    (["{file}", "--out", "{tmp}/o", "--eval-fraction", "1.5"], ["--eval-fraction 1.5"]),
    (["{file}", "--out", "{tmp}/o", "--tokenizer", "{tmp}/none.json"], ["does not exist"]),
    (["{file}", "--out", "{tmp}/o", "--tokenizer", "{tmp}", "--vocab-size", "300"],
     ["not allowed with"]),
    (["{jsonl}", "--out", "{tmp}/o", "--text-field", "content"], ["no field 'content'"]),
    (["{empty}", "--out", "{tmp}/o"], ["corpus is empty"]),
    (["--out", "{tmp}/o"], ["no INPUT"]),
    (["{file}"], ["--out"]),
])
def test_cli_user_errors(corpus_dir, tmp_path, capsys, extra, fragments):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a.txt").write_text("some text\n")
    names = dict(tmp=tmp_path, file=tmp_path / "a.txt", jsonl=corpus_dir / "docs.jsonl",
                 empty=tmp_path / "empty")
    args = ["tokenize", *(a.format(**names) for a in extra)]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert_error_line(err, fragments)
    assert not (tmp_path / "o").exists()


def test_full_disk_is_a_user_error_and_leaves_no_partial_files(tokenized, corpus_dir, tmp_path,
                                                               monkeypatch):
    import errno

    from tierflow.data.tokenfile import TokenWriter
    out, _ = tokenized

    def full(self, tokens, *rest):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    monkeypatch.setattr(TokenWriter, "write", full)
    with pytest.raises(TierflowError, match="No space left on device; fix: free disk space"):
        tokenize([corpus_dir / "src"], tmp_path / "full", tokenizer=out, log=io.StringIO())
    assert list((tmp_path / "full").iterdir()) == []  # the token files come first
