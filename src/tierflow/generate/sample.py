"""``tierflow generate``: sample text from a causal LM with a KV cache, streamed as it comes.

``generate(model, tokenizer, prompt, Sampling(...))`` returns the continuation (the prompt not
included); ``sample_ids(model, prompt_ids, Sampling(...))`` is the token-level loop underneath,
a generator of ids.
The loop is ours, not ``model.generate``: one forward pass over the prompt fills the KV cache
(``use_cache=True``), then one pass per new token feeds only that token with
``past_key_values``. Each step takes the last position's logits in fp32, masks the ids the
tokenizer cannot decode, and picks the argmax (``temperature=0``) or samples from
``softmax(logits / temperature)`` restricted to the ``top_k`` largest, with a seeded
``torch.Generator`` so a seed gives the same text every time. Generation stops after
``max_new_tokens`` or at an end-of-sequence id (the model config's ``eos_token_id`` and the
tokenizer's end-of-text token). With a chat template (``tierflow generate --chat``) the prompt
is a user message: the template renders it with its generation prompt, the reply alone is
written, and the tokenizer's eos token (the template's end of turn) stops it too.

Text is streamed by decoding all generated ids and printing what was not printed yet, holding
back a trailing partial UTF-8 character (a byte-level token can end mid-character).

Without ``--ram``, or when it holds ``memory_needed`` (weights in the compute dtype, KV cache
and an activation margin, from the config and the safetensors headers) plus a runtime allowance,
the whole model is loaded into RAM by ``load_model``. Below that,
``stream.load_streamed`` keeps as many decoder layers in RAM as the budget holds and
reads the others from the checkpoint for every forward pass (the plan and, at the end, what the
reads cost are printed on stderr); the text is the same as with every weight in RAM. A budget
below even that is refused, naming the smallest budget that works.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

import torch

from ..core.errors import TierflowError
from ..models.files import max_positions
from .memory import MemoryNeed, dtype_name, fits_in_ram, memory_needed
from .options import GenerateRequest, Sampling, check_request
from .stream import load_streamed

_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


@dataclass
class GenerateStats:
    """Counts and times of one generation (prefill = the pass over the prompt)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped_at_eos: bool = False
    seed: int | None = None  # the sampling seed used (drawn when none was given)

    @property
    def tok_s(self) -> float:
        """New tokens per second of the whole generation (prefill included)."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    def summary(self) -> str:
        end = "end-of-sequence token" if self.stopped_at_eos else "max new tokens"
        seed = f"; seed {self.seed}" if self.seed is not None else ""
        return (f"[generate] {self.new_tokens} tokens in {self.prefill_s + self.decode_s:.2f} s: "
                f"{self.tok_s:.1f} tok/s (prompt {self.prompt_tokens} tokens in "
                f"{self.prefill_s * 1000:.0f} ms; stopped at {end}{seed})")


def check_length(model: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit in the model's positions."""
    limit = max_positions(model.config)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        fix = (f"lower --max-new-tokens to {limit - prompt_tokens}" if prompt_tokens < limit
               else f"shorten the prompt to fewer than {limit} tokens")
        raise TierflowError(f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens "
                            f"{max_new_tokens} is {prompt_tokens + max_new_tokens} tokens, above "
                            f"the model's {limit} positions: {fix}")


