"""Train a Domino drafter for a Hugging Face target, in resumable time-boxed chunks.

    python -m vllm_dominotree.training --target DIR --data FILE.jsonl --out DIR \\
        [--minutes 10] [--block-size 8] [--draft-layers 1]

Data: JSONL lines {"tokens": [...], "prompt_len": n}: a prompt and the target's own
response to it (self-distillation). Every run continues from `out/` if it holds a
checkpoint, trains until the time box ends, and leaves
  out/drafter/   the drafter in the released DFlash/Domino format (shards <= 16 MiB),
  out/state/     optimizer state (shards <= 16 MiB) and progress.json,
so a chunk may end anywhere and the next one (on a fresh machine) picks up there.

The objective (per anchor position p in a response, K = block_size drafts with
shift_label): block [x_p, MASK...] over the target's context features of x_0..x_{p-1};
slot i's hidden row h_i predicts x_{p+1+i}. Loss = cross-entropy of the marginals
lm_head(h_i) plus cross-entropy of Domino's corrected logits
lm_head(h_i) + embed_proj([h_i ; S_i]) for i >= pure_draft_prefix_len, where S_i is the
GRU state after the true tokens x_p .. x_{p+i} (teacher forcing), as the chain decoder
and the tree builder use it. The target (embedding, lm_head) stays frozen.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from .drafter.checkpoint import (
    default_target_layer_ids,
    read_shards,
    write_checkpoint,
    write_shards,
)
from .drafter.model import ContextKV, Drafter

MAX_FILE_BYTES = 16 * 1024 * 1024


def drafter_config(target_config, *, block_size: int, layers: int, gru: int, emb: int,
                   mask_token_id: int) -> dict:  # fmt: skip
    """A released-format Domino config for this target (Qwen3-style drafter layers of
    the target's attention shape)."""
    t = target_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": t.vocab_size,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": float(getattr(t, "rope_theta", None) or 10000.0),
        "num_target_layers": t.num_hidden_layers,
        "layer_types": ["full_attention"] * layers,
        "torch_dtype": "float32",
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": default_target_layer_ids(t.num_hidden_layers, layers),
            "projector_type": "domino",
            "gru_hidden_dim": gru,
            "emb_dim": emb,
            "pure_draft_prefix_len": 1,
            "shift_label": True,
        },
    }


