"""PyTorch parallel-block transformer: a DiffEqFormer materialised at M solver steps.

Each layer k is one Euler step of the ODE with its weights W(t_k) frozen (the step size is
already folded into the output projections), so the block is
``x + attn(norm_attn(x)) + mlp(norm_mlp(x))``. Shipped with ode-lm `hf` exports of the gpt2
and llama flavours and loaded with ``trust_remote_code=True``.

KV cache: transformers' ``Cache`` API (``DynamicCache``), one cache layer per vector-field
evaluation, as in ode-lm's own generation: a step of an S-stage solver evaluates f at S
states, each with its own keys/values, so M steps need M·S layers. The export is the Euler
materialisation (S = 1), so that is one cache layer per transformer layer. ``generate()``
passes the cache as ``cache`` (transformers 5) or ``past_key_values`` (4.x); both are
accepted, and the forward returns it under the output field the installed version has.
Positions count real tokens only (``attention_mask`` cumsum), so a left-padded row sees what
the same prompt sees unpadded.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_ode_lm import OdeLMConfig

# The output field generate() reads the cache back from: `cache` (5.x) / `past_key_values`.
_CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                else "past_key_values")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def make_norm(config: OdeLMConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.hidden_size, config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: OdeLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.use_rope = config.position_type == "rope"
        rot = int(self.head_dim * config.rotary_fraction)
        self.rotary_dim = rot - rot % 2
        self.rope_theta = config.rope_theta

    def rope(self, x, positions):
        d = self.rotary_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = positions.float()[..., None] * inv.to(x.device)  # [B, T, d/2]
        cos = torch.cat((ang, ang), -1).cos()[:, None]  # [B, 1, T, d]
        sin = torch.cat((ang, ang), -1).sin()[:, None]
        xr, xp = x[..., :d].float(), x[..., d:]
        xr = xr * cos + rotate_half(xr) * sin
        return torch.cat((xr.to(x.dtype), xp), dim=-1)

    def forward(self, x, positions, mask, cache=None):
        """mask [B, 1, T, past + T]; with a ``cache`` the new (rotated) keys/values are
        appended to this layer's and the queries attend over all of them."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # [B, H, T, Dh]
        if self.use_rope and self.rotary_dim > 0:
            q, k = self.rope(q, positions), self.rope(k, positions)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, config: OdeLMConfig):
        super().__init__()
        d, h, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.act = config.mlp_act
        self.up = nn.Linear(d, h, bias=bias)
        self.gate = nn.Linear(d, h, bias=bias) if self.act == "swiglu" else None
        self.down = nn.Linear(h, d, bias=bias)

    def forward(self, x):
        if self.act == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        approx = "tanh" if self.act == "gelu_tanh" else "none"
        return self.down(F.gelu(self.up(x), approximate=approx))


class ParallelBlock(nn.Module):
    def __init__(self, config: OdeLMConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.mlp_norm = make_norm(config)
        self.attn = Attention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, positions, mask, cache=None):
        a = self.attn(self.attn_norm(x), positions, mask, cache)
        return x + a + self.mlp(self.mlp_norm(x))


class OdeLMPreTrainedModel(PreTrainedModel):
    config_class = OdeLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["ParallelBlock"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class OdeLMModel(OdeLMPreTrainedModel):
    def __init__(self, config: OdeLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(ParallelBlock(config, i)
                                    for i in range(config.num_hidden_layers))
        self.final_norm = make_norm(config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        """input_ids [B, T] are the new tokens; ``attention_mask`` [B, past + T] covers the
        cached ones too (1 = real token, 0 = padding)."""
        b, t = input_ids.shape
        dev = input_ids.device
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(b, past + t, dtype=torch.long, device=dev)
        if position_ids is None:  # left padding: positions count real tokens only
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        q_idx = past + torch.arange(t, device=dev)[:, None]
        k_idx = torch.arange(past + t, device=dev)[None, :]
        valid = attention_mask.bool()[:, None, None, :]
        mask = (k_idx <= q_idx) & (valid | (k_idx == q_idx))  # a query always sees itself
        x = self.embed_tokens(input_ids)
        if self.config.position_type == "learned":
            x = x + self.embed_positions(position_ids)
        for layer in self.layers:
            x = layer(x, position_ids, mask, cache)
        return self.final_norm(x)


class OdeLMForCausalLM(OdeLMPreTrainedModel, GenerationMixin):
    def __init__(self, config: OdeLMConfig):
        super().__init__(config)
        self.model = OdeLMModel(config)
        if not config.tied_head:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                past_key_values=None, use_cache=None, labels=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True) and labels is None
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        elif not use_cache:
            cache = None
        h = self.model(input_ids, attention_mask, position_ids, cache)
        w = self.model.embed_tokens.weight if self.config.tied_head else self.lm_head.weight
        logits = torch.matmul(h, w.t()).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
