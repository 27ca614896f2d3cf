"""A slow, independent KV eviction for Llama-family models: every K/V kept, evicted tokens masked out.

The mask-based simulation of docs/design.md ("H2O and the other policies"), like h2o_reference.py for OPT, built on
transformers' own Llama modules and extended to grouped-query attention (a KV head's score sums
its query heads) and to the other deterministic policies: after every step, each (layer, sequence,
KV head) keeps its `window` newest tokens and the older ones of highest priority up to `capacity`
(of equal priority the older one goes), each sequence with its own heavy and recent budgets. It
shares no code with flexh2o.
"""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SINKS = 4


def rule(kv_policy: str, heavy: int, recent: int):
    """(capacity, window, priority(pos, score, current)) of a policy, as docs/design.md and kv/ define them."""
    capacity = heavy + recent
    if kv_policy == "h2o":
        return capacity, recent, lambda pos, score, current: score
    if kv_policy == "local":
        return capacity, capacity, lambda pos, score, current: float(pos)
    if kv_policy == "sink":
        sinks = min(SINKS, capacity - 1)
        return capacity, capacity - sinks, lambda pos, score, current: 1e9 if pos < sinks else float(pos)
    if kv_policy == "tova":
        return capacity, 1, lambda pos, score, current: current
    raise ValueError(kv_policy)


class MaskedEvictionLlama:
    def __init__(self, hf_model, kv_policy: str, heavy: list, recent: list):
        """heavy, recent: each sequence's budgets."""
        self.m, self.cfg, self.lm_head = hf_model.model, hf_model.config, hf_model.lm_head
        self.rules = [rule(kv_policy, h, r) for h, r in zip(heavy, recent)]

    @torch.no_grad()
    def generate(self, ids, mask, new_tokens):
        """Greedy tokens [b, new_tokens] and the logits of each step."""
        b = ids.shape[0]
        cfg = self.cfg
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        n_layers = cfg.num_hidden_layers
        real = mask.bool()
        positions = real.long().cumsum(1) * real - 1
        self.keys = [torch.zeros(b, self.kv_heads, 0, self.d) for _ in range(n_layers)]
        self.values = [torch.zeros(b, self.kv_heads, 0, self.d) for _ in range(n_layers)]
        self.kept = [torch.zeros(b, self.kv_heads, 0, dtype=torch.bool) for _ in range(n_layers)]
        self.score = [torch.zeros(b, self.kv_heads, 0) for _ in range(n_layers)]
        self.key_pos = torch.zeros(b, 0, dtype=torch.long)
        tokens, logits_out = ids, []
        for _ in range(new_tokens):
            logits = self._forward(tokens, positions, real)
            logits_out.append(logits)
            tokens, positions = logits.argmax(-1, keepdim=True), self.key_pos[:, -1:] + 1
            real = torch.ones(b, 1, dtype=torch.bool)
        return torch.stack([x.argmax(-1) for x in logits_out], 1), logits_out

    def _forward(self, tokens, positions, real):
        x = self.m.embed_tokens(tokens)
        cos, sin = self.m.rotary_emb(x, positions.clamp(min=0))
        first = self.key_pos.shape[1] == 0
        self.key_pos = torch.cat([self.key_pos, torch.where(real, positions, -1)], 1)
        for j, layer in enumerate(self.m.layers):
            x = x + self._attention(j, layer, layer.input_layernorm(x), cos, sin, real, first)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.m.norm(x[:, -1]))

    def _attention(self, j, layer, h, cos, sin, real, first):
        att = layer.self_attn
        b, n, _ = h.shape
        group = self.heads // self.kv_heads

        def split(t):
            return t.view(b, n, -1, self.d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(split(att.q_proj(h)), split(att.k_proj(h)), cos, sin)
        self.keys[j] = torch.cat([self.keys[j], k], 2)
        self.values[j] = torch.cat([self.values[j], split(att.v_proj(h))], 2)
        self.kept[j] = torch.cat([self.kept[j], real[:, None, :].expand(b, self.kv_heads, n)], 2)
        self.score[j] = torch.cat([self.score[j], torch.zeros(b, self.kv_heads, n)], 2)
        total = self.keys[j].shape[2]
        allowed = self.kept[j].repeat_interleave(group, 1)[:, :, None, :].expand(b, self.heads, n, total).clone()
        allowed &= torch.ones(n, total, dtype=torch.bool).tril(total - n)  # causal
        if first:  # a padding query row attends to itself only; its output is never used
            for row in range(b):
                for i in range(n):
                    if not real[row, i]:
                        allowed[row, :, i] = False
                        allowed[row, :, i, i] = True
        keys, values = (t.repeat_interleave(group, 1) for t in (self.keys[j], self.values[j]))
        logits = (q @ keys.transpose(-1, -2)) * self.d ** -0.5
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        by_kv_head = probs.view(b, self.kv_heads, group, n, total).sum(2)  # [b, kv_heads, n, total]
        self.score[j] += (by_kv_head * real[:, None, :, None]).sum(2)
        self._evict(j, current=by_kv_head[:, :, -1])
        out = (probs @ values).transpose(1, 2).reshape(b, n, -1)
        return att.o_proj(out)

    def _evict(self, j, current):
        kept, score, pos = self.kept[j], self.score[j], self.key_pos
        b, kv_heads, total = kept.shape
        for row in range(b):
            capacity, window_size, rank = self.rules[row]
            for head in range(kv_heads):
                held = [t for t in range(total) if kept[row, head, t]]
                if len(held) <= capacity:
                    continue
                newest = max(int(pos[row, t]) for t in held)
                window = [t for t in held if pos[row, t] > newest - window_size]

                def priority(t):
                    return float(rank(int(pos[row, t]), score[row, head, t], current[row, head, t]))
                # Highest priority first; of equal ones the newer token first, so the older one goes.
                older = sorted((t for t in held if t not in window), key=lambda t: (-priority(t), -int(pos[row, t])))
                keep = set(window) | set(older[: capacity - len(window)])
                for t in held:
                    if t not in keep:
                        kept[row, head, t] = False
