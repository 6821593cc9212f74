"""Train a Domino drafter for a Hugging Face target, in resumable time-boxed chunks.

    python -m vllm_dominotree.training --target DIR --data FILE.jsonl --out DIR \\
        [--minutes 10] [--block-size 16] [--draft-layers 1] [--target-layers 4]

Data: JSONL lines {"tokens": [...], "prompt_len": n}: a prompt and the target's own
response to it (self-distillation). Every run continues from `out/` if it holds a
checkpoint, trains until the time box ends, and leaves
  out/drafter/   the drafter in the released DFlash/Domino format, float32,
  out/state/     Adam's moments (bfloat16) and progress.json,
every file <= 16 MiB, so a chunk may end anywhere and the next one (on a fresh machine)
picks up there. `--export DIR` writes the drafter in bfloat16 for shipping.
`--init-from DIR` starts a new run from a released Domino drafter's weights instead of
a fresh one (its architecture, Adam's moments from zero, the warm-up again): a machine
that has lost the run's state continues from the shipped drafter; with `--draft-layers`
above its own it continues deeper (the new layers start as no-ops).

The objective (per anchor position p in a response, K = block_size drafts with
shift_label): block [x_p, MASK...] over the target's context features of x_0..x_{p-1};
draft row i predicts x_{p+1+i}. Loss = cross-entropy of the marginals lm_head(h_i) plus
cross-entropy of Domino's corrected logits lm_head(h_i) + embed_proj([h_i ; S_i]) for
i >= pure_draft_prefix_len, where S_i is the GRU state after the true tokens
x_p .. x_{p+i} (teacher forcing), as the chain decoder and the tree builder use it.
Row i's terms weigh exp(-i / decay): deep drafts are rarely reached, so early rows
matter most. A step trains many anchors of many sequences at once: the blocks sit side
by side under one attention mask (context before each anchor, its own block).
The target (embedding, lm_head) stays frozen.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from ..drafter import checkpoint
from ..drafter.checkpoint import (
    default_target_layer_ids,
    load_tensors,
    read_shards,
    read_spec,
    write_checkpoint,
    write_shards,
)
from ..drafter.model import Drafter

MAX_FILE_BYTES = 16 * 1024 * 1024


def drafter_config(
    target_config,
    *,
    block_size: int,
    layers: int,
    target_layers: int,
    gru: int,
    emb: int,
    mask_token_id: int,
) -> dict:
    """A released-format Domino config for this target (Qwen3-style drafter layers of
    the target's attention shape)."""
    t = target_config
    return checkpoint.drafter_config(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=layers,
        num_heads=t.num_attention_heads,
        num_kv_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        vocab_size=t.vocab_size,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=_target_rope_theta(t),
        num_target_layers=t.num_hidden_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=default_target_layer_ids(t.num_hidden_layers, target_layers),
        gru_hidden_dim=gru,
        emb_dim=emb,
    )


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


def released_start(
    drafter_dir: Path, target_config, layers: int | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """A released Domino drafter's config and float32 tensors, as a new run's start; it
    must be a drafter of this target (hidden size, vocabulary, layer count). `layers`
    above the drafter's own grows it (`grown`); None keeps its depth."""
    spec = read_spec(drafter_dir)
    if not spec.is_domino:
        raise ValueError(
            f"--init-from {drafter_dir}: a plain DFlash checkpoint; training needs a Domino "
            "drafter (dflash_config.projector_type 'domino')"
        )
    t = target_config
    theirs = (spec.hidden_size, spec.vocab_size, spec.num_target_layers)
    ours = (t.hidden_size, t.vocab_size, t.num_hidden_layers)
    if theirs != ours:
        raise ValueError(
            f"--init-from {drafter_dir}: a drafter for another target (hidden size, "
            f"vocabulary, layers {theirs}; this target's {ours})"
        )
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    config["torch_dtype"] = "float32"
    tensors = {n: t.float() for n, t in load_tensors(spec).items()}
    if layers is None or layers == spec.num_layers:
        return config, tensors
    if layers < spec.num_layers:
        raise ValueError(
            f"--draft-layers {layers} with --init-from {drafter_dir}: that drafter has "
            f"{spec.num_layers} layers; a run can add layers to it, not drop them (leave "
            "--draft-layers out to keep its depth)"
        )
    return grown(config, tensors, layers)


def grown(
    config: dict, tensors: dict[str, torch.Tensor], layers: int
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The drafter deepened to `layers`, computing exactly what it computed before: each
    new layer is a copy of its last one whose two residual branches write nothing (o_proj
    and down_proj zero), so training starts from the drafter's accuracy and the new
    layers learn what they add (the zeroed projections get gradients at once, the rest
    from the first step on)."""
    last = config["num_hidden_layers"] - 1
    source = f"layers.{last}."
    tensors = dict(tensors)
    for i in range(last + 1, layers):
        for name, tensor in list(tensors.items()):
            if name.startswith(source):
                tensors[f"layers.{i}." + name[len(source) :]] = tensor.clone()
        for silent in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            tensors[f"layers.{i}.{silent}"].zero_()
    config = dict(config, num_hidden_layers=layers)
    if "layer_types" in config:
        config["layer_types"] = list(config["layer_types"]) + [config["layer_types"][-1]] * (
            layers - 1 - last
        )
    return config, tensors


def load_sequences(path: Path) -> list[tuple[list[int], int]]:
    """(tokens, prompt_len) of every line of a JSONL file (xz-compressed when named .xz)."""
    text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["tokens"], r["prompt_len"]) for r in rows]


@dataclass
class Batch:
    """Sequences and the anchors trained in one step."""

    tokens: torch.Tensor  # [B, L], right-padded with 0
    lengths: torch.Tensor  # [B]
    anchors: torch.Tensor  # [B, A] anchor positions p (0 where unused)
    valid: torch.Tensor  # [B, A] bool


def make_batch(
    sequences: list[tuple[list[int], int]],
    num_drafts: int,
    anchors: int,
    max_len: int,
    rng: random.Random,
) -> Batch:
    """Up to `anchors` distinct anchor positions per sequence, each in the response and
    with all num_drafts labels inside the sequence."""
    rows = [tokens[:max_len] for tokens, _ in sequences]
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    points = torch.zeros(len(rows), anchors, dtype=torch.long)
    valid = torch.zeros(len(rows), anchors, dtype=torch.bool)
    for b, (row, (_, prompt_len)) in enumerate(zip(rows, sequences, strict=True)):
        tokens[b, : len(row)] = torch.tensor(row)
        first, last = max(prompt_len - 1, 1), len(row) - num_drafts - 1
        if last >= first:
            chosen = rng.sample(range(first, last + 1), min(anchors, last - first + 1))
            points[b, : len(chosen)] = torch.tensor(chosen)
            valid[b, : len(chosen)] = True
    lengths = torch.tensor([len(r) for r in rows])
    return Batch(tokens, lengths, points, valid)


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """anchors: [B, A] -> [B, A*bs, L + A*bs] boolean: a block's rows see the context
    before its anchor and the whole of their own block, nothing of the other blocks."""
    b, a = anchors.shape
    device = anchors.device
    context = torch.arange(context_len, device=device) < anchors[..., None]  # [B, A, L]
    context = context.repeat_interleave(block_size, dim=1)
    own = torch.eye(a, dtype=torch.bool, device=device).repeat_interleave(block_size, 0)
    own = own.repeat_interleave(block_size, 1).expand(b, -1, -1)
    return torch.cat([context, own], dim=-1)


@dataclass
class BlockLogits:
    """The drafter's predictions for a batch's blocks, each row against its label."""

    base: torch.Tensor  # [B, A, K, V] the marginals lm_head(h_i)
    corrected: torch.Tensor  # [B, A, K, V] Domino's corrected logits (rows < prefix: base)
    labels: torch.Tensor  # [B, A, K] x_{p+1+i}


def target_features(target, layer_ids, tokens: torch.Tensor, lengths: torch.Tensor):
    """tokens: [B, L] -> the target's hidden states at layer_ids: [B, L, n*H]."""
    attention = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
    with torch.no_grad():
        hidden = target(tokens, attention_mask=attention.long(), output_hidden_states=True)
    return torch.cat([hidden.hidden_states[i + 1] for i in layer_ids], dim=-1)


def block_hidden(
    target, drafter: Drafter, batch: Batch, device: torch.device, features=None
) -> torch.Tensor:
    """Every anchor's block from the target's features before it: the drafter's
    final-normed rows of its drafts [B, A, K, H]. features: the batch's target_features
    when the caller already has them (several passes over the anchors of one batch of
    tokens)."""
    tokens, anchors = batch.tokens.to(device), batch.anchors.to(device)
    b, a = anchors.shape
    s = drafter.spec
    embed = target.get_input_embeddings().weight
    bs = s.block_size
    positions = torch.arange(tokens.shape[1], device=device).expand(b, -1)
    if features is None:
        features = target_features(target, s.target_layer_ids, tokens, batch.lengths.to(device))
    context = drafter.backbone.context_kv(features, positions)
    slots = torch.arange(bs, device=device)
    embeds = embed[s.mask_token_id].expand(b, a, bs, -1).clone()
    embeds[:, :, 0] = embed[tokens.gather(1, anchors)]
    return drafter.backbone(
        embeds.flatten(1, 2),
        (anchors[..., None] + slots).flatten(1),
        context,
        block_mask(anchors, tokens.shape[1], bs),
    ).view(b, a, bs, -1)[:, :, s.first_draft_slot :]


def block_logits(
    target, drafter: Drafter, batch: Batch, device: torch.device, features=None
) -> BlockLogits:
    """The objective's forward (module docstring): every anchor's block (block_hidden),
    the GRU over the true tokens (teacher forcing)."""
    tokens, anchors = batch.tokens.to(device), batch.anchors.to(device)
    b, a = anchors.shape
    s, head = drafter.spec, drafter.head
    embed = target.get_input_embeddings().weight
    k = s.num_drafts
    hidden = block_hidden(target, drafter, batch, device, features)  # [B, A, K, H]
    drafts = torch.arange(k, device=device)
    labels = tokens.gather(1, (anchors[..., None] + 1 + drafts).flatten(1)).view(b, a, k)
    base = target.get_output_embeddings()(hidden)  # [B, A, K, V]
    # GRU states after x_p .. x_{p+i}, i = 0 .. K-1 (teacher forcing).
    inputs = embed[tokens.gather(1, (anchors[..., None] + drafts).flatten(1))]
    inputs = inputs.view(b * a, k, -1)
    state = head.initial_state(inputs[:, 0])
    states = [state]
    for i in range(1, k):
        state = head.gru_step(inputs[:, i], state)
        states.append(state)
    correction = head.correction(hidden, torch.stack(states, 1).view(b, a, k, -1))
    correction[:, :, : s.pure_draft_prefix_len] = 0
    return BlockLogits(base, base + correction, labels)


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """Weighted mean cross-entropy, in float32. logits [..., V], labels and weights [...]"""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    return (ce * weights.flatten()).sum() / weights.sum()


def bf16_matmuls(device: torch.device) -> bool:
    """Whether training runs its matmuls in bfloat16 (the drafter's master weights stay
    float32): on CUDA, and on CPUs with AMX, where a bfloat16 step took 11 s against
    19 s in float32 (2 cores, batch 16 x 32 anchors; float32 elsewhere)."""
    return device.type == "cuda" or (device.type == "cpu" and torch.cpu._is_amx_tile_supported())


class Trainer:
    def __init__(
        self,
        target_dir: Path,
        out: Path,
        *,
        block_size: int,
        layers: int | None,
        target_layers: int,
        gru: int,
        emb: int,
        lr: float,
        seed: int,
        device: str,
        decay: float | None = None,
        warmup: int = 0,
        init_from: Path | None = None,
    ):
        """init_from: a released drafter a new run starts from (its architecture wins over
        block_size, target_layers, gru and emb; `layers` above its own deepens it, None
        keeps it); ignored when `out` holds a run. A fresh run has `layers` (None: 1)."""
        self.device = torch.device(device)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        self.target.to(self.device).eval().requires_grad_(False)
        self.out = out
        self.lr, self.warmup, self.decay, self.seed = lr, warmup, decay, seed
        self.progress = {"step": 0, "seconds": 0.0, "losses": []}
        drafter_dir, state_dir = out / "drafter", out / "state"
        if not (state_dir / "progress.json").is_file():
            cfg = self.target.config
            if init_from is not None:
                config, tensors = released_start(init_from, cfg, layers)
            else:
                mask = cfg.vocab_size - 1 if cfg.eos_token_id is None else _first(cfg.eos_token_id)
                config = drafter_config(
                    cfg,
                    block_size=block_size,
                    layers=layers or 1,
                    target_layers=target_layers,
                    gru=gru,
                    emb=emb,
                    mask_token_id=mask,
                )
                tensors = initial_tensors(config, self.target, torch.Generator().manual_seed(seed))
            write_checkpoint(drafter_dir, config, tensors, max_shard_bytes=MAX_FILE_BYTES)
        self.drafter = Drafter.load(str(drafter_dir), device=self.device).requires_grad_(True)
        self.spec = self.drafter.spec
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=lr, weight_decay=0.0)
        if (state_dir / "progress.json").is_file():
            self._load_state(state_dir)
        self.autocast = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=bf16_matmuls(self.device)
        )

    def row_weights(self) -> torch.Tensor:
        """Per draft row i: exp(-i / decay), or 1 without decay. [K]"""
        rows = torch.arange(self.spec.num_drafts, device=self.device, dtype=torch.float32)
        return torch.ones_like(rows) if self.decay is None else torch.exp(-rows / self.decay)

    def loss(self, batch: Batch) -> torch.Tensor:
        logits = block_logits(self.target, self.drafter, batch, self.device)
        weights = batch.valid.to(self.device)[..., None] * self.row_weights()  # [B, A, K]
        corrected_weights = weights.clone()
        corrected_weights[..., : self.spec.pure_draft_prefix_len] = 0
        base_ce = mean_cross_entropy(logits.base, logits.labels, weights)
        return 0.5 * (
            base_ce + mean_cross_entropy(logits.corrected, logits.labels, corrected_weights)
        )

    def train(
        self,
        sequences,
        *,
        minutes: float,
        batch_size: int,
        anchors: int,
        max_len: int = 1024,
        max_steps: int | None = None,
    ):
        deadline = time.monotonic() + 60 * minutes
        started = time.monotonic()
        done = 0
        while time.monotonic() < deadline and (max_steps is None or done < max_steps):
            rng = random.Random(self.seed * 1_000_003 + self.progress["step"])
            chosen = [sequences[rng.randrange(len(sequences))] for _ in range(batch_size)]
            batch = make_batch(chosen, self.spec.num_drafts, anchors, max_len, rng)
            self.progress["step"] += 1
            done += 1
            if not batch.valid.any():
                continue
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * min(1.0, self.progress["step"] / max(1, self.warmup))
            with self.autocast:
                loss = self.loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
            self.optimizer.step()
            self.progress["losses"].append(round(loss.item(), 4))
        self.progress["seconds"] += time.monotonic() - started
        self.save()
        return self.progress

    def save(self) -> None:
        """The drafter (released format, float32) and Adam's moments (bfloat16, which
        halves what must survive a machine restart), in files <= 16 MiB."""
        write_checkpoint(
            self.out / "drafter",
            self._config(),
            self._tensors(torch.float32),
            max_shard_bytes=MAX_FILE_BYTES,
        )
        state_dir = self.out / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        optimizer = self.optimizer.state_dict()
        tensors = {
            f"{index}.{key}": value.cpu() if key == "step" else value.cpu().to(torch.bfloat16)
            for index, entry in optimizer["state"].items()
            for key, value in entry.items()
        }
        if tensors:
            write_shards(state_dir, "optimizer", tensors, MAX_FILE_BYTES)
        (state_dir / "progress.json").write_text(json.dumps(self.progress))

    def export(self, dest: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """The drafter alone, in the released format and `dtype` (what ships)."""
        config = self._config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
        return write_checkpoint(dest, config, self._tensors(dtype), max_shard_bytes=MAX_FILE_BYTES)

    def _config(self) -> dict:
        return json.loads((self.out / "drafter" / "config.json").read_text())

    def _tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        params = _named_parameters(self.drafter)
        return {n: params[n].detach().cpu().to(dtype) for n in self.spec.expected_shapes()}

    def _load_state(self, state_dir: Path) -> None:
        self.progress = json.loads((state_dir / "progress.json").read_text())
        if not (state_dir / "optimizer.safetensors.index.json").is_file():
            return
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in read_shards(state_dir, "optimizer").items():
            index, key = name.split(".", 1)
            device = "cpu" if key == "step" else self.device
            state.setdefault(int(index), {})[key] = tensor.to(device, torch.float32)
        saved = self.optimizer.state_dict()
        saved["state"] = state
        self.optimizer.load_state_dict(saved)


def _target_rope_theta(config) -> float:
    """The target's RoPE base: the drafter layers start as copies of its layers.
    (transformers 5 keeps it in rope_parameters; older configs at the top level.)"""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError(f"target config {config.__class__.__name__} names no rope_theta")
    return float(theta)


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
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dominotree.training", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--draft-layers",
        type=int,
        help="drafter layers (default 1); with --init-from, the released drafter's, and "
        "more than its own deepen it (new layers start silent: the same drafts at step 0)",
    )
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--gru", type=int, default=256)
    parser.add_argument("--emb", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--decay", type=float, default=7.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--export", type=Path, help="also write the drafter in bfloat16 here")
    parser.add_argument(
        "--init-from",
        type=Path,
        help="a new run starts from this released Domino drafter (its architecture; fresh "
        "optimizer and warm-up); ignored when --out holds a run",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    trainer = Trainer(
        args.target,
        args.out,
        block_size=args.block_size,
        layers=args.draft_layers,
        target_layers=args.target_layers,
        gru=args.gru,
        emb=args.emb,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        decay=args.decay,
        warmup=args.warmup,
        init_from=args.init_from,
    )
    progress = trainer.train(
        load_sequences(args.data),
        minutes=args.minutes,
        batch_size=args.batch_size,
        anchors=args.anchors,
        max_len=args.max_len,
        max_steps=args.max_steps,
    )
    if args.export:
        trainer.export(args.export)
    recent = progress["losses"][-50:]
    print(
        json.dumps(
            {
                "step": progress["step"],
                "seconds": round(progress["seconds"], 1),
                "recent_loss": sum(recent) / max(1, len(recent)),
            }
        )
    )
