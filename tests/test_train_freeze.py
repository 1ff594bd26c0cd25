"""tierflow train --freeze / --train-only: partial fine-tuning from the command line.

The in-memory run matches a plain PyTorch loop over the same batches (fp32, 3 steps: losses
within rtol 1e-5, every weight within 1e-4: Adam turns rounding-level gradient differences
of near-zero gradients into visible steps), frozen weights come back bit for bit, the --disk
run matches the in-memory one and resumes bit for bit, a checkpoint resumes only with its
patterns, and the selection's errors are one line each."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_support import assert_error_line, fp32_train_args, records, run_main, train_losses
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tierflow.core.errors import TierflowError
from tierflow.data.tokenfile import TokenFile
from tierflow.models.freeze import freeze_parameters
from tierflow.train.data import Batches
from tierflow.train.optimizer import BETAS, EPS
from tierflow.train.schedule import lr_at
from tierflow.train.sol import model_flops_per_token

STEPS = 3
LR = 1e-2  # fp32_train_args'
TRAIN_ONLY = "model.layers.1.*,lm_head.*"
FREEZE = "model.embed_tokens.*,model.layers.0.*"


def train(capsys, *args) -> str:
    code, out, err = run_main(*args, capsys=capsys)
    assert code == 0, err
    return out


def plain_pytorch_losses(env: dict, frozen_prefixes: tuple[str, ...]) -> tuple[list[float],
                                                                               dict]:
    """The trainer's loop written in plain PyTorch: the same batches, AdamW groups (decay on
    matrices), cosine schedule and clipping, over the parameters not frozen."""
    model = AutoModelForCausalLM.from_pretrained(env["model"], dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen_prefixes))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS)
    batches = Batches(TokenFile.open(f"{env['data']}/train.bin"), 32, 2, seed=0)
    torch.manual_seed(0)
    losses = []
    for step in range(STEPS):
        batch = batches.next()  # (2, 33)
        logits = model(input_ids=batch[:, :-1]).logits  # (2, 32, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=LR, warmup=0, total=STEPS, min_lr=LR / 10)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_train_only_matches_plain_pytorch_and_keeps_frozen_weights(train_env, tmp_path,
                                                                    capsys):
    out = train(capsys, *fp32_train_args(train_env, tmp_path / "run", STEPS,
                                         "--train-only", TRAIN_ONLY))
    expected_losses, expected = plain_pytorch_losses(
        train_env, ("model.embed_tokens.", "model.layers.0.", "model.norm."))
    torch.testing.assert_close(train_losses(tmp_path / "run"), expected_losses, rtol=1e-5,
                               atol=0.0)
    initial = load_file(f"{train_env['model']}/model.safetensors")
    final = load_file(str(tmp_path / "run" / f"step_{STEPS}" / "model.safetensors"))
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-4)  # train_and_match's
        if name.startswith(("model.embed_tokens.", "model.layers.0.", "model.norm.")):
            assert torch.equal(final[name], initial[name]), name
        else:
            assert not torch.equal(final[name], initial[name]), name
    assert "forward only, once (nothing in or before them trains): embed, layers.0" in out
    plan = records(tmp_path / "run" / "log.jsonl", "plan")[-1]
    assert plan["trainable_parameters"] == sum(
        v.numel() for n, v in expected.items() if n.startswith(("model.layers.1.", "lm_head.")))


def test_frozen_run_on_disk_matches_memory_and_resumes_bit_for_bit(train_env, tmp_path,
                                                                    capsys):
    """--freeze with every stage streamed: the in-memory run's losses; a checkpoint resumes
    on disk with the uninterrupted run's losses; the optimizer holds no frozen state."""
    disk = tmp_path / "disk"
    disk.mkdir()
    on_disk = ("--disk", str(disk), "--stream", "all")
    train(capsys, *fp32_train_args(train_env, tmp_path / "ram", 4, "--freeze", FREEZE))
    train(capsys, *fp32_train_args(train_env, tmp_path / "disk-run", 4, "--save-every", "2",
                                   "--freeze", FREEZE, *on_disk))
    torch.testing.assert_close(train_losses(tmp_path / "disk-run"),
                               train_losses(tmp_path / "ram"), rtol=1e-5, atol=0.0)
    train(capsys, "train", "--resume", str(tmp_path / "disk-run" / "step_2"), "--out",
          str(tmp_path / "resumed"), *on_disk)
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "disk-run")[2:]
    options = records(tmp_path / "resumed" / "log.jsonl", "options")[-1]
    assert options["freeze"] == FREEZE  # inherited from the checkpoint's run
    states = load_file(str(tmp_path / "disk-run" / "step_2" / "optimizer.safetensors"))
    final = load_file(str(tmp_path / "disk-run" / "step_4" / "model.safetensors"))
    trainable = [n for n in final if not n.startswith(("model.embed_tokens.",
                                                       "model.layers.0."))]
    assert len({k.split(".")[3] for k in states if k.startswith("opt.0.state.")}) == \
        len(trainable)


