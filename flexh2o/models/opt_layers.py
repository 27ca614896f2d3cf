"""flexh2o's own OPT layers: input embedding, self-attention, ReLU MLP, output embedding.

Each is written to the uniform layer interface (layer.py); weights are named as in Hugging Face
OPT checkpoints (without the leading `model.`).
"""

import torch
import torch.nn.functional as F

from ..kv.eviction import per_kv_head
from ..kv.home import CacheHome, batch_split
from .attention import decode_attention, prompt_attention, prompt_attention_observed
from .layer import Layer

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2


def _layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


class InputEmbed(Layer):
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
        tokens, positions, *project_in = self.weights
        x = F.embedding(step.token_ids, tokens)
        if project_in:
            x = F.linear(x, project_in[0])
        return x + F.embedding(step.positions + POSITION_OFFSET, positions)


class SelfAttention(Layer):
    def __init__(self, spec, index: int):
        self.spec = spec
        self.prefix = f"decoder.layers.{index}."
        self.homes = []
        self.loading = []

    def weight_specs(self):
        h, p = self.spec.hidden_size, self.prefix
        specs = [(p + "self_attn_layer_norm.weight", (h,)), (p + "self_attn_layer_norm.bias", (h,))]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += [(f"{p}self_attn.{proj}.weight", (h, h)), (f"{p}self_attn.{proj}.bias", (h,))]
        return specs

    def prepare(self, t):
        ln_w, ln_b, q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b = t
        # One matrix product for q, k and v instead of three.
        return [ln_w, ln_b, torch.cat([q_w, k_w, v_w]), torch.cat([q_b, k_b, v_b]), out_w, out_b]

    def init_cache(self, batch_sizes, kv, policy):
        """kv: this layer's KV policy object (flexh2o.kv), which fixes the capacity."""
        s = self.spec
        self.kv = kv
        self.homes = [CacheHome(self.tiers, b, s.num_kv_heads, s.head_dim, kv.capacity, kv.accumulates,
                                batch_split(b, policy.cache_gpu_percent, policy.cache_cpu_percent),
                                policy.cpu_cache_compute, policy.compress_cache) for b in batch_sizes]
        self.loading = [None] * len(batch_sizes)

    def free_cache(self):
        for home in self.homes:
            home.close()
        self.homes, self.loading = [], []

    def load_cache(self, i, k):
        self.loading[k] = self.homes[k].load(prefill=i == 0)

    def wait_inputs(self, k):
        super().wait_inputs(k)
        self.loading[k].wait()

    def store_cache(self, i, k):
        self.homes[k].store(self.loading[k].wait())
        self.loading[k] = None

    def forward(self, hidden, step):
        ln_w, ln_b, qkv_w, qkv_b, out_w, out_b = self.weights
        s = self.spec
        b, n, h = hidden.shape
        x = _layer_norm(hidden, ln_w, ln_b) if s.do_layer_norm_before else hidden
        qkv = F.linear(x, qkv_w, qkv_b).view(b, n, 3, s.num_heads, s.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, n, head_dim]
        scale = s.head_dim ** -0.5
        parts = self.loading[step.k].wait()  # [(rows, KVCache)]: sequences whose cache lives in one place
        if step.prefill:
            out = self._prompt(q, k, v, scale, step, parts)
        else:
            # A part the CPU attends over (cpu_cache_compute): its q and new K/V start towards the
            # CPU first, so that copy and the CPU's attention overlap the device's own parts.
            on_cpu = {n: self.tiers.start_host_copy([t[rows] for t in (q, k, v, step.positions)], cache.k.dtype)
                      for n, (rows, cache) in enumerate(parts) if cache.k.device != q.device}
            outs = [None if n in on_cpu else self._decode(q[rows], k[rows], v[rows], step.positions[rows], cache,
                                                          scale, step)
                    for n, (rows, cache) in enumerate(parts)]
            for n, copied in on_cpu.items():
                outs[n] = self._decode(*copied.wait(), parts[n][1], scale, step).to(q.device, q.dtype)
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        hidden = hidden.add_(F.linear(out.transpose(1, 2).reshape(b, n, h), out_w, out_b))
        return hidden if s.do_layer_norm_before else _layer_norm(hidden, ln_w, ln_b)

    def _decode(self, q, k_new, v_new, positions, cache, scale, step):
        """One new token per sequence against `cache`; the KV policy then stores it."""
        o, logits, probs = decode_attention(q, cache, k_new, v_new, scale)
        self.kv.decode(cache, k_new, v_new, positions, logits, probs, step)
        return o

    def _prompt(self, q, k, v, scale, step, parts):
        """The prompt's attention; the KV policy then takes its tokens into the cache."""
        kv_heads = self.spec.num_kv_heads
        seen = None
        if self.kv.uses_attention:
            out, seen = prompt_attention_observed(
                q, k, v, step.prompt_mask, step.key_valid, scale,
                lambda logits, probs, real_rows: self.kv.contribution(logits, probs, real_rows, step))
            seen = per_kv_head(seen, kv_heads)
        else:
            out = prompt_attention(q, k, v, step.prompt_mask, scale)
        b, _, n, _ = k.shape
        pos = step.positions.to(torch.int32)[:, None, :].expand(b, kv_heads, n)
        for rows, cache in parts:
            dev = cache.k.device
            self.kv.prompt(cache, k[rows].to(dev), v[rows].to(dev), pos[rows].to(dev),
                           None if seen is None else seen[rows].to(dev), step)
        return out


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
        x = _layer_norm(hidden, ln_w, ln_b) if pre else hidden
        x = F.linear(x, fc1_w, fc1_b).relu_()
        hidden = hidden.add_(F.linear(x, fc2_w, fc2_b))
        return hidden if pre else _layer_norm(hidden, ln_w, ln_b)


class OutputEmbed(Layer):
    """Final layer norm, projection and the (tied) LM head; picks the next token of each sequence."""

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
        w = list(self.weights)
        x = hidden[:, -1]  # only the last position predicts the next token
        if s.final_layer_norm:
            x = _layer_norm(x, w.pop(0), w.pop(0))
        if s.embed_dim != s.hidden_size:
            x = F.linear(x, w.pop(0))
        logits = F.linear(x, w.pop(0))
        return step.choose_next(logits.float())
