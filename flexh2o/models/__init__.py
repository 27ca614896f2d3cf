"""Model families: turn a model name or a local checkpoint directory into a spec."""

import dataclasses
import os

from flexh2o.common.errors import UsageError, check_regular_file
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.checkpoints.weights import checkpoint_formats
from flexh2o.models import llama, opt

FAMILIES = {"opt": opt, "llama": llama, "mistral": llama, "qwen2": llama}  # config.json's model_type -> module
SUPPORTED_TYPES = tuple(FAMILIES)
PRESETS = {**opt.PRESETS, **llama.PRESETS}
ORGANIZATIONS = ("facebook/", "huggingfacetb/", "meta-llama/")  # a preset may be named as its HF repository


def read_hf_config(directory: str, flag: str) -> dict:
    path = os.path.join(directory, "config.json")
    check_regular_file(path, flag)
    try:
        with open(path, "rb") as f:
            config = parse_json(f.read())
    except OSError as e:
        raise UsageError(flag, f"cannot read {path}: {e.strerror}") from None
    except BadJson as e:
        raise UsageError(flag, f"{path} {e}: not a model's settings") from None
    if not isinstance(config, dict):
        raise UsageError(flag, f"{path} holds a JSON {type(config).__name__}, not an object of model settings")
    return config


def spec_from_directory(directory: str, name: str, flag: str):
    return spec_from_config(read_hf_config(directory, flag), directory, name, flag)


def spec_from_config(config: dict, where: str, name: str, flag: str):
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise UsageError(flag, f"{where} holds a {model_type!r} model; supported: {', '.join(SUPPORTED_TYPES)}")
    return FAMILIES[model_type].spec_from_hf_config(config, name, flag)


def eos_ids(spec) -> list[int]:
    """Every id that ends a sequence of this model (Llama 3 lists several; OPT has one)."""
    ids = getattr(spec, "eos_token_ids", None) or spec.eos_token_id
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def is_gguf(path: str | None) -> bool:
    return path is not None and path.lower().endswith(".gguf")


def same_shape(a, b) -> bool:
    """Whether two specs make the same weights (names and shapes): a checkpoint of one fits the other."""
    def weights(spec):
        return [s for layer in spec.build_layers() for s in layer.weight_specs()]
    return a.family == b.family and weights(a) == weights(b)


def preset_name(model: str) -> str:
    name = model.lower()
    for org in ORGANIZATIONS:
        name = name.removeprefix(org)
    return name


def resolve_model(model: str, path: str | None = None):
    """(spec, weights directory or None) for a preset name (or its HF repository, e.g.
    facebook/opt-1.3b), or a local HF directory."""
    if path is not None and not os.path.isdir(path):
        raise UsageError("--path", f"weights directory {path} does not exist")
    if is_gguf(model):  # one file: config, weights and tokenizer
        from flexh2o.checkpoints.gguf_reader import read_gguf
        name = os.path.basename(model)[: -len(".gguf")]
        gguf = read_gguf(model, check_config=lambda config: llama.spec_from_hf_config(config, model, "--model"))
        spec = spec_from_config(gguf.config, model, name, "--model")
        return with_stored_formats(spec, gguf.stored_formats()), model
    if os.path.lexists(os.path.join(model, "config.json")):  # not isfile: a FIFO there is refused, not skipped
        spec = spec_from_directory(model, os.path.basename(os.path.normpath(model)), "--model")
        return with_stored_formats(spec, tuple(sorted(checkpoint_formats(model, "--model").items()))), model
    name = preset_name(model)
    if name not in PRESETS:
        raise UsageError("--model", f"unknown model {model!r}; accepted: {', '.join(PRESETS)} "
                         "(optionally as their HF repository, e.g. facebook/opt-1.3b) "
                         "or a directory holding an HF config.json")
    spec = PRESETS[name]
    if path is not None and os.path.isfile(os.path.join(path, "config.json")):
        found = spec_from_directory(path, name, "--path")
        if not same_shape(found, spec):
            raise UsageError("--path", f"{path}/config.json does not describe {name} "
                             f"(layers {found.num_layers}, hidden {found.hidden_size}, "
                             f"expected layers {spec.num_layers}, hidden {spec.hidden_size})")
        spec = found
    if path is not None:
        spec = with_stored_formats(spec, tuple(sorted(checkpoint_formats(path).items())))
    return spec, path


def with_stored_formats(spec, formats: tuple):
    """The spec with the (name, format) pairs its checkpoint stores (gguf_blocks.py)."""
    return dataclasses.replace(spec, stored_formats=formats) if formats != spec.stored_formats else spec