@pytest.mark.parametrize("flags", [("--matmul-dtype", "fp8"),
                                   ("--model-dtype", "bf16", "--master", "none")])
def test_low_precision_leaves_frozen_weights_as_they_were(train_env, tmp_path, capsys, flags):
    """fp8 Linears (a frozen one passes its input's gradient only) and bf16 weights updated
    by stochastic rounding: the frozen weights come back as loaded (bf16: rounded once)."""
    args = fp32_train_args(train_env, tmp_path / "run", 2, "--freeze", FREEZE, *flags)
    at = args.index("--dtype")
    del args[at:at + 2]  # its fp32 matmuls would contradict both
    train(capsys, *args)
    initial = load_file(f"{train_env['model']}/model.safetensors")
    final = load_file(str(tmp_path / "run" / "step_2" / "model.safetensors"))
    for name, value in final.items():
        before = initial[name].to(value.dtype)
        assert torch.equal(value, before) == name.startswith(("model.embed_tokens.",
                                                               "model.layers.0.")), name


def test_frozen_checkpoints_resume_across_disk_and_memory(train_env, tmp_path, capsys):
    """The optimizer states of a frozen run are in the single-process format either way: an
    in-memory checkpoint resumes with --disk, and a --disk one in memory, with the
    uninterrupted runs' losses (fp32, unclipped: the same arithmetic, rtol 1e-5)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    on_disk = ("--disk", str(disk), "--stream", "all")
    for run, extra in (("ram", ()), ("disk-run", on_disk)):
        train(capsys, *fp32_train_args(train_env, tmp_path / run, 4, "--save-every", "2",
                                       "--clip", "0", "--freeze", FREEZE, *extra))
    train(capsys, "train", "--resume", str(tmp_path / "ram" / "step_2"), "--out",
          str(tmp_path / "to-disk"), *on_disk)
    train(capsys, "train", "--resume", str(tmp_path / "disk-run" / "step_2"), "--out",
          str(tmp_path / "to-ram"), "--disk", "none")
    expected = train_losses(tmp_path / "ram")[2:]
    for run in ("to-disk", "to-ram"):
        torch.testing.assert_close(train_losses(tmp_path / run), expected, rtol=1e-5, atol=0.0)


def test_a_checkpoint_resumes_only_with_its_frozen_parameters(train_env, tmp_path, capsys):
    train(capsys, *fp32_train_args(train_env, tmp_path / "run", 2, "--freeze", FREEZE))
    code, _, err = run_main("train", "--resume", str(tmp_path / "run" / "step_2"), "--freeze",
                            "model.embed_tokens.*", "--out", str(tmp_path / "other"),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, ["is of a different run", "freeze", "--freeze/--train-only"])


def test_bad_selections_are_one_line(train_env, tmp_path, capsys):
    cases = [
        (("--freeze", "model.layer.*"), ["--freeze pattern 'model.layer.*' matches no "
                                         "parameter", "model.embed_tokens.weight"]),
        (("--train-only", "lm_head.*,nope"), ["--train-only pattern 'nope'"]),
        (("--freeze", "*"), ["--freeze '*' freezes all", "nothing would train"]),
        (("--train-only", "lm_head.*", "--freeze", "lm_head.*"), ["freezes all"]),
        (("--freeze", "model.norm.*,,lm_head.*"), ["has an empty pattern"]),
    ]
    for flags, fragments in cases:
        code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "o", 1, *flags),
                                capsys=capsys)
        assert code == 2, (flags, err)
        assert_error_line(err, fragments)


def test_a_toml_list_of_globs(train_env, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('train-only = ["model.layers.1.*", "lm_head.*"]\n')
    train(capsys, *fp32_train_args(train_env, tmp_path / "run", 1, "--config", str(config)))
    options = records(tmp_path / "run" / "log.jsonl", "options")[-1]
    assert options["train_only"] == TRAIN_ONLY
    config.write_text("freeze = 3\n")
    code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "o", 1, "--config",
                                             str(config)), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--freeze 3 is not text", "parameter-name globs"])


def _tied_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def test_the_plan_names_a_tied_parameter_frozen_under_both_names(train_env, tmp_path,
                                                                  capsys):
    """Qwen2 with a tied head: freezing the embedding freezes the head, and [Plan] says so."""
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=304, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=128)).save_pretrained(tmp_path / "qwen2")
    env = dict(train_env, model=str(tmp_path / "qwen2"))
    out = train(capsys, *fp32_train_args(env, tmp_path / "run", 1, "--freeze",
                                         "model.embed_tokens.*"))
    assert ("model.embed_tokens.weight and lm_head.weight are one tied parameter, frozen "
            "under each name") in out
    final = load_file(str(tmp_path / "run" / "step_1" / "model.safetensors"))
    initial = load_file(str(tmp_path / "qwen2" / "model.safetensors"))
    assert torch.equal(final["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])


def test_a_tied_parameter_answers_to_both_names():
    model = _tied_qwen2()
    frozen = freeze_parameters(model, "lm_head.weight", None)
    assert not model.model.embed_tokens.weight.requires_grad
    assert frozen.frozen == 1 and frozen.frozen_numel == 64 * 32
    model = _tied_qwen2()
    freeze_parameters(model, None, "lm_head.*,model.norm.*")
    assert model.model.embed_tokens.weight.requires_grad  # trains: the head trains
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    with pytest.raises(TierflowError, match="--freeze pattern 'x' matches no parameter"):
        freeze_parameters(model, "x", None)


def test_flops_count_what_frozen_layers_skip():
    """Every parameter trainable: 6 per matmul parameter + 12 x layers x width x seq. A
    frozen layer skips its weights' gradients (2 per parameter); run before anything that
    trains, it skips its inputs' gradients and its attention's backward too. The tied head
    is computed last: frozen, it still passes its input's gradient back."""
    model = _tied_qwen2()
    seq, width = 16, 32
    attention = 2 * width * seq  # layers x width x seq
    matmul = sum(p.numel() for p in model.parameters())  # tied: the embedding is the head
    layer0 = sum(p.numel() for p in model.model.layers[0].parameters())
    head = 64 * 32
    assert model_flops_per_token(model, seq) == 6 * matmul + 12 * attention
    model.model.layers[0].requires_grad_(False)  # the tied lookup trains: all backpropagate
    assert model_flops_per_token(model, seq) == 6 * matmul - 2 * layer0 + 12 * attention
    model.lm_head.weight.requires_grad_(False)  # and the embedding: layer 0 runs forward only
    assert model_flops_per_token(model, seq) == \
        6 * matmul - 4 * layer0 - 2 * head + (4 * 2 + 8 * 1) * width * seq
