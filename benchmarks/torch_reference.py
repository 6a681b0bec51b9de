"""The PyTorch reference training step for benchmarks/step.py: the same shapes and
semantics as the trainer's step (float32 master weights, bf16 autocast compute, AdamW with
decay on matrices, global-norm clipping at 1.0), as people write it on one GPU:

  gpt2   nanoGPT-style GPT (learned positions, pre-LayerNorm, tanh GELU, tied head),
         F.scaled_dot_product_attention(is_causal=True), fused AdamW, torch.compile
  qwen2  transformers' Qwen2ForCausalLM (RMSNorm, rotary, grouped-query attention,
         SwiGLU) with attn_implementation="sdpa", fused AdamW, torch.compile

Prints one JSON object (step_ms, tokens_per_s, compile_s, loss). GPU only; not part of
the CPU test suite.

Usage:
  python -m benchmarks.torch_reference --family gpt2 --d-model 2048 --layers 16 --heads 16 --seq 2048 --batch 4
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from taco_jax import strict_json


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def qwen2(vocab: int, seq: int, d: int, layers: int, heads: int, kv_heads: int, d_ff: int) -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=d_ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=torch.float32)
    model.config.use_cache = False
    return _LogitsOnly(model)


class _LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx, use_cache=False).logits


def measure(model: nn.Module, vocab: int, batch: int, seq: int, steps: int) -> dict:
    """Median step time over 3 trials of `steps` CUDA-synchronized steps, after compile."""
    model = model.cuda().train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=True,
    )
    compiled = torch.compile(model)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=generator) for _ in range(2)]

    def step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for i in range(3):
        step(batches[i % 2])
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for i in range(steps):
            loss = step(batches[i % 2])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / steps)
    step_s = statistics.median(times)
    return {
        "step_ms": 1e3 * step_s,
        "tokens_per_s": batch * seq / step_s,
        "compile_s": compile_s,
        "loss": float(loss),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("gpt2", "qwen2"), default="gpt2")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=5632)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.family == "gpt2":
        model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    else:
        model = qwen2(args.vocab, args.seq, args.d_model, args.layers, args.heads, args.kv_heads, args.d_ff)
    print(strict_json.dumps(measure(model, args.vocab, args.batch, args.seq, args.steps)))


if __name__ == "__main__":
    main()
