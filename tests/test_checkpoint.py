"""Training checkpoints: transformers-loadable, exact round trips, crash safety."""
import errno
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import tiny_configs
from tierflow import TierflowError, load_model
from tierflow.train import checkpoint as ckpt
from tierflow.train.checkpoint import load_checkpoint, save_checkpoint
from tierflow.train.checkpoint_dirs import latest_checkpoint
from tierflow.train.codec import (capture_rng, config_hash, flatten_optimizer_states, restore_rng,
                                  unflatten_optimizer_states)

CONFIGS = tiny_configs()
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


def trained(kind="llama", steps=2):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind]())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        model(input_ids=TOKENS, labels=TOKENS).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def step(model, opt):
    loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_round_trip_loads_in_transformers(tmp_path, kind):
    model, opt = trained(kind)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0"}')
    path = save_checkpoint(tmp_path / "run", 2, model, tokenizer_file=tokenizer,
                           optimizer_state=[opt.state_dict()], trainer_state={"position": 24})
    assert path == tmp_path / "run" / "step_2"
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "optimizer.safetensors",
                                        "tokenizer.json", "trainer_state.json"]
    theirs, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = load_model(path).eval()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=TOKENS).logits
        assert torch.equal(theirs(input_ids=TOKENS).logits, expected)
        assert torch.equal(ours(input_ids=TOKENS).logits, expected)
    assert theirs.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert (path / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_resume_continues_exactly(tmp_path):
    model, opt = trained("qwen2-tied")
    random.seed(5)
    torch.manual_seed(5)
    save_checkpoint(tmp_path, 2, model, optimizer_state=[opt.state_dict(), None],
                    trainer_state={"position": 24, "rng": capture_rng(),
                                   "hash": config_hash({"lr": 1e-2})})
    expected = [step(model, opt) for _ in range(3)]
    draws = (random.random(), torch.rand(3))

    loaded = load_checkpoint(tmp_path)  # the run directory means its latest checkpoint
    assert loaded.step == 2 and loaded.trainer_state["position"] == 24
    assert loaded.optimizer_state[1] is None
    assert loaded.trainer_state["hash"] == config_hash({"lr": 1e-2}) != config_hash({"lr": 2e-2})
    model2 = load_model(loaded.path)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(loaded.optimizer_state[0])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)
    restore_rng(loaded.trainer_state["rng"])
    assert [step(model2, opt2) for _ in range(3)] == expected
    assert random.random() == draws[0] and torch.equal(torch.rand(3), draws[1])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_optimizer_flattening_names_and_round_trip():
    _, opt = trained("llama", steps=1)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    states = [opt.state_dict(), None, sgd.state_dict()]
    tensors, structure = flatten_optimizer_states(states)
    assert "opt.0.state.0.exp_avg" in tensors and "opt.0.state.3.exp_avg_sq" in tensors
    assert tensors["opt.0.state.0.step"].shape == ()
    back = unflatten_optimizer_states(tensors, structure)
    assert back[1] is None and back[2]["param_groups"] == sgd.state_dict()["param_groups"]
    assert back[0]["param_groups"] == opt.state_dict()["param_groups"]
    for pid, s in opt.state_dict()["state"].items():
        for name, value in s.items():
            assert torch.equal(back[0]["state"][pid][name], value)


