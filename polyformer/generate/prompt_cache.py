"""Prompt caching: the decode state of a fixed prompt, computed once, saved to one safetensors file
with the config of the model it belongs to, and loaded for many continuations.

    state = net.new_state(1, prompt.shape[1]); net(prompt, state=state)      # prompt (1, n)
    save_prompt_cache("seed.safetensors", net, state, prompt)
    ...
    state, prompt = load_prompt_cache("seed.safetensors", net, max_len=prompt.shape[1] + 256)
    logits = next_token_logits(net, state, prompt)   # (1, num_tokens); then net(token, state=state), ...
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import checks
from ..build import model_config
from ..interfaces import KV
from ..memory.kv_cache import DecodeState
from ..memory.window_state import WindowState
from ..train.files import save_tensors
from ..wrappers import TransformerWrapper
from .decode import AutoregressiveWrapper

try:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file, save_file
except ImportError:  # pragma: no cover - exercised only without the optional extra
    safe_open = load_file = save_file = None
    SafetensorError = OSError

FORMAT = "polyformer.prompt_cache"
VERSION = 2          # 2: kernel-attention summaries carry the keys' mass "n"; window states keep their ring


def _need_safetensors() -> None:
    if save_file is None:
        raise ImportError("prompt caching needs safetensors: pip install 'polyformer[cache]' (or safetensors)")


def _unwrap(net: nn.Module) -> TransformerWrapper:
    inner = net.net if isinstance(net, AutoregressiveWrapper) else net
    if not isinstance(inner, TransformerWrapper):
        raise TypeError(f"net must be a TransformerWrapper or an AutoregressiveWrapper, got {type(net).__name__}")
    return inner


def _config_json(net: TransformerWrapper) -> str:
    return json.dumps(model_config(net), sort_keys=True, separators=(",", ":"))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _differences(saved: Any, current: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(path, description) of every place two configs differ; path[0] is the top-level field."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            where = path + (str(key),)
            if key not in saved or key not in current:
                side = "saved" if key in saved else "current"
                out.append((where, f"{'.'.join(where)} only in the {side} model"))
            else:
                out.extend(_differences(saved[key], current[key], where))
        return out
    return [] if saved == current else [(path, f"{'.'.join(path)}: saved {saved!r}, this model {current!r}")]


def _tensors(state: DecodeState) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The committed part of the state as named contiguous tensors, and how to put it back."""
    def own(x: Tensor) -> Tensor:       # a contiguous copy: slices of the preallocated storage
        return x.detach().clone(memory_format=torch.contiguous_format)

    ring = isinstance(state, WindowState)      # a window's ring: every slot as it is (memory/window_state.py)
    n = state.slots if ring else state.length
    tensors = {"k": own(state.k[:, :, :, :n]), "v": own(state.v[:, :, :, :n]),
               "pos": own(state.pos[:, :n]), "mask": own(state.mask[:, :n])}
    for i, h in state.shift.items():
        tensors[f"shift.{i}"] = own(h if ring else h[:, :n])
    if ring:
        tensors["kept"] = own(state.kept)
    cross = {}
    for i, kv in state.cross.items():
        tensors[f"cross.{i}.k"], tensors[f"cross.{i}.v"] = own(kv.k), own(kv.v)
        if kv.pos is not None:
            tensors[f"cross.{i}.pos"] = own(kv.pos)
        if kv.mask is not None:
            tensors[f"cross.{i}.mask"] = own(kv.mask)
        cross[str(i)] = kv.free
    recurrent = {}
    for i, memory in state.recurrent_layers.items():
        trail = memory.saved()
        recurrent[str(i)] = [s is not None for s in trail]
        for t, summary in enumerate(trail):
            for name, x in (summary or {}).items():
                tensors[f"recurrent.{i}.{t}.{name}"] = own(x)
    return tensors, {"shift": sorted(state.shift), "cross": cross, "prefix": state.prefix, "recurrent": recurrent,
                     "window": state.history if ring else None}


