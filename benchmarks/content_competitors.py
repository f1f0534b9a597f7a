"""The contenders of `benchmarks/content_attention.py`: content-based sparse attention (issue 18) as one
attention block, our dense attention, and the PyPI / Hugging Face layers users would pick instead at equal
settings. Each family is a `Family` in `FAMILIES`: LSH, Routing, Sinkhorn.

- polyformer: `Decoder(dim=512, depth=1, heads=8, custom_layers=("a",), <keywords>)`: pre-norm, bias-free
  projections, the kernel, output projection, residual, the stack's final norm.
- The packages' attention layers carry their own projections; `PackageLayer` (benchmarks/linear_competitors)
  adds pre-LayerNorm, residual and final LayerNorm around them.

LSH settings, equal on every side: chunks of 64, 4 hash rounds, n / 64 buckets (reformer-pytorch's fixed
rule), causal, shared query-key; dropout 0, so train and eval compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from .common import version
from .linear_competitors import PackageLayer
from .sparse_competitors import DIM, DIM_HEAD, HEADS, Contender, polyformer

CHUNK, HASHES = 64, 4


def lsh_keywords(n: int, global_sort: bool = False) -> dict:
    return dict(attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=CHUNK, attn_lsh_n_hashes=HASHES,
                attn_lsh_n_buckets=max(2, n // CHUNK), attn_lsh_global_sort=global_sort)


class HFLsh(nn.Module):
    """Hugging Face's LSHSelfAttention (shared query-key projection, value projection) and the output
    dense of its ReformerSelfOutput, as one attention module."""

    def __init__(self, n: int):
        super().__init__()
        from transformers import ReformerConfig
        from transformers.models.reformer.modeling_reformer import LSHSelfAttention

        config = ReformerConfig(hidden_size=DIM, num_attention_heads=HEADS, attention_head_size=DIM_HEAD,
                                num_hashes=HASHES, num_buckets=max(2, n // CHUNK), lsh_attn_chunk_length=CHUNK,
                                lsh_num_chunks_before=1, lsh_num_chunks_after=0, is_decoder=True,
                                lsh_attention_probs_dropout_prob=0.0, attn_layers=["lsh"], max_position_embeddings=n)
        self.attn = LSHSelfAttention(config)
        self.out = nn.Linear(HEADS * DIM_HEAD, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.attn(x).hidden_states)


def _reformer_pytorch(n: int) -> nn.Module:
    from reformer_pytorch import LSHSelfAttention

    return PackageLayer(LSHSelfAttention(dim=DIM, heads=HEADS, dim_head=DIM_HEAD, bucket_size=CHUNK, n_hashes=HASHES,
                                         causal=True))


@dataclass(frozen=True)
class Package:
    label: str
    pip: str
    build: Callable[[int], nn.Module]
    note: str


@dataclass(frozen=True)
class Family:
    """One content-based attention: our contenders at length n and the packages it is measured against."""

    name: str
    ours: Callable[[int], list[Contender]]
    packages: tuple[Package, ...]

    def contenders(self, n: int) -> tuple[list[Contender], dict[str, str]]:
        """Ours, then every installed package's layer; a note for each package that is missing."""
        out, missing = list(self.ours(n)), {}
        for p in self.packages:
            if version(p.pip) is None:
                missing[p.label] = f"{p.pip} is not installed"
                continue
            torch.manual_seed(0)
            layer = p.build(n)
            out.append(Contender(p.label, layer, layer, False, p.note))
        return out, missing


def _lsh_ours(n: int) -> list[Contender]:
    return [polyformer("polyformer lsh", True, note="Decoder(custom_layers=('a',), "
                       + ", ".join(f"{k}={v!r}" for k, v in lsh_keywords(n).items()) + "): buckets chunked by "
                       "position (no future leak)", **lsh_keywords(n)),
            polyformer("polyformer lsh global sort", True, note="as polyformer lsh with attn_lsh_global_sort=True: "
                       "the paper's / Hugging Face's global sort (leaks the future)", **lsh_keywords(n, True))]


