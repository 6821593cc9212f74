"""The released DFlash / Domino checkpoint format: config parsing, tensor loading, checks.

A checkpoint is a folder with `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`). Tensor names carry no prefix. The drafter has no
embedding and no lm_head: it borrows the target's. Every problem found here raises
`DrafterFormatError` naming the file and the field or tensor, so a user learns at load
time, not from a shape error deep inside a forward pass.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# `causal_v5` is the name Domino's projector had before its release.
DOMINO_PROJECTOR_NAMES = ("domino", "causal_v5")


class DrafterFormatError(ValueError):
    """A drafter checkpoint that cannot be used as it is (or not with this target)."""


@dataclass(frozen=True)
class DrafterSpec:
    """Everything the drafter's code needs from `config.json`, validated."""

    path: Path
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    # Domino only (is_domino False for a plain DFlash checkpoint).
    is_domino: bool
    gru_hidden_dim: int
    emb_dim: int
    pure_draft_prefix_len: int
    shift_label: bool

    @property
    def num_drafts(self) -> int:
        """Drafts per block K. With `shift_label` block slot i predicts draft i, so every
        slot drafts; without it slot i + 1 predicts draft i and the anchor slot drafts
        nothing."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.shift_label else 1

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape."""
        h, hd = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, len(self.target_layer_ids) * h),
            "hidden_norm.weight": (h,),
            "norm.weight": (h,),
        }
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (self.num_heads * hd, h),
                p + "self_attn.k_proj.weight": (self.num_kv_heads * hd, h),
                p + "self_attn.v_proj.weight": (self.num_kv_heads * hd, h),
                p + "self_attn.o_proj.weight": (h, self.num_heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
            if self.attention_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (self.num_heads * hd,),
                    p + "self_attn.k_proj.bias": (self.num_kv_heads * hd,),
                    p + "self_attn.v_proj.bias": (self.num_kv_heads * hd,),
                    p + "self_attn.o_proj.bias": (h,),
                }
        if self.is_domino:
            g, e = self.gru_hidden_dim, self.emb_dim
            shapes |= {
                "prefix_gru.weight_ih_l0": (3 * g, h),
                "prefix_gru.weight_hh_l0": (3 * g, g),
                "embed_proj.0.weight": (e, h + g),
                "embed_proj.2.weight": (self.vocab_size, e),
            }
        return shapes


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids DFlash picks when the config names none: spread over the target's
    depth from layer 1 to layer num_target_layers - 3 (Python rounding, as released)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _field(cfg: dict, name: str, file: Path, kind: type, *, where: str = "") -> Any:
    if name not in cfg:
        raise DrafterFormatError(f"{file}: missing field '{where}{name}'")
    value = cfg[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DrafterFormatError(
            f"{file}: field '{where}{name}' should be {kind.__name__}, got {value!r}"
        )
    return value


def _rope_theta(cfg: dict, file: Path) -> float:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise DrafterFormatError(
                f"{file}: field 'rope_parameters.rope_type' is {rope_type!r}; DFlash drafters "
                "use plain RoPE ('default')"
            )
        return float(_field(params, "rope_theta", file, float, where="rope_parameters."))
    scaling = cfg.get("rope_scaling")
    if scaling not in (None, {}) and (
        not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "default"
    ):
        raise DrafterFormatError(
            f"{file}: field 'rope_scaling' is {scaling!r}; DFlash drafters use plain RoPE"
        )
    return float(_field(cfg, "rope_theta", file, float))


def read_spec(path: str | Path) -> DrafterSpec:
    """Parse and validate a drafter's `config.json` (either released layout)."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise DrafterFormatError(
            f"{file}: not found; the drafter 'model' must be a folder holding a DFlash or "
            "Domino checkpoint (config.json + model.safetensors)"
        )
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise DrafterFormatError(f"{file}: not valid JSON ({err})") from err

    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        raise DrafterFormatError(
            f"{file}: field 'architectures' is {archs!r}; expected ['DFlashDraftModel'] "
            "(a DFlash or Domino drafter)"
        )
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        raise DrafterFormatError(f"{file}: missing field 'dflash_config'")

    num_layers = _field(cfg, "num_hidden_layers", file, int)
    num_heads = _field(cfg, "num_attention_heads", file, int)
    hidden = _field(cfg, "hidden_size", file, int)
    num_target_layers = cfg.get("num_target_layers")
    if "target_layer_ids" in dflash:
        layer_ids = dflash["target_layer_ids"]
        if not (
            isinstance(layer_ids, list)
            and layer_ids
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids)
        ):
            raise DrafterFormatError(
                f"{file}: field 'dflash_config.target_layer_ids' should be a non-empty list "
                f"of layer indices, got {layer_ids!r}"
            )
    elif isinstance(num_target_layers, int):
        layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    else:
        raise DrafterFormatError(
            f"{file}: needs 'dflash_config.target_layer_ids' or 'num_target_layers'"
        )

    block_size = dflash.get("block_size", cfg.get("block_size"))
    if not isinstance(block_size, int) or block_size < 2:
        raise DrafterFormatError(
            f"{file}: field 'block_size' (top level or in dflash_config) should be an int >= 2, "
            f"got {block_size!r}"
        )

    projector = dflash.get("projector_type")
    if projector is not None and projector not in DOMINO_PROJECTOR_NAMES:
        raise DrafterFormatError(
            f"{file}: field 'dflash_config.projector_type' is {projector!r}; known: "
            f"{', '.join(DOMINO_PROJECTOR_NAMES)} (Domino) or absent (plain DFlash)"
        )
    is_domino = projector is not None
    gru_hidden_dim = emb_dim = 0
    if is_domino:
        gru_hidden_dim = _field(dflash, "gru_hidden_dim", file, int, where="dflash_config.")
        emb_dim = dflash.get("emb_dim", cfg.get("emb_dim"))
        if not isinstance(emb_dim, int):
            raise DrafterFormatError(
                f"{file}: field 'emb_dim' (dflash_config or top level) is missing or not an int"
            )
    prefix_len = dflash.get("pure_draft_prefix_len", 0)
    if not isinstance(prefix_len, int) or isinstance(prefix_len, bool):
        raise DrafterFormatError(
            f"{file}: field 'dflash_config.pure_draft_prefix_len' should be int, got {prefix_len!r}"
        )
    shift_label = dflash.get("shift_label", False)
    if not isinstance(shift_label, bool):
        raise DrafterFormatError(
            f"{file}: field 'dflash_config.shift_label' should be true or false, got "
            f"{shift_label!r}"
        )
    num_kv_heads = cfg.get("num_key_value_heads", num_heads)
    head_dim = cfg.get("head_dim") or hidden // num_heads
    for name, value in (("num_key_value_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DrafterFormatError(
                f"{file}: field '{name}' should be a positive int, got {value!r}"
            )
    spec = DrafterSpec(
        path=path,
        hidden_size=hidden,
        intermediate_size=_field(cfg, "intermediate_size", file, int),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_field(cfg, "vocab_size", file, int),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, file),
        attention_bias=bool(cfg.get("attention_bias", False)),
        block_size=block_size,
        mask_token_id=_field(dflash, "mask_token_id", file, int, where="dflash_config."),
        target_layer_ids=tuple(layer_ids),
        num_target_layers=num_target_layers,
        is_domino=is_domino,
        gru_hidden_dim=gru_hidden_dim,
        emb_dim=emb_dim,
        pure_draft_prefix_len=prefix_len,
        shift_label=shift_label,
    )
    if not 0 <= prefix_len <= spec.num_drafts:
        raise DrafterFormatError(
            f"{file}: field 'dflash_config.pure_draft_prefix_len' is {prefix_len}; it must lie "
            f"in [0, {spec.num_drafts}]"
        )
    for layer in cfg.get("layer_types") or []:
        if layer != "full_attention":
            raise DrafterFormatError(
                f"{file}: field 'layer_types' holds {layer!r}; only full_attention drafter "
                "layers are supported"
            )
    return spec


def check_fits_target(
    spec: DrafterSpec, *, hidden_size: int, vocab_size: int, num_layers: int
) -> None:
    """Raise if the drafter cannot run on this target (sizes the config declares)."""
    file = spec.path / CONFIG_FILE
    if spec.hidden_size != hidden_size:
        raise DrafterFormatError(
            f"{file}: field 'hidden_size' is {spec.hidden_size} but the target's hidden size is "
            f"{hidden_size}; this drafter was trained for another target model"
        )
    if spec.vocab_size != vocab_size:
        raise DrafterFormatError(
            f"{file}: field 'vocab_size' is {spec.vocab_size} but the target's vocabulary has "
            f"{vocab_size} entries; this drafter was trained for another target model"
        )
    if not 0 <= spec.mask_token_id < vocab_size:
        raise DrafterFormatError(
            f"{file}: field 'dflash_config.mask_token_id' is {spec.mask_token_id}, outside the "
            f"target's vocabulary [0, {vocab_size})"
        )
    too_deep = [i for i in spec.target_layer_ids if i >= num_layers]
    if too_deep:
        raise DrafterFormatError(
            f"{file}: field 'dflash_config.target_layer_ids' names layers {too_deep} but the "
            f"target has {num_layers} layers; this drafter was trained for a deeper target"
        )


def _weight_files(path: Path) -> list[Path]:
    index = path / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
            raise DrafterFormatError(
                f"{index}: not a safetensors index (needs a 'weight_map' of tensor -> file): "
                f"{err!r}"
            ) from err
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise DrafterFormatError(f"{index}: names shard files that are missing: {missing}")
        return [path / s for s in shards]
    single = path / WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise DrafterFormatError(
        f"{path}: holds neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}; a drafter checkpoint "
        "needs its safetensors weights"
    )


def load_tensors(spec: DrafterSpec) -> dict[str, torch.Tensor]:
    """Read the checkpoint's tensors, checking every expected name and shape."""
    expected = spec.expected_shapes()
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in _weight_files(spec.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in expected:
                    tensors[name] = f.get_tensor(name)
                    origin[name] = file
                else:
                    logger.warning("%s: ignoring unexpected tensor %s", file, name)
    files = ", ".join(str(f) for f in _weight_files(spec.path))
    missing = [n for n in expected if n not in tensors]
    if missing:
        hint = ""
        if any(n.startswith(("prefix_gru", "embed_proj")) for n in missing) and spec.is_domino:
            hint = (
                " (config.json declares a Domino projector, so the GRU and embed_proj are needed)"
            )
        raise DrafterFormatError(
            f"{files}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}{hint}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise DrafterFormatError(
                f"{origin[name]}: tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                f"expected {shape} from {spec.path / CONFIG_FILE}"
            )
    return tensors


def drafter_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    rms_norm_eps: float,
    rope_theta: float,
    num_target_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    domino: bool = True,
    gru_hidden_dim: int | None = None,
    emb_dim: int | None = None,
    pure_draft_prefix_len: int = 1,
    shift_label: bool = True,
) -> dict:
    """A drafter's config.json in the released layout that read_spec() reads: Qwen3-style
    layers, `rope_theta` at the top level, block size, mask token and target layer ids in
    `dflash_config`, and (Domino) the head's fields there too."""
    dflash: dict = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    if domino:
        dflash |= {
            "projector_type": "domino",
            "gru_hidden_dim": gru_hidden_dim,
            "emb_dim": emb_dim,
            "pure_draft_prefix_len": pure_draft_prefix_len,
            "shift_label": shift_label,
        }
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "num_target_layers": num_target_layers,
        "layer_types": ["full_attention"] * num_layers,
        "torch_dtype": "float32",
        "dflash_config": dflash,
    }


def write_checkpoint(
    path: str | Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a checkpoint in the released layout (used by tests, the demo pair and
    training). With max_shard_bytes, tensors go to numbered shards of at most that size
    (a single tensor larger than it gets a shard of its own) plus the index file."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / WEIGHTS_FILE))
        return path
    write_shards(path, "model", tensors, max_shard_bytes)
    return path


def write_shards(path: Path, prefix: str, tensors: dict[str, torch.Tensor], max_bytes: int) -> None:
    """Save tensors as `{prefix}-0000i-of-0000n.safetensors` files of at most max_bytes
    each (a larger tensor gets a file of its own) and `{prefix}.safetensors.index.json`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in path.glob(f"{prefix}-*-of-*.safetensors"):  # an earlier save's shards
        stale.unlink()
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(path / file))
        weight_map |= dict.fromkeys(shard, file)
    index = path / f"{prefix}.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}, indent=1))


def read_shards(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors `write_shards` saved."""
    index = json.loads((path / f"{prefix}.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = f.get_tensor(name)
    return out
