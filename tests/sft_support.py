"""A tiny instruct model directory as transformers saves one (tokenizer.json with ChatML special
tokens, tokenizer_config.json with a chat template, generation_config.json, config.json and
weights), and small chat / prompt-completion record files: what the fine-tuning tests share."""
import json
import os
from pathlib import Path

import torch

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ("<|im_start|>", "<|im_end|>")


def chat_model_dir(root: Path, family: str = "llama", template: bool = True,
                   layers: int = 2) -> Path:
    """A tiny ``family`` (llama or qwen2) instruct model under ``root``: its end token
    ``<|im_end|>``, its tokenizer a byte-level BPE of the stdlib's textwrap.py."""
    import transformers

    from tierflow.data.tokenizer import train_tokenizer
    text = (Path(os.__file__).parent / "textwrap.py").read_text()
    tok = train_tokenizer([text], 300)
    tok.add_special_tokens(list(SPECIALS))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|im_end|>")
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}
    if template:
        config["chat_template"] = CHATML
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls[1](cls[0](vocab_size=vocab, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=256,
                              eos_token_id=eos, bos_token_id=None, tie_word_embeddings=False))
        model.generation_config = transformers.GenerationConfig(eos_token_id=eos)
        model.save_pretrained(root)
    return root


def chats(n: int = 12) -> list[dict]:
    """``n`` small conversations: a system turn in some, one or two assistant answers."""
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"wrap text number {i}"},
                    {"role": "assistant", "content": f"the wrapped text {i} " * (1 + i % 3)}]
        if i % 2:
            messages = [{"role": "system", "content": "you wrap text"}, *messages,
                        {"role": "user", "content": "and fill it?"},
                        {"role": "assistant", "content": "filled " * (1 + i % 4)}]
        out.append({"messages": messages})
    return out


def unanswered(n: int = 4) -> list[dict]:
    """``n`` chats that end on a user's question nobody answered: their last turn is context
    that no target follows (what a test can poison without touching any target's input)."""
    return [{"messages": [{"role": "user", "content": f"indent line {i}"},
                          {"role": "assistant", "content": f"indented {i} " * (1 + i % 2)},
                          {"role": "user", "content": "and now shorten " * (1 + i % 3)}]}
            for i in range(n)]


def pairs(n: int = 12) -> list[dict]:
    """``n`` prompt/completion records of uneven lengths."""
    return [{"prompt": f"dedent this {i}: ", "completion": "text " * (1 + i % 5)}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