LSH = Family("lsh", _lsh_ours, (
    Package("reformer-pytorch LSHSelfAttention(causal)", "reformer-pytorch", _reformer_pytorch,
            f"bucket_size={CHUNK} (its chunk length; n / {CHUNK} buckets), n_hashes={HASHES}, causal; global sort, "
            "leaks the future; its output projection has a bias; rotations redrawn on every call."),
    Package("transformers LSHSelfAttention(is_decoder)", "transformers", HFLsh,
            f"lsh_attn_chunk_length={CHUNK}, num_buckets=n / {CHUNK}, num_hashes={HASHES}, one chunk back, "
            "is_decoder=True; global sort; plus its output dense (bias-free)."),
))

class RoutingTransformerLayer(nn.Module):
    """routing-transformer's SelfAttention in polyformer's block: x + attn(norm(x)), final norm. Its k-means
    initialises itself on the first training call (its #4: an untrained layer cannot run in eval), so one
    training call is made when it is built."""

    def __init__(self, n: int) -> None:
        super().__init__()
        from routing_transformer.routing_transformer import SelfAttention

        self.norm, self.final_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SelfAttention(DIM, 1, n, HEADS, 0, WINDOW, dim_head=DIM_HEAD, causal=True)
        self(torch.randn(1, n, DIM))

    def forward(self, x: Tensor) -> Tensor:
        out, _aux = self.attn(self.norm(x))
        return self.final_norm(x + out)


WINDOW = 64


def _routing_ours(n: int) -> list[Contender]:
    clusters = max(1, n // WINDOW)
    return [polyformer("polyformer routing", True, attn_routing=True, attn_routing_clusters=clusters,
                       attn_routing_window=WINDOW,
                       note=f"Decoder(custom_layers=('a',), attn_routing=True, attn_routing_clusters={clusters}, "
                            f"attn_routing_window={WINDOW}): every head routes; a query sees its cluster's keys "
                            "in its chunk and the one before, earlier positions only")]


ROUTING = Family("routing", _routing_ours, (
    Package("routing-transformer SelfAttention(causal)", "routing-transformer", RoutingTransformerLayer,
            f"n / {WINDOW} clusters, window_size={WINDOW}, local_attn_heads=0, causal; each cluster takes its "
            f"{WINDOW} nearest tokens of the whole sequence (leaks the future)."),
))

SINKHORN_ITERS, SINKHORN_TEMPERATURE = 5, 0.75


def _sinkhorn_ours(n: int) -> list[Contender]:
    return [polyformer("polyformer sinkhorn", True, attn_sinkhorn=True, attn_sinkhorn_bucket_size=CHUNK,
                       attn_sinkhorn_iters=SINKHORN_ITERS, attn_sinkhorn_temperature=SINKHORN_TEMPERATURE,
                       note=f"Decoder(custom_layers=('a',), attn_sinkhorn=True, bucket {CHUNK}, {SINKHORN_ITERS} "
                            f"iterations, temperature {SINKHORN_TEMPERATURE}): causal Sinkhorn balancing")]


def _sinkhorn_transformer(n: int) -> nn.Module:
    from sinkhorn_transformer import SinkhornSelfAttention

    return PackageLayer(SinkhornSelfAttention(DIM, CHUNK, n, heads=HEADS, dim_head=DIM_HEAD, causal=True,
                                              non_permutative=False, sinkhorn_iter=SINKHORN_ITERS,
                                              temperature=SINKHORN_TEMPERATURE, n_top_buckets=1))


SINKHORN = Family("sinkhorn", _sinkhorn_ours, (
    Package("sinkhorn-transformer SinkhornCausalAttention", "sinkhorn-transformer", _sinkhorn_transformer,
            f"bucket {CHUNK}, n_top_buckets=1; its causal path has no Sinkhorn balancing (a masked "
            "differentiable top-k of cumulative-mean scores); needs n divisible by the bucket; no decode cache."),
))

FAMILIES: list[Family] = [LSH, ROUTING, SINKHORN]


def dense() -> Contender:
    return polyformer("polyformer dense causal", True, note="Decoder(custom_layers=('a',)), fused dense attention")
