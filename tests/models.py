"""Tiny models for tests, built with a fixed seed: HF causal LMs, a ResNet-style CNN, a residual
MLP and an nn.Sequential MLP. Each builder has a matching sample builder."""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
HIDDEN = 32

# family -> (config class name, causal-LM class name, extra config fields)
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
HF_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
}
CORE_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox")


def _dropout_fields(family: str, p: float) -> dict:
    if family == "gpt2":
        return dict(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
    if family == "gpt_neox":
        return dict(hidden_dropout=p, attention_dropout=p)
    if family == "phi3":
        return dict(resid_pdrop=p, embd_pdrop=p, attention_dropout=p)
    return dict(attention_dropout=p)


def hf_config(family: str, *, layers: int = 2, dropout: float = 0.0):
    import transformers

    config_cls, _, extra = HF_FAMILIES[family]
    if family == "gpt2":
        fields = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=4, n_positions=64,
                      bos_token_id=1, eos_token_id=2)
    elif family == "gpt_neox":
        fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    else:
        fields = dict(_LLAMA_LIKE, num_hidden_layers=layers)
    fields.update(extra)
    fields.update(_dropout_fields(family, dropout))
    return getattr(transformers, config_cls)(**fields)


def tiny_hf(family: str, *, layers: int = 2, dropout: float = 0.0, seed: int = 0,
            attn_implementation: str = "eager"):
    """A tiny randomly initialised causal LM of ``family`` (see HF_FAMILIES), in train mode
    when dropout > 0, else in eval mode."""
    import transformers

    config = hf_config(family, layers=layers, dropout=dropout)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, HF_FAMILIES[family][1])(config)
    return model.train(dropout > 0)


def hf_sample(batch: int = 2, seq: int = 16, *, labels: bool = True, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    sample = {"input_ids": ids}
    if labels:
        sample["labels"] = ids.clone()
    return sample


# ---------------------------------------------------------------------------- plain torch


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn + shortcut, then relu (ResNet's basic block)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                      nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 8, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = self.pool(self.relu(self.bn(self.stem(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(x.mean((2, 3)), 1)  # (B, 2 * width)
        return self.fc(self.drop(x))


class ResidualMLP(nn.Module):
    """x -> in_proj -> n x (h + MLP(LN(h))) -> LN -> out_proj, with dropout in the blocks."""

    def __init__(self, d_in: int = 16, d: int = 32, d_out: int = 8, blocks: int = 3,
                 dropout: float = 0.1):
        super().__init__()
        self.in_proj = nn.Linear(d_in, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))
        self.ups = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(blocks))
        self.dropout = dropout
        self.norm = nn.LayerNorm(d)
        self.out_proj = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, d_in)
        h = self.in_proj(x)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            y = down(torch.nn.functional.gelu(up(norm(h))))
            h = h + torch.nn.functional.dropout(y, self.dropout, self.training)
        return self.out_proj(self.norm(h))


def resnet_cnn(*, seed: int = 0, dropout: float = 0.1) -> TinyResNet:
    torch.manual_seed(seed)
    return TinyResNet(dropout=dropout).train()


def resnet_sample(batch: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def residual_mlp(*, seed: int = 0, dropout: float = 0.1) -> ResidualMLP:
    torch.manual_seed(seed)
    return ResidualMLP(dropout=dropout).train()


def mlp_sample(batch: int = 8, d_in: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, d_in, generator=torch.Generator().manual_seed(seed))


def sequential_mlp(*, seed: int = 0, dropout: float = 0.1, d_in: int = 16, d: int = 32,
                   depth: int = 3) -> nn.Sequential:
    """Linear-ReLU-Dropout blocks then a Linear head, in train mode."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d_in if i == 0 else d, d), nn.ReLU(), nn.Dropout(dropout)]
    layers.append(nn.Linear(d, 8))
    return nn.Sequential(*layers).train()


# ---------------------------------------------------------------------------- save/load round trips

def tiny_configs() -> dict:
    """name -> a builder of a tiny config, one per family shape a checkpoint must handle:
    separate head (Llama), tied head (Qwen2), GPT-2's own layout, and GPT-NeoX, whose
    checkpoints name its head ``embed_out`` (the module is ``lm_head`` in transformers 5)."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    return {
        "llama": lambda: LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2),
        "qwen2-tied": lambda: Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, tie_word_embeddings=True),
        "gpt2": lambda: GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                   n_positions=64, bos_token_id=0, eos_token_id=0),
        "gpt-neox": lambda: GPTNeoXConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=64),
    }
