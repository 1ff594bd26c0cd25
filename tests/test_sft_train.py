"""Packed fine-tuning: a packed batch's loss and every gradient equal the sum over its documents
run one by one (fp32, Llama and Qwen2 chains, a plan that recomputes), masked positions take no
gradient, gradient accumulation 4 equals batch x4 with uneven masks, and a fine-tune's
checkpoint loads in transformers with the model's tokenizer, chat template and end token."""
import io

import pytest
import torch
from cli_support import records, run_main
from sft_support import chat_model_dir, chats, pairs, write_jsonl

import tierflow
from tierflow.data.tokenfile import TokenFile
from tierflow.data.tokenize import tokenize
from tierflow.train.packing import IGNORE, PackedBatches, step_inputs, targets


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenized(request, tmp_path_factory):
    """A tiny ``family`` instruct model and its chat + prompt/completion records tokenized."""
    root = tmp_path_factory.mktemp(request.param)
    model = chat_model_dir(root / "model", request.param, layers=3)
    write_jsonl(root / "mix.jsonl", chats(10) + pairs(10))
    tokenize([root / "mix.jsonl"], root / "data", tokenizer=model, eval_fraction=0,
             log=io.StringIO())
    return model, TokenFile.open(root / "data" / "train.bin")


def _model(directory):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").float()


def _per_document(model, tokens, batch):
    """The packed batch's documents run one by one by plain PyTorch: their summed target
    cross-entropy over the batch's target count, backward; the gradients by name."""
    model.zero_grad()
    total = 0.0
    ids, labels, positions = (batch[k] for k in ("input_ids", "shift_labels", "position_ids"))
    for row in range(ids.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            logits = model(input_ids=ids[row:row + 1, a:b]).logits[0]  # (n, V)
            total = total + torch.nn.functional.cross_entropy(
                logits, labels[row, a:b], ignore_index=IGNORE, reduction="sum")
    loss = total / targets(batch)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_batch_equals_its_documents_one_by_one(tokenized):
    directory, tokens = tokenized
    batch = PackedBatches(tokens, 160, 3, seed=0).next()
    assert (batch["position_ids"] == 0).sum() > 3  # several documents a row
    model = _model(directory)
    want_loss, want = _per_document(model, tokens, batch)
    model.zero_grad()
    inputs = step_inputs(batch, torch.device("cpu"), targets(batch))
    module = tierflow.fit(model, inputs, planner="checkpoint-all")
    assert module.plan.recomputed_stages()
    loss = module(**inputs).loss
    loss.backward()
    torch.testing.assert_close(float(loss), want_loss, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_masked_positions_take_no_gradient(tokenized):
    """Poisoned context: whatever the hidden state at a non-target position, the loss does not
    see it (its gradient there is exactly zero), and the targets' gradients are not."""
    directory, tokens = tokenized
    batch = PackedBatches(tokens, 160, 2, seed=1).next()
    model = _model(directory)
    inputs = step_inputs(batch, torch.device("cpu"), targets(batch))
    module = tierflow.fit(model, inputs, planner="checkpoint-all")
    seen = []

    def keep(module, args, out):  # the final norm's output: what the head reads per position
        out.retain_grad()
        seen.append(out)

    handle = model.model.norm.register_forward_hook(keep)
    try:
        module(**inputs).loss.backward()
    finally:
        handle.remove()
    grad = seen[-1].grad  # (rows, seq, hidden)
    masked = batch["shift_labels"] == IGNORE
    assert masked.any() and (~masked).any()
    assert torch.all(grad[masked] == 0)
    assert torch.all(grad[~masked].abs().sum(-1) > 0)


def test_accumulation_of_4_equals_a_batch_4_times_larger(tokenized):
    directory, tokens = tokenized
    big = PackedBatches(tokens, 160, 4, seed=2).next()
    small = PackedBatches(tokens, 160, 1, seed=2)
    micro = [small.next() for _ in range(4)]
    counts = [targets(b) for b in micro]
    assert len(set(counts)) > 1  # the masks are spread unevenly
    assert all(torch.equal(big["input_ids"][k], micro[k]["input_ids"][0]) for k in range(4))
    model = _model(directory)
    inputs = step_inputs(big, torch.device("cpu"), targets(big))
    module = tierflow.fit(model, inputs, planner="checkpoint-all")
    model.zero_grad()
    want = float(module(**inputs).loss)
    module(**inputs).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = 0.0
    for batch in micro:
        loss = module(**step_inputs(batch, torch.device("cpu"), sum(counts))).loss
        loss.backward()
        got += float(loss)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_fine_tune_trains_packed_and_its_checkpoint_loads_as_the_model(tmp_path, capsys):
    from transformers import AutoTokenizer
    model = chat_model_dir(tmp_path / "model", "qwen2")
    write_jsonl(tmp_path / "chat.jsonl", chats(24))
    capsys.readouterr()
    assert run_main("tokenize", str(tmp_path / "chat.jsonl"), "--tokenizer", str(model),
                    "--out", str(tmp_path / "data"), "--seq-len", "160",
                    capsys=capsys)[0] == 0
    runs = {}
    for name, shape in {"accum": ("1", "4"), "batch": ("4", "1")}.items():
        code, _, err = run_main(
            "train", "--model", str(model), "--data", str(tmp_path / "data"), "--seq-len", "160",
            "--batch-size", shape[0], "--grad-accum", shape[1], "--dtype", "fp32", "--steps",
            "2", "--warmup", "0", "--eval-every", "2", "--out", str(tmp_path / name),
            capsys=capsys)
        assert code == 0, err
        runs[name] = [r["loss"] for r in records(tmp_path / name / "log.jsonl", "train")]
    torch.testing.assert_close(runs["accum"], runs["batch"], rtol=1e-5, atol=0)
    step = tmp_path / "batch" / "step_2"
    assert (step / "generation_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(step)
    assert tok.eos_token == "<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")
