"""A training run's settings: typed sections (model, data, train), presets, TOML / YAML files and
dotted command-line overrides (`--model.depth 4`). Unknown keys fail with the closest valid ones."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..keywords import closest


@dataclass
class ModelSettings:
    dim: int = 256
    depth: int = 4
    heads: int = 4
    max_seq_len: int = 256
    layers: dict[str, Any] = field(default_factory=lambda: {"rotary_pos_emb": True, "ff_glu": True})


@dataclass
class DataSettings:
    paths: list[str] = field(default_factory=list)     # empty: the Python standard library's sources
    max_bytes: int | None = 4_000_000              # of training text, after the split; none: all
    tokenizer: str = "byte"                             # "byte" or "bpe"
    vocab_size: int = 2048                              # bpe only
    val_fraction: float = 0.05


@dataclass
class TrainSettings:
    objective: str = "lm"               # "lm", "mlm", "prefix_lm", "seq2seq"
    task: str = "copy"                  # seq2seq: "copy", "reverse", "sort"
    task_length: int = 16               # seq2seq: sequence length of the synthetic task
    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    sample_tokens: int = 200
    checkpoint_every: int = 100
    keep_last: int = 3
    seed: int = 0
    bf16: bool = False
    compile: bool = False
    fsdp: bool = False
    expert_parallel: int = 1            # processes each expert layer's experts are spread over (torchrun)
    progress: bool = True
    tensorboard: bool | None = None     # None: events when tensorboard is installed; True: warn if it is not


@dataclass
class RunSettings:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"model": {"dim": 64, "depth": 2, "heads": 4, "max_seq_len": 64},
             "data": {"max_bytes": 400_000},
             "train": {"steps": 200, "batch_size": 8, "lr": 3e-3, "warmup": 10, "eval_every": 50,
                       "checkpoint_every": 50, "eval_batches": 4, "sample_tokens": 80}},
    "small": {"model": {"dim": 192, "depth": 4, "heads": 4, "max_seq_len": 128},
              "train": {"steps": 400, "batch_size": 16, "lr": 2e-3, "warmup": 20, "eval_every": 100}},
    "base": {"model": {"dim": 512, "depth": 8, "heads": 8, "max_seq_len": 512},
             "data": {"max_bytes": None},
             "train": {"steps": 20000, "batch_size": 32, "lr": 6e-4, "warmup": 500, "eval_every": 500,
                       "checkpoint_every": 500}},
}

# one line per setting, for `polyformer train --help` (a test keeps it complete)
MEANING: dict[tuple[str, str], str] = {
    ("model", "dim"): "width of the residual stream",
    ("model", "depth"): "number of attention + feedforward layers",
    ("model", "heads"): "attention heads",
    ("model", "max_seq_len"): "tokens per training window (and learned positions, if any)",
    ("model", "layers"): "layer keywords as --model.layers.NAME VALUE (any Decoder keyword, e.g. alibi_pos_emb)",
    ("data", "paths"): "text files / folders to train on (--data.paths a.txt notes/); none: the stdlib sources",
    ("data", "max_bytes"): "training text kept after the split (none: all of it)",
    ("data", "tokenizer"): "byte, or bpe (trained on the corpus, saved with the run)",
    ("data", "vocab_size"): "BPE vocabulary size",
    ("data", "val_fraction"): "share of the files held out for validation",
    ("train", "objective"): "lm, mlm, prefix_lm or seq2seq",
    ("train", "task"): "seq2seq's synthetic task: copy, reverse or sort",
    ("train", "task_length"): "seq2seq's sequence length",
    ("train", "steps"): "optimizer steps (also --steps); a --resume may raise it: past the steps planned at the "
                        "start, the learning rate holds its final value (lr x min_lr_ratio)",
    ("train", "batch_size"): "sequences per optimizer step (all processes together)",
    ("train", "grad_accum"): "micro-batches the batch is split into",
    ("train", "lr"): "peak learning rate (AdamW)",
    ("train", "min_lr_ratio"): "cosine decay floor, as a share of lr",
    ("train", "warmup"): "linear warmup steps",
    ("train", "weight_decay"): "AdamW weight decay",
    ("train", "grad_clip"): "gradient norm clip (0: none)",
    ("train", "eval_every"): "steps between validation losses and samples",
    ("train", "eval_batches"): "validation batches per evaluation",
    ("train", "sample_tokens"): "tokens sampled at each evaluation",
    ("train", "checkpoint_every"): "steps between checkpoints",
    ("train", "keep_last"): "checkpoints kept",
    ("train", "seed"): "seed of weights, data order and sampling",
    ("train", "bf16"): "bfloat16 autocast",
    ("train", "compile"): "torch.compile the model",
    ("train", "fsdp"): "shard with FSDP under torchrun (also --fsdp)",
    ("train", "expert_parallel"): "under torchrun, spread each ff_moe layer's experts over N processes (all_to_all "
                                  "token exchange); N divides ff_num_experts and the number of processes",
    ("train", "progress"): "show a progress bar",
    ("train", "tensorboard"): "TensorBoard events: true (warn if tensorboard is missing), false, or none (when installed)",
}

# the settings `eval` takes, as `train` spells them (any other is refused, saying why)
EVAL_SETTINGS = {"data.paths": "text files / folders to score, whole (default: the run's validation split)",
                 "data.max_bytes": "with --data.paths: read at most this much of them (default: all)",
                 "train.batch_size": "windows per forward pass (default: the run's)",
                 "train.eval_batches": "batches scored (as --batches; default: the run's, or all of --data.paths)"}


def settings_help() -> str:
    """Every setting with its default and meaning, for `train --help`."""
    lines = ["settings (--section.key VALUE; [default]):"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            name = f"{section}.{f.name}"
            lines.append(f"  --{name:<24} {MEANING[section, f.name]} [{json.dumps(default)}]")
    return "\n".join(lines)


SECTIONS = {"model": ModelSettings, "data": DataSettings, "train": TrainSettings}

CHOICES = {("data", "tokenizer"): ("byte", "bpe"),
           ("train", "objective"): ("lm", "mlm", "prefix_lm", "seq2seq"),
           ("train", "task"): ("copy", "reverse", "sort")}
POSITIVE = {("model", "dim"), ("model", "depth"), ("model", "heads"), ("model", "max_seq_len"),
            ("train", "steps"), ("train", "batch_size"), ("train", "grad_accum"), ("train", "eval_every"),
            ("train", "eval_batches"), ("train", "checkpoint_every"), ("train", "keep_last"),
            ("train", "task_length"), ("data", "vocab_size"), ("train", "expert_parallel")}


def to_dict(settings: RunSettings) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(settings)))


def from_dict(data: dict[str, Any]) -> RunSettings:
    settings = RunSettings()
    apply(settings, data, source="settings")
    return settings


def apply(settings: RunSettings, data: dict[str, Any], source: str) -> None:
    """Write nested {section: {key: value}} into settings, refusing unknown keys by name."""
    sections = {f.name for f in dataclasses.fields(RunSettings)}
    for section, values in data.items():
        if section not in sections:
            raise KeyError(f"{source}: unknown section {section!r}{closest(section, sections)}")
        if not isinstance(values, dict):
            raise ValueError(f"{source}: section {section!r} must be a table of keys, got {values!r}")
        for key, value in values.items():
            set_value(settings, f"{section}.{key}", value, source)
    validate(settings)


def set_value(settings: RunSettings, dotted: str, value: Any, source: str = "--") -> None:
    """Set `section.key` (or `model.layers.<keyword>`), converting strings to the field's type."""
    parts = dotted.split(".")
    sections = {f.name: f for f in dataclasses.fields(RunSettings)}
    if parts[0] not in sections:
        raise KeyError(f"{source}: unknown setting {dotted!r}{closest(parts[0], sections)}")
    target = getattr(settings, parts[0])
    if parts[:2] == ["model", "layers"] and len(parts) == 3:       # any layer keyword
        target.layers = {**target.layers, parts[2]: parse_literal(value)}
        return
    names = {f.name: f for f in dataclasses.fields(target)}
    if len(parts) != 2 or parts[1] not in names:
        valid = [f"{parts[0]}.{n}" for n in names]
        raise KeyError(f"{source}: unknown setting {dotted!r}{closest(dotted, valid)}")
    hint = typing.get_type_hints(type(target))[parts[1]]
    setattr(target, parts[1], convert(value, hint, dotted))


