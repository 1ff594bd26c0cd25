"""Fine-tuning data: chat, prompt/completion and text records from JSONL, JSON, Parquet and CSV
tokenized with a model directory's own chat template, into token files with a loss mask and
document boundaries (format version 2; version-1 files still read), and the one-line refusals
of bad input."""
import io
import json
import struct

import numpy as np
import pytest
from cli_support import assert_error_line, run_main
from sft_support import chat_model_dir, chats, pairs, write_jsonl, write_parquet
from tokenizers import Tokenizer

from tierflow.data.tokenfile import HEADER_BYTES, MAGIC, TokenFile, TokenWriter
from tierflow.data.tokenize import tokenize


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("sft") / "model")


def _documents(path):
    """(ids, mask) of every document of a token file."""
    f = TokenFile.open(path)
    bounds = f.offsets.tolist()
    return [(f.tokens[a:b].tolist(), f.mask[a:b].tolist()) for a, b in zip(bounds, bounds[1:])]


def _targets(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def test_chat_records_render_through_the_models_template_and_mask_all_but_answers(model,
                                                                                  tmp_path):
    from transformers import AutoTokenizer
    rows = chats(6)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    result = tokenize([tmp_path / "chat.jsonl"], tmp_path / "d", tokenizer=model,
                      eval_fraction=0, log=io.StringIO())
    assert result.masked and result.kinds == {"chat": 6}
    hf = AutoTokenizer.from_pretrained(model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    docs = _documents(tmp_path / "d" / "train.bin")
    assert len(docs) == 6
    for row, (ids, mask) in zip(rows, docs):
        rendered = hf.apply_chat_template(row["messages"], tokenize=False)
        assert ids == tok.encode(rendered, add_special_tokens=False).ids  # no end token added
        answers = "".join(m["content"] + "<|im_end|>\n" for m in row["messages"]
                          if m["role"] == "assistant")
        assert _targets(tok, ids, mask) == answers
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["vocab_hash"] == result.vocab_hash and meta["masked"]
    saved = AutoTokenizer.from_pretrained(tmp_path / "d")  # the model's files, template included
    assert saved.chat_template == hf.chat_template and saved.eos_token == "<|im_end|>"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_prompt_completion_records_count_the_completion_and_the_end_token(model, tmp_path,
                                                                          suffix):
    rows = pairs(5)
    path = tmp_path / f"pc{suffix}"
    if suffix == ".parquet":
        write_parquet(path, rows)
    elif suffix == ".jsonl":
        write_jsonl(path, rows)
    else:
        path.write_text(json.dumps(rows))
    tokenize([path], tmp_path / "d", tokenizer=model, eval_fraction=0, log=io.StringIO())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    for row, (ids, mask) in zip(rows, _documents(tmp_path / "d" / "train.bin")):
        assert tok.decode(ids, skip_special_tokens=False) == \
            row["prompt"] + row["completion"] + "<|im_end|>"
        assert _targets(tok, ids, mask).strip() == (row["completion"] + "<|im_end|>").strip()
        assert mask[0] == 0


def test_csv_text_records_read_the_named_column_and_count_every_token(model, tmp_path):
    (tmp_path / "t.csv").write_text('id,body\n1,"first, with a comma"\n2,second text\n')
    tokenize([tmp_path / "t.csv"], tmp_path / "d", tokenizer=model, eval_fraction=0,
             text_field="body", log=io.StringIO())
    f = TokenFile.open(tmp_path / "d" / "train.bin")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert f.mask is None and f.documents == 2
    assert tok.decode(f.tokens[:f.offsets[1]].tolist(), skip_special_tokens=False) == \
        "first, with a comma<|im_end|>"


def test_version_1_token_files_still_read(tmp_path):
    path = tmp_path / "old.bin"
    ids = np.arange(40, dtype="<u2")
    path.write_bytes(struct.pack("<8sIIQQ", MAGIC, 1, 2, len(ids), 50).ljust(HEADER_BYTES, b"\0")
                     + ids.tobytes())
    f = TokenFile.open(path)
    assert f.version == 1 and f.mask is None and f.offsets is None and f.documents is None
    assert f.window(3, 5).tolist() == [3, 4, 5, 6, 7]


def test_version_2_round_trip_with_mask_and_boundaries(tmp_path):
    with TokenWriter(tmp_path / "t.bin", 300, masked=True) as w:
        w.write([5, 6, 7], np.array([0, 1, 1], np.uint8))
        w.write([8, 9])  # no mask given: every token counts
    f = TokenFile.open(tmp_path / "t.bin")
    assert f.tokens.tolist() == [5, 6, 7, 8, 9] and f.mask.tolist() == [0, 1, 1, 1, 1]
    assert f.offsets.tolist() == [0, 3, 5] and f.version == 2


def _bad_inputs(model, tmp_path):
    no_answer = [{"messages": [{"role": "user", "content": "hi"}]}]
    odd_role = [{"messages": [{"role": "wizard", "content": "hi"},
                              {"role": "assistant", "content": "ho"}]}]
    long = [{"prompt": "p", "completion": "text " * 200}]
    plain = chat_model_dir(tmp_path / "plain", template=False)
    return {
        "no assistant turn": (write_jsonl(tmp_path / "a.jsonl", no_answer), [],
                              ["no assistant turn", "a.jsonl:1", "fix:"]),
        "unknown role": (write_jsonl(tmp_path / "b.jsonl", odd_role), [],
                         ["unknown role 'wizard'", "fix:"]),
        "no chat template": (write_jsonl(tmp_path / "c.jsonl", chats(2)), ["--tokenizer",
                                                                          str(plain)],
                             ["has no chat template", "fix:"]),
        "too long": (write_jsonl(tmp_path / "d.jsonl", long), ["--seq-len", "64"],
                     ["more than --seq-len 64", "--truncate"]),
        "no column": (write_parquet(tmp_path / "e.parquet", [{"question": "q", "a": "b"}]), [],
                      ["has no column 'text'", "question", "--text-field"]),
    }


@pytest.mark.parametrize("case", ["no assistant turn", "unknown role", "no chat template",
                                  "too long", "no column"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(model, tmp_path, capsys, case):
    path, extra, fragments = _bad_inputs(model, tmp_path)[case]
    capsys.readouterr()  # what building the models printed
    if "--tokenizer" not in extra:
        extra = ["--tokenizer", str(model), *extra]
    out = tmp_path / "out"
    code, _, err = run_main("tokenize", str(path), "--out", str(out), *extra, capsys=capsys)
    assert code == 2
    if case == "too long":  # found while encoding: the progress lines before it stay
        err = err.splitlines()[-1]
    assert_error_line(err, fragments)
    assert not out.exists()


def test_too_long_records_are_cut_with_truncate(model, tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "text " * 200}])
    result = tokenize([tmp_path / "d.jsonl"], tmp_path / "out", tokenizer=model,
                      eval_fraction=0, seq_len=64, truncate=True, log=io.StringIO())
    assert result.truncated == 1 and result.train_tokens == 64


def test_training_on_data_of_another_tokenizer_is_refused_in_one_line(model, tmp_path, capsys):
    write_jsonl(tmp_path / "t.jsonl", [{"text": f"some text {i} " * 20} for i in range(20)])
    tokenize([tmp_path / "t.jsonl"], tmp_path / "d", vocab_size=300, log=io.StringIO())
    args = ["train", "--model", str(model), "--data", str(tmp_path / "d"), "--seq-len", "16",
            "--steps", "1", "--out", str(tmp_path / "out")]
    code, _, err = run_main(*args, capsys=capsys)
    assert code == 2
    assert_error_line(err, ["another tokenizer", "--tokenizer", "--allow-other-tokenizer"])
    assert not (tmp_path / "out").exists()