def initial_tensors(config: dict, target, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Drafter layers start as copies of the target's last layers (the q/k norms, which
    a Llama target lacks, as ones); fc, GRU and correction start small and random."""
    h, n, v = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    g, e = config["dflash_config"]["gru_hidden_dim"], config["dflash_config"]["emb_dim"]
    ids = config["dflash_config"]["target_layer_ids"]
    target_state = target.state_dict()
    num_target = config["num_target_layers"]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(shape, generator=generator) / shape[-1] ** 0.5

    tensors = {
        "fc.weight": rand(h, len(ids) * h),
        "hidden_norm.weight": torch.ones(h),
        "norm.weight": target_state["model.norm.weight"].float().clone(),
        "prefix_gru.weight_ih_l0": rand(3 * g, h),
        "prefix_gru.weight_hh_l0": rand(3 * g, g),
        "embed_proj.0.weight": rand(e, h + g),
        "embed_proj.2.weight": torch.zeros(v, e),  # the correction starts at zero
    }
    for i in range(n):
        source = f"model.layers.{num_target - n + i}."
        for name, tensor in target_state.items():
            if name.startswith(source) and "rotary" not in name:
                tensors[f"layers.{i}." + name[len(source) :]] = tensor.float().clone()
        head_dim = config["head_dim"]
        for norm in ("q_norm", "k_norm"):
            tensors.setdefault(f"layers.{i}.self_attn.{norm}.weight", torch.ones(head_dim))
    return tensors


def load_sequences(path: Path) -> list[tuple[list[int], int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["tokens"], r["prompt_len"]) for r in rows]


class Trainer:
    def __init__(self, target_dir: Path, out: Path, *, block_size: int, layers: int, gru: int,
                 emb: int, lr: float, seed: int, device: str):  # fmt: skip
        self.device = torch.device(device)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        self.target.to(self.device).eval().requires_grad_(False)
        self.embed = self.target.get_input_embeddings().weight
        self.lm_head = self.target.get_output_embeddings()
        self.out = out
        self.progress = {"step": 0, "seconds": 0.0, "losses": []}
        drafter_dir, state_dir = out / "drafter", out / "state"
        if not (state_dir / "progress.json").is_file():
            cfg = self.target.config
            mask = cfg.vocab_size - 1 if cfg.eos_token_id is None else _first(cfg.eos_token_id)
            config = drafter_config(cfg, block_size=block_size, layers=layers, gru=gru, emb=emb,
                                    mask_token_id=mask)  # fmt: skip
            tensors = initial_tensors(config, self.target, torch.Generator().manual_seed(seed))
            write_checkpoint(drafter_dir, config, tensors, max_shard_bytes=MAX_FILE_BYTES)
        self.drafter = Drafter.load(str(drafter_dir), device=self.device).requires_grad_(True)
        self.spec = self.drafter.spec
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=lr, weight_decay=0.0)
        if (state_dir / "progress.json").is_file():
            self._load_state(state_dir)
        self.rng = random.Random(seed + self.progress["step"])

    def _features(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.target(tokens[None], output_hidden_states=True).hidden_states
        return torch.cat([hidden[i + 1][0] for i in self.spec.target_layer_ids], dim=-1)

    def loss(self, tokens: list[int], prompt_len: int, anchors: int) -> torch.Tensor | None:
        k = self.spec.num_drafts
        first = max(prompt_len - 1, 1)
        last = len(tokens) - k - 1
        if last < first:
            return None
        ids = torch.tensor(tokens, device=self.device)
        context = self.drafter.backbone.context_kv(
            self._features(ids), torch.arange(len(tokens), device=self.device)
        )
        head = self.drafter.head
        mask = self.embed[self.spec.mask_token_id]
        losses = []
        for p in self.rng.sample(range(first, last + 1), min(anchors, last - first + 1)):
            prefix = ContextKV([c[:p] for c in context.keys], [c[:p] for c in context.values])
            rows = self.drafter.block_hidden(self.embed[ids[p]], mask, p, prefix)
            labels = ids[p + 1 : p + 1 + k]
            base = self.lm_head(rows)  # [K, V]
            losses.append(F.cross_entropy(base, labels))
            # GRU states after x_p .. x_{p+i}, i = 0 .. K-1 (teacher forcing).
            state = head.initial_state(self.embed[ids[p]][None])
            states = [state]
            for i in range(1, k):
                state = head.gru_step(self.embed[ids[p + i]][None], state)
                states.append(state)
            corrected = base + head.correction(rows, torch.cat(states))
            start = self.spec.pure_draft_prefix_len
            losses.append(F.cross_entropy(corrected[start:], labels[start:]))
        return torch.stack(losses).mean()

    def train(self, sequences, *, minutes: float, anchors: int, max_steps: int | None = None):
        deadline = time.monotonic() + 60 * minutes
        started = time.monotonic()
        done = 0
        while time.monotonic() < deadline and (max_steps is None or done < max_steps):
            tokens, prompt_len = sequences[self.progress["step"] % len(sequences)]
            loss = self.loss(tokens, prompt_len, anchors)
            self.progress["step"] += 1
            done += 1
            if loss is None:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
            self.optimizer.step()
            self.progress["losses"].append(round(loss.item(), 4))
        self.progress["seconds"] += time.monotonic() - started
        self.save()
        return self.progress

    def save(self) -> None:
        """The drafter (released format) and the optimizer state, in files <= 16 MiB."""
        config = json.loads((self.out / "drafter" / "config.json").read_text())
        names = list(self.spec.expected_shapes())
        params = _named_parameters(self.drafter)
        write_checkpoint(self.out / "drafter", config,
                         {n: params[n].detach().cpu() for n in names},
                         max_shard_bytes=MAX_FILE_BYTES)  # fmt: skip
        state_dir = self.out / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        optimizer = self.optimizer.state_dict()
        tensors = {
            f"{index}.{key}": value.cpu()
            for index, entry in optimizer["state"].items()
            for key, value in entry.items()
        }
        if tensors:
            write_shards(state_dir, "optimizer", tensors, MAX_FILE_BYTES)
        (state_dir / "progress.json").write_text(json.dumps(self.progress))

    def _load_state(self, state_dir: Path) -> None:
        self.progress = json.loads((state_dir / "progress.json").read_text())
        if not (state_dir / "optimizer.safetensors.index.json").is_file():
            return
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in read_shards(state_dir, "optimizer").items():
            index, key = name.split(".", 1)
            state.setdefault(int(index), {})[key] = tensor.to(self.device)
        saved = self.optimizer.state_dict()
        saved["state"] = state
        self.optimizer.load_state_dict(saved)


def _first(value) -> int:
    return value[0] if isinstance(value, list) else value


def _named_parameters(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Checkpoint name -> parameter (the backbone stores names with '.' as '__')."""
    out = {name.replace("__", "."): p for name, p in drafter.backbone.w.items()}
    head = drafter.head
    out |= {
        "prefix_gru.weight_ih_l0": head.w_ih,
        "prefix_gru.weight_hh_l0": head.w_hh,
        "embed_proj.0.weight": head.proj_in,
        "embed_proj.2.weight": head.proj_out,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--gru", type=int, default=256)
    parser.add_argument("--emb", type=int, default=128)
    parser.add_argument("--anchors", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    trainer = Trainer(args.target, args.out, block_size=args.block_size, layers=args.draft_layers,
                      gru=args.gru, emb=args.emb, lr=args.lr, seed=args.seed,
                      device=args.device)  # fmt: skip
    progress = trainer.train(load_sequences(args.data), minutes=args.minutes, anchors=args.anchors,
                             max_steps=args.max_steps)  # fmt: skip
    recent = progress["losses"][-50:]
    print(json.dumps({"step": progress["step"], "seconds": round(progress["seconds"], 1),
                      "recent_loss": sum(recent) / max(1, len(recent))}))  # fmt: skip


if __name__ == "__main__":
    main()
