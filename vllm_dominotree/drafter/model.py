"""The DFlash backbone and Domino's correction head, in plain torch (no engine).

Backbone: Qwen3-style layers whose queries come only from the block
`[anchor, MASK x (B-1)]` and whose keys/values are the target's context features
(projected by each layer's own k/v) followed by the block itself. Attention inside
the block is not causal. One pass per round gives one hidden row per block slot.

Head (Domino only): a bias-free GRU over the target embeddings of the tokens drafted
so far, and `embed_proj = Linear(H+G -> E), SiLU, Linear(E -> V)` on `[h_i ; S]`,
added to the marginal logits `lm_head(h_i)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import DrafterSpec, load_tensors, read_spec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x: [..., T, heads, head_dim], positions: [..., T]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    )
    angles = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[..., None, :]  # [..., T, 1, head_dim]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass
class ContextKV:
    """The drafter's cache: per layer, the context keys (RoPE applied) and values.
    keys[i], values[i]: [..., T, kv_heads, head_dim] (training adds a batch dimension)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[-3] if self.keys else 0

    def append(self, other: ContextKV) -> None:
        for i in range(len(self.keys)):
            self.keys[i] = torch.cat([self.keys[i], other.keys[i]])
            self.values[i] = torch.cat([self.values[i], other.values[i]])


class DFlashBackbone(nn.Module):
    def __init__(self, spec: DrafterSpec, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.w = nn.ParameterDict(
            {
                name.replace(".", "__"): nn.Parameter(t, requires_grad=False)
                for name, t in tensors.items()
                if not name.startswith(("prefix_gru", "embed_proj"))
            }
        )

    def _p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "__")]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(f"{name}.bias".replace(".", "__"))
        return F.linear(x, self._p(f"{name}.weight"), bias)

    def _kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        s = self.spec
        p = f"layers.{layer}.self_attn."
        shape = (*x.shape[:-1], s.num_kv_heads, s.head_dim)
        k = self._linear(x, p + "k_proj").view(shape)
        k = rope(rms_norm(k, self._p(p + "k_norm.weight"), s.rms_norm_eps), positions, s.rope_theta)
        v = self._linear(x, p + "v_proj").view(shape)
        return k, v

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """features: [..., T, n_layers * H] (the target's hidden states at
        target_layer_ids, concatenated); positions: [..., T]. Returns the K/V every
        drafter layer attends to."""
        ctx = rms_norm(
            F.linear(features, self._p("fc.weight")),
            self._p("hidden_norm.weight"),
            self.spec.rms_norm_eps,
        )
        keys, values = [], []
        for i in range(self.spec.num_layers):
            k, v = self._kv(i, ctx, positions)
            keys.append(k)
            values.append(v)
        return ContextKV(keys, values)

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        context: ContextKV,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """block_embeds: [..., B, H] target embeddings of [anchor, MASK...] (one block, or
        several side by side when attn_mask keeps them apart); positions: [..., B];
        attn_mask: [..., B, T + B] boolean over context then block keys, None = all.
        Returns the final-normed hidden rows [..., B, H]."""
        s = self.spec
        x = block_embeds
        heads = (*x.shape[:-1], s.num_heads, s.head_dim)
        mask = None if attn_mask is None else attn_mask.unsqueeze(-3)  # broadcast over heads
        for i in range(s.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, self._p(p + "input_layernorm.weight"), s.rms_norm_eps)
            q = self._linear(h, p + "self_attn.q_proj").view(heads)
            q = rms_norm(q, self._p(p + "self_attn.q_norm.weight"), s.rms_norm_eps)
            q = rope(q, positions, s.rope_theta)
            k, v = self._kv(i, h, positions)
            k = torch.cat([context.keys[i], k], dim=-3).transpose(-3, -2)
            v = torch.cat([context.values[i], v], dim=-3).transpose(-3, -2)
            if mask is not None:  # masked SDPA kernels want equal head counts
                k = k.repeat_interleave(s.num_heads // s.num_kv_heads, dim=-3)
                v = v.repeat_interleave(s.num_heads // s.num_kv_heads, dim=-3)
            attn = F.scaled_dot_product_attention(
                q.transpose(-3, -2), k, v, attn_mask=mask, enable_gqa=mask is None
            )
            x = x + self._linear(attn.transpose(-3, -2).flatten(-2), p + "self_attn.o_proj")
            h = rms_norm(x, self._p(p + "post_attention_layernorm.weight"), s.rms_norm_eps)
            gate = self._linear(h, p + "mlp.gate_proj")
            up = self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(F.silu(gate) * up, p + "mlp.down_proj")
        return rms_norm(x, self._p("norm.weight"), s.rms_norm_eps)


class DominoHead(nn.Module):
    """Domino's GRU over drafted tokens and its low-rank correction of the marginals."""

    def __init__(self, spec: DrafterSpec, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.w_ih = nn.Parameter(tensors["prefix_gru.weight_ih_l0"], requires_grad=False)
        self.w_hh = nn.Parameter(tensors["prefix_gru.weight_hh_l0"], requires_grad=False)
        self.proj_in = nn.Parameter(tensors["embed_proj.0.weight"], requires_grad=False)
        self.proj_out = nn.Parameter(tensors["embed_proj.2.weight"], requires_grad=False)

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    def gru_step(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One torch.nn.GRU step (gate order r, z, n; no biases). x: [n, H], state: [n, G]."""
        gi = F.linear(x, self.w_ih)
        gh = F.linear(state, self.w_hh)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * state

    def initial_state(self, anchor_embeds: torch.Tensor) -> torch.Tensor:
        """GRU state after the anchor token. anchor_embeds: [n, H] -> [n, G]."""
        zeros = anchor_embeds.new_zeros(anchor_embeds.shape[0], self.spec.gru_hidden_dim)
        return self.gru_step(anchor_embeds, zeros)

    def split_proj_in(self) -> tuple[torch.Tensor, torch.Tensor]:
        """embed_proj.0 acting on [h ; S] = W_h h + W_s S: the two blocks [E, H], [E, G]."""
        return self.proj_in[:, : self.hidden_size], self.proj_in[:, self.hidden_size :]

    def correction(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary correction logits. hidden: [n, H], state: [n, G] -> [n, V]."""
        return F.linear(
            F.silu(F.linear(torch.cat([hidden, state], -1), self.proj_in)), self.proj_out
        )


class Drafter(nn.Module):
    """A loaded DFlash or Domino drafter: spec, backbone, and (Domino) head."""

    def __init__(self, spec: DrafterSpec, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.backbone = DFlashBackbone(spec, tensors)
        self.head = DominoHead(spec, tensors) if spec.is_domino else None

    @classmethod
    def load(
        cls,
        path: str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Drafter:
        spec = read_spec(path)
        tensors = {k: v.to(device=device, dtype=dtype) for k, v in load_tensors(spec).items()}
        return cls(spec, tensors).eval()

    def block_hidden(
        self,
        anchor_embed: torch.Tensor,
        mask_embed: torch.Tensor,
        start: int,
        context: ContextKV,
    ) -> torch.Tensor:
        """Run the block for one round: anchor at position `start`, masks after it.
        Returns the hidden rows that predict drafts 0..K-1: [K, H]."""
        b = self.spec.block_size
        embeds = torch.cat([anchor_embed[None], mask_embed[None].expand(b - 1, -1)])
        positions = torch.arange(start, start + b, device=embeds.device)
        hidden = self.backbone(embeds, positions, context)
        return hidden[self.spec.first_draft_slot :]
