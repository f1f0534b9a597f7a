"""Whole models as plain data: `model_config(model)` is JSON-ready, `build_model(config)` rebuilds an
identical (freshly initialised) model, so weights saved next to the JSON load into it."""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from .config import LayersConfig, from_dict, to_dict
from .encoder_decoder import XTransformer
from .stack import AttentionLayers, CrossAttender, Decoder, Encoder
from .wrappers import ContinuousTransformerWrapper, TransformerWrapper, ViTransformerWrapper
from .xval import XValTransformerWrapper

WRAPPERS = {cls.__name__: cls for cls in (TransformerWrapper, ContinuousTransformerWrapper, ViTransformerWrapper,
                                          XValTransformerWrapper)}
STACKS = {cls.__name__: cls for cls in (AttentionLayers, Encoder, Decoder, CrossAttender)}
FORMAT = 1


def model_config(model: nn.Module) -> dict[str, Any]:
    """{"format", "class", "args", "layers": {"class", "config"}} for a wrapper or a bare stack;
    an XTransformer is its keywords alone (its stacks are built from them)."""
    if isinstance(model, AttentionLayers):
        return {"format": FORMAT, "class": None, "args": {},
                "layers": {"class": _stack_name(model), "config": to_dict(model.cfg)}}
    if isinstance(model, XTransformer):
        args = dict(model.init_args)
        json.dumps(args)
        return {"format": FORMAT, "class": "XTransformer", "args": args, "layers": None}
    kind = next((name for name, cls in WRAPPERS.items() if isinstance(model, cls)), None)
    if kind is None:      # (isinstance: wrapping such as FSDP's subclasses the model's class)
        raise TypeError(f"model_config takes a polyformer wrapper or stack, got {type(model).__name__}")
    args = {k: v for k, v in model.init_args.items() if k != "attn_layers"}
    json.dumps(args)      # every wrapper argument is plain data
    return {"format": FORMAT, "class": kind, "args": args,
            "layers": {"class": _stack_name(model.attn_layers), "config": to_dict(model.attn_layers.cfg)}}


def _stack_name(stack: AttentionLayers) -> str:
    return next(c.__name__ for c in type(stack).__mro__ if c.__name__ in STACKS)


def build_model(config: dict[str, Any]) -> nn.Module:
    if config.get("format") != FORMAT:
        raise ValueError(f"model config format {config.get('format')!r} is not supported (expected {FORMAT})")
    if config["class"] == "XTransformer":
        return XTransformer(**config["args"])
    layers_cls = STACKS.get(config["layers"]["class"])
    if layers_cls is None:
        raise ValueError(f"unknown stack class {config['layers']['class']!r}; expected one of {sorted(STACKS)}")
    layers = layers_cls.from_config(from_dict(LayersConfig, config["layers"]["config"]))
    if config["class"] is None:
        return layers
    wrapper = WRAPPERS.get(config["class"])
    if wrapper is None:
        raise ValueError(f"unknown wrapper class {config['class']!r}; expected one of {sorted(WRAPPERS)}")
    return wrapper(**config["args"], attn_layers=layers)
