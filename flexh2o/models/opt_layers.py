"""flexh2o's own OPT layers: input embedding, self-attention, ReLU MLP, output embedding.

Each is written to the uniform layer interface (layer.py); weights are named as in Hugging Face
OPT checkpoints (without the leading `model.`).
"""

import torch
import torch.nn.functional as F

from flexh2o.models.cached_attention import CachedAttention
from flexh2o.models.layer import Layer
from flexh2o.models.linear import linear
from flexh2o.models.lm_head import logits
from flexh2o.models.real_tokens import real_tokens

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2


def _layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


class InputEmbed(Layer):
    gathered = 2  # the token and position tables

    def __init__(self, spec):
        self.spec = spec

    def weight_specs(self):
        s = self.spec
        specs = [("decoder.embed_tokens.weight", (s.vocab_size, s.embed_dim)),
                 ("decoder.embed_positions.weight", (s.max_positions + POSITION_OFFSET, s.hidden_size))]
        if s.embed_dim != s.hidden_size:
            specs.append(("decoder.project_in.weight", (s.hidden_size, s.embed_dim)))
        return specs

    def forward(self, hidden, step):
        x = self.rows(0, step.host_token_ids, step.token_ids)
        if self.weights:  # project_in
            x = linear(x, self.weights[0])
        return x + self.rows(1, step.host_positions + POSITION_OFFSET, step.positions + POSITION_OFFSET)


class SelfAttention(CachedAttention):
    def __init__(self, spec, index: int):
        super().__init__(spec)
        self.prefix = f"decoder.layers.{index}."

    def weight_specs(self):
        h, p = self.spec.hidden_size, self.prefix
        specs = [(p + "self_attn_layer_norm.weight", (h,)), (p + "self_attn_layer_norm.bias", (h,))]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += [(f"{p}self_attn.{proj}.weight", (h, h)), (f"{p}self_attn.{proj}.bias", (h,))]
        return specs

    def prepare(self, t, cat=torch.cat):
        ln_w, ln_b, q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b = t
        # One matrix product for q, k and v instead of three.
        return [ln_w, ln_b, cat([q_w, k_w, v_w]), cat([q_b, k_b, v_b]), out_w, out_b]

    def forward(self, hidden, step):
        ln_w, ln_b, qkv_w, qkv_b, out_w, out_b = self.weights
        s = self.spec
        b, n, _ = hidden.shape
        tokens = real_tokens(step)
        x = tokens.gather(hidden)
        x = _layer_norm(x, ln_w, ln_b) if s.do_layer_norm_before else x
        qkv = tokens.scatter(linear(x, qkv_w, qkv_b), b, n).view(b, n, 3, s.num_heads, s.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, n, head_dim]
        hidden = tokens.add_into(hidden, linear(tokens.gather(self.attend(q, k, v, step)), out_w, out_b))
        return hidden if s.do_layer_norm_before else _layer_norm(hidden, ln_w, ln_b)


class MLP(Layer):
    def __init__(self, spec, index: int):
        self.spec = spec
        self.prefix = f"decoder.layers.{index}."

    def weight_specs(self):
        h, f, p = self.spec.hidden_size, self.spec.ffn_dim, self.prefix
        return [(p + "final_layer_norm.weight", (h,)), (p + "final_layer_norm.bias", (h,)),
                (p + "fc1.weight", (f, h)), (p + "fc1.bias", (f,)),
                (p + "fc2.weight", (h, f)), (p + "fc2.bias", (h,))]

    def forward(self, hidden, step):
        ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b = self.weights
        pre = self.spec.do_layer_norm_before
        tokens = real_tokens(step)
        x = tokens.gather(hidden)
        x = _layer_norm(x, ln_w, ln_b) if pre else x
        x = linear(x, fc1_w, fc1_b).relu_()
        hidden = tokens.add_into(hidden, linear(x, fc2_w, fc2_b))
        return hidden if pre else _layer_norm(hidden, ln_w, ln_b)


class OutputEmbed(Layer):
    """Final layer norm, projection and the (tied) LM head; picks the next token of each sequence."""
    one_of_a_kind = True

    def __init__(self, spec):
        self.spec = spec

    def weight_specs(self):
        s = self.spec
        specs = []
        if s.final_layer_norm:
            specs += [("decoder.final_layer_norm.weight", (s.hidden_size,)),
                      ("decoder.final_layer_norm.bias", (s.hidden_size,))]
        if s.embed_dim != s.hidden_size:
            specs.append(("decoder.project_out.weight", (s.embed_dim, s.hidden_size)))
        head = "decoder.embed_tokens.weight" if s.tie_word_embeddings else "lm_head.weight"
        return specs + [(head, (s.vocab_size, s.embed_dim))]

    def forward(self, hidden, step):
        s = self.spec

        def head(x):
            w = list(self.weights)
            if s.final_layer_norm:
                x = _layer_norm(x, w.pop(0), w.pop(0))
            if s.embed_dim != s.hidden_size:
                x = linear(x, w.pop(0))
            return logits(x, w.pop(0)).float()
        if step.score_prompt is not None:
            step.score_prompt(hidden, head)
        return step.choose_next(head(hidden[:, -1]))  # only the last position predicts the next token
