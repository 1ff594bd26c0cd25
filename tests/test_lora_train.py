"""``tierflow train --lora``: a LoRA fine-tune from the command line.

Runs in memory under a plan that recomputes and with every stage streamed from ``--disk``
match a plain PyTorch loop over the same peft model (fp32, the same batches, AdamW, schedule
and clipping: losses within rtol 1e-5); no frozen weight is ever written back to the disk
tier; a checkpoint is a PEFT adapter directory that ``PeftModel.from_pretrained`` loads as it
is, with the reference's logits, and ``--merge`` a Hugging Face checkpoint that
``AutoModelForCausalLM`` loads with the same logits; a run of adapters resumes bit for bit;
bad input is one line with exit code 2. A Qwen2 fine-tune of chat records trains adapters on
two projections of a streamed base and saves what peft and transformers load."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_support import assert_error_line, fp32_train_args, run_main, train_losses
from transformers import AutoModelForCausalLM

from tierflow.data.tokenfile import TokenFile
from tierflow.exec.offload import OffloadedParameters
from tierflow.models.lora import ALL_LINEAR, LoraSpec, add_adapters
from tierflow.train.data import Batches
from tierflow.train.optimizer import BETAS, EPS
from tierflow.train.schedule import lr_at

STEPS = 4
LR = 1e-2  # fp32_train_args'
LORA = ("--lora", "4", "--lora-alpha", "8")


def train(capsys, *args) -> str:
    code, out, err = run_main(*args, capsys=capsys)
    assert code == 0, err
    return out


def plain_peft(env: dict) -> tuple[list[float], torch.nn.Module]:
    """The trainer's loop in plain PyTorch over the same peft model (adapters of rank 4,
    alpha 8, on every projection, drawn from seed 0): its losses and the trained model."""
    model = AutoModelForCausalLM.from_pretrained(env["model"], dtype=torch.float32)
    add_adapters(model, LoraSpec(4, 8.0, 0.0, ALL_LINEAR), seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": trainable, "weight_decay": 0.1}], lr=LR,
                                  betas=BETAS, eps=EPS)
    batches = Batches(TokenFile.open(f"{env['data']}/train.bin"), 32, 2, seed=0)
    torch.manual_seed(0)
    losses = []
    for step in range(STEPS):
        batch = batches.next()  # (2, 33)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=LR, warmup=0, total=STEPS, min_lr=LR / 10)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, model.eval()


@pytest.mark.slow
def test_lora_matches_plain_peft_streams_a_frozen_base_and_saves_what_peft_loads(
        train_env, tmp_path, capsys, monkeypatch):
    from peft import PeftModel
    disk = tmp_path / "disk"
    disk.mkdir()
    written: list[bool] = []  # requires_grad of each weight written back to the disk tier
    write_all = OffloadedParameters.write_all
    monkeypatch.setattr(OffloadedParameters, "write_all",
                        lambda self, ps, *after: (written.extend(p.requires_grad for p in ps),
                                                  write_all(self, ps, *after))[1])
    out = train(capsys, *fp32_train_args(train_env, tmp_path / "disk-run", STEPS, *LORA,
                                         "--merge", "--save-every", "2", "--disk", str(disk),
                                         "--stream", "all"))
    assert written and all(written)  # only adapters: the base's files stay as first written
    assert "frozen" in out
    train(capsys, *fp32_train_args(train_env, tmp_path / "ram-run", STEPS, *LORA,
                                   "--recompute", "all"))
    want, reference = plain_peft(train_env)
    for run in ("disk-run", "ram-run"):
        torch.testing.assert_close(train_losses(tmp_path / run), want, rtol=1e-5, atol=0.0)

    step = tmp_path / "disk-run" / f"step_{STEPS}"
    assert not (step / "model.safetensors").exists()  # the base never changes
    assert not (tmp_path / "disk-run" / "step_2" / "merged").exists()  # the last step's only
    ids = torch.arange(40).reshape(2, 20) % 300
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(train_env["model"], dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, step).eval()
        adapted = loaded(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(step / "merged", dtype=torch.float32)
        merged_logits = merged.eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged_logits, adapted, rtol=1e-5, atol=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())

    train(capsys, "train", "--resume", str(tmp_path / "disk-run" / "step_2"), "--out",
          str(tmp_path / "resumed"))
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "disk-run")[2:]


def test_bad_lora_input_is_one_line(train_env, tmp_path, capsys):
    cases = [
        (("--lora", "0"), ["--lora 0 is not a rank", "at least 1", "--lora 16"]),
        (("--lora", "4", "--lora-targets", "q_proj,qkv"),
         ["--lora-targets 'qkv' names no module", "q_proj, k_proj", "all-linear"]),
        (("--lora-alpha", "8"), ["--lora-alpha sets up LoRA adapters", "--lora RANK"]),
        (("--merge",), ["--merge sets up LoRA adapters"]),
        (("--lora", "4", "--lora-dropout", "1"), ["--lora-dropout 1.0 must be below 1"]),
        (("--lora", "4", "--train-only", "lm_head.*"), ["drop --train-only"]),
    ]
    for flags, fragments in cases:
        out = tmp_path / "o"
        code, _, err = run_main(*fp32_train_args(train_env, out, 1, *flags), capsys=capsys)
        assert code == 2, (flags, err)
        assert_error_line(err, fragments)
        assert not list(out.glob("step_*")), flags


@pytest.mark.slow
def test_a_qwen2_chat_fine_tune_of_adapters_on_a_streamed_base(tmp_path, capsys):
    """Packed chat records, Qwen2, every stage streamed from --disk: the adapter directory
    loads in peft with the model's tokenizer beside it, and merged/ gives peft's logits."""
    from peft import PeftModel
    from sft_support import chat_model_dir, chats, write_jsonl
    from transformers import AutoTokenizer
    model = chat_model_dir(tmp_path / "model", "qwen2")
    write_jsonl(tmp_path / "chat.jsonl", chats(16))
    assert run_main("tokenize", str(tmp_path / "chat.jsonl"), "--tokenizer", str(model),
                    "--out", str(tmp_path / "data"), "--seq-len", "160",
                    capsys=capsys)[0] == 0
    disk = tmp_path / "disk"
    disk.mkdir()
    train(capsys, "train", "--model", str(model), "--data", str(tmp_path / "data"),
          "--seq-len", "160", "--batch-size", "2", "--matmul-dtype", "fp32", "--lr", "1e-2",
          "--steps", "2", "--warmup", "0", "--eval-every", "0", "--out", str(tmp_path / "run"),
          "--disk", str(disk), "--stream", "all", "--lora", "8", "--lora-targets",
          "q_proj,v_proj", "--merge")
    step = tmp_path / "run" / "step_2"
    assert AutoTokenizer.from_pretrained(step).eos_token == "<|im_end|>"
    ids = torch.arange(30).reshape(2, 15) + 3
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, step).eval()
        assert {n.split(".")[-4] for n, _ in loaded.named_parameters() if ".lora_A." in n} \
            == {"q_proj", "v_proj"}
        adapted = loaded(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(step / "merged", dtype=torch.float32)
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, adapted, rtol=1e-5,
                                   atol=1e-5)
