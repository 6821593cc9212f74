"""What a tree backend refuses (engine/backend_support.py), on stand-ins for vLLM's
attention implementations: the features are read from the same attributes."""

from types import SimpleNamespace

import pytest
from vllm.v1.attention.backend import AttentionType

from vllm_dominotree.engine.backend_support import FEATURES, TREE_LACKS, check_supported


def layer_impl(**features):
    plain = dict(
        attn_type=AttentionType.DECODER,
        alibi_slopes=None,
        sliding_window=None,
        logits_soft_cap=None,
        kv_cache_dtype="auto",
    )
    return SimpleNamespace(**{**plain, **features})


@pytest.mark.parametrize(
    "features, named",
    [
        ({"sliding_window": (4095, 0)}, "sliding windows"),
        ({"logits_soft_cap": 30.0}, "logit soft-capping"),
        ({"kv_cache_dtype": "fp8"}, "a quantized KV cache"),
        ({"sinks": object()}, "attention sinks"),
    ],
)
def test_a_layer_with_a_feature_trees_lack_is_refused_by_name(features, named):
    impl = layer_impl(**features)
    with pytest.raises(NotImplementedError, match=named):
        check_supported(impl, TREE_LACKS, "CPU")
    with pytest.raises(NotImplementedError, match=named):  # refused every time
        check_supported(impl, TREE_LACKS, "CPU")


def test_a_plain_layer_passes_and_is_checked_once(monkeypatch):
    reads = []
    monkeypatch.setitem(FEATURES, "ALiBi", lambda impl: reads.append(impl) or False)
    impl = layer_impl()
    for _ in range(3):  # a layer's every verification step
        check_supported(impl, TREE_LACKS, "CPU")
    assert reads == [impl]
