"""Attention shapes the one-GPU benchmarks share (chunking, pack): `b x s x heads x d`, K/V heads, causal.

`s` is the global sequence (every token a rank attends after the sequence -> heads exchange); each
rank holds s / P tokens before it and heads / P heads after it. On the command line a shape is
`BxSxHxD`, optionally followed by `:kvN` (K/V heads, GQA) and `:causal`, e.g. `1x4096x32x128:kv8:causal`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import ulysses


@dataclass(frozen=True)
class Shape:
    b: int
    s: int  # global sequence
    heads: int
    d: int
    kv_heads: int = 0  # 0: as many as heads (no GQA)
    causal: bool = False
    name: str = ""  # the model it stands for, in the tables

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def layout(self) -> str:
        """b x s x heads x d, and the K/V heads where they differ: what a relayout sees."""
        gqa = f" kv{self.kv}" if self.kv != self.heads else ""
        return f"{self.b}x{self.s}x{self.heads}x{self.d}{gqa}"

    @property
    def layout_label(self) -> str:
        return f"{self.name} {self.layout}".strip()

    @property
    def label(self) -> str:
        """The model, the layout, and whether the attention is causal."""
        return self.layout_label + (" causal" if self.causal else "")

    def splits(self, world_size: int) -> bool:
        """Whether the sequence and every head count split evenly over `world_size` ranks."""
        return not (self.s % world_size or self.heads % world_size or self.kv % world_size)


def parse(text: str) -> Shape:
    """`BxSxHxD[:kvN][:causal]` -> Shape; ValueError when it is not one."""
    dims, *flags = text.strip().lower().split(":")
    b, s, h, d = (int(v) for v in dims.split("x"))
    kv = next((int(f[2:]) for f in flags if f.startswith("kv")), 0)
    if any(f != "causal" and not f.startswith("kv") for f in flags) or min(b, s, h, d) < 1 or kv < 0:
        raise ValueError(text)
    return Shape(b, s, h, d, kv_heads=kv, causal="causal" in flags)


def parse_list(text: str | None, p: argparse.ArgumentParser) -> list[Shape] | None:
    """--shapes as Shapes (None when not given); a usage error names a bad one."""
    if not text:
        return None
    try:
        return [parse(item) for item in text.split(",")]
    except ValueError:
        p.error(f"--shapes {text!r}: expected comma-separated BxSxHxD[:kvN][:causal], e.g. 1x4096x32x128:kv8:causal")


# Issue 31's shapes for the chunking tax: Llama-like (32 heads, causal) at 4K and 16K tokens,
# Flux-like (24 heads; 4096 image + 512 text tokens), Wan-2.1-like (40 heads; 480p, 81 frames).
LLAMA_4K = Shape(1, 4096, 32, 128, causal=True, name="Llama")
LLAMA_16K = Shape(1, 16384, 32, 128, causal=True, name="Llama")
FLUX = Shape(1, 4096 + 512, 24, 128, name="Flux")
WAN = Shape(1, 32760, 40, 128, name="Wan")
CHUNKING = [LLAMA_4K, LLAMA_16K, FLUX, WAN]
# The Ulysses benchmark's shapes (its baseline's DiT-like ones, then Wan-2.1-like).
ULYSSES = [Shape(b, s, h, d, name="Wan" if s > 30000 else "DiT") for b, s, h, d in ulysses.DEFAULT_SHAPES]
# What the pack kernel must also take: K/V with fewer heads (Llama-3-like GQA), and a local sequence
# that is odd (4098 / 2 = 2049 tokens; Wan's 32760 / 2 = 16380 is no multiple of 16 either).
GQA = [
    Shape(1, 4096, 32, 128, kv_heads=8, causal=True, name="Llama-3"),
    Shape(1, 16384, 32, 128, kv_heads=8, causal=True, name="Llama-3"),
]
ODD = Shape(1, 4098, 24, 128, name="odd")
PACK = list(dict.fromkeys([*CHUNKING, *ULYSSES, *GQA, ODD]))  # Wan 32760 is in both lists: once
