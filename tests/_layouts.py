"""One pre-norm Llama/GPT block, written in several layouts with the same arithmetic: flat (one
``forward``), attention/MLP submodules with HF-style or torchtitan-style names, fused q/k/v and
gate/up projections split or chunked as nanoGPT writes them; bias on or off, SwiGLU or GELU,
dense or MoE MLP. Every layout holds the same parameter values (``load``), so gradients compare
across layouts too."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, HIDDEN, EXPERTS, TOP_K = 64, 4, 128, 4, 2
LAYOUTS = ("hf", "titan", "flat", "fused", "flat_fused", "nanogpt")


def _act(x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(x) if gate is None else F.silu(gate) * x


def _attention(q, k, v):
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, DIM)


def _route(x, router):
    """Top-k softmax routing over ``EXPERTS`` experts: (weights, chosen expert per token)."""
    probs = F.softmax(router(x), dim=-1)
    weight, chosen = probs.topk(TOP_K, dim=-1)
    return weight, chosen


def _moe(tokens, router, w_in, w_out, swiglu):
    """Routed experts as batched GEMMs over every token (a dense dispatch: each expert sees all
    tokens, weighted by its routing weight or 0), the shape torchtitan's and HF's batched experts
    take when capacity is the token count."""
    weight, chosen = _route(tokens, router)
    dense = torch.zeros(tokens.shape[0], EXPERTS, dtype=tokens.dtype).scatter(1, chosen, weight)
    h = torch.bmm(tokens.unsqueeze(0).expand(EXPERTS, -1, -1), w_in)
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    out = torch.bmm(h, w_out)  # (E, T, D)
    return (out * dense.t().unsqueeze(-1)).sum(0)


class _Experts(nn.Module):
    def __init__(self, swiglu):
        super().__init__()
        self.swiglu = swiglu
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN * (2 if swiglu else 1)) * DIM ** -0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN ** -0.5)


class _MLP(nn.Module):
    def __init__(self, names, swiglu, bias, fused):
        super().__init__()
        gate, up, down = names
        self.names, self.swiglu, self.fused = names, swiglu, fused
        if fused and swiglu:
            setattr(self, gate + up, nn.Linear(DIM, 2 * HIDDEN, bias=bias))
        else:
            if swiglu:
                setattr(self, gate, nn.Linear(DIM, HIDDEN, bias=bias))
            setattr(self, up, nn.Linear(DIM, HIDDEN, bias=bias))
        setattr(self, down, nn.Linear(HIDDEN, DIM, bias=bias))

    def forward(self, x):
        gate, up, down = self.names
        if self.fused and self.swiglu:
            g, u = getattr(self, gate + up)(x).chunk(2, dim=-1)
        else:
            g = getattr(self, gate)(x) if self.swiglu else None
            u = getattr(self, up)(x)
        return getattr(self, down)(_act(u, g))


class _MoE(nn.Module):
    def __init__(self, swiglu):
        super().__init__()
        self.swiglu = swiglu
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = _Experts(swiglu)

    def forward(self, x):
        b, s, d = x.shape
        return _moe(x.reshape(b * s, d), self.gate, self.experts.w_in, self.experts.w_out,
                    self.swiglu).view(b, s, d)


class _Attention(nn.Module):
    def __init__(self, names, bias, fused):
        super().__init__()
        self.names, self.fused = names, fused
        q, k, v, o = names
        if fused:
            setattr(self, q + k + v, nn.Linear(DIM, 3 * DIM, bias=bias))
        else:
            for n in (q, k, v):
                setattr(self, n, nn.Linear(DIM, DIM, bias=bias))
        setattr(self, o, nn.Linear(DIM, DIM, bias=bias))

    def forward(self, x):
        q, k, v, o = self.names
        if self.fused:
            qkv = getattr(self, q + k + v)(x).split(DIM, dim=-1)
        else:
            qkv = [getattr(self, n)(x) for n in (q, k, v)]
        return getattr(self, o)(_attention(*qkv))


_NAMES = {  # norms, attention, mlp; attention projections; MLP projections
    "hf": (("input_layernorm", "post_attention_layernorm"), "self_attn", "mlp",
           ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")),
    "titan": (("attention_norm", "ffn_norm"), "attention", "feed_forward",
              ("wq", "wk", "wv", "wo"), ("w1", "w3", "w2")),
    # fused only: c_attn = q + k + v, c_fc = gate + up
    "nanogpt": (("ln_1", "ln_2"), "attn", "mlp", ("c_attn", "", "", "c_proj"), ("c_fc", "", "c_proj")),
}


class Normalize(nn.Module):
    """A norm module whose class and attribute names say nothing of a norm (``ln_1``)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.weight = nn.Parameter(torch.ones(DIM))
        self.bias = nn.Parameter(torch.zeros(DIM)) if norm == "layer" else None

    def forward(self, x):
        if self.norm == "rms":
            return F.rms_norm(x, (DIM,), self.weight)
        return F.layer_norm(x, (DIM,), self.weight, self.bias, 1e-5)


