"""Packed fine-tuning: a packed batch's loss and every gradient equal the sum over its documents
run one by one (fp32, Llama and Qwen2 chains, a plan that recomputes in memory and one that
recomputes and streams every stage's weights from the disk tier), masked positions take no
gradient and their poisoned labels change no bit of the loss or of a gradient, gradient
accumulation 4 equals batch x4 with uneven masks (in memory and from disk), and a fine-tune's
checkpoint loads in transformers with the model's tokenizer, chat template and end token."""
import io

import numpy as np
import pytest
import torch
from cli_support import records, run_main
from sft_support import chat_model_dir, chats, pairs, unanswered, write_jsonl

import tierflow
from tierflow.core.config import FitConfig
from tierflow.data.tokenfile import TokenFile, TokenWriter
from tierflow.data.tokenize import tokenize
from tierflow.train.packing import IGNORE, PackedBatches, step_inputs, targets

PLACEMENTS = ["recompute", "disk"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenized(request, tmp_path_factory):
    """A tiny ``family`` instruct model and its chat + prompt/completion records tokenized (some
    chats end on an unanswered user turn: context after the last target)."""
    root = tmp_path_factory.mktemp(request.param)
    model = chat_model_dir(root / "model", request.param, layers=3)
    write_jsonl(root / "mix.jsonl", chats(10) + pairs(10) + unanswered(4))
    tokenize([root / "mix.jsonl"], root / "data", tokenizer=model, eval_fraction=0,
             log=io.StringIO())
    return model, TokenFile.open(root / "data" / "train.bin")


class _Recorder(torch.optim.Optimizer):
    """An optimizer that steps nothing: it keeps a copy of each model parameter's gradient as
    it sees it (by name), which is how a test reads the gradients of a plan that streams
    weights from disk, whose updates run inside the backward."""

    def __init__(self, params, names: dict[int, str], seen: dict[str, torch.Tensor]):
        super().__init__(params, {})
        self.names, self.seen = names, seen

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) in self.names:  # not the probe's scratch
                    self.seen[self.names[id(p)]] = p.grad.clone()


def _placed(model, inputs, placement, disk, grad_accum=1):
    """``model`` fitted for ``inputs`` by a plan that recomputes every stage (placement
    "recompute"), or that also streams every stage's weights from ``disk`` ("disk"); and a
    function that gives the gradients of the last step by name."""
    if placement == "recompute":
        module = tierflow.fit(model, inputs, planner="checkpoint-all")
        assert module.streamer is None
        grads = lambda: {n: p.grad.clone() for n, p in model.named_parameters()}  # noqa: E731
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        seen: dict[str, torch.Tensor] = {}
        module = tierflow.fit(model, inputs, optimizer=lambda ps: _Recorder(ps, names, seen),
                              disk=disk, grad_accum=grad_accum,
                              config=FitConfig(planner="checkpoint-all", stream="all",
                                               prefetch_depth=1))
        assert len(module.streamer.streamed) >= 3  # the decoder layers at least
        seen.clear()

        def grads():
            assert seen.keys() == set(names.values())
            return dict(seen)
    assert module.plan.recomputed_stages()
    return module, grads


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
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_packed_batch_equals_its_documents_one_by_one(tokenized, placement, tmp_path):
    directory, tokens = tokenized
    batch = PackedBatches(tokens, 160, 3, seed=0).next()
    assert (batch["position_ids"] == 0).sum() > 3  # several documents a row
    model = _model(directory)
    want_loss, want = _per_document(model, tokens, batch)
    model.zero_grad()
    inputs = step_inputs(batch, torch.device("cpu"), targets(batch))
    module, grads = _placed(model, inputs, placement, tmp_path)
    loss = module(**inputs).loss
    loss.backward()
    torch.testing.assert_close(float(loss.detach()), want_loss, rtol=1e-6, atol=0)
    got = grads()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


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


