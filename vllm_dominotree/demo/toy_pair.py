"""A small target / Domino drafter pair whose drafts are often right (tests, demo).

Random weights accept nothing, so acceptance paths (deep, sibling, partial, whole
block) need a pair built to agree:

- Target: a real Qwen3ForCausalLM whose MLPs write nothing to the residual stream
  (down_proj = 0) and whose attention writes `context` times a random projection
  (0 by default). With context 0 its next-token logits are lm_head(norm(embed(t))):
  a bigram model. lm_head row t' is beta * embed[pi^-1(t')] for a permutation pi, so the
  greedy successor of t is pi(t) and temperature sampling spreads over the others.
- Drafter: a Domino checkpoint in the released format. Its backbone rows are
  norm(embed(slot token)) plus small noise, so draft 0 (no correction, slot 0 = anchor)
  is the target's own prediction and deeper marginals say little. Its GRU keeps
  S ~ tanh(alpha * embed(last token)) (the update gate is shut through a constant
  embedding coordinate), and embed_proj = [B, -B] . SiLU . [I ; -I] is exactly
  B S because silu(u) - silu(-u) = u, with B = lm_head / alpha: the correction
  predicts the target's next token from the path. Gaussian noise of relative size
  `noise` on B sets how often the corrected top-1 is wrong (then the right token is
  usually a near sibling, which is what trees are for).

Token V-1 is the drafter's mask token and the EOS; the target never predicts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafter.checkpoint import DrafterSpec, default_target_layer_ids, write_checkpoint
from ..drafter.checkpoint import drafter_config as checkpoint_drafter_config
from ..drafter.model import DominoHead

CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,"


@dataclass(frozen=True)
class PairSpec:
    vocab: int = 64
    hidden: int = 64
    target_layers: int = 4
    draft_layers: int = 1
    block_size: int = 8
    beta: float = 0.06  # target sharpness: logit gap ~ beta * hidden between top-1 and rest
    alpha: float = 0.25  # GRU input scale (tanh stays near its linear range)
    noise: float = 0.3  # relative noise on the correction's output rows
    sharpness: float = 2.0  # scales the correction: the drafter's confidence, not its errors
    # Scale of the target's attention output. 0: a pure bigram (drafts are often right,
    # but wrong K/V or attention masks cannot change a token). 1.4: about a fifth of the
    # greedy tokens depend on the context, so tests see attention and KV-cache mistakes.
    context: float = 0.0
    backbone_noise: float = 0.02  # small weights in the drafter layers' output projections
    seed: int = 0


def _embeddings(spec: PairSpec, gen: torch.Generator) -> torch.Tensor:
    emb = torch.randn(spec.vocab, spec.hidden, generator=gen)
    emb[:, 0] = 1.0  # the constant coordinate that shuts the GRU's update gate
    return emb / emb.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1: the final norm keeps it


def _bigram_head(spec: PairSpec, emb: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """lm_head [V, H] of the bigram: row pi(t) = beta * emb[t] for a random permutation
    pi of 0..V-2. Row V-1 (mask / EOS) points away from every embedding (their constant
    coordinate is positive), so the target never ends a sequence by itself."""
    pi = torch.randperm(spec.vocab - 1, generator=gen)
    head = torch.zeros(spec.vocab, spec.hidden)
    head[pi] = spec.beta * emb[: spec.vocab - 1]
    head[spec.vocab - 1, 0] = -10.0
    return head


def target_config(spec: PairSpec) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": 2 * spec.hidden,
        "num_hidden_layers": spec.target_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": spec.hidden // 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": spec.vocab - 1,
        "eos_token_id": spec.vocab - 1,
        "attention_bias": False,
    }


def drafter_config(
    spec: PairSpec,
    *,
    domino: bool = True,
    block_size_in_dflash_config: bool = True,
    rope_parameters: bool = True,
    projector_name: str = "domino",
    shift_label: bool = True,
    explicit_layer_ids: bool = True,
) -> dict:
    """The toy drafter's config.json: the released layout (checkpoint.drafter_config),
    rewritten into any of the other layouts seen in the wild."""
    hidden = spec.hidden
    cfg = checkpoint_drafter_config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=spec.draft_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=hidden // 2,
        vocab_size=spec.vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        num_target_layers=spec.target_layers,
        block_size=spec.block_size,
        mask_token_id=spec.vocab - 1,
        target_layer_ids=default_target_layer_ids(spec.target_layers, spec.draft_layers),
        domino=domino,
        gru_hidden_dim=hidden,
        emb_dim=2 * hidden,
        shift_label=shift_label,
    )
    dflash = cfg["dflash_config"]
    if rope_parameters:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if not block_size_in_dflash_config:
        cfg["block_size"] = dflash.pop("block_size")
    if not explicit_layer_ids:
        del dflash["target_layer_ids"]
    if domino:
        dflash["projector_type"] = projector_name
        cfg["emb_dim"] = 2 * hidden
    return cfg


def target_tensors(spec: PairSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    emb = _embeddings(spec, gen)
    lm_head = _bigram_head(spec, emb, gen)
    context_gen = torch.Generator().manual_seed(spec.seed + 2)
    h, hd, inter = spec.hidden, spec.hidden // 2, 2 * spec.hidden
    tensors = {
        "model.embed_tokens.weight": emb,
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": lm_head,
    }
    for i in range(spec.target_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": 0.1 * torch.randn(2 * hd, h, generator=gen),
            p + "self_attn.k_proj.weight": 0.1 * torch.randn(hd, h, generator=gen),
            p + "self_attn.v_proj.weight": 0.1 * torch.randn(hd, h, generator=gen),
            p + "self_attn.o_proj.weight": spec.context
            * torch.randn(h, 2 * hd, generator=context_gen)
            / (2 * hd) ** 0.5,
            p + "self_attn.q_norm.weight": torch.ones(hd),
            p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": 0.1 * torch.randn(inter, h, generator=gen),
            p + "mlp.up_proj.weight": 0.1 * torch.randn(inter, h, generator=gen),
            p + "mlp.down_proj.weight": torch.zeros(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    return tensors


def drafter_tensors(spec: PairSpec, *, domino: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    emb = _embeddings(spec, gen)
    lm_head = _bigram_head(spec, emb, gen)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    h, hd, inter = spec.hidden, spec.hidden // 2, 2 * spec.hidden
    n_ctx = spec.draft_layers  # one context feature per target layer id
    eps = spec.backbone_noise
    tensors = {
        "fc.weight": torch.randn(h, n_ctx * h, generator=gen) / (n_ctx * h) ** 0.5,
        "hidden_norm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
    }
    for i in range(spec.draft_layers):
        p = f"layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": 0.2 * torch.randn(2 * hd, h, generator=gen),
            p + "self_attn.k_proj.weight": 0.2 * torch.randn(hd, h, generator=gen),
            p + "self_attn.v_proj.weight": 0.2 * torch.randn(hd, h, generator=gen),
            p + "self_attn.o_proj.weight": eps * torch.randn(h, 2 * hd, generator=gen),
            p + "self_attn.q_norm.weight": torch.ones(hd),
            p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": 0.2 * torch.randn(inter, h, generator=gen),
            p + "mlp.up_proj.weight": 0.2 * torch.randn(inter, h, generator=gen),
            p + "mlp.down_proj.weight": eps * torch.randn(h, inter, generator=gen),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    if domino:
        g = h
        w_ih = torch.zeros(3 * g, h)
        w_ih[g : 2 * g, 0] = -40.0  # update gate z = sigmoid(-40): the state is replaced
        w_ih[2 * g :] = spec.alpha * torch.eye(g)  # candidate n = tanh(alpha * x)
        rows = spec.sharpness * lm_head / spec.alpha
        rows = rows + spec.noise * rows.std() * torch.randn(rows.shape, generator=gen)
        eye = torch.eye(g)
        tensors |= {
            "prefix_gru.weight_ih_l0": w_ih,
            "prefix_gru.weight_hh_l0": torch.zeros(3 * g, g),
            "embed_proj.0.weight": torch.cat(
                [torch.zeros(2 * g, h), torch.cat([eye, -eye])], dim=1
            ),
            "embed_proj.2.weight": torch.cat([rows, -rows], dim=1),
        }
    return tensors


def write_tokenizer(path: Path, vocab: int) -> None:
    """A character-level tokenizer (one char per id, the last id is <eos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = list(CHARS[: vocab - 1])
    chars += [f"<t{i}>" for i in range(len(chars), vocab - 1)]
    table = {c: i for i, c in enumerate(chars)} | {"<eos>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "bos_token": "<eos>",
                "unk_token": "<eos>",
                "pad_token": "<eos>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                # Chat turns as "role content " (characters of the toy alphabet only, so
                # every character stays one token); the chat endpoints need a template.
                "chat_template": (
                    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                    "{% if add_generation_prompt %}assistant {% endif %}"
                ),
            }
        )
    )