class SubmoduleBlock(nn.Module):
    """Attention and MLP as submodules (``hf`` or ``titan`` names); ``fused``: one q/k/v and one
    gate/up projection."""

    def __init__(self, style="hf", *, swiglu=True, bias=False, moe=False, fused=False, norm="rms"):
        super().__init__()
        norms, attn, mlp, attn_names, mlp_names = _NAMES[style]
        self.names = norms, attn, mlp
        kind = nn.RMSNorm if norm == "rms" else nn.LayerNorm
        for n in norms:
            setattr(self, n, Normalize(norm) if style == "nanogpt" else kind(DIM))
        setattr(self, attn, _Attention(attn_names, bias, fused))
        setattr(self, mlp, _MoE(swiglu) if moe else _MLP(mlp_names, swiglu, bias, fused))

    def forward(self, x):
        (n1, n2), attn, mlp = self.names
        x = x + getattr(self, attn)(getattr(self, n1)(x))
        return x + getattr(self, mlp)(getattr(self, n2)(x))


class FlatBlock(nn.Module):
    """The same block in one ``forward``: only Linears (and the experts' weights) as submodules,
    the norms as functions of their weights (``F.rms_norm``/``F.layer_norm``), as users write
    their own blocks; ``fused``: ``c_attn`` and ``c_fc`` as nanoGPT names them."""

    def __init__(self, *, swiglu=True, bias=False, moe=False, fused=False, norm="rms"):
        super().__init__()
        self.swiglu, self.moe, self.fused, self.norm = swiglu, moe, fused, norm
        self.ln_1 = nn.Parameter(torch.ones(DIM))
        self.ln_2 = nn.Parameter(torch.ones(DIM))
        if norm == "layer":
            self.ln_1_b = nn.Parameter(torch.zeros(DIM))
            self.ln_2_b = nn.Parameter(torch.zeros(DIM))
        if fused:
            self.c_attn = nn.Linear(DIM, 3 * DIM, bias=bias)
        else:
            self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=bias) for _ in range(3))
        self.c_proj = nn.Linear(DIM, DIM, bias=bias)
        if moe:
            self.router = nn.Linear(DIM, EXPERTS, bias=False)
            self.experts = _Experts(swiglu)
        else:
            if fused and swiglu:
                self.c_fc = nn.Linear(DIM, 2 * HIDDEN, bias=bias)
            else:
                if swiglu:
                    self.gate = nn.Linear(DIM, HIDDEN, bias=bias)
                self.up = nn.Linear(DIM, HIDDEN, bias=bias)
            self.down = nn.Linear(HIDDEN, DIM, bias=bias)

    def _norm(self, x, i):
        w = getattr(self, f"ln_{i}")
        if self.norm == "rms":
            return F.rms_norm(x, (DIM,), w, None)
        return F.layer_norm(x, (DIM,), w, getattr(self, f"ln_{i}_b"), 1e-5)

    def forward(self, x):
        h = self._norm(x, 1)
        qkv = self.c_attn(h).split(DIM, dim=-1) if self.fused else (self.q(h), self.k(h), self.v(h))
        x = x + self.c_proj(_attention(*qkv))
        h = self._norm(x, 2)
        if self.moe:
            b, s, d = h.shape
            return x + _moe(h.reshape(b * s, d), self.router, self.experts.w_in,
                            self.experts.w_out, self.swiglu).view(b, s, d)
        if self.fused and self.swiglu:
            g, u = self.c_fc(h).chunk(2, dim=-1)
        else:
            g = self.gate(h) if self.swiglu else None
            u = self.up(h)
        return x + self.down(_act(u, g))