def save_prompt_cache(path: str | os.PathLike, net: nn.Module, state: DecodeState, prompt: Tensor) -> None:
    """Write the decode state of `prompt` to one safetensors file, atomically.

    Args:
        path: the file to write; replaced only once the new file is complete (temp file in the same
            directory, then `os.replace`), so a failed save leaves no file and no temp file behind.
        net: the `TransformerWrapper` (or `AutoregressiveWrapper`) that computed the state.
        state: a `DecodeState` after `net(prompt, state=state)`: (b, length) committed positions.
        prompt: (b, n) the token ids that were run, n = state.length - num_memory_tokens.

    The file holds k, v, pos, mask of the committed positions (a windowed model's ring: every slot and
    its text mask `kept`, with its rollback room `history`), the token-shift histories and the
    cross-attention keys / values, with metadata: the model's config JSON and its sha256, the
    state's length and memory-token prefix, the prompt ids and the format version.
    """
    _need_safetensors()
    net = _unwrap(net)
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a DecodeState, got {type(state).__name__}")
    if net.attn_layers.hourglass is not None:
        raise ValueError("a prompt cache keeps keys at one resolution; an hourglass stack (hourglass=...) has several")
    if net.landmarks is not None or net.interspersed is not None:
        raise ValueError("a prompt cache stores the prompt's tokens; landmark_block / memory_tokens_interspersed_every "
                         "place tokens of their own between them")
    prompt = checks.token_ids(prompt, net.num_tokens, "prompt")
    if state.pending:
        raise ValueError("state has a step under way (pending positions): save it between steps")
    n = state.length - net.num_memory_tokens
    if tuple(prompt.shape) != (state.batch, n):
        raise ValueError(f"prompt must have shape (state batch, cached tokens) = ({state.batch}, {n}), "
                         f"got {tuple(prompt.shape)}")
    if state.layers != net.attn_layers.num_self_attn:
        raise ValueError(f"state holds {state.layers} layers, the model has {net.attn_layers.num_self_attn} "
                         "self-attention blocks: it was made for another model")
    tensors, layout = _tensors(state)
    config = _config_json(net)
    metadata = {"format": FORMAT, "version": str(VERSION), "config": config, "config_sha256": _sha256(config),
                "length": str(state.length), "prompt": json.dumps(prompt.tolist()),
                "layout": json.dumps(layout)}
    path = Path(path)
    # a fresh name in the same directory: os.replace is atomic only within one file system
    tmp = str(path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        save_tensors(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:             # on disk before it takes the name
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _corrupt(path: Path, why: str) -> ValueError:
    return ValueError(f"prompt cache {str(path)!r} is corrupt or truncated: {why}")


def _read_metadata(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt cache {str(path)!r} does not exist (or is not a file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise _corrupt(path, str(error)) from error


def _read_tensors(path: Path, device: torch.device) -> dict[str, Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise _corrupt(path, str(error)) from error


def load_prompt_cache(path: str | os.PathLike, net: nn.Module, max_len: int) -> tuple[DecodeState, Tensor]:
    """Load a prompt cache written by `save_prompt_cache` for `net`.

    Args:
        path: the safetensors file.
        net: the model to continue with; its config must equal the one the cache was saved for.
        max_len: tokens the new state holds, prompt included (as `net.new_state`); >= prompt length.

    Returns:
        (state, prompt): a fresh `DecodeState` (b rows) holding the cached positions, and the
        prompt ids (b, n). Continue with `next_token_logits(net, state, prompt)`; `state.clone()`
        gives independent copies for several continuations.

    Raises FileNotFoundError for a missing file, ValueError for a file saved for another model
    config (naming the differing fields) or a corrupt / truncated one (naming the path).
    """
    _need_safetensors()
    net = _unwrap(net)
    path = Path(path)
    param = next(net.parameters())
    metadata = _read_metadata(path)         # refuse a wrong file before reading its tensors
    if metadata.get("format") != FORMAT:
        raise _corrupt(path, f"no {FORMAT!r} metadata (not a prompt cache)")
    if metadata.get("version") != str(VERSION):
        raise ValueError(f"prompt cache {str(path)!r} has format version {metadata.get('version')!r}; "
                         f"this polyformer reads version {VERSION}")
    try:
        saved_json, length = metadata["config"], int(metadata["length"])
        if _sha256(saved_json) != metadata["config_sha256"]:
            raise ValueError("config does not match its sha256")
        saved_config = json.loads(saved_json)
        prompt = torch.tensor(json.loads(metadata["prompt"]), dtype=torch.long, device=param.device)
        layout = json.loads(metadata["layout"])
        if not isinstance(layout, dict):
            raise ValueError("layout is not a JSON object")
    except (KeyError, ValueError, TypeError) as error:
        raise _corrupt(path, f"bad metadata ({error})") from error
    current = model_config(net)
    if json.loads(json.dumps(current)) != saved_config:
        diff = _differences(saved_config, json.loads(json.dumps(current)))
        fields = sorted({where[0] for where, _ in diff if where})
        details = "; ".join(text for _, text in diff[:5]) + (" ..." if len(diff) > 5 else "")
        raise ValueError(f"prompt cache {str(path)!r} was saved for another model: top-level config fields "
                         f"{', '.join(fields)} differ ({details})")
    tensors = _read_tensors(path, param.device)
    return _rebuild(path, net, tensors, layout, length, prompt, max_len), prompt


def _rebuild(path: Path, net: TransformerWrapper, tensors: dict[str, Tensor], layout: dict[str, Any],
             length: int, prompt: Tensor, max_len: int) -> DecodeState:
    try:
        k, v, pos, mask = tensors["k"], tensors["v"], tensors["pos"], tensors["mask"]
    except KeyError as error:
        raise _corrupt(path, f"tensor {error} is missing") from error
    b = k.shape[1] if k.ndim == 5 else -1
    n = length - net.num_memory_tokens
    history = layout.get("window")          # a window's ring: its rollback room (None: not a ring)
    ring = history is not None
    if ring != (net.attn_layers.window is not None) or (ring and not (isinstance(history, int) and history >= 0)):
        raise _corrupt(path, "its decode-state kind (a window's ring or not) does not fit this model")
    slots = k.shape[3] if ring and k.ndim == 5 else length     # a ring keeps all its slots
    if (k.ndim != 5 or v.ndim != 5 or k.shape[3] != slots or v.shape[:4] != k.shape[:4]
            or tuple(pos.shape) != (b, slots) or tuple(mask.shape) != (b, slots) or mask.dtype != torch.bool
            or tuple(prompt.shape) != (b, n)):
        raise _corrupt(path, f"tensor shapes do not agree with length {length}")
    if not isinstance(max_len, int) or max_len < n:
        raise ValueError(f"max_len must be an integer >= the cached prompt length ({n}), got {max_len!r}")
    state = net.new_state(b, max_len, dtype=k.dtype, device=k.device, **({"history": history} if ring else {}))
    if (state.k.shape[:3] + state.k.shape[4:] != k.shape[:3] + k.shape[4:] or state.v.shape[4] != v.shape[4]
            or (ring and state.slots != slots)):
        raise _corrupt(path, f"k / v shapes {tuple(k.shape)} / {tuple(v.shape)} do not fit this model")
    state.k[:, :, :, :slots], state.v[:, :, :, :slots] = k, v
    state.pos[:, :slots], state.mask[:, :slots] = pos, mask
    if ring:
        kept = tensors.get("kept")
        if kept is None or kept.shape != state.kept.shape or kept.dtype != torch.bool:
            raise _corrupt(path, "the ring's text mask (kept) is missing or has the wrong shape")
        state.kept.copy_(kept)          # sinks_done stays False: the next step's commit finds it again
    for i in layout.get("shift", []):
        h = tensors.get(f"shift.{i}")
        width = state.ring if ring else length          # a ring's shift history is a ring of its own
        if h is None or h.ndim != 3 or tuple(h.shape[:2]) != (b, width):
            raise _corrupt(path, f"token-shift history {i} is missing or has the wrong shape")
        state.shift[int(i)] = h.new_zeros(b, state.ring if ring else state.max_len, h.shape[-1])
        state.shift[int(i)][:, :width] = h
    for i, free in layout.get("cross", {}).items():
        if f"cross.{i}.k" not in tensors or f"cross.{i}.v" not in tensors:
            raise _corrupt(path, f"cross-attention keys / values {i} are missing")
        state.cross[int(i)] = KV(tensors[f"cross.{i}.k"], tensors[f"cross.{i}.v"], tensors.get(f"cross.{i}.pos"),
                                 tensors.get(f"cross.{i}.mask"), int(free))
    for i, present in layout.get("recurrent", {}).items():
        if int(i) not in state.recurrent_layers or not isinstance(present, list) or not present:
            raise _corrupt(path, f"recurrent summary {i} does not fit this model")
        trail = []
        for t, there in enumerate(present):
            names = {key.rsplit(".", 1)[1] for key in tensors if key.startswith(f"recurrent.{i}.{t}.")}
            if there and not names:
                raise _corrupt(path, f"recurrent summary {i} is missing")
            trail.append({n: tensors[f"recurrent.{i}.{t}.{n}"] for n in sorted(names)} if there else None)
        state.recurrent_layers[int(i)].restore(trail)
    if set(state.recurrent_layers) != {int(i) for i in layout.get("recurrent", {})}:
        raise _corrupt(path, "the recurrent summaries do not match this model's blocks")
    prefix = layout.get("prefix")
    if not isinstance(prefix, int) or not 0 <= prefix <= length:
        raise _corrupt(path, f"bad memory-token prefix {prefix!r}")
    state.length, state.prefix = length, prefix
    state.padded = ring or not bool(mask.all())
    return state


def next_token_logits(net: nn.Module, state: DecodeState, prompt: Tensor, context: Tensor | None = None,
                      context_mask: Tensor | None = None) -> Tensor:
    """Logits (b, num_tokens) of the token after the cached prompt, which the state does not keep:
    the last cached position is rolled back and run again (one token of compute)."""
    net = _unwrap(net)
    state.rollback(1)
    return net(prompt[:, -1:], context=context, context_mask=context_mask, state=state)[:, -1]
