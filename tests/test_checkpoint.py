"""The released DFlash / Domino checkpoint format: round trips in every layout, sharded
weights, load-time errors, target checks, and the drafter's GRU / correction / backbone
against plain torch references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vllm_dominotree.demo.toy_pair import PairSpec, drafter_config, drafter_tensors
from vllm_dominotree.drafter import (
    ContextKV,
    Drafter,
    DrafterFormatError,
    check_fits_target,
    default_target_layer_ids,
    load_tensors,
    read_spec,
    write_checkpoint,
)
from vllm_dominotree.drafter.checkpoint import read_shards, write_shards
from vllm_dominotree.drafter.model import rope

# Two drafter layers over an 8-layer target: target_layer_ids [1, 5], fc takes 2 * H.
SPEC = PairSpec(target_layers=8, draft_layers=2)
H, V = SPEC.hidden, SPEC.vocab
GRU_TENSORS = {
    "prefix_gru.weight_ih_l0": "w_ih",
    "prefix_gru.weight_hh_l0": "w_hh",
    "embed_proj.0.weight": "proj_in",
    "embed_proj.2.weight": "proj_out",
}


def write(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    return write_checkpoint(path, cfg, tensors)


def write_default(path: Path, domino: bool = True, **layout) -> tuple[dict, dict]:
    cfg = drafter_config(SPEC, domino=domino, **layout)
    tensors = drafter_tensors(SPEC, domino=domino)
    write(path, cfg, tensors)
    return cfg, tensors


def random_domino(path: Path, g: int = 24, e: int = 40, *, shift_label: bool = True, seed=0):
    """A Domino checkpoint with G != H != E and random (non-toy) head weights."""
    gen = torch.Generator().manual_seed(seed)
    cfg = drafter_config(SPEC, shift_label=shift_label)
    cfg["dflash_config"] |= {"gru_hidden_dim": g, "emb_dim": e}
    tensors = drafter_tensors(SPEC)
    tensors |= {
        "prefix_gru.weight_ih_l0": 0.3 * torch.randn(3 * g, H, generator=gen),
        "prefix_gru.weight_hh_l0": 0.3 * torch.randn(3 * g, g, generator=gen),
        "embed_proj.0.weight": 0.2 * torch.randn(e, H + g, generator=gen),
        "embed_proj.2.weight": 0.2 * torch.randn(V, e, generator=gen),
    }
    write(path, cfg, tensors)
    return Drafter.load(str(path)), tensors


def assert_loaded_equal(drafter: Drafter, tensors: dict[str, torch.Tensor]) -> None:
    backbone_names = {n for n in tensors if n not in GRU_TENSORS}
    assert set(drafter.backbone.w.keys()) == {n.replace(".", "__") for n in backbone_names}
    for name in backbone_names:
        assert torch.equal(drafter.backbone.w[name.replace(".", "__")], tensors[name]), name
    if drafter.spec.is_domino:
        for name, attr in GRU_TENSORS.items():
            assert torch.equal(getattr(drafter.head, attr), tensors[name]), name
    else:
        assert drafter.head is None


# --- default_target_layer_ids ---------------------------------------------------------


@pytest.mark.parametrize(
    ("num_target", "num_draft", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (36, 1, [18]),
        (7, 1, [3]),
        (28, 5, [1, 7, 13, 19, 25]),
        (8, 2, [1, 5]),
        (11, 3, [1, 4, 8]),  # 1 + 3.5 rounds half to even (Python round, as released)
        (13, 3, [1, 6, 10]),  # 1 + 4.5 -> 6 (half to even)
    ],
)
def test_default_target_layer_ids(num_target, num_draft, expected):
    assert default_target_layer_ids(num_target, num_draft) == expected
    released = (
        [num_target // 2]
        if num_draft == 1
        else [round(1 + i * (num_target - 4) / (num_draft - 1)) for i in range(num_draft)]
    )
    assert expected == released


# --- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("explicit_layer_ids", [True, False], ids=["ids", "num_target_layers"])
@pytest.mark.parametrize("shift_label", [True, False], ids=["shift", "noshift"])
@pytest.mark.parametrize("projector", ["domino", "causal_v5", None], ids=str)
@pytest.mark.parametrize("rope_parameters", [True, False], ids=["rope_params", "rope_theta"])
@pytest.mark.parametrize("block_in_dflash", [True, False], ids=["block_dflash", "block_top"])
def test_round_trip(
    tmp_path, block_in_dflash, rope_parameters, projector, shift_label, explicit_layer_ids
):
    domino = projector is not None
    cfg = drafter_config(
        SPEC,
        domino=domino,
        block_size_in_dflash_config=block_in_dflash,
        rope_parameters=rope_parameters,
        projector_name=projector or "domino",
        shift_label=shift_label,
        explicit_layer_ids=explicit_layer_ids,
    )
    dflash = cfg["dflash_config"]
    # Layout checks: the config really is in the layout under test.
    assert ("block_size" in dflash) == block_in_dflash
    assert ("block_size" in cfg) != block_in_dflash
    assert ("target_layer_ids" in dflash) == explicit_layer_ids
    assert dflash.get("projector_type") == projector
    # A distinctive theta, so a default could not pass by accident.
    if rope_parameters:
        cfg["rope_parameters"]["rope_theta"] = 12345.0
    else:
        cfg["rope_theta"] = 12345.0
    if not domino and shift_label:
        dflash["shift_label"] = True
    tensors = drafter_tensors(SPEC, domino=domino)
    write(tmp_path, cfg, tensors)

    spec = read_spec(tmp_path)
    assert spec.path == tmp_path
    assert spec.block_size == SPEC.block_size
    assert spec.shift_label is shift_label
    assert spec.num_drafts == (SPEC.block_size if shift_label else SPEC.block_size - 1)
    assert spec.first_draft_slot == (0 if shift_label else 1)
    assert spec.is_domino is domino
    assert spec.rope_theta == 12345.0
    assert spec.target_layer_ids == (1, 5)
    assert spec.num_target_layers == SPEC.target_layers
    assert spec.pure_draft_prefix_len == (1 if domino else 0)
    assert spec.mask_token_id == V - 1
    assert (spec.hidden_size, spec.vocab_size, spec.num_layers) == (H, V, SPEC.draft_layers)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 1, H // 2)
    assert (spec.gru_hidden_dim, spec.emb_dim) == ((H, 2 * H) if domino else (0, 0))

    assert set(spec.expected_shapes()) == set(tensors)
    loaded = load_tensors(spec)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t), name

    drafter = Drafter.load(str(tmp_path))
    assert drafter.spec == spec
    assert_loaded_equal(drafter, tensors)


def test_plain_dflash_ignores_extra_gru_tensors(tmp_path):
    """GRU tensors in a plain DFlash checkpoint are not expected, so they are skipped."""
    cfg = drafter_config(SPEC, domino=False)
    tensors = drafter_tensors(SPEC, domino=True)
    write(tmp_path, cfg, tensors)
    loaded = load_tensors(read_spec(tmp_path))
    assert not any(n in loaded for n in GRU_TENSORS)
    assert set(loaded) == set(drafter_tensors(SPEC, domino=False))


def test_load_dtype(tmp_path):
    _, tensors = write_default(tmp_path)
    drafter = Drafter.load(str(tmp_path), dtype=torch.bfloat16)
    w = drafter.backbone.w["fc__weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, tensors["fc.weight"].to(torch.bfloat16))
    assert drafter.head.w_ih.dtype == torch.bfloat16


# --- sharded checkpoints --------------------------------------------------------------


def test_sharded_checkpoint(tmp_path):
    cfg = drafter_config(SPEC)
    tensors = drafter_tensors(SPEC)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n].contiguous() for n in shard_names}, str(tmp_path / file))
        weight_map |= dict.fromkeys(shard_names, file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert not (tmp_path / "model.safetensors").exists()

    loaded = load_tensors(read_spec(tmp_path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t), name
    assert_loaded_equal(Drafter.load(str(tmp_path)), tensors)


def test_sharded_checkpoint_missing_tensor(tmp_path):
    cfg = drafter_config(SPEC)
    tensors = drafter_tensors(SPEC)
    del tensors["embed_proj.2.weight"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "a.safetensors"))
    index = {"weight_map": dict.fromkeys(tensors, "a.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DrafterFormatError) as err:
        load_tensors(read_spec(tmp_path))
    assert str(tmp_path / "a.safetensors") in str(err.value)
    assert "embed_proj.2.weight" in str(err.value)


@pytest.mark.parametrize(
    "index_text, needle",
    [
        ("{not json", "not a safetensors index"),
        ('{"files": []}', "weight_map"),
        ('{"weight_map": {"fc.weight": "gone.safetensors"}}', "gone.safetensors"),
    ],
)
def test_broken_shard_index(tmp_path, index_text, needle):
    (tmp_path / "config.json").write_text(json.dumps(drafter_config(SPEC)))
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(DrafterFormatError) as err:
        load_tensors(read_spec(tmp_path))
    assert str(tmp_path / "model.safetensors.index.json") in str(err.value)
    assert needle in str(err.value)


# --- load-time errors -----------------------------------------------------------------


def _drop(cfg, *keys):
    d = cfg
    for k in keys[:-1]:
        d = d[k]
    del d[keys[-1]]


def _set(value, *keys):
    def edit(cfg):
        d = cfg
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return edit


CONFIG_ERRORS = {
    # name: (config edit, substrings the message must contain besides config.json)
    "architectures": (_set(["Qwen3ForCausalLM"], "architectures"), ["'architectures'"]),
    "no_architectures": (lambda c: _drop(c, "architectures"), ["'architectures'"]),
    "no_dflash_config": (lambda c: _drop(c, "dflash_config"), ["'dflash_config'"]),
    "no_mask_token_id": (
        lambda c: _drop(c, "dflash_config", "mask_token_id"),
        ["'dflash_config.mask_token_id'"],
    ),
    "mask_token_id_str": (_set("63", "dflash_config", "mask_token_id"), ["mask_token_id"]),
    "block_size_1": (_set(1, "dflash_config", "block_size"), ["'block_size'", "got 1"]),
    "block_size_str": (_set("8", "dflash_config", "block_size"), ["'block_size'", "'8'"]),
    "block_size_missing": (lambda c: _drop(c, "dflash_config", "block_size"), ["'block_size'"]),
    "projector_type": (
        _set("bogus_proj", "dflash_config", "projector_type"),
        ["'dflash_config.projector_type'", "bogus_proj"],
    ),
    "no_gru_hidden_dim": (
        lambda c: _drop(c, "dflash_config", "gru_hidden_dim"),
        ["'dflash_config.gru_hidden_dim'"],
    ),
    "no_emb_dim": (
        lambda c: (_drop(c, "dflash_config", "emb_dim"), _drop(c, "emb_dim")),
        ["'emb_dim'"],
    ),
    "rope_type": (
        _set({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_parameters"),
        ["'rope_parameters.rope_type'", "yarn"],
    ),
    "rope_scaling": (
        lambda c: (
            _drop(c, "rope_parameters"),
            c.update(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
        ),
        ["'rope_scaling'", "linear"],
    ),
    "no_rope_theta": (
        lambda c: _drop(c, "rope_parameters", "rope_theta"),
        ["'rope_parameters.rope_theta'"],
    ),
    "layer_types": (
        _set(["full_attention", "sliding_attention"], "layer_types"),
        ["'layer_types'", "sliding_attention"],
    ),
    "target_layer_ids": (_set([], "dflash_config", "target_layer_ids"), ["target_layer_ids"]),
    "no_layer_ids": (
        lambda c: (_drop(c, "dflash_config", "target_layer_ids"), _drop(c, "num_target_layers")),
        ["target_layer_ids", "num_target_layers"],
    ),
    "hidden_size_str": (_set("64", "hidden_size"), ["'hidden_size'"]),
    "no_vocab_size": (lambda c: _drop(c, "vocab_size"), ["'vocab_size'"]),
    "prefix_len_high": (
        _set(SPEC.block_size + 1, "dflash_config", "pure_draft_prefix_len"),
        ["'dflash_config.pure_draft_prefix_len'", f"[0, {SPEC.block_size}]"],
    ),
    "prefix_len_str": (
        _set("1", "dflash_config", "pure_draft_prefix_len"),
        ["'dflash_config.pure_draft_prefix_len'", "'1'"],
    ),
    "shift_label_str": (
        _set("false", "dflash_config", "shift_label"),
        ["'dflash_config.shift_label'", "'false'"],
    ),
    "head_dim_null": (_set("32", "head_dim"), ["'head_dim'"]),
    "kv_heads_null": (_set(None, "num_key_value_heads"), ["'num_key_value_heads'"]),
    "rope_scaling_str": (
        lambda c: (_drop(c, "rope_parameters"), c.update(rope_theta=1e4, rope_scaling="linear")),
        ["'rope_scaling'"],
    ),
    "layer_ids_bool": (_set([True], "dflash_config", "target_layer_ids"), ["target_layer_ids"]),
    "prefix_len_negative": (
        _set(-1, "dflash_config", "pure_draft_prefix_len"),
        ["'dflash_config.pure_draft_prefix_len'"],
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors(tmp_path, case):
    edit, needles = CONFIG_ERRORS[case]
    cfg, tensors = write_default(tmp_path)
    edit(cfg)
    write(tmp_path, cfg, tensors)
    with pytest.raises(DrafterFormatError) as err:
        Drafter.load(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "config.json") in message
    for needle in needles:
        assert needle in message


def test_prefix_len_bound_without_shift_label(tmp_path):
    """Without shift_label there are block_size - 1 drafts, so block_size is too long."""
    cfg, tensors = write_default(tmp_path, shift_label=False)
    cfg["dflash_config"]["pure_draft_prefix_len"] = SPEC.block_size - 1
    write(tmp_path, cfg, tensors)
    assert read_spec(tmp_path).pure_draft_prefix_len == SPEC.block_size - 1
    cfg["dflash_config"]["pure_draft_prefix_len"] = SPEC.block_size
    write(tmp_path, cfg, tensors)
    with pytest.raises(DrafterFormatError, match=rf"\[0, {SPEC.block_size - 1}\]"):
        read_spec(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(DrafterFormatError) as err:
        Drafter.load(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)
    assert "not found" in str(err.value)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["DFlashDraftModel"],')
    with pytest.raises(DrafterFormatError) as err:
        read_spec(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)
    assert "not valid JSON" in str(err.value)


def test_missing_weights(tmp_path):
    write_default(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    read_spec(tmp_path)  # the config alone is fine
    with pytest.raises(DrafterFormatError) as err:
        Drafter.load(str(tmp_path))
    assert str(tmp_path) in str(err.value)
    assert "model.safetensors" in str(err.value)


@pytest.mark.parametrize(
    "missing",
    ["embed_proj.2.weight", "prefix_gru.weight_hh_l0", "fc.weight", "layers.1.mlp.up_proj.weight"],
)
def test_missing_tensor(tmp_path, missing):
    cfg, tensors = write_default(tmp_path)
    del tensors[missing]
    write(tmp_path, cfg, tensors)
    with pytest.raises(DrafterFormatError) as err:
        Drafter.load(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message
    assert missing in message
    assert ("Domino projector" in message) == missing.startswith(("prefix_gru", "embed_proj"))


@pytest.mark.parametrize(
    ("name", "bad_shape", "good_shape"),
    [
        ("fc.weight", (H, H), (H, 2 * H)),
        ("layers.0.self_attn.k_proj.weight", (H, H), (H // 2, H)),
        ("embed_proj.0.weight", (2 * H, H), (2 * H, 2 * H)),
        ("norm.weight", (H + 1,), (H,)),
    ],
)
def test_misshaped_tensor(tmp_path, name, bad_shape, good_shape):
    cfg, tensors = write_default(tmp_path)
    assert tuple(tensors[name].shape) == good_shape
    tensors[name] = torch.zeros(bad_shape)
    write(tmp_path, cfg, tensors)
    with pytest.raises(DrafterFormatError) as err:
        Drafter.load(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message
    assert str(tmp_path / "config.json") in message
    assert f"'{name}'" in message
    assert str(bad_shape) in message
    assert str(good_shape) in message


# --- check_fits_target ----------------------------------------------------------------

FITS = {"hidden_size": H, "vocab_size": V, "num_layers": SPEC.target_layers}


@pytest.mark.parametrize(
    ("target", "mask_token_id", "field"),
    [
        ({"hidden_size": 2 * H}, V - 1, "'hidden_size'"),
        ({"vocab_size": V + 1}, V - 1, "'vocab_size'"),
        ({}, V, "'dflash_config.mask_token_id'"),
        ({}, -1, "'dflash_config.mask_token_id'"),
        ({"num_layers": 5}, V - 1, "'dflash_config.target_layer_ids'"),  # ids [1, 5]
    ],
)
def test_check_fits_target_errors(tmp_path, target, mask_token_id, field):
    cfg, tensors = write_default(tmp_path)
    cfg["dflash_config"]["mask_token_id"] = mask_token_id
    write(tmp_path, cfg, tensors)
    spec = read_spec(tmp_path)
    with pytest.raises(DrafterFormatError) as err:
        check_fits_target(spec, **(FITS | target))
    assert str(tmp_path / "config.json") in str(err.value)
    assert field in str(err.value)


def test_check_fits_target_passes(tmp_path):
    write_default(tmp_path)
    spec = read_spec(tmp_path)
    assert check_fits_target(spec, **FITS) is None
    # The shallowest target that still holds layer 5.
    assert check_fits_target(spec, **(FITS | {"num_layers": 6})) is None


# --- Domino head against torch references ---------------------------------------------


def test_gru_step_matches_torch_gru(tmp_path):
    g = 24
    drafter, tensors = random_domino(tmp_path, g=g)
    head = drafter.head
    gru = nn.GRU(input_size=H, hidden_size=g, bias=False, batch_first=True)
    with torch.no_grad():
        gru.weight_ih_l0.copy_(tensors["prefix_gru.weight_ih_l0"])
        gru.weight_hh_l0.copy_(tensors["prefix_gru.weight_hh_l0"])
    gen = torch.Generator().manual_seed(1)
    n, steps = 3, 5
    x = torch.randn(n, steps, H, generator=gen)
    with torch.no_grad():
        expected, last = gru(x)
        state = head.initial_state(x[:, 0])  # the first step starts from a zero state
        assert torch.allclose(state, expected[:, 0], atol=1e-6)
        for t in range(1, steps):
            state = head.gru_step(x[:, t], state)
            assert torch.allclose(state, expected[:, t], atol=1e-6), t
        assert torch.allclose(state, last[0], atol=1e-6)
        # From a random (non-zero) state as well.
        h0 = torch.randn(1, n, g, generator=gen)
        expected, _ = gru(x[:, :1], h0)
        assert torch.allclose(head.gru_step(x[:, 0], h0[0]), expected[:, 0], atol=1e-6)
    assert state.abs().max() > 0.05  # a real, non-degenerate state


def test_correction_matches_sequential(tmp_path):
    g, e = 24, 40
    drafter, tensors = random_domino(tmp_path, g=g, e=e)
    head = drafter.head
    ref = nn.Sequential(nn.Linear(H + g, e, bias=False), nn.SiLU(), nn.Linear(e, V, bias=False))
    with torch.no_grad():
        ref[0].weight.copy_(tensors["embed_proj.0.weight"])
        ref[2].weight.copy_(tensors["embed_proj.2.weight"])
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, H, generator=gen)
    state = torch.randn(4, g, generator=gen)
    with torch.no_grad():
        got = head.correction(hidden, state)
        expected = ref(torch.cat([hidden, state], -1))
    assert got.shape == (4, V)
    assert torch.allclose(got, expected, atol=1e-6)
    w_h, w_s = head.split_proj_in()
    assert torch.equal(torch.cat([w_h, w_s], 1), tensors["embed_proj.0.weight"])
    assert w_h.shape == (e, H)
    assert w_s.shape == (e, g)


# --- DFlash backbone ------------------------------------------------------------------


def _features(t: int, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, 2 * H, generator=gen)


def test_context_kv_chunked_equals_whole(tmp_path):
    write_default(tmp_path)
    backbone = Drafter.load(str(tmp_path)).backbone
    t, split = 11, 4
    features, positions = _features(t), torch.arange(t) + 7
    with torch.no_grad():
        whole = backbone.context_kv(features, positions)
        chunked = backbone.context_kv(features[:split], positions[:split])
        chunked.append(backbone.context_kv(features[split:], positions[split:]))
    assert whole.length == chunked.length == t
    assert len(whole.keys) == len(whole.values) == SPEC.draft_layers
    for i in range(SPEC.draft_layers):
        assert whole.keys[i].shape == (t, 1, H // 2)
        assert torch.allclose(whole.keys[i], chunked.keys[i], atol=1e-6)
        assert torch.allclose(whole.values[i], chunked.values[i], atol=1e-6)
    # Positions matter for keys (RoPE) but not for values.
    with torch.no_grad():
        shifted = backbone.context_kv(features, positions + 1)
    assert not torch.allclose(shifted.keys[0], whole.keys[0])
    assert torch.equal(shifted.values[0], whole.values[0])


def test_context_kv_empty():
    assert ContextKV([], []).length == 0


@pytest.mark.parametrize("shift_label", [True, False])
def test_block_hidden(tmp_path, shift_label):
    drafter, _ = random_domino(tmp_path, shift_label=shift_label)
    k = SPEC.block_size if shift_label else SPEC.block_size - 1
    assert drafter.spec.num_drafts == k
    gen = torch.Generator().manual_seed(4)
    anchor, mask = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    t = 6
    with torch.no_grad():
        context = drafter.backbone.context_kv(_features(t), torch.arange(t))
        rows = drafter.block_hidden(anchor, mask, t, context)
        again = drafter.block_hidden(anchor, mask, t, context)
        other = drafter.block_hidden(
            anchor, mask, t, drafter.backbone.context_kv(_features(t, seed=5), torch.arange(t))
        )
    assert rows.shape == (k, H)
    assert torch.isfinite(rows).all()
    assert torch.equal(rows, again)
    assert not torch.allclose(rows, other)  # the rows do read the context
    # Final norm with unit weights: every row has RMS 1.
    assert torch.allclose(rows.pow(2).mean(-1).sqrt(), torch.ones(k), atol=1e-3)


def test_block_hidden_shift_label_drops_anchor_slot(tmp_path):
    """The same weights with and without shift_label: without it, the anchor slot's row
    is dropped and the other rows are the same."""
    with_shift, _ = random_domino(tmp_path / "shift", shift_label=True)
    without, _ = random_domino(tmp_path / "noshift", shift_label=False)
    gen = torch.Generator().manual_seed(6)
    anchor, mask = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    t = 5
    with torch.no_grad():
        context = with_shift.backbone.context_kv(_features(t), torch.arange(t))
        all_rows = with_shift.block_hidden(anchor, mask, t, context)
        drafts = without.block_hidden(anchor, mask, t, context)
    assert all_rows.shape == (SPEC.block_size, H)
    assert drafts.shape == (SPEC.block_size - 1, H)
    assert torch.equal(drafts, all_rows[1:])


def test_rope_matches_transformers_qwen3():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim, theta = 32, 12345.0
    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(9, 2, head_dim, generator=gen)
    k = torch.randn(9, 1, head_dim, generator=gen)
    positions = torch.arange(9) + 3
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
    assert torch.allclose(rope(q, positions, theta), q_ref, atol=1e-5)
    assert torch.allclose(rope(k, positions, theta), k_ref, atol=1e-5)


def test_shards_rewritten_with_fewer_files_leave_none_behind(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(4)}
    write_shards(tmp_path, "model", tensors, max_bytes=1024)  # one tensor per file
    write_shards(tmp_path, "model", tensors, max_bytes=4096)  # all in one file
    assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    assert all(torch.equal(read_shards(tmp_path, "model")[k], v) for k, v in tensors.items())
