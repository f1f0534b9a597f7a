"""The Reformer (arXiv:2001.04451) as `ReformerModelWithLMHead`: a causal, reversible pre-norm stack
(reversible=True) whose two streams are concatenated, normalised over 2 hidden_size and read by an
LM head of 2 hidden_size features with a bias (reversible_merge="concat"); ReLU feedforward with biases
(`chunk_size_feed_forward` as ff_chunks: same outputs); axial positions (axial_pos_emb) or a learned
table; no attention biases. Every layer is either

- "local": q, k, v projections, softmax(q k / √d) over the query's chunk of local_attn_chunk_length
  positions and the `local_num_chunks_before` chunks before it, causal: attn_block_local=(c, c * before);
- "lsh": shared query-key attention (attn_shared_qk: keys are the queries normalised to length √d,
  eps 1e-6, as Hugging Face's) under the paper's global sort (attn_lsh_global_sort, kernels/lsh_sort.py),
  lsh_attn_chunk_length positions a chunk, the chunk before it seen too, hash rounds combined as
  exp(lse_r - logsumexp lse); rotations from hash_seed (attn_lsh_seed: Hugging Face's
  torch.manual_seed(hash_seed) then randn((heads, head_size, num_hashes, num_buckets / 2)) draws them).

Hugging Face's model, measured on transformers 5.23 (modeling_reformer.py):
- its ReformerOnlyLMHead keeps `lm_head.bias` but never adds it (the decoder is built bias=False; 4.x
  linked the two with `self.decoder.bias = self.bias`): the converted head adds it, as 4.x and the
  trained checkpoints did, so 5.23's logits are ours less lm_head.bias (equal when it is zero, as it
  stays in a model trained under 5.x: it gets no gradient);
- a query that sees no key but its own gets, in float32, slightly less than its own value when its
  key is twice in its window (several hash rounds: the round before's last chunk holds it too): each
  copy scores self_mask_value_float32 = -1e5 and exp(s - logsumexp) rounds the pair's weight to about
  0.9978 (spacing 2^-7 at 1e5). polyformer gives such a query its own value (the paper's rule), so
  with num_hashes > 1 the logits differ by up to ~1e-2 on random tiny models; with one round, or that
  constant where float32 holds the log-sum-exp (-32), they are equal within 1e-5;
- its local look-back is cyclic: with local_num_chunks_before = B >= 2 and 2 to B chunks (after its
  padding) a chunk's window wraps onto itself and counts its keys twice; polyformer counts each once;
- it reseeds the global torch RNG in every LSH layer (torch.manual_seed(hash_seed); in training
  torch.seed() per layer): polyformer draws from its own generator and leaves the global RNG alone;
- with hash_seed None it draws fresh rotations on every call, train or eval: not reproducible; the
  converted model keeps attn_lsh_seed None (fixed rotations per layer in eval, fresh in training);
- it pads every input longer than the smallest chunk to a multiple of the lcm of the chunk lengths
  (masked), and the global sort's first chunk of each round reads the last chunk of the round before,
  so outputs depend on the padded length. For one kind of layer the lcm is that chunk length, which is
  what the LSH kernel pads to: equal at every length. A mix of "local" and "lsh" layers (as the published
  checkpoints are) converts with each layer's attention its own (attn_per_layer, per_layer.py) when
  local_attn_chunk_length divides lsh_attn_chunk_length: the lcm is then the LSH chunk length again.
Refused (by the config field): a mix whose local_attn_chunk_length does not divide lsh_attn_chunk_length
(Hugging Face would pad the LSH layers' sort to the lcm, ours to the LSH chunk: other logits at most
lengths), num_buckets None (Hugging Face picks it from the first input's length and keeps it) or
factorised, chunks after the query's, is_decoder False, tied embeddings.
The global sort cannot decode with a state (the sort moves with every new token): a converted model with
"lsh" layers generates with cache_kv=False; an all-"local" one decodes with a state like any Decoder.
"""

