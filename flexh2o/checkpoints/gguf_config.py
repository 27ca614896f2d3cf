"""A GGUF file's metadata as the Hugging Face config.json of its model (gguf_reader.py reads the
rest): shapes, norms, rotary settings (linear scaling, or llama3's read back from rope_freqs) and
special tokens, each field checked."""

import numpy as np

from flexh2o.common.errors import UsageError
from flexh2o.checkpoints.gguf_file import StringArray

FLAG = "--model"
# llama3-style RoPE scaling is stored as this tensor of per-frequency divisors, not as metadata.
ROPE_FREQS = "rope_freqs.weight"


def hf_config(reader, arch, path, tensors, check_config, rope_freqs) -> dict:
    """The Hugging Face config.json fields that GGUF metadata holds for a Llama-family model;
    rope_freqs: the file's rope_freqs tensor as float64 values, or None."""
    def number(key, default=...):
        return scalar(reader, f"{arch}.{key}", path, default)

    heads = number("attention.head_count")
    hidden = number("embedding_length")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": number("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": number("attention.head_count_kv", heads),
        "intermediate_size": number("feed_forward_length"),
        "vocab_size": number("vocab_size", _rows(tensors, "embed_tokens.weight", path)),
        "max_position_embeddings": number("context_length"),
        "rms_norm_eps": _float32(number("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(number("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": "layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }
    head_dim = number("attention.key_length", number("rope.dimension_count", None))
    if head_dim is not None:
        config["head_dim"] = head_dim
    for field in ("bos", "eos", "padding"):
        token_id = scalar(reader, f"tokenizer.ggml.{field}_token_id", path, None)
        if token_id is not None:
            config[f"{field.replace('padding', 'pad')}_token_id"] = token_id
    if check_config is not None:
        check_config(config)  # impossible shapes refused here, as a config.json's would be
    if isinstance(heads, int) and heads > 0:
        config.setdefault("head_dim", hidden // heads)
    rope_scaling = _rope_scaling(reader, arch, path, config, rope_freqs)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(reader, arch, path, config, freqs):
    """Hugging Face rope_scaling from the file: linear from metadata, llama3-style from rope_freqs."""
    kind = scalar(reader, f"{arch}.rope.scaling.type", path, "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32(scalar(reader, f"{arch}.rope.scaling.factor", path))}
    if kind != "none":
        raise UsageError(FLAG, f"{path} uses {kind!r} RoPE scaling; supported: linear and llama3")
    if freqs is None:
        return None
    return _llama3_scaling(freqs, config, path)


def _llama3_scaling(divisors, config, path):
    """llama3 rope_scaling whose per-frequency divisors (llama.cpp's rope_freqs) are `divisors`.

    Llama 3.1 and 3.2 use low_freq_factor 1, high_freq_factor 4 and an original context of 8192; those
    are tried first. Otherwise the middle band, where 1/divisor is linear in 1/wavelength, gives the
    parameters (up to a common scale, fixed by low_freq_factor = 1). Either is checked against the file.
    """
    inv_freq = _inverse_frequencies(config, len(divisors))
    factor = float(divisors.max())
    params = {"rope_type": "llama3", "factor": _float32(factor), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if not np.allclose(_llama3_divisors(inv_freq, params), divisors, rtol=1e-4):
        params.update(_fit_llama3_band(inv_freq, divisors, factor, path))
    if not np.allclose(_llama3_divisors(inv_freq, params), divisors, rtol=1e-4):
        raise UsageError(FLAG, f"{path}: its {ROPE_FREQS} is not llama3-style RoPE scaling")
    return params


def _inverse_frequencies(config, count):
    exponents = np.arange(count, dtype=np.float64) * 2 / config["head_dim"]
    return config["rope_theta"] ** -exponents


def _llama3_divisors(inv_freq, params):
    """llama.cpp's rope_freqs for these llama3 parameters (the formula of its converter)."""
    wavelength = 2 * np.pi / inv_freq
    old_context = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = (old_context / wavelength - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelength < old_context / high, 1.0, divisors)
    return np.where(wavelength > old_context / low, factor, divisors)


def _fit_llama3_band(inv_freq, divisors, factor, path):
    # In the band, smooth = 1/wavelength * old_context/(high-low) - low/(high-low): a line.
    band = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if band.sum() < 2:
        raise UsageError(FLAG, f"{path}: too few rotary frequencies in its {ROPE_FREQS} band to read llama3 scaling")
    smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[band] / (2 * np.pi), smooth, 1)
    if not intercept < 0 < slope:
        raise UsageError(FLAG, f"{path}: its {ROPE_FREQS} is not llama3-style RoPE scaling")
    width = -1 / intercept  # high - low, with low = 1
    return {"low_freq_factor": 1.0, "high_freq_factor": round(1 + width, 6),
            "original_max_position_embeddings": int(round(slope * width))}


def _rows(tensors, name, path):
    if name not in tensors:
        raise UsageError(FLAG, f"{path} has no token embedding ({name})")
    return int(tensors[name].shape[-1])  # GGUF lists the innermost dimension first


def _float32(value):
    """A float32 from the file as the shortest decimal that reads back the same (1e-05, not 9.99e-06)."""
    return None if value is None else float(str(np.float32(value)))


def scalar(reader, key, path, default=...):
    """A single-valued metadata field (int, float, bool or str); `default` where it is absent."""
    if key not in reader.fields:
        if default is ...:
            raise UsageError(FLAG, f"{path} lacks the GGUF metadata {key!r}")
        return default
    value = reader.fields[key]
    if isinstance(value, (np.ndarray, StringArray)):
        raise UsageError(FLAG, f"{path}: GGUF metadata {key!r} is a list, not one value")
    return value


def string(reader, key, path):
    value = scalar(reader, key, path)
    if not isinstance(value, str):
        raise UsageError(FLAG, f"{path}: GGUF metadata {key!r} is not text")
    return value
