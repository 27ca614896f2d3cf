"""A slow, independent H2O: OPT with every K/V kept and evicted tokens masked out.

This is the mask-based simulation of the H2O paper's code (docs/design.md, "H2O and the other policies"): attention
always runs over the whole sequence, each (layer, sequence, head) holds a mask of the tokens it
still keeps, and after every step the eviction rule is applied with plain Python loops. It shares
no code with flexh2o; the tests hold the engine's real eviction to it.
"""

import torch
import torch.nn.functional as F


class MaskedH2OOPT:
    def __init__(self, hf_model, heavy: list, recent: list):
        """heavy, recent: each sequence's budgets (docs/design.md: from its own real prompt length)."""
        self.m, self.cfg = hf_model.model.decoder, hf_model.config
        self.lm_head = hf_model.lm_head.weight
        self.heavy, self.recent = heavy, recent

    @torch.no_grad()
    def generate(self, ids, mask, new_tokens):
        """Greedy tokens [b, new_tokens] and the logits of each step."""
        b, s = ids.shape
        cfg = self.cfg
        heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        n_layers = cfg.num_hidden_layers
        real = mask.bool()
        positions = real.long().cumsum(1) * real - 1
        self.keys = [torch.zeros(b, heads, 0, d) for _ in range(n_layers)]
        self.values = [torch.zeros(b, heads, 0, d) for _ in range(n_layers)]
        self.kept = [torch.zeros(b, heads, 0, dtype=torch.bool) for _ in range(n_layers)]  # per key
        self.score = [torch.zeros(b, heads, 0) for _ in range(n_layers)]
        self.key_pos = torch.zeros(b, 0, dtype=torch.long)
        tokens, logits_out = ids, []
        for step in range(new_tokens):
            logits = self._forward(tokens, positions, real)
            logits_out.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
            tokens, positions = nxt, self.key_pos[:, -1:] + 1
            real = torch.ones(b, 1, dtype=torch.bool)
        return torch.stack([x.argmax(-1) for x in logits_out], 1), logits_out

    def _forward(self, tokens, positions, real):
        m, cfg = self.m, self.cfg
        b, n = tokens.shape
        x = F.embedding(tokens, m.embed_tokens.weight)
        if m.project_in is not None:
            x = m.project_in(x)
        x = x + F.embedding(positions + 2, m.embed_positions.weight)
        first = self.key_pos.shape[1] == 0
        self.key_pos = torch.cat([self.key_pos, torch.where(real, positions, -1)], 1)
        for j, layer in enumerate(m.layers):
            x = self._attention(j, layer, x, real, first)
            h = layer.final_layer_norm(x) if cfg.do_layer_norm_before else x
            x = x + layer.fc2(torch.relu(layer.fc1(h)))
            if not cfg.do_layer_norm_before:
                x = layer.final_layer_norm(x)
        x = x[:, -1]
        if m.final_layer_norm is not None:
            x = m.final_layer_norm(x)
        if m.project_out is not None:
            x = m.project_out(x)
        return x @ self.lm_head.T

    def _attention(self, j, layer, x, real, first):
        cfg, att = self.cfg, layer.self_attn
        b, n, hidden = x.shape
        heads = cfg.num_attention_heads
        d = hidden // heads
        h = layer.self_attn_layer_norm(x) if cfg.do_layer_norm_before else x

        def split(t):
            return t.view(b, n, heads, d).transpose(1, 2)
        q, k, v = split(att.q_proj(h)), split(att.k_proj(h)), split(att.v_proj(h))
        self.keys[j] = torch.cat([self.keys[j], k], 2)
        self.values[j] = torch.cat([self.values[j], v], 2)
        new_kept = real[:, None, :].expand(b, heads, n)
        self.kept[j] = torch.cat([self.kept[j], new_kept], 2)
        self.score[j] = torch.cat([self.score[j], torch.zeros(b, heads, n)], 2)
        total = self.keys[j].shape[2]
        allowed = self.kept[j][:, :, None, :].expand(b, heads, n, total).clone()
        allowed &= torch.ones(n, total, dtype=torch.bool).tril(total - n)  # causal
        if first:  # a padding query row attends to itself only; its output is never used
            for row in range(b):
                for i in range(n):
                    if not real[row, i]:
                        allowed[row, :, i] = False
                        allowed[row, :, i, i] = True
        logits = (q @ self.keys[j].transpose(-1, -2)) * d ** -0.5
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        self.score[j] += (probs * real[:, None, :, None]).sum(2)
        out = (probs @ self.values[j]).transpose(1, 2).reshape(b, n, hidden)
        x = x + att.out_proj(out)
        if not cfg.do_layer_norm_before:
            x = layer.self_attn_layer_norm(x)
        self._evict(j)
        return x

    def _evict(self, j):
        kept, score, pos = self.kept[j], self.score[j], self.key_pos
        b, heads, total = kept.shape
        for row in range(b):
            heavy, recent = self.heavy[row], self.recent[row]
            for head in range(heads):
                held = [t for t in range(total) if kept[row, head, t]]
                if len(held) <= heavy + recent:
                    continue
                newest = max(int(pos[row, t]) for t in held)
                window = [t for t in held if pos[row, t] > newest - recent]
                # Highest score first; of equal scores the newer token first, so the older one goes.
                older = sorted((t for t in held if t not in window),
                               key=lambda t: (-float(score[row, head, t]), -int(pos[row, t])))
                keep = set(window) | set(older[: heavy])
                for t in held:
                    if t not in keep:
                        kept[row, head, t] = False
