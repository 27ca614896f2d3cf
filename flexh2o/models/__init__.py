"""Model families: turn a model name or a local checkpoint directory into a spec."""

import json
import os

from ..errors import UsageError
from .opt import PRESETS, same_shape, spec_from_hf_config

SUPPORTED_TYPES = ("opt",)


def read_hf_config(directory: str, flag: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise UsageError(flag, f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise UsageError(flag, f"{path} holds a JSON {type(config).__name__}, not an object of model settings")
    return config


def spec_from_directory(directory: str, name: str, flag: str):
    config = read_hf_config(directory, flag)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise UsageError(flag, f"{directory} holds a {model_type!r} model; supported: {', '.join(SUPPORTED_TYPES)}")
    return spec_from_hf_config(config, name, flag)


def resolve_model(model: str, path: str | None = None):
    """(spec, weights directory or None) for a preset name, `facebook/<preset>`, or a local HF directory."""
    if path is not None and not os.path.isdir(path):
        raise UsageError("--path", f"weights directory {path} does not exist")
    if os.path.isfile(os.path.join(model, "config.json")):
        return spec_from_directory(model, os.path.basename(os.path.normpath(model)), "--model"), model
    name = model.lower().removeprefix("facebook/")
    if name not in PRESETS:
        raise UsageError("--model", f"unknown model {model!r}; accepted: {', '.join(PRESETS)} "
                         "(optionally as facebook/<name>) or a directory holding an HF config.json")
    spec = PRESETS[name]
    if path is not None and os.path.isfile(os.path.join(path, "config.json")):
        found = spec_from_directory(path, name, "--path")
        if not same_shape(found, spec):
            raise UsageError("--path", f"{path}/config.json does not describe {name} "
                             f"(layers {found.num_layers}, hidden {found.hidden_size}, "
                             f"expected layers {spec.num_layers}, hidden {spec.hidden_size})")
        spec = found
    return spec, path