def _poisoned_copy(tokens: TokenFile, path) -> tuple[TokenFile, int]:
    """``tokens`` written again to ``path`` with a random other id at every masked position
    that no target of its document follows, and the number of ids so changed. Those tokens
    are the labels of masked positions and nothing else the loss could read: an earlier
    masked token (a prompt) is also the context of the targets after it, which it must
    change. Same mask, same document boundaries."""
    ids = np.array(tokens.window(0, len(tokens)), dtype=np.int64)  # (tokens,)
    mask = np.asarray(tokens.mask)
    rng = np.random.default_rng(0)
    changed = 0
    with TokenWriter(path, tokens.vocab_size, masked=True) as out:
        for start, end in zip(tokens.offsets[:-1].tolist(), tokens.offsets[1:].tolist()):
            doc = ids[start:end].copy()
            hit = np.flatnonzero(mask[start:end])
            tail = slice(int(hit[-1]) + 1 if len(hit) else 0, len(doc))
            doc[tail] = (doc[tail] + rng.integers(1, tokens.vocab_size, len(doc[tail]))
                         ) % tokens.vocab_size
            changed += len(doc[tail])
            out.write(doc, mask[start:end])
    return TokenFile.open(path), changed


def test_poisoned_masked_labels_change_no_bit(tokenized, tmp_path):
    """The token file as ``tokenize`` wrote it, and a copy whose masked labels are poisoned
    (random ids): their packed batches (every row, as the training loop draws them) give the
    same loss and every gradient to the bit. A loss that read a masked label, or attention
    across the documents of a row, would see the poison."""
    directory, tokens = tokenized
    poisoned, changed = _poisoned_copy(tokens, tmp_path / "train.bin")
    rows = len(PackedBatches(tokens, 160, 1, seed=3).rows)
    clean, dirty = (PackedBatches(t, 160, rows, seed=3).next() for t in (tokens, poisoned))
    differ = clean["input_ids"] != dirty["input_ids"]
    assert changed >= 20 and int(differ.sum()) == changed  # every poisoned token is drawn
    assert torch.equal(clean["shift_labels"], dirty["shift_labels"])
    assert torch.equal(clean["position_ids"], dirty["position_ids"])
    assert torch.all(clean["shift_labels"][:, :-1][differ[:, 1:]] == IGNORE)  # masked labels
    assert targets(clean) > 100
    model = _model(directory)
    counted = targets(clean)
    module = tierflow.fit(model, step_inputs(clean, torch.device("cpu"), counted),
                          planner="checkpoint-all")
    runs = []
    for batch in (clean, dirty):
        model.zero_grad()
        loss = module(**step_inputs(batch, torch.device("cpu"), counted)).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, grads), (poisoned_loss, poisoned_grads) = runs
    assert torch.equal(poisoned_loss, loss), (float(poisoned_loss), float(loss))
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(poisoned_grads[name], grad), name


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_accumulation_of_4_equals_a_batch_4_times_larger(tokenized, placement, tmp_path):
    """Four micro-batches of uneven target counts, each loss over the step's count, backward
    one after another (from disk: the gradients wait there between them, the update after
    the fourth) give the loss and gradients of the one batch of their rows (its documents
    run one by one by plain PyTorch)."""
    directory, tokens = tokenized
    big = PackedBatches(tokens, 160, 4, seed=2).next()
    small = PackedBatches(tokens, 160, 1, seed=2)
    micro = [small.next() for _ in range(4)]
    counts = [targets(b) for b in micro]
    assert len(set(counts)) > 1  # the masks are spread unevenly
    assert all(torch.equal(big["input_ids"][k], micro[k]["input_ids"][0]) for k in range(4))
    assert sum(counts) == targets(big)
    model = _model(directory)
    want_loss, want = _per_document(_model(directory), tokens, big)  # plain PyTorch
    inputs = step_inputs(micro[0], torch.device("cpu"), sum(counts))
    module, grads = _placed(model, inputs, placement, tmp_path, grad_accum=4)
    model.zero_grad()
    got = 0.0
    for batch in micro:
        loss = module(**step_inputs(batch, torch.device("cpu"), sum(counts))).loss
        loss.backward()
        got += float(loss.detach())
    torch.testing.assert_close(got, want_loss, rtol=1e-6, atol=0)
    accumulated = grads()
    for name in want:
        torch.testing.assert_close(accumulated[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


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
