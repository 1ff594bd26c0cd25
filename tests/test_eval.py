"""``tierflow eval``: the masked mean loss of a model on held-out token files equals a hand
computation (each document run alone by transformers, only its loss mask's targets counted;
plain text in consecutive windows), the same under a RAM budget with a disk tier (the plan
tierflow train makes), and equal to tierflow train's own last ``[V]`` evaluation of the same
weights; bad input is one line."""
import io
import json
import math

import pytest
import torch
from cli_support import assert_error_line, records, run_main
from sft_support import chat_model_dir, chats, pairs, write_jsonl

from tierflow.data.tokenfile import TokenFile
from tierflow.data.tokenize import tokenize


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny instruct model; its chat + prompt/completion records tokenized (masked, v2) and
    a plain text file tokenized with its tokenizer (no mask: windows)."""
    root = tmp_path_factory.mktemp("eval")
    model = chat_model_dir(root / "model")
    write_jsonl(root / "mix.jsonl", chats(8) + pairs(8))
    tokenize([root / "mix.jsonl"], root / "sft", tokenizer=model, eval_fraction=0.3,
             log=io.StringIO())
    (root / "text.txt").write_text("the wrapped text is filled and dedented. " * 40)
    tokenize([root / "text.txt"], root / "text", tokenizer=model, eval_fraction=0.5,
             log=io.StringIO())
    return root, model


def _model(directory):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory).float().eval()


@torch.no_grad()
def masked_mean_by_hand(directory, tokens: TokenFile) -> tuple[float, int]:
    """Each document alone through transformers: the summed cross-entropy of the tokens its
    mask counts (a target is the next token, when that token is masked in), over their count."""
    model = _model(directory)
    total, count = 0.0, 0
    for d in range(len(tokens.offsets) - 1):
        a, b = int(tokens.offsets[d]), int(tokens.offsets[d + 1])
        ids = torch.from_numpy(tokens.window(a, b - a)).long()
        mask = torch.from_numpy(tokens.mask[a:b].copy()).bool()
        logits = model(input_ids=ids[None]).logits[0, :-1]  # (n - 1, V)
        losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        total += float(losses[mask[1:]].sum())
        count += int(mask[1:].sum())
    return total / count, count


@torch.no_grad()
def window_mean_by_hand(directory, tokens: TokenFile, seq_len: int) -> tuple[float, int]:
    model = _model(directory)
    total, count = 0.0, 0
    for w in range((len(tokens) - 1) // seq_len):
        ids = torch.from_numpy(tokens.window(w * seq_len, seq_len + 1)).long()
        logits = model(input_ids=ids[None, :-1]).logits[0]
        total += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
        count += seq_len
    return total / count, count


def evaluated(capsys, *args):
    code, out, err = run_main("eval", "--dtype", "fp32", "--json", *map(str, args),
                              capsys=capsys)
    assert code == 0, err
    return [json.loads(line) for line in out.strip().splitlines()], err


def test_masked_loss_equals_the_documents_by_hand(env, capsys):
    root, model = env
    tokens = TokenFile.open(root / "sft" / "eval.bin")
    assert tokens.mask is not None and 0 < tokens.mask.sum() < len(tokens)
    want, count = masked_mean_by_hand(model, tokens)
    (got,), _ = evaluated(capsys, "--model", model, "--seq-len", 192, "--batch-size", 2,
                          root / "sft")
    assert got["packed"] and got["tokens"] == count
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(want), rel=1e-5)


def test_plain_text_windows_by_hand_and_the_line(env, capsys):
    root, model = env
    tokens = TokenFile.open(root / "text" / "eval.bin")
    assert tokens.mask is None
    want, count = window_mean_by_hand(model, tokens, 16)
    assert count > 3 * 16  # a last, smaller batch counts too
    (got,), _ = evaluated(capsys, "--model", model, "--seq-len", 16, "--batch-size", 3,
                          root / "text" / "eval.bin")
    assert not got["packed"] and got["tokens"] == count
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    code, out, _ = run_main("eval", "--model", str(model), "--seq-len", "16", "--dtype", "fp32",
                            str(root / "text"), str(root / "text" / "train.bin"), capsys=capsys)
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 2
    assert lines[0].startswith(f"{root / 'text' / 'eval.bin'}: loss {want:.4f} | ppl ")
    assert lines[1].startswith(f"{root / 'text' / 'train.bin'}: loss ")


def test_under_ram_with_a_disk_tier_the_plan_gives_the_same_loss(env, capsys, tmp_path):
    root, model = env
    want, _ = evaluated(capsys, "--model", model, "--seq-len", 192, root / "sft")
    got, err = evaluated(capsys, "--model", model, "--seq-len", 192, "--ram", "2GiB",
                         "--disk", tmp_path, root / "sft")
    assert "[Plan]" in err
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-5)


def test_equals_train_last_evaluation(env, capsys, tmp_path):
    """tierflow train's last [V] of a fine-tune and tierflow eval of its checkpoint: one
    computation, one number."""
    root, model = env
    out = tmp_path / "run"
    code, _, err = run_main("train", "--model", str(model), "--data", str(root / "sft"),
                            "--steps", "2", "--eval-every", "2", "--eval-steps", "2",
                            "--seq-len", "192", "--batch-size", "2", "--dtype", "fp32",
                            "--out", str(out), capsys=capsys)
    assert code == 0, err
    (last,) = records(out / "log.jsonl", "eval")
    got, _ = evaluated(capsys, "--model", out, "--seq-len", 192, "--batch-size", 2,
                       "--max-batches", 2, root / "sft")
    assert got[0]["loss"] == pytest.approx(last["loss"], rel=1e-5)


def test_bad_input_is_one_line(env, capsys):
    root, model = env
    for args, fragments in [
        ([root / "nope.bin"], ["nope.bin", "does not exist"]),
        ([root / "sft", root / "text"], ["loss mask", "two calls"]),
        (["--seq-len", "8", root / "sft"], ["--seq-len 8", "fix:"]),
    ]:
        code, out, err = run_main("eval", "--model", str(model), *map(str, args), capsys=capsys)
        assert code == 2 and out == ""
        assert_error_line(err, fragments)
