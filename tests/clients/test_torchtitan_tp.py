"""torchtitan style tensor parallelism on two gloo ranks: DTensor's `parallelize_module` with
torchtitan's Llama plan (ColwiseParallel / RowwiseParallel; then with SequenceParallel norms, whose
sequence shards move by reduce-scatter and all-gather) on a small model of torchtitan's layout,
compiled with backend="graphar". graphar rewrites the all-reduces; it has no op for reduce-scatter
or all-gather, which stay on the process group's collectives, and its log says so."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tests.clients._harness import Run, Setting, check, measured, run_ranks

VOCAB, DIM, HEADS, HEAD_DIM, LAYERS = 128, 64, 4, 16, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads of this rank
        q, k, v = (w(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Transformer, sequence_parallel: bool) -> Transformer:
    """torchtitan's parallelize_llama tensor-parallel plan (loss_parallel off: logits replicated)."""
    mesh = dist.init_device_mesh(model.output.weight.device.type, (dist.get_world_size(),))
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
        parallelize_module(block, mesh, plan)
    return model


def run(rank: int, setting: Setting) -> list[Run]:
    runs = []
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0)).to(setting.device)
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        model = parallelize(Transformer().to(setting.device, setting.dtype), sequence_parallel)
        with torch.no_grad(), measured(f"torchtitan {'TP + SP' if sequence_parallel else 'TP'}") as result:
            result.compare(setting.compile(model)(tokens), model(tokens))
        runs.append(result)
    return runs


def _worker(rank: int) -> None:
    tp, sp = run(rank, Setting())
    # TP: the vocab-parallel embedding's sum and each layer's wo and w2 rewritten; the logits' all-gather left.
    check(tp, {"all_reduce": 1 + 2 * LAYERS}, {"all_gather_into_tensor": 1})
    # SP: no all-reduce. The embedding and every wo and w2 reduce-scatter, every attention and MLP
    # input and the output all-gather (its input and the logits): all left.
    check(sp, {}, {"all_gather_into_tensor": 2 * LAYERS + 2, "reduce_scatter_tensor": 2 * LAYERS + 1})


def test_torchtitan_parallelize_module() -> None:
    run_ranks(_worker)