def test_trainer_state_keeps_types(tmp_path):
    model, _ = trained("llama", steps=0)
    state = {"rng": torch.get_rng_state(), "t": (1, 2.5, None), "by_id": {3: "x"},
             "nan": float("nan"), "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 2)}
    loaded = load_checkpoint(save_checkpoint(tmp_path, 0, model, trainer_state=state))
    got = loaded.trainer_state
    assert loaded.optimizer_state is None and not loaded.has_tokenizer
    assert torch.equal(got["rng"], state["rng"]) and got["rng"].dtype == torch.uint8
    assert got["t"] == (1, 2.5, None) and got["by_id"] == {3: "x"} and got["nan"] != got["nan"]
    assert torch.equal(got["bf16"], state["bf16"]) and torch.equal(got["mask"], state["mask"])
    assert got["empty"].shape == (0, 2)
    with pytest.raises(TierflowError, match="cannot store a object at x"):
        save_checkpoint(tmp_path, 1, model, trainer_state={"x": object()})
    assert latest_checkpoint(tmp_path).name == "step_0"


def test_latest_ignores_temporary_and_incomplete(tmp_path):
    model, _ = trained("llama", steps=0)
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 5, model, trainer_state={})
    save_checkpoint(tmp_path, 10, model, trainer_state={})
    (tmp_path / "step_20.tmp-999999").mkdir()  # a save killed mid-write
    (tmp_path / "step_30").mkdir()  # no trainer_state.json: not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"
    (tmp_path / "step_10").rename(tmp_path / "step_10.replaced-999999")  # killed mid-replace
    save_checkpoint(tmp_path, 15, model, trainer_state={})
    assert not (tmp_path / "step_20.tmp-999999").exists()  # its process is gone: cleaned up
    assert sorted(os.listdir(tmp_path)) == ["step_10", "step_15", "step_30", "step_5"]


def fail_after(monkeypatch, nbytes, err=errno.ENOSPC):
    written = [0]
    original = ckpt._write

    def write(f, data):
        written[0] += len(data)
        if written[0] > nbytes:
            raise OSError(err, os.strerror(err))
        original(f, data)

    monkeypatch.setattr(ckpt, "_write", write)


@pytest.mark.parametrize("after", [0, 100, 5000])
def test_disk_full_keeps_the_previous_checkpoint(tmp_path, monkeypatch, after):
    model, opt = trained("llama")
    save_checkpoint(tmp_path, 1, model, optimizer_state=[opt.state_dict()], trainer_state={"a": 1})
    before = files(tmp_path / "step_1")
    step(model, opt)
    fail_after(monkeypatch, after)
    with pytest.raises(TierflowError) as e:
        save_checkpoint(tmp_path, 2, model, optimizer_state=[opt.state_dict()],
                        trainer_state={"a": 2})
    msg = str(e.value)
    assert msg.startswith(f"no space left on device writing checkpoint to {tmp_path / 'step_2'}")
    assert "free space or use --out elsewhere" in msg and "step_1 is intact" in msg
    assert "\n" not in msg
    assert sorted(os.listdir(tmp_path)) == ["step_1"]  # no step_2, no temporary directory
    assert files(tmp_path / "step_1") == before
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"


def test_failed_resave_of_the_same_step_keeps_it(tmp_path, monkeypatch):
    model, opt = trained("llama")
    save_checkpoint(tmp_path, 1, model, trainer_state={"a": 1})
    before = files(tmp_path / "step_1")
    fail_after(monkeypatch, 1000, errno.EACCES)
    with pytest.raises(TierflowError, match="cannot write checkpoint .* step_1 is intact"):
        save_checkpoint(tmp_path, 1, model, trainer_state={"a": 2})
    assert sorted(os.listdir(tmp_path)) == ["step_1"] and files(tmp_path / "step_1") == before
    monkeypatch.undo()
    save_checkpoint(tmp_path, 1, model, trainer_state={"a": 2})
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    assert load_checkpoint(tmp_path / "step_1").trainer_state == {"a": 2}


def test_unwritable_out(tmp_path):
    model, _ = trained("llama", steps=0)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierflowError, match="cannot create checkpoint directory"):
        save_checkpoint(blocker / "run", 1, model, trainer_state={})


def test_damaged_checkpoints_are_one_line_errors(tmp_path):
    model, opt = trained("llama")
    path = save_checkpoint(tmp_path, 3, model, optimizer_state=[opt.state_dict()], trainer_state={})
    for name in ("optimizer.safetensors", "model.safetensors"):
        good = (path / name).read_bytes()
        (path / name).write_bytes(b"\xff" * 8 + good[8:])
        with pytest.raises(TierflowError, match=f"{name} is not a readable safetensors file") as e:
            load_checkpoint(path)
        assert "\n" not in str(e.value)
        (path / name).write_bytes(good)
    (path / "trainer_state.json").write_text("{")
    with pytest.raises(TierflowError, match="not a valid trainer state"):
        load_checkpoint(path)
    with pytest.raises(TierflowError, match="does not exist"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TierflowError, match="holds no step_N"):
        load_checkpoint(tmp_path / "empty")
