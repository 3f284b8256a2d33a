"""The seed paper's appendix module (Fig. code, Variant 3), restated for comparison.

It follows the published listing step by step (gate, ε-squeeze, offset loop with gather, log-prior,
−inf mask, one softmax) so that tests can check `piattn` against the paper's own definition and load its
state dict. Nothing in piattn imports this file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AppendixPiAttention(nn.Module):
    def __init__(self, d, h, k=4, pi=16, causal=True):
        super().__init__()
        self.k, self.pi, self.h, self.causal = k, pi, h, causal
        self.scale = (d // h) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.gate = nn.Sequential(nn.Linear(d, d // 2), nn.GELU(), nn.Linear(d // 2, h), nn.Sigmoid())
        self.eps = 1e-4

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = self.gate(x).permute(0, 2, 1) * (1 - 2 * self.eps) + self.eps
        y = self.union(q, k, v, a)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))

    def union(self, q, k, v, a):
        B, H, T, dh = q.shape
        idx = torch.arange(T, device=q.device)
        offs = list(range(-self.k, 1)) if self.causal else list(range(-self.k, self.k + 1))
        for o in [-self.pi] if self.causal else [-self.pi, self.pi]:
            if o not in offs:
                offs.append(o)
        logits, vals = [], []
        for o in offs:
            raw = idx + o
            valid = (raw >= 0) & (raw < T)
            g = raw.clamp(0, T - 1).view(1, 1, T, 1).expand(B, H, T, dh)
            kg, vg = torch.gather(k, 2, g), torch.gather(v, 2, g)
            s = (q * kg).sum(-1) * self.scale
            prior = a if abs(o) <= self.k else 1 - a
            s = s + prior.clamp_min(self.eps).log()
            logits.append(s.masked_fill(~valid, float("-inf")))
            vals.append(vg)
        w = F.softmax(torch.stack(logits, -1), -1)
        return (w.unsqueeze(-1) * torch.stack(vals, -2)).sum(-2)