from __future__ import annotations

import math
from typing import Any

from ..position.axial import AxialPositions
from ..stack import Decoder
from ..wrappers import TransformerWrapper
from .family import Family, Link, Unsupported, activation, activation_name, ff_mult, inner_dim, layer_names

DEFAULTS = {"attention_head_size": 64, "attn_layers": ["local", "lsh", "local", "lsh", "local", "lsh"],
            "axial_pos_embds": True, "axial_pos_shape": [64, 64], "axial_pos_embds_dim": [64, 192],
            "chunk_size_feed_forward": 0, "feed_forward_size": 512, "hash_seed": None, "hidden_act": "relu",
            "hidden_size": 256, "is_decoder": False, "layer_norm_eps": 1e-12, "local_num_chunks_before": 1,
            "local_num_chunks_after": 0, "local_attn_chunk_length": 64, "lsh_attn_chunk_length": 64,
            "lsh_num_chunks_before": 1, "lsh_num_chunks_after": 0, "max_position_embeddings": 4096,
            "num_attention_heads": 12, "num_buckets": None, "num_hashes": 1, "vocab_size": 320,
            "tie_word_embeddings": False}


def _positive(c: dict[str, Any], key: str) -> int:
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Unsupported(f"reformer: {key} must be a positive integer, got {value!r}")
    return value


def kinds(c: dict[str, Any]) -> list[str]:
    """Each layer's attention kind ("local" or "lsh"); `Unsupported` for another name, or for a mix whose
    local chunk length does not divide the LSH chunk length (see the module's docstring)."""
    kinds = list(c["attn_layers"] or [])
    if not kinds or any(k not in ("local", "lsh") for k in kinds):
        raise Unsupported(f"reformer: attn_layers must name 'local' or 'lsh' layers, got {c['attn_layers']!r}")
    if len(set(kinds)) > 1:
        local, lsh = _positive(c, "local_attn_chunk_length"), _positive(c, "lsh_attn_chunk_length")
        if lsh % local:
            raise Unsupported(f"reformer: attn_layers={kinds!r} mixes 'local' and 'lsh' layers with "
                              f"local_attn_chunk_length={local} not dividing lsh_attn_chunk_length={lsh}: Hugging Face "
                              f"pads the sequence to a multiple of their lcm ({math.lcm(local, lsh)}), which moves the "
                              "LSH layers' global sort; polyformer's pads to the LSH chunk length")
    return kinds


def buckets(c: dict[str, Any]) -> int:
    n = c["num_buckets"]
    if isinstance(n, (list, tuple)) and len(n) == 1:
        n = n[0]
    if n is None:
        raise Unsupported("reformer: num_buckets=None (Hugging Face picks it from the first input's length and "
                          "keeps it) is not supported: set num_buckets")
    if isinstance(n, (list, tuple)):
        raise Unsupported(f"reformer: a factorised num_buckets={list(n)!r} (buckets hashed per factor) is not "
                          "supported: give one even number")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n % 2:
        raise Unsupported(f"reformer: num_buckets must be an even integer >= 2, got {n!r}")
    return n


def attention_keywords(c: dict[str, Any]) -> dict[str, Any]:
    """The stack keywords of the layers' attention: one kind's on the stack, a mix's per layer (attn_per_layer)."""
    layers = kinds(c)
    if len(set(layers)) == 1:
        return kind_keywords(c, layers[0])
    each = {k: kind_keywords(c, k) for k in set(layers)}
    return {"attn_per_layer": [each[k] for k in layers]}


