"""flexh2o's own Llama-family layers: token embedding, self-attention with rotary embeddings and
grouped-query attention, SwiGLU MLP, output embedding.

Each is written to the uniform layer interface (layer.py); the attention's cache side is the one
every family shares (cached_attention.py). Weights are named as in Hugging Face checkpoints
(without the leading `model.`; the untied LM head is `lm_head.weight`).
"""

import math

import torch

from flexh2o.models.cached_attention import CachedAttention
from flexh2o.models.layer import Layer
from flexh2o.models.layer_ops import rms_norm, rotate_heads, silu_times_up
from flexh2o.models.llama_decode import attention_step, mlp_step
from flexh2o.models.linear import linear
from flexh2o.models.lm_head import logits
from flexh2o.models.real_tokens import real_tokens


def inverse_frequencies(spec) -> torch.Tensor:
    """The rotary frequency of each pair of a head's values (float32), scaled as the spec says."""
    d = spec.head_dim
    freqs = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = spec.rope_scaling
    if scaling is None:
        return freqs
    if scaling.kind == "linear":
        return freqs / scaling.factor
    return llama3_frequencies(freqs, scaling)


def llama3_frequencies(freqs: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor are stretched by factor, shorter
    than original / high_freq_factor kept, and those in between blended linearly in original / wavelength."""
    original = scaling.original_max_positions
    wavelength = 2 * math.pi / freqs
    stretched = torch.where(wavelength > original / scaling.low_freq_factor, freqs / scaling.factor, freqs)
    blend = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    between = (wavelength >= original / scaling.high_freq_factor) & (wavelength <= original / scaling.low_freq_factor)
    return torch.where(between, blended, stretched)


class Rotary:
    """cos and sin of each token's rotary phase, from its absolute position."""

    def __init__(self, spec):
        self.freqs = inverse_frequencies(spec)
        self.on_device = {}  # device -> freqs there, moved once

    def phases(self, step, dtype):
        """cos, sin [b, 1, n, head_dim] in `dtype` (computed in float32) of step.positions [b, n];
        computed once per step, which every attention layer shares."""
        key = (id(self), dtype)
        if key not in step.memo:
            positions = step.positions
            device = positions.device
            if device not in self.on_device:
                self.on_device[device] = self.freqs.to(device)
            angles = positions.float()[..., None] * self.on_device[device]
            angles = torch.cat([angles, angles], dim=-1)[:, None]
            step.memo[key] = angles.cos().to(dtype), angles.sin().to(dtype)
        return step.memo[key]


class InputEmbed(Layer):
    gathered = 1  # the token table

    def __init__(self, spec):
        self.spec = spec

    def weight_specs(self):
        return [("embed_tokens.weight", (self.spec.vocab_size, self.spec.hidden_size))]

    def forward(self, hidden, step):
        return self.rows(0, step.host_token_ids, step.token_ids)


class SelfAttention(CachedAttention):
    decode_half = "attention"  # a layer whose decode step can run in C, with the MLP after it (llama_decode.py)

    def __init__(self, spec, index: int, rotary: Rotary):
        super().__init__(spec)
        self.prefix = f"layers.{index}."
        self.rotary = rotary

    def weight_specs(self):
        s, p = self.spec, self.prefix
        h, q_rows, kv_rows = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        specs = [(p + "input_layernorm.weight", (h,))]
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            specs.append((f"{p}self_attn.{proj}.weight", (rows, h)))
            if s.qkv_bias:
                specs.append((f"{p}self_attn.{proj}.bias", (rows,)))
        specs.append((p + "self_attn.o_proj.weight", (h, q_rows)))
        if s.o_bias:
            specs.append((p + "self_attn.o_proj.bias", (h,)))
        return specs

    def prepare(self, t, cat=torch.cat):
        """[norm, q, k, v and o weights, biases where the model has them] -> [norm, qkv weight,
        (qkv bias), o weight, (o bias)]: one matrix product for q, k and v instead of three."""
        t = list(t)
        norm = t.pop(0)
        qkv = [t.pop(0) for _ in range(6 if self.spec.qkv_bias else 3)]
        fused = [cat(qkv[0::2]), cat(qkv[1::2])] if self.spec.qkv_bias else [cat(qkv)]
        return [norm, *fused, *t]

    def split_weights(self):
        """(norm, qkv weight, qkv bias or None, o weight, o bias or None)."""
        w = list(self.weights)
        norm, qkv_w = w.pop(0), w.pop(0)
        qkv_b = w.pop(0) if self.spec.qkv_bias else None
        o_w = w.pop(0)
        return norm, qkv_w, qkv_b, o_w, w.pop(0) if self.spec.o_bias else None

    def forward(self, hidden, step):
        lib = self.cpu_kernels
        if attention_step(self, hidden, step, lib):
            return hidden
        norm, qkv_w, qkv_b, o_w, o_b = self.split_weights()
        s = self.spec
        b, n, _ = hidden.shape
        tokens = real_tokens(step)
        qkv = tokens.scatter(linear(rms_norm(tokens.gather(hidden), norm, s.rms_norm_eps, lib), qkv_w, qkv_b), b, n)
        qk_heads = s.num_heads + s.num_kv_heads
        cos, sin = self.rotary.phases(step, qkv.dtype)
        qk = rotate_heads(qkv, qk_heads, s.head_dim, cos, sin, lib)  # q and k turned together: one set of kernels
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
        v = qkv.view(b, n, qk_heads + s.num_kv_heads, s.head_dim).transpose(1, 2)[:, qk_heads:]  # [b, kv heads, n, d]
        out = self.attend(q, k, v, step)
        return tokens.add_into(hidden, linear(tokens.gather(out), o_w, o_b))


class MLP(Layer):
    decode_half = "mlp"

    def __init__(self, spec, index: int):
        self.spec = spec
        self.prefix = f"layers.{index}."

    def weight_specs(self):
        h, f, p = self.spec.hidden_size, self.spec.ffn_dim, self.prefix
        return [(p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)), (p + "mlp.down_proj.weight", (h, f))]

    def prepare(self, t, cat=torch.cat):
        norm, gate, up, down = t
        return [norm, cat([gate, up]), down]  # one matrix product for gate and up

    def forward(self, hidden, step):
        lib = self.cpu_kernels
        if mlp_step(self, hidden, step, lib):
            return hidden
        norm, gate_up_w, down_w = self.weights
        tokens = real_tokens(step)
        gate_up = linear(rms_norm(tokens.gather(hidden), norm, self.spec.rms_norm_eps, lib), gate_up_w)
        return tokens.add_into(hidden, linear(silu_times_up(gate_up, lib), down_w))


class OutputEmbed(Layer):
    """Final RMSNorm and the LM head (tied to the token embedding or not); picks the next token of each sequence."""
    one_of_a_kind = True

    def __init__(self, spec):
        self.spec = spec

    def weight_specs(self):
        s = self.spec
        head = "embed_tokens.weight" if s.tie_word_embeddings else "lm_head.weight"
        return [("norm.weight", (s.hidden_size,)), (head, (s.vocab_size, s.hidden_size))]

    def forward(self, hidden, step):
        norm, weight = self.weights

        def head(h):
            return logits(rms_norm(h, norm, self.spec.rms_norm_eps, self.cpu_kernels), weight).float()
        if step.score_prompt is not None:
            step.score_prompt(hidden, head)
        return step.choose_next(head(hidden[:, -1]))  # only the last position predicts the next token