def stop_ids(model: Any, tokenizer: Any = None) -> set[int]:
    """End-of-sequence ids: the config's ``eos_token_id`` (int or list) and the tokenizer's
    end-of-text token when it has one of the usual names."""
    ids: set[int] = set()
    for config in (getattr(model, "generation_config", None), model.config):
        eos = getattr(config, "eos_token_id", None) if config is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(i) for i in eos)
    if tokenizer is not None:
        for name in _EOS_NAMES:
            token_id = tokenizer.token_to_id(name)
            if token_id is not None:
                ids.add(token_id)
    return ids


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
          generator: torch.Generator) -> int:
    """One id from the fp32 logits of the last position (shape (vocab,))."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def sample_ids(model: Any, prompt_ids: Sequence[int], sampling: Sampling = Sampling(), *,
               stop: set[int] | None = None, allowed_vocab: int | None = None,
               stats: GenerateStats | None = None) -> Iterator[int]:
    """Yield up to ``sampling.max_new_tokens`` new ids after ``prompt_ids``, using a KV cache.

    ``stop``: ids that end generation (the stop id is yielded, then the loop ends).
    ``allowed_vocab``: ids at or above it are never picked (a model vocabulary padded beyond
    the tokenizer's). ``stats`` is filled in as it goes (with the seed drawn, when
    ``sampling.seed`` is None).
    """
    if len(prompt_ids) == 0:
        raise TierflowError("the prompt encodes to no tokens: give a non-empty --prompt")
    check_length(model, len(prompt_ids), sampling.max_new_tokens)
    stats = stats if stats is not None else GenerateStats()
    stats.prompt_tokens = len(prompt_ids)
    stop = stop or set()
    generator = torch.Generator()
    if sampling.temperature > 0:
        stats.seed = generator.seed() if sampling.seed is None else sampling.seed
        generator.manual_seed(stats.seed)
    model.config.use_cache = True
    if model.training:
        model.eval()
    device = next(model.parameters()).device

    start = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    if cache is None:
        raise TierflowError(f"{type(model).__name__} returned no KV cache (past_key_values) "
                            "with use_cache=True: generation needs a causal LM that caches")
    logits = out.logits[0, -1].float()
    stats.prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    for i in range(sampling.max_new_tokens):
        if allowed_vocab is not None and allowed_vocab < logits.numel():
            logits[allowed_vocab:] = float("-inf")
        token = _pick(logits, sampling.temperature, sampling.top_k, generator)
        stats.new_tokens = i + 1
        stats.decode_s = time.perf_counter() - start
        yield token
        if token in stop:
            stats.stopped_at_eos = True
            break
        if i + 1 == sampling.max_new_tokens:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1].float()
    stats.decode_s = time.perf_counter() - start


class _Streamer:
    """Turns ids into text pieces: decode everything, emit what is new, hold back a trailing
    replacement character (an incomplete multi-byte character)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.start = len(self._decode())
        self.printed = self.start

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        piece, self.printed = text[self.printed:], max(len(text), self.printed)
        return piece

    def finish(self) -> str:
        text = self._decode()
        piece, self.printed = text[self.printed:], max(len(text), self.printed)
        return piece

    def text(self) -> str:
        return self._decode()[self.start:]


def encode_prompt(tokenizer: Any, prompt: str, chat_template: Any = None) -> list[int]:
    """The ids of ``prompt``; with ``chat_template`` (``data.examples.ChatTemplate``) the ids
    of the conversation of one user message ``prompt`` rendered with the generation prompt,
    encoded without added special tokens (the template writes its own)."""
    if not isinstance(prompt, str) or not prompt:
        raise TierflowError("the prompt is empty: give some text with --prompt")
    if chat_template is not None:
        text = chat_template.render([{"role": "user", "content": prompt}], True)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
    else:
        ids = tokenizer.encode(prompt).ids
    if not ids:
        raise TierflowError(f"the prompt {prompt[:40]!r} encodes to no tokens: give text the "
                            "tokenizer knows")
    return ids


def generate(model: Any, tokenizer: Any, prompt: str, sampling: Sampling = Sampling(), *,
             stream: TextIO | Callable[[str], Any] | None = None,
             stats: GenerateStats | None = None, chat_template: Any = None) -> str:
    """The text ``model`` writes after ``prompt`` (a ``tokenizers.Tokenizer`` encodes and
    decodes), picked as ``sampling`` says; ``stream`` (a text file or a function) receives
    the text piece by piece as it is generated; ``stats`` receives counts and times. With
    ``chat_template`` (``data.examples.ChatTemplate``) ``prompt`` is a user message: the
    reply is written after the template's generation prompt and ends at the template's end
    token (the tokenizer's eos, besides the model's and generation config's eos ids)."""
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template)
    streamer = _Streamer(tokenizer, prompt_ids)
    emit = _emitter(stream)
    stop = stop_ids(model, tokenizer)
    if chat_template is not None:
        stop |= chat_template.end_ids()
    for token in sample_ids(model, prompt_ids, sampling, stop=stop,
                            allowed_vocab=tokenizer.get_vocab_size(with_added_tokens=True),
                            stats=stats):
        emit(streamer.push(token))
    emit(streamer.finish())
    return streamer.text()


def _emitter(stream: TextIO | Callable[[str], Any] | None) -> Callable[[str], None]:
    if stream is None:
        return lambda piece: None
    if callable(stream) and not hasattr(stream, "write"):
        return lambda piece: piece and stream(piece)  # type: ignore[misc]

    def write(piece: str) -> None:
        if piece:
            stream.write(piece)  # type: ignore[union-attr]
            stream.flush()  # type: ignore[union-attr]
    return write


