"""tierflow train round trips: tiny Llama, Qwen2 (tied) and GPT-2 directories written by
save_pretrained train 3 steps (fp32) and the checkpoint loads in transformers with the logits of
the trainer's own model; TensorBoard event files parsed back by an independent reader."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from cli_support import run_main
from tierflow import load_model
from tierflow.data.tokenfile import write_tokens
from tierflow.train import checkpoint as ckpt_module

VOCAB = 96
CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64),
    "qwen2-tied": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True,
                                      max_position_embeddings=64),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=0, eos_token_id=0),
}
PROBE = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt-data")
    rng = np.random.default_rng(0)
    write_tokens(root / "train.bin", rng.integers(0, VOCAB, 4000), VOCAB)
    write_tokens(root / "eval.bin", rng.integers(0, VOCAB, 800), VOCAB)
    return root




def logits(model, tokens=PROBE):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_three_steps_then_transformers_loads_the_trained_weights(kind, data, tmp_path, capsys,
                                                                 monkeypatch):
    torch.manual_seed(0)
    initial = AutoModelForCausalLM.from_config(CONFIGS[kind]())
    initial.save_pretrained(tmp_path / "model")
    before = logits(initial)

    saved = []
    original = ckpt_module.save_checkpoint

    def spy(out_dir, step, model, **kw):
        saved.append((step, model))
        return original(out_dir, step, model, **kw)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", spy)
    code, out, err = run_main(
        "train", "--model", str(tmp_path / "model"), "--data", str(data), "--seq-len", "16",
        "--batch-size", "2", "--steps", "3", "--dtype", "fp32", "--lr", "1e-2", "--warmup", "0",
        "--eval-every", "0", "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 0, err
    assert [s for s, _ in saved] == [3]
    trainer_model = saved[-1][1]
    expected = logits(trainer_model)  # the trainer's own model, after its 3 optimizer steps
    assert not torch.allclose(expected, before), "training changed nothing"

    path = tmp_path / "run" / "step_3"
    theirs, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(theirs) is type(initial)
    assert theirs.config.tie_word_embeddings == initial.config.tie_word_embeddings
    if initial.config.tie_word_embeddings:
        assert theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight
    ours = load_model(path)
    got_theirs, got_ours = logits(theirs), logits(ours)
    assert torch.equal(got_theirs, expected)
    assert torch.equal(got_ours, expected)
    # the same after resuming: tierflow's loader gives the weights transformers gets
    for (name, a), (_, b) in zip(sorted(theirs.state_dict().items()),
                                 sorted(ours.state_dict().items())):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------- TensorBoard

def _masked_crc(data: bytes) -> int:
    """CRC32C written out bit by bit (independent of the table in tierflow), then masked."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, object]]:
    out, i = [], 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i:i + n], i + n
        else:
            raise AssertionError(f"wire type {wire}")
        out.append((field, value))
    assert i == len(buf)
    return out


def read_events(path: Path) -> list[dict]:
    raw = path.read_bytes()
    events, i = [], 0
    while i < len(raw):
        header = raw[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[i + 8:i + 12])[0] == _masked_crc(header)
        body = raw[i + 12:i + 12 + n]
        assert struct.unpack("<I", raw[i + 12 + n:i + 16 + n])[0] == _masked_crc(body)
        i += 16 + n
        event: dict = {"values": {}}
        for field, value in _fields(body):
            if field == 1:
                event["wall_time"] = struct.unpack("<d", value)[0]
            elif field == 2:
                event["step"] = value
            elif field == 3:
                event["file_version"] = value.decode()
            elif field == 5:
                for f, v in _fields(value):
                    assert f == 1
                    parts = dict(_fields(v))
                    event["values"][parts[1].decode()] = struct.unpack("<f", parts[2])[0]
        events.append(event)
    assert i == len(raw)
    return events


def test_encoding_known_values():
    from tierflow.train.tensorboard import crc32c, encode_event, record
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    data = encode_event(1.5, 300, scalars={"a": 2.0})
    assert data == (b"\x09" + struct.pack("<d", 1.5) + b"\x10\xac\x02" + b"\x2a\x0a"
                    + b"\x0a\x08\x0a\x01a\x15" + struct.pack("<f", 2.0))
    assert record(data)[12:-4] == data


def test_tensorboard_event_file(data, tmp_path, capsys):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path / "model")
    board = tmp_path / "tb"
    code, out, err = run_main(
        "train", "--model", str(tmp_path / "model"), "--data", str(data), "--seq-len", "16",
        "--batch-size", "2", "--steps", "4", "--dtype", "fp32", "--eval-every", "2",
        "--eval-steps", "1", "--out", str(tmp_path / "run"), "--tensorboard", str(board),
        capsys=capsys)
    assert code == 0, err
    files = list(board.iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents."), files
    events = read_events(files[0])
    assert events[0]["file_version"] == "brain.Event:2" and events[0]["step"] == 0
    import json
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in log if r["kind"] == "train"}
    evals = {r["step"]: r for r in log if r["kind"] == "eval"}
    got_train = {e["step"]: e["values"] for e in events if "train/loss" in e["values"]}
    got_eval = {e["step"]: e["values"]["eval/loss"] for e in events if "eval/loss" in e["values"]}
    assert sorted(got_train) == [1, 2, 3, 4] and sorted(got_eval) == [2, 4]
    f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
    for step, values in got_train.items():
        r = train[step]
        assert values == {"train/loss": f32(r["loss"]), "train/grad_norm": f32(r["norm"]),
                          "train/lr": f32(r["lr"]), "train/tok_s": f32(r["tok_s"]),
                          "memory/ram_bytes": f32(r["ram_bytes"])}
    assert got_eval == {s: f32(r["loss"]) for s, r in evals.items()}
    assert all(e["wall_time"] > 1e9 for e in events)

    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        return  # the independent reader above is the check
    acc = event_accumulator.EventAccumulator(str(board))
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [s.value for s in acc.Scalars("eval/loss")] == [got_eval[2], got_eval[4]]


def test_unwritable_tensorboard_dir_is_one_line(data, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_main("train", "--model", "llama-20m", "--data", str(data), "--out",
                            str(tmp_path / "run"), "--tensorboard", str(blocker / "tb"),
                            capsys=capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"--tensorboard {blocker / 'tb'} is not writable" \
        in lines[0], err
