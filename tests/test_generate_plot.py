"""``tierflow generate`` (our KV-cache sampling loop against transformers' greedy generate,
seeded sampling, the command line) and ``tierflow plot`` (a synthetic log to a PNG, errors)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierflow.cli.main import main
from tierflow.core.errors import TierflowError
from tierflow.data.tokenizer import EOT, train_tokenizer
from tierflow.generate.options import Sampling
from tierflow.generate.sample import GenerateStats, encode_prompt, generate, sample_ids, stop_ids

SRC = str(Path(__file__).resolve().parents[1] / "src")
TEXTS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog. " * 4,
         "import os\nprint(os.getcwd())\n", "héllo wörld, ünïcode ✓ 日本語 text"] * 3


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 300)


def tiny_lm(family: str, vocab: int, eos: int):
    import transformers
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=96, bos_token_id=eos, eos_token_id=eos)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
            bos_token_id=None, eos_token_id=eos, pad_token_id=None)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    """A tiny Llama saved with save_pretrained plus its tokenizer.json."""
    directory = tmp_path_factory.mktemp("gen") / "model"
    model = tiny_lm("llama", tok.get_vocab_size(), tok.token_to_id(EOT))
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("prompt", ["def add", "the quick brown"])
def test_greedy_equals_transformers_generate(tok, family, prompt):
    eos = tok.token_to_id(EOT)
    model = tiny_lm(family, tok.get_vocab_size(), eos)
    ids = encode_prompt(tok, prompt)
    ours = list(sample_ids(model, ids, Sampling(40, temperature=0), stop={eos}))
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40,
                         pad_token_id=eos, eos_token_id=eos)[0, len(ids):].tolist()
    assert ours == ref
    assert len(ours) >= 10  # the comparison covers many cached steps


def test_loaded_checkpoint_greedy_matches_and_text_streams(model_dir, tok):
    from tierflow import load_model
    model = load_model(model_dir, dtype=torch.float32)
    pieces: list[str] = []
    stats = GenerateStats()
    text = generate(model, tok, "def add", Sampling(30, temperature=0), stream=pieces.append,
                    stats=stats)
    assert "".join(pieces) == text
    ids = encode_prompt(tok, "def add")
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=30,
                         pad_token_id=0)[0].tolist()
    assert text == tok.decode(ref)[len(tok.decode(ids)):]
    assert stats.new_tokens == len(ref) - len(ids) and stats.tok_s > 0


def test_seeded_sampling_is_reproducible(model_dir, tok):
    from tierflow import load_model
    model = load_model(model_dir, dtype=torch.float32)
    def seeded(seed: int, **kw) -> list[int]:
        return list(sample_ids(model, [5, 6, 7], Sampling(25, temperature=1.0, seed=seed, **kw),
                               stop=set()))
    a, b, c = seeded(1), seeded(1), seeded(2)
    assert a == b and a != c and len(a) == 25
    # top-k 1 is greedy whatever the temperature
    greedy = list(sample_ids(model, [5, 6, 7], Sampling(25, temperature=0), stop=set()))
    assert seeded(3, top_k=1) == greedy
    buf = io.StringIO()
    assert generate(model, tok, "x = ", Sampling(seed=4), stream=buf) == \
        generate(model, tok, "x = ", Sampling(seed=4))


def test_ids_beyond_the_tokenizer_are_never_picked(tok):
    eos = tok.token_to_id(EOT)
    model = tiny_lm("llama", tok.get_vocab_size() + 64, eos)
    with torch.no_grad():  # make the padded ids the most likely ones
        model.lm_head.weight[tok.get_vocab_size():] *= 50
    ids = list(sample_ids(model, [5, 6], Sampling(20, temperature=0),
                          allowed_vocab=tok.get_vocab_size()))
    assert all(i < tok.get_vocab_size() for i in ids)


def test_api_errors(tok):
    model = tiny_lm("llama", tok.get_vocab_size(), 0)
    with pytest.raises(TierflowError, match="empty"):
        generate(model, tok, "")
    with pytest.raises(TierflowError, match="positions"):
        generate(model, tok, "hi", Sampling(max_new_tokens=500))
    with pytest.raises(TierflowError, match="temperature"):
        generate(model, tok, "hi", Sampling(temperature=-0.5))
    with pytest.raises(TierflowError, match="top-k"):
        generate(model, tok, "hi", Sampling(top_k=0))
    assert 0 in stop_ids(model, tok)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    env.pop("TIERFLOW_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_generate_prints_text_and_speed(model_dir):
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", "def add",
                   "--max-new-tokens", "12", "--seed", "0", "--top-k", "20", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def add")
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("[generate] ") and "tok/s" in last and "fp32" in last


def test_generate_from_a_run_directory_samples_its_latest_checkpoint(model_dir, tmp_path,
                                                                     capsys):
    """``--model OUT`` (tierflow train's --out) means its latest complete step_N, as
    ``--resume OUT`` does; stderr names it. A step without trainer_state.json is a save
    that did not finish, and is passed over."""
    import shutil
    run = tmp_path / "run"
    for step in (2, 10, 11):
        shutil.copytree(model_dir, run / f"step_{step}")
        if step != 11:
            (run / f"step_{step}" / "trainer_state.json").write_text("{}")
    args = ["--prompt", "def add", "--max-new-tokens", "8", "--seed", "0", "--dtype", "fp32"]
    assert main(["generate", "--model", str(run), *args]) == 0
    from_run = capsys.readouterr()
    assert f"{run}: its latest checkpoint, step_10" in from_run.err
    assert main(["generate", "--model", str(run / "step_10"), *args]) == 0
    from_step = capsys.readouterr()
    assert from_step.out.splitlines()[0] == from_run.out.splitlines()[0]  # the same text
    assert "latest checkpoint" not in from_step.err


def one_line_error(capsys, args, *fragments):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierflow: error: "), captured.err
    assert "Traceback" not in captured.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return captured


@pytest.mark.parametrize("extra, fragments", [
    (["--prompt", ""], ["prompt is empty"]),
    (["--prompt", "x", "--max-new-tokens", "abc"], ["--max-new-tokens", "'abc'"]),
    (["--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--prompt", "x", "--temperature", "-1"], ["--temperature"]),
    (["--prompt", "x", "--temperature", "nan"], ["--temperature"]),
    (["--prompt", "x", "--top-k", "0"], ["--top-k"]),
    (["--prompt", "x", "--max-new-tokens", "1000"], ["positions", "--max-new-tokens"]),
    (["--prompt", "x", "--tokenizer", "/nonexistent/tokenizer.json"], ["does not exist"]),
])
def test_cli_generate_errors(capsys, model_dir, extra, fragments):
    captured = one_line_error(capsys, ["generate", "--model", str(model_dir), *extra], *fragments)
    assert captured.out == ""  # nothing printed before the error


def test_cli_generate_missing_model_and_tokenizer(capsys, tmp_path):
    one_line_error(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
                   "does not exist")
    one_line_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "x"],
                   "no config.json", "save_pretrained")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")  # present; the tokenizer is missed first
    one_line_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "x"],
                   "no tokenizer.json", "--tokenizer")


# ---------------------------------------------------------------- generate --chat

@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from sft_support import chat_model_dir
    return chat_model_dir(tmp_path_factory.mktemp("chat") / "model")


def test_cli_chat_renders_the_template_and_prints_only_the_reply(chat_dir, capsys,
                                                                  monkeypatch):
    """``--chat``: the prompt is a user message rendered by the model directory's chat
    template with its generation prompt (the ids the model gets), generation ends at the
    template's end token <|im_end|>, and only the reply is printed, its end token not. The
    model's next tokens are forced by a hook on its LM head: two words, then <|im_end|>."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    import tierflow.exec.load
    tok = Tokenizer.from_file(str(chat_dir / "tokenizer.json"))
    reply_ids = tok.encode(" wrapped text").ids
    end = tok.token_to_id("<|im_end|>")
    forced, seen = [*reply_ids, end, *reply_ids], []
    real_load = tierflow.exec.load.load_model

    def load_forcing(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda _m, _a, kw: seen.append(kw["input_ids"][0].tolist()), with_kwargs=True)

        def force(_module, _inputs, logits):
            logits = torch.zeros_like(logits)
            logits[..., forced[len(seen) - 1]] = 1.0
            return logits
        model.lm_head.register_forward_hook(force)
        return model
    monkeypatch.setattr(tierflow.exec.load, "load_model", load_forcing)
    assert main(["generate", "--model", str(chat_dir), "--chat", "--prompt", "wrap this",
                 "--temperature", "0", "--dtype", "fp32", "--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    rendered = AutoTokenizer.from_pretrained(chat_dir).apply_chat_template(
        [{"role": "user", "content": "wrap this"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert seen[0] == tok.encode(rendered, add_special_tokens=False).ids
    reply, summary = out.split("\n[generate] ")
    assert reply == " wrapped text"  # no prompt, no <|im_end|>, nothing after it
    assert f"{len(reply_ids) + 1} tokens" in summary and "end-of-sequence" in summary


def test_chat_template_end_ids_are_the_tokenizer_and_generation_eos(chat_dir):
    from tokenizers import Tokenizer

    from tierflow.data.examples import ChatTemplate
    end = Tokenizer.from_file(str(chat_dir / "tokenizer.json")).token_to_id("<|im_end|>")
    assert ChatTemplate(chat_dir).end_ids() == {end}


def test_cli_chat_without_a_template_is_one_line(tmp_path, capsys):
    from sft_support import chat_model_dir
    plain = chat_model_dir(tmp_path / "plain", template=False, layers=1)
    capsys.readouterr()  # save_pretrained's progress bar
    captured = one_line_error(capsys, ["generate", "--model", str(plain), "--chat",
                                       "--prompt", "hi"],
                              "--chat", "no chat template", str(plain), "fix:")
    assert captured.out == ""


# ---------------------------------------------------------------- plot

def write_log(path: Path, steps: int = 30) -> None:
    lines = [json.dumps({"kind": "config", "budget": {"ram": 3 << 29}})]
    for s in range(1, steps + 1):
        lines.append(json.dumps({"kind": "train", "step": s, "tokens": 512 * s,
                                 "loss": 5.0 / (1 + s / 10), "tok_s": 1000.0 + s, "ms": 500.0,
                                 "ram_bytes": (1 << 30) + s * 1000, "mem": {"disk": 1 << 20}}))
        if s % 10 == 0:
            lines.append(json.dumps({"kind": "eval", "step": s, "eval_loss": 5.2 / (1 + s / 10)}))
    lines.append(lines[2])  # a resumed run repeats a step
    lines.append('{"kind": "train", "step": 31, "lo')  # cut short by a kill
    path.write_text("\n".join(lines) + "\n\n")


def test_read_log_is_tolerant(tmp_path):
    from tierflow.cli.plot import read_log
    path = tmp_path / "run.jsonl"
    write_log(path)
    log = read_log(path)
    assert [r["step"] for r in log.train] == list(range(1, 31))
    assert [r["step"] for r in log.eval] == [10, 20, 30]
    assert log.eval[0]["tokens"] == 5120  # taken from the train record of the same step
    assert log.train[0]["mem"] == {"ram": (1 << 30) + 1000, "disk": 1 << 20}
    assert log.budgets == {"ram": 3 << 29}
    assert log.skipped_lines == 1


def test_cli_plot_writes_a_png(tmp_path, capsys):
    import matplotlib.image
    log = tmp_path / "run.jsonl"
    write_log(log)
    out = tmp_path / "run.png"
    assert main(["plot", str(log), "-o", str(out)]) == 0
    assert "30 train and 3 eval records" in capsys.readouterr().out
    assert out.stat().st_size > 0
    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert not list(tmp_path.glob(".*tmp*"))


def test_plot_minimal_records(tmp_path):
    """Only step and loss: the panels without data say so; the default output is LOG.png."""
    log = tmp_path / "min.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    assert main(["plot", str(log)]) == 0
    assert (tmp_path / "min.png").stat().st_size > 0


def test_plot_errors(tmp_path, capsys):
    one_line_error(capsys, ["plot", str(tmp_path / "missing.jsonl")], "does not exist")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    one_line_error(capsys, ["plot", str(empty)], "is empty")
    no_train = tmp_path / "eval_only.jsonl"
    no_train.write_text(json.dumps({"kind": "eval", "step": 1, "eval_loss": 2.0}) + "\nnot json\n")
    one_line_error(capsys, ["plot", str(no_train)], "no train records", "eval")
    log = tmp_path / "run.jsonl"
    write_log(log, steps=3)
    one_line_error(capsys, ["plot", str(log), "-o", str(tmp_path / "run.xyz")], ".png")
    one_line_error(capsys, ["plot", str(log), "-o", str(tmp_path / "no" / "run.png")],
                   "does not exist")


def test_trainer_shaped_log(tmp_path):
    """The records tierflow train writes: budget as a bare int (RAM), eval with ``loss``."""
    from tierflow.cli.plot import plot_run, read_log
    records = [{"kind": "options", "ram": 1 << 30},
               {"kind": "plan", "weights": 1000, "predicted_peak": 1 << 28, "budget": 1 << 30},
               *({"kind": "train", "step": s, "total": 4, "loss": 3.0 - s / 10, "norm": 1.0,
                  "ms": 10.0, "tok_s": 500.0, "ram_bytes": 1 << 27, "budget": 1 << 30,
                  "tokens": 256 * s} for s in range(1, 5)),
               {"kind": "eval", "step": 4, "loss": 2.9, "ppl": 18.2, "tokens": 1024},
               {"kind": "checkpoint", "step": 4, "path": "out/step_4"}]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_log(path)
    assert log.budgets == {"ram": 1 << 30} and log.predicted_peak == 1 << 28
    assert [(r["step"], r["loss"]) for r in log.eval] == [(4, 2.9)]
    assert log.other_records == 3
    assert plot_run(log, tmp_path / "log.svg").stat().st_size > 0