def resolve_dtype(name: str) -> torch.dtype:
    """``auto``: bf16 where the CPU computes it natively (or on a GPU), else fp32."""
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    if name != "auto":
        raise TierflowError(f"--dtype {name!r} is not one of auto, bf16, fp32")
    from ..profile.machine import fast_bf16
    return torch.bfloat16 if fast_bf16() else torch.float32


def run(request: GenerateRequest, out: TextIO | None = None) -> GenerateStats:
    """What ``tierflow generate`` does: check everything, load, then for each prompt (one, or
    several in turn: the model is loaded once) stream the prompt and its continuation to
    ``out`` (stdout), then a line with tokens/s. With ``chat`` each prompt is a user message
    rendered by the tokenizer's chat template, and only the reply is written. With ``enforce``
    (and a ``ram`` budget) the kernel holds the process to ``ram`` above its RSS after the
    imports: once the plan fits, before a weight is read, it enters a memory cgroup
    (``enforce.hold``; what it says goes to stderr), or with ``unenforced_ok`` says why it
    cannot and runs on. Returns the last prompt's stats."""
    from ..data.tokenizer import load_tokenizer
    from ..exec.load import load_model
    from ..models.int8 import is_quantized

    out = out if out is not None else sys.stdout
    r = request
    directory, tok_path, budget = check_request(r)
    hold = _kernel_limit(budget, r.unenforced_ok) if r.enforce and budget is not None else None
    if directory != Path(r.model):
        print(f"[generate] {r.model}: its latest checkpoint, {directory.name}", file=sys.stderr,
              flush=True)
    tok = load_tokenizer(tok_path)
    template = None
    if r.chat:
        from ..data.examples import ChatTemplate
        template = ChatTemplate(tok_path)
    torch_dtype = resolve_dtype(r.dtype)
    prompt_tokens = max(len(encode_prompt(tok, p, template)) for p in r.prompts)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    need: MemoryNeed | None = None
    if budget is not None:
        need = memory_needed(directory, torch_dtype, prompt_tokens, r.max_new_tokens)
    streaming = None
    if need is not None and budget is not None and not fits_in_ram(need, budget):
        model, streaming = load_streamed(directory, torch_dtype, need, budget,
                                         ram_text=str(r.ram), prompt_tokens=prompt_tokens,
                                         max_new_tokens=r.max_new_tokens, vocab_size=vocab,
                                         log=sys.stderr, before_reading=hold)
    else:
        if hold is not None:
            hold()
        model = load_model(directory, vocab_size=vocab, dtype=torch_dtype, for_generation=True)
    weights = ", int8 weights" if is_quantized(model.config) else ""
    stats = GenerateStats()
    try:
        check_length(model, prompt_tokens, r.max_new_tokens)
        for text in r.prompts:
            stats = GenerateStats()
            if template is None:
                out.write(text)
                out.flush()
            generate(model, tok, text, r.sampling, stream=out, stats=stats,
                     chat_template=template)
            out.write("\n" + stats.summary() + f", {dtype_name(torch_dtype)}{weights}\n")
            out.flush()
    finally:
        if streaming is not None:
            streaming.close()
    if streaming is not None:
        print(f"[stream] {streaming.summary()}", file=sys.stderr, flush=True)
    return stats


def _kernel_limit(budget: int, unenforced_ok: bool) -> Callable[[], object]:
    """``--enforce``: the RSS baseline now, after the imports (transformers' model code
    included, as ``tierflow train`` and the peers take theirs), and the function that enters
    a memory cgroup holding the process to ``budget`` above it (``enforce.hold``; a line on
    stderr says which, or why none)."""
    import transformers.modeling_utils  # noqa: F401  (part of the RSS baseline)

    from ..exec.enforce import hold
    from ..exec.load import load_model  # noqa: F401  (part of the RSS baseline)
    from ..exec.memory import return_free_memory, rss_bytes
    baseline = rss_bytes()

    def enter() -> object:
        return_free_memory()  # malloc's caches are not the process's to keep charged
        return hold(budget, baseline, rss_bytes(), unenforced_ok=unenforced_ok,
                    say=lambda line: print(line, file=sys.stderr, flush=True))
    return enter
