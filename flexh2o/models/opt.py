"""OPT: the published model shapes and the spec that builds flexh2o's own OPT layers."""

from dataclasses import dataclass

from flexh2o.common.errors import UsageError
from flexh2o.models.hf_config import is_int, positive_ints, token_id


@dataclass(frozen=True)
class OPTSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_dim: int
    vocab_size: int = 50272
    max_positions: int = 2048
    word_embed_proj_dim: int = 0  # 0: same as hidden_size (every OPT but 350m)
    do_layer_norm_before: bool = True  # False: layer norm after attention / MLP (opt-350m)
    final_layer_norm: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    family: str = "opt"
    stored_formats: tuple = ()  # as LlamaSpec's

    @property
    def embed_dim(self) -> int:
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    def build_layers(self) -> list:
        from flexh2o.models.opt_layers import InputEmbed, SelfAttention, MLP, OutputEmbed
        layers = [InputEmbed(self)]
        for j in range(self.num_layers):
            layers += [SelfAttention(self, j), MLP(self, j)]
        return layers + [OutputEmbed(self)]

    def param_count(self) -> int:
        h, f, e = self.hidden_size, self.ffn_dim, self.embed_dim
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        embed = self.vocab_size * e + (self.max_positions + 2) * h
        proj = 2 * h * e if e != h else 0
        final_ln = 2 * h if self.final_layer_norm else 0
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.num_layers * per_layer + embed + proj + final_ln + lm_head

    def hidden_bytes(self, batch: int, seq_len: int, dtype_bytes: int) -> int:
        return batch * seq_len * self.hidden_size * dtype_bytes

    @property
    def mlp_working_width(self) -> int:
        """Values per token the MLP holds at its peak beside its input: fc1's output."""
        return self.ffn_dim


def _preset(name, layers, hidden, heads, **kw):
    return OPTSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                   ffn_dim=4 * hidden, **kw)


PRESETS = {s.name: s for s in [
    _preset("opt-125m", 12, 768, 12),
    _preset("opt-350m", 24, 1024, 16, word_embed_proj_dim=512, do_layer_norm_before=False,
            final_layer_norm=False),
    _preset("opt-1.3b", 24, 2048, 32),
    _preset("opt-2.7b", 32, 2560, 32),
    _preset("opt-6.7b", 32, 4096, 32),
    _preset("opt-13b", 40, 5120, 40),
    _preset("opt-30b", 48, 7168, 56),
    _preset("opt-66b", 64, 9216, 72),
    _preset("opt-175b", 96, 12288, 96),
]}


POSITIVE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim", "vocab_size",
                   "max_position_embeddings")
TOKEN_FIELDS = {"pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}


def checked_fields(config: dict, refuse) -> dict:
    """The shape fields of an OPT config.json, each a positive integer, and its special token ids."""
    shape = positive_ints(config, POSITIVE_FIELDS, refuse)
    proj = config.get("word_embed_proj_dim")
    proj = config["hidden_size"] if proj is None else proj  # None: as HF's OPTConfig, the hidden size
    if not is_int(proj) or proj < 1:
        refuse(f"config.json's word_embed_proj_dim must be a positive integer, got {proj!r}")
    tokens = {}
    for field, default in TOKEN_FIELDS.items():
        value = config.get(field)
        tokens[field] = token_id(default if value is None else value, field, shape["vocab_size"], refuse)
    return {**shape, "word_embed_proj_dim": proj, **tokens}


def spec_from_hf_config(config: dict, name: str, flag: str = "--model") -> OPTSpec:
    """An OPTSpec from the fields of an HF OPT config.json."""
    def refuse(what):
        raise UsageError(flag, f"{name}: {what}; flexh2o runs standard OPT checkpoints")

    if config.get("activation_function", "relu") != "relu":
        refuse(f"activation {config['activation_function']!r} is not ReLU")
    if not config.get("enable_bias", True) or not config.get("layer_norm_elementwise_affine", True):
        refuse("layers without biases or layer-norm weights")
    c = checked_fields(config, refuse)
    hidden = c["hidden_size"]
    if hidden % c["num_attention_heads"]:
        refuse("hidden_size is not a multiple of num_attention_heads")
    pre_norm = config.get("do_layer_norm_before", True)
    return OPTSpec(
        name=name,
        num_layers=c["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=c["num_attention_heads"],
        ffn_dim=c["ffn_dim"],
        vocab_size=c["vocab_size"],
        max_positions=c["max_position_embeddings"],
        word_embed_proj_dim=0 if c["word_embed_proj_dim"] == hidden else c["word_embed_proj_dim"],
        do_layer_norm_before=pre_norm,
        final_layer_norm=pre_norm and not config.get("_remove_final_layer_norm", False),
        tie_word_embeddings=config.get("tie_word_embeddings", True),
        pad_token_id=c["pad_token_id"],
        bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"],
    )