def kind_keywords(c: dict[str, Any], kind: str) -> dict[str, Any]:
    """The attention keywords of one kind of layer."""
    if kind == "local":
        chunk = _positive(c, "local_attn_chunk_length")
        if c["local_num_chunks_after"] != 0:
            raise Unsupported(f"reformer: local_num_chunks_after={c['local_num_chunks_after']!r} is not supported "
                              "(0: a causal model sees no later chunk)")
        before = c["local_num_chunks_before"]
        if isinstance(before, bool) or not isinstance(before, int) or before < 0:
            raise Unsupported(f"reformer: local_num_chunks_before must be an integer >= 0, got {before!r}")
        return {"attn_block_local": (chunk, chunk * before)}
    if (c["lsh_num_chunks_before"], c["lsh_num_chunks_after"]) != (1, 0):
        raise Unsupported(f"reformer: lsh_num_chunks_before={c['lsh_num_chunks_before']!r} / lsh_num_chunks_after="
                          f"{c['lsh_num_chunks_after']!r} are not supported: the global sort reads one chunk before "
                          "(1 / 0)")
    seed = c["hash_seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise Unsupported(f"reformer: hash_seed must be an integer or None, got {seed!r}")
    return {"attn_lsh": True, "attn_shared_qk": True, "attn_lsh_global_sort": True,
            "attn_lsh_bucket_size": _positive(c, "lsh_attn_chunk_length"),
            "attn_lsh_n_hashes": _positive(c, "num_hashes"), "attn_lsh_n_buckets": buckets(c),
            "attn_lsh_seed": seed}


def position_keywords(c: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's absolute positions and max_seq_len: axial (the longest input a * b positions, or
    max_position_embeddings if fewer) or a learned table."""
    n = _positive(c, "max_position_embeddings")
    if not c["axial_pos_embds"]:
        return {"max_seq_len": n, "use_abs_pos_emb": True}
    shape, dims = list(c["axial_pos_shape"]), list(c["axial_pos_embds_dim"])
    if len(shape) != 2 or len(dims) != 2:
        raise Unsupported(f"reformer: axial_pos_shape={shape!r} / axial_pos_embds_dim={dims!r}: polyformer's axial "
                          "positions have two axes (as Hugging Face's eval forward)")
    if sum(dims) != c["hidden_size"]:
        raise Unsupported(f"reformer: axial_pos_embds_dim={dims!r} must add up to hidden_size ({c['hidden_size']})")
    return {"max_seq_len": min(n, shape[0] * shape[1]), "axial_pos_emb": tuple(shape),
            "axial_pos_emb_dims": tuple(dims)}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if not c["is_decoder"]:
        raise Unsupported("reformer: is_decoder=False: ReformerModelWithLMHead is causal (is_decoder=True)")
    if c["tie_word_embeddings"]:
        raise Unsupported("reformer: tie_word_embeddings=True cannot tie an LM head of 2 * hidden_size features to "
                          "the token embedding")
    dim = _positive(c, "hidden_size")
    wrap = {"num_tokens": _positive(c, "vocab_size"), "tie_embedding": False, **position_keywords(c)}
    chunk = c["chunk_size_feed_forward"] or 0
    layers = dict(dim=dim, depth=len(c["attn_layers"] or []), heads=_positive(c, "num_attention_heads"),
                  attn_dim_head=_positive(c, "attention_head_size"), reversible=True, reversible_merge="concat",
                  ff_mult=ff_mult(_positive(c, "feed_forward_size"), dim), norm_eps=float(c["layer_norm_eps"]),
                  **activation(c["hidden_act"], "reformer", "hidden_act", relu=True),
                  **attention_keywords(c))
    if chunk:
        layers["ff_chunks"] = max(1, math.ceil(wrap["max_seq_len"] / chunk))
    return Decoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    inner = c["num_attention_heads"] * c["attention_head_size"]
    projections = {"local": ("query", "key", "value"), "lsh": ("query_key", "value")}
    if c["axial_pos_embds"]:
        positions = [Link(f"pos_emb.weights.{i}", (f"embeddings.position_embeddings.weights.{i}",)) for i in (0, 1)]
    else:
        positions = [Link("pos_emb.emb.weight", ("embeddings.position_embeddings.embedding.weight",))]
    out = [Link("token_emb.weight", ("embeddings.word_embeddings.weight",)), *positions]
    for (a, f, h), kind in zip(layer_names(len(c["attn_layers"]), "encoder.layers"), kinds(c)):
        out += [Link(f"{a}.branch.project.to_qkv.weight",
                     tuple(f"{h}.attention.self_attention.{p}.weight" for p in projections[kind]),
                     sizes=(inner,) * len(projections[kind])),
                Link(f"{a}.branch.output.proj.weight", (f"{h}.attention.output.dense.weight",))]
        for t in ("weight", "bias"):
            out += [Link(f"{a}.norm_in.{t}", (f"{h}.attention.layer_norm.{t}",)),
                    Link(f"{f}.norm_in.{t}", (f"{h}.feed_forward.layer_norm.{t}",)),
                    Link(f"{f}.branch.proj_in.{t}", (f"{h}.feed_forward.dense.dense.{t}",)),
                    Link(f"{f}.branch.proj_out.{t}", (f"{h}.feed_forward.output.dense.{t}",))]
    out += [Link(f"attn_layers.final_norm.{t}", (f"encoder.layer_norm.{t}",)) for t in ("weight", "bias")]
    return out + [Link("to_logits.weight", ("lm_head.decoder.weight",), absolute=True),
                  Link("to_logits.bias", ("lm_head.bias",), absolute=True)]


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    """The model's Hugging Face config, as close as it goes: `differences` names what is left (another
    kernel, a mean merge, ...)."""
    c = model.attn_layers.cfg
    a, n = c.attention, model.max_seq_len
    out: dict[str, Any] = {
        "vocab_size": model.num_tokens, "hidden_size": c.dim, "num_attention_heads": a.heads,
        "attention_head_size": a.dim_head, "feed_forward_size": inner_dim(model),
        "hidden_act": activation_name(model), "layer_norm_eps": c.norm_eps, "is_decoder": True,
        "tie_word_embeddings": False, "max_position_embeddings": n,
        "chunk_size_feed_forward": math.ceil(n / c.ff.chunks) if c.ff.chunks > 1 else 0,
        "hidden_dropout_prob": 0.0, "local_attention_probs_dropout_prob": 0.0,
        "lsh_attention_probs_dropout_prob": 0.0, "axial_pos_embds": isinstance(model.pos_emb, AxialPositions)}
    if out["axial_pos_embds"]:
        out.update(axial_pos_shape=list(model.pos_emb.shape),
                   axial_pos_embds_dim=[w.shape[-1] for w in model.pos_emb.weights])
    layers = c.attention_layers if c.attention_layers is not None else (a,) * c.depth   # per layer: attn_per_layer
    out["attn_layers"] = ["lsh" if layer.kernel.name == "lsh" else "local" for layer in layers]
    lsh = next((layer.kernel.options for layer in layers if layer.kernel.name == "lsh"), None)
    if lsh is not None:         # one set of LSH options for every "lsh" layer (differences names another)
        out.update(lsh_attn_chunk_length=lsh.bucket_size, num_hashes=lsh.n_hashes, num_buckets=lsh.n_buckets,
                   hash_seed=lsh.seed)
    if "local" in out["attn_layers"]:
        local = next((p.options for layer in layers if layer.kernel.name != "lsh" for p in layer.pattern
                      if p.name == "block_local"), None)
        chunk = local.query_block if local is not None else DEFAULTS["local_attn_chunk_length"]
        out.update(local_attn_chunk_length=chunk, local_num_chunks_before=local.memory // chunk if local else 1)
    return out


REFORMER = Family(
    model_type="reformer", classes={"ReformerModelWithLMHead": "reformer."}, defaults=DEFAULTS, derived=(),
    build=build, links=links, config_of=config_of, embedding="embeddings.word_embeddings.weight")