def build(layout, *, swiglu=True, bias=False, moe=False, norm="rms", seed=0):
    """The block in ``layout`` with the parameters drawn for seed ``seed`` (the same values in
    every layout: fused weights are the concatenation of the split ones)."""
    torch.manual_seed(seed)
    ref = SubmoduleBlock("hf", swiglu=swiglu, bias=bias, moe=moe, norm=norm)
    if layout in ("hf", "titan", "fused", "nanogpt"):
        model = SubmoduleBlock("hf" if layout == "fused" else layout, swiglu=swiglu, bias=bias,
                               moe=moe, fused=layout in ("fused", "nanogpt"), norm=norm)
    else:
        model = FlatBlock(swiglu=swiglu, bias=bias, moe=moe, fused=layout == "flat_fused", norm=norm)
    load(model, ref)
    return model


def _values(ref):
    """The reference block's parameters by role."""
    a, m = ref.self_attn, ref.mlp
    out = {"n1": [ref.input_layernorm.weight], "n2": [ref.post_attention_layernorm.weight]}
    if getattr(ref.input_layernorm, "bias", None) is not None:
        out["n1"].append(ref.input_layernorm.bias)
        out["n2"].append(ref.post_attention_layernorm.bias)
    out.update(q=a.q_proj, k=a.k_proj, v=a.v_proj, o=a.o_proj)
    if isinstance(m, _MoE):
        out.update(router=m.gate.weight, w_in=m.experts.w_in, w_out=m.experts.w_out)
    else:
        out.update(gate=getattr(m, "gate_proj", None), up=m.up_proj, down=m.down_proj)
    return out


@torch.no_grad()
def _copy(dst: nn.Linear, *srcs: nn.Linear) -> None:
    dst.weight.copy_(torch.cat([s.weight for s in srcs]))
    if dst.bias is not None:
        dst.bias.copy_(torch.cat([s.bias for s in srcs]))


@torch.no_grad()
def load(model: nn.Module, ref: SubmoduleBlock) -> None:
    r = _values(ref)
    if isinstance(model, SubmoduleBlock):
        (n1, n2), attn, mlp = (getattr(model, n) if isinstance(n, str) else [getattr(model, x) for x in n]
                               for n in model.names)
        for norm, vals in ((n1, r["n1"]), (n2, r["n2"])):  # nn.RMSNorm: no bias
            norm.weight.copy_(vals[0])
            if len(vals) > 1:
                norm.bias.copy_(vals[1])
        q, k, v, o = attn.names
        if attn.fused:
            _copy(getattr(attn, q + k + v), r["q"], r["k"], r["v"])
        else:
            for n, role in zip((q, k, v), "qkv"):
                _copy(getattr(attn, n), r[role])
        _copy(getattr(attn, o), r["o"])
        if isinstance(mlp, _MoE):
            mlp.gate.weight.copy_(r["router"])
            mlp.experts.w_in.copy_(r["w_in"])
            mlp.experts.w_out.copy_(r["w_out"])
            return
        gate, up, down = mlp.names
        if mlp.fused and mlp.swiglu:
            _copy(getattr(mlp, gate + up), r["gate"], r["up"])
        else:
            if mlp.swiglu:
                _copy(getattr(mlp, gate), r["gate"])
            _copy(getattr(mlp, up), r["up"])
        _copy(getattr(mlp, down), r["down"])
        return
    model.ln_1.copy_(r["n1"][0])
    model.ln_2.copy_(r["n2"][0])
    if model.norm == "layer":
        model.ln_1_b.copy_(r["n1"][1])
        model.ln_2_b.copy_(r["n2"][1])
    if model.fused:
        _copy(model.c_attn, r["q"], r["k"], r["v"])
    else:
        for n in "qkv":
            _copy(getattr(model, n), r[n])
    _copy(model.c_proj, r["o"])
    if model.moe:
        model.router.weight.copy_(r["router"])
        model.experts.w_in.copy_(r["w_in"])
        model.experts.w_out.copy_(r["w_out"])
        return
    if model.fused and model.swiglu:
        _copy(model.c_fc, r["gate"], r["up"])
    else:
        if model.swiglu:
            _copy(model.gate, r["gate"])
        _copy(model.up, r["up"])
    _copy(model.down, r["down"])