def write_target(path: str | Path, spec: PairSpec) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path, target_config(spec), target_tensors(spec))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": spec.vocab - 1, "bos_token_id": spec.vocab - 1})
    )
    write_tokenizer(path, spec.vocab)
    return path


def write_drafter(path: str | Path, spec: PairSpec, **layout) -> Path:
    domino = layout.get("domino", True)
    return write_checkpoint(
        path, drafter_config(spec, **layout), drafter_tensors(spec, domino=domino)
    )


def write_pair(root: str | Path, spec: PairSpec = PairSpec()) -> tuple[Path, Path]:
    """Write target/ and drafter/ under root; returns their paths."""
    root = Path(root)
    return write_target(root / "target", spec), write_drafter(root / "drafter", spec)


def random_domino_head(
    *,
    hidden: int,
    vocab: int,
    gru_hidden: int,
    emb_dim: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> DominoHead:
    """A Domino head with random weights of the given shapes (Qwen3-4B's: hidden 2560,
    vocab 151936, GRU 1024, rank 256), made on the device: for cost measurements and
    graph-vs-eager checks, where weight values do not matter."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        fan_in = shape[-1]
        return (torch.randn(shape, generator=gen, device=device) / fan_in**0.5).to(dtype)

    tensors = {
        "prefix_gru.weight_ih_l0": rand(3 * gru_hidden, hidden),
        "prefix_gru.weight_hh_l0": rand(3 * gru_hidden, gru_hidden),
        "embed_proj.0.weight": rand(emb_dim, hidden + gru_hidden),
        "embed_proj.2.weight": 8 * rand(vocab, emb_dim),
    }
    spec = DrafterSpec(
        path=Path("<random>"),
        hidden_size=hidden,
        intermediate_size=0,
        num_layers=0,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        attention_bias=False,
        block_size=16,
        mask_token_id=0,
        target_layer_ids=(0,),
        num_target_layers=None,
        is_domino=True,
        gru_hidden_dim=gru_hidden,
        emb_dim=emb_dim,
        pure_draft_prefix_len=1,
        shift_label=True,
    )
    return DominoHead(spec, tensors)