def parse_literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return {"true": True, "false": False}.get(value.lower(), value)


def convert(value: Any, hint: Any, name: str) -> Any:
    """A command-line string (or a file's value) as the field's type."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"{name} cannot be empty")
    origin = typing.get_origin(base)
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            return str(value)
        if origin is list:
            if isinstance(value, str):
                return [v for v in value.split(",") if v]
            return list(value)
        if origin is dict:
            return dict(json.loads(value) if isinstance(value, str) else value)
    except (TypeError, ValueError, json.JSONDecodeError):
        pass
    else:
        return value
    raise ValueError(f"{name}: cannot read {value!r} as {getattr(base, '__name__', base)}")


def validate(settings: RunSettings) -> None:
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(settings, section), key)
        if value not in allowed:
            raise ValueError(f"{section}.{key} must be one of {list(allowed)}, got {value!r}")
    for section, key in POSITIVE:
        value = getattr(getattr(settings, section), key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{section}.{key} must be a positive integer, got {value!r}")
    t = settings.train
    if not t.lr > 0:
        raise ValueError(f"train.lr must be > 0, got {t.lr}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.warmup < 0 or t.grad_clip < 0 or t.weight_decay < 0:
        raise ValueError("train.warmup, train.grad_clip and train.weight_decay must be >= 0")
    if not 0 < settings.data.val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {settings.data.val_fraction}")
    if settings.data.max_bytes is not None and settings.data.max_bytes < 1024:
        raise ValueError(f"data.max_bytes must be >= 1024 or none, got {settings.data.max_bytes}")


def load_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml) or YAML (.yaml / .yml) settings file as nested dicts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as err:
            raise ImportError("YAML config files need PyYAML: pip install pyyaml (or use TOML)") from err
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of sections")
        return data
    raise ValueError(f"config file {str(path)!r} must end in .toml, .yaml or .yml")


def resolve(preset: str | None, config_file: str | None, overrides: list[tuple[str, str]]) -> RunSettings:
    """Defaults, then the preset, then the config file, then each --section.key override."""
    settings = RunSettings()
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        apply(settings, PRESETS[preset], source=f"preset {preset!r}")
    if config_file is not None:
        apply(settings, load_file(config_file), source=f"config file {config_file!r}")
    for dotted, value in overrides:
        set_value(settings, dotted, value, source=f"--{dotted}")
    validate(settings)
    return settings
