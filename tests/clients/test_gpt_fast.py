"""A gpt-fast style decode loop on two gloo ranks: a small Llama-style model whose tensor parallelism
sums the attention and MLP outputs with torch.distributed._functional_collectives.all_reduce (as
gpt-fast's tp.py hooks do), a KV cache written at `input_pos`, prefill compiled with dynamic=True and
`decode_one_token` with mode="reduce-overhead", fullgraph=True (on the CPU there are no CUDA graphs to
record; it must still compile and run). Two generate calls: batch 2 then batch 1, prompts of 5 and 3
tokens, positions advancing one a step.

Needs no client package: gpt-fast is a script to copy, not a library, so its pattern is written here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from tests.clients._harness import Run, Setting, check, measured, run_ranks

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS, MAX_SEQ = 128, 64, 4, 2, 16, 2, 16
STEPS = 3


def _all_reduce(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


class KVCache(nn.Module):
    def __init__(self, batch: int, heads: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        shape = (batch, heads, MAX_SEQ, HEAD_DIM)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.wqkv = nn.Linear(DIM, (heads + 2 * kv_heads) * HEAD_DIM, bias=False)
        self.wo = nn.Linear(heads * HEAD_DIM, DIM, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split([self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], -1)
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, hidden, bias=False), nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(heads, kv_heads), FeedForward(hidden)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5), nn.RMSNorm(DIM, eps=1e-5)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, heads: int = HEADS, kv_heads: int = KV_HEADS, hidden: int = 4 * DIM) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(heads, kv_heads, hidden) for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(DIM, eps=1e-5), nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)))

    def setup_caches(self, batch: int) -> None:
        p = self.output.weight
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, layer.attention.kv_heads, p.dtype, p.device.type)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask[None, None, input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, mask)
        return self.output(self.norm(x))


def _shard(full: Transformer, rank: int) -> Transformer:
    """This rank's shard of `full`, as gpt-fast's tp.py cuts it: wqkv's Q, K and V heads and w1/w3 by
    rows, wo and w2 by columns, each summed over the ranks by a hook on its module."""
    world = dist.get_world_size()
    local = Transformer(HEADS // world, KV_HEADS // world, 4 * DIM // world)
    state = {}
    for name, w in full.state_dict().items():
        if name.endswith("wqkv.weight"):
            parts = w.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM])
            w = torch.cat([p.chunk(world)[rank] for p in parts])
        elif name.endswith(("w1.weight", "w3.weight")):
            w = w.chunk(world)[rank]
        elif name.endswith(("wo.weight", "w2.weight")):
            w = w.chunk(world, dim=1)[rank]
        state[name] = w
    local.load_state_dict(state)
    for layer in local.layers:
        layer.attention.register_forward_hook(_all_reduce)
        layer.feed_forward.register_forward_hook(_all_reduce)
    return local


def prefill(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(x, input_pos)[:, -1]


def decode_one_token(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(x, input_pos)[:, -1]


def generate(
    model: Transformer, prompt: torch.Tensor, prefill_fn, decode_fn, tokens: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """gpt-fast's generate loop, greedy; fed `tokens` instead where given (the compiled run takes
    eager's picks: a near tie could pick otherwise)."""
    b, s = prompt.shape
    model.setup_caches(b)
    input_pos = torch.arange(s, device=prompt.device)
    logits = [prefill_fn(model, prompt, input_pos).clone()]
    for i in range(STEPS):
        token = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[i]
        input_pos = torch.tensor([s + i], device=prompt.device)
        logits.append(decode_fn(model, token, input_pos).clone())  # CUDA graphs reuse their outputs
    return logits


def run(rank: int, setting: Setting) -> list[Run]:
    torch.manual_seed(0)
    model = _shard(Transformer(), rank).to(setting.device, setting.dtype)
    with measured("gpt-fast decode loop") as result:
        prefill_c = setting.compile(prefill, fullgraph=True, dynamic=True)
        decode_c = setting.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            for b, s in ((2, 5), (1, 3)):
                prompt = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(b)).to(setting.device)
                want = generate(model, prompt, prefill, decode_one_token)
                picks = [w.argmax(-1, keepdim=True) for w in want[:-1]]
                for got, expected in zip(generate(model, prompt, prefill_c, decode_c, picks), want):
                    result.compare(got, expected)
    return [result]


def _worker(rank: int) -> None:
    (result,) = run(rank, Setting())
    # Two all-reduces a layer in each graph: prefill and decode for each batch size (the KV cache, a
    # buffer and so of static size, ties the batch to a number even under dynamic=True); prompt lengths
    # and positions compile nothing new. fullgraph=True: no graph breaks.
    check(result, {"all_reduce": 2 * 2 * 2 * LAYERS}, {})


def test_gpt_fast_decode_loop() -> None:
    run_ranks(_worker)
