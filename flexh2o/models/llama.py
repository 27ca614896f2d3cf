"""The Llama family (Llama 2 and 3, Mistral, Qwen2, SmolLM2): the spec that builds flexh2o's own
Llama layers, a few published shapes, and the spec of an HF config.json.

One architecture covers them all: RMSNorm before attention and MLP, rotary position embeddings,
grouped-query attention, a SwiGLU MLP and an LM head tied to the token embedding or not. They
differ in settings only: Qwen2 has biases on q, k and v; Llama 3 scales its rotary frequencies;
Mistral (v0.1) and Qwen2 may attend within a sliding window, which over a run no longer than the
window is plain causal attention, so such a model runs up to its window's length.
"""

from dataclasses import dataclass

from flexh2o.common.errors import UsageError
from flexh2o.models.hf_config import is_int, is_number, positive_int, positive_ints, positive_number, token_id

MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled: "linear" divides them all by factor; "llama3" divides
    the low ones by factor, keeps the high ones and blends those in between (Llama 3.1)."""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class LlamaSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int  # the MLP's intermediate_size
    vocab_size: int
    max_positions: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q, k and v (Qwen2; Llama's attention_bias)
    o_bias: bool = False    # a bias on the output projection (Llama's attention_bias)
    pad_token_id: int = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    eos_token_ids: tuple = ()  # every end-of-sequence id the config lists; eos_token_id is the first
    model_type: str = "llama"
    family: str = "llama"
    # (checkpoint name, format) of each matrix its checkpoint stores low-bit or 16-bit
    # (gguf_blocks.py), placed as stored where gguf_blocks.applies: the pre-flight counts those bytes.
    stored_formats: tuple = ()

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def embed_dim(self) -> int:
        return self.hidden_size

    def build_layers(self) -> list:
        from flexh2o.models.llama_layers import InputEmbed, SelfAttention, MLP, OutputEmbed, Rotary
        rotary = Rotary(self)  # one table of frequencies, shared by every attention layer
        layers = [InputEmbed(self)]
        for j in range(self.num_layers):
            layers += [SelfAttention(self, j, rotary), MLP(self, j)]
        return layers + [OutputEmbed(self)]

    def param_count(self) -> int:
        h, f, v = self.hidden_size, self.ffn_dim, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        per_layer = attention + 3 * h * f + 2 * h  # and two RMSNorm weights
        lm_head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * per_layer + v * h + h + lm_head

    def hidden_bytes(self, batch: int, seq_len: int, dtype_bytes: int) -> int:
        return batch * seq_len * self.hidden_size * dtype_bytes

    @property
    def mlp_working_width(self) -> int:
        """Values per token the MLP holds at its peak beside its input: gate and up, and silu(gate)."""
        return 3 * self.ffn_dim


# Published shapes, for runs on dummy weights (a checkpoint's own config.json is read with --path).
PRESETS = {s.name: s for s in [
    LlamaSpec("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, rms_norm_eps=1e-5, rope_theta=100000.0,
              tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, eos_token_ids=(0,)),
    LlamaSpec("llama-2-7b-hf", 32, 4096, 32, 32, 11008, 32000, 4096, rms_norm_eps=1e-5, pad_token_id=2,
              eos_token_ids=(2,)),
    LlamaSpec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072, rms_norm_eps=1e-5, rope_theta=500000.0,
              rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), pad_token_id=128001,
              bos_token_id=128000, eos_token_id=128001, eos_token_ids=(128001,)),
]}

SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings")


def spec_from_hf_config(config: dict, name: str, flag: str = "--model") -> LlamaSpec:
    """A LlamaSpec from the fields of an HF Llama, Mistral or Qwen2 config.json."""
    def refuse(what):
        raise UsageError(flag, f"{name}: {what}; flexh2o runs standard Llama, Mistral and Qwen2 checkpoints")

    model_type = config.get("model_type", "llama")
    check_architecture(config, refuse)
    shape = positive_ints(config, SHAPE_FIELDS, refuse)
    heads, hidden = shape["num_attention_heads"], shape["hidden_size"]
    kv_heads = positive_int(config, "num_key_value_heads", refuse, default=heads)
    if heads % kv_heads:
        refuse(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    if config.get("head_dim") is None and hidden % heads:
        refuse("hidden_size is not a multiple of num_attention_heads")
    head_dim = positive_int(config, "head_dim", refuse, default=hidden // heads)
    if head_dim % 2:
        refuse(f"config.json's head_dim must be even (rotary embeddings turn pairs of values), got {head_dim}")
    theta, scaling = rope_settings(config, shape["max_position_embeddings"], refuse)
    qkv_bias, o_bias = attention_biases(config, model_type, refuse)
    return LlamaSpec(
        name=name,
        num_layers=shape["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_dim=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        max_positions=attended_positions(config, model_type, shape["max_position_embeddings"], refuse),
        head_dim=head_dim,
        rms_norm_eps=positive_number(config, "rms_norm_eps", refuse, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=config.get("tie_word_embeddings", False) is True,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        model_type=model_type,
        **special_tokens(config, shape["vocab_size"], refuse),
    )


def check_architecture(config: dict, refuse):
    """Refuses settings outside the one architecture the layers implement."""
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"activation {config['hidden_act']!r} is not SiLU")
    if config.get("mlp_bias"):
        refuse("MLP biases (mlp_bias) are not supported")


def rope_settings(config: dict, max_positions: int, refuse) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5's rope_parameters, or the older rope_theta and rope_scaling."""
    field = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = config.get(field) or {}
    if not isinstance(rope, dict) or any(isinstance(value, dict) for value in rope.values()):
        refuse(f"config.json's {field} must be one object of RoPE settings, got {rope!r}")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        refuse(f"partial rotary embeddings (partial_rotary_factor {partial!r}) are not supported")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not is_number(theta) or theta <= 0:
        refuse(f"config.json's rope_theta must be a positive number, got {theta!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(f"RoPE type {kind!r} in {field} is not supported (accepted: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling("linear", rope_number(rope, "factor", field, refuse))
    low, high = (rope_number(rope, key, field, refuse) for key in ("low_freq_factor", "high_freq_factor"))
    if high <= low:
        refuse(f"{field}.high_freq_factor ({high:g}) must exceed low_freq_factor ({low:g})")
    original = rope.get("original_max_position_embeddings") or max_positions
    if not is_int(original) or original < 1:
        refuse(f"{field}.original_max_position_embeddings must be a positive integer, got {original!r}")
    return float(theta), RopeScaling("llama3", rope_number(rope, "factor", field, refuse), low, high, original)


def rope_number(rope: dict, key: str, field: str, refuse) -> float:
    value = rope.get(key)
    if not is_number(value) or value <= 0:
        refuse(f"{field}.{key} must be a positive number, got {value!r}")
    return float(value)


def attention_biases(config: dict, model_type: str, refuse) -> tuple[bool, bool]:
    """(on q, k and v; on the output projection). Qwen2 always has the former and never the latter."""
    if model_type == "qwen2":
        return True, False
    bias = config.get("attention_bias", False)
    if not isinstance(bias, bool):
        refuse(f"config.json's attention_bias must be true or false, got {bias!r}")
    return bias, bias


def attended_positions(config: dict, model_type: str, max_positions: int, refuse) -> int:
    """The longest run whose attention is plain causal: a sliding window, where one is used, caps it."""
    uses_window = model_type == "mistral" or (model_type == "qwen2" and config.get("use_sliding_window"))
    if not uses_window or config.get("sliding_window") is None:
        return max_positions
    return min(max_positions, positive_int(config, "sliding_window", refuse))


def special_tokens(config: dict, vocab_size: int, refuse) -> dict:
    """pad, bos and eos ids; eos may be a list (the first stops a sequence). A missing pad is the
    first eos, as transformers' generate pads with it."""
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    for value in eos_ids:
        token_id(value, "eos_token_id", vocab_size, refuse)
    bos, pad = config.get("bos_token_id"), config.get("pad_token_id")
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    return {"pad_token_id": token_id(pad, "pad_token_id", vocab_size, refuse),
            "bos_token_id": None if bos is None else token_id(bos, "bos_token_id", vocab_size, refuse),
            "eos_token_id": eos_ids[0] if eos_ids else None,
            "eos_token_ids": eos_ids}
