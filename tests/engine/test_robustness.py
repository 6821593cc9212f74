"""Robustness of the DominoTree runner inside a real vLLM (CPU) engine.

- preemption with recompute (a KV cache far too small for the batch); the shared pair's
  target depends on its context, so wrong K/V would show (checked here too);
- prompts that end right at max_model_len (the scheduler cuts the trees short);
- requests aborted mid-generation, and a request added after the abort;
- greedy and seeded sampled requests in one batch.

Greedy outputs must equal the no-speculation engine's: DominoTree is lossless.
"""

from __future__ import annotations

import itertools

import pytest
from safetensors.torch import load_file
from vllm import SamplingParams

from .conftest import MAX_MODEL_LEN, dominotree, greedy, make_llm, shutdown, tree_stats

pytestmark = pytest.mark.slow

EOS = 63


def _prompt(seed: int, length: int) -> list[int]:
    """A deterministic prompt of token ids in 0..62 (the EOS, 63, excluded)."""
    return [(seed * 7 + 11 * i + (i * i) % 5) % EOS for i in range(length)]


def _metric(llm, name: str) -> float:
    """Sum of a counter over its label sets (0 if the engine has not registered it)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _first_diff(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# 1. Preemption with recompute --------------------------------------------------------

BLOCK_SIZE = 32  # CPU_ATTN supports multiples of 32
NUM_BLOCKS = 16  # 512 token slots for a batch that needs ~1900 (plus the tree rows)
PREEMPT_PROMPTS = [_prompt(s, 8 + (s * 5) % 33) for s in range(16)]
PREEMPT_MAX_TOKENS = 100
# A step's token budget below the long prompts' lengths: their prefills come in chunks.
MAX_BATCHED_TOKENS = 128


@pytest.fixture(scope="module")
def small_cache(pair_dirs, baseline):
    # `baseline` first: creating an engine re-registers vLLM's Prometheus metrics, so
    # this engine's preemption counter must be the one get_metrics() reads.
    llm = make_llm(
        pair_dirs,
        dominotree(pair_dirs),
        num_gpu_blocks_override=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
    )
    yield llm
    shutdown(llm)


def test_preemption_recompute_matches_baseline(small_cache, baseline):
    expected = greedy(baseline, PREEMPT_PROMPTS, PREEMPT_MAX_TOKENS)
    preemptions = _metric(small_cache, "vllm:num_preemptions")
    trees = tree_stats(small_cache)["trees"]

    outputs = greedy(small_cache, PREEMPT_PROMPTS, PREEMPT_MAX_TOKENS)

    preempted = _metric(small_cache, "vllm:num_preemptions") - preemptions
    assert preempted > 0, "the KV cache was not small enough to force a preemption"
    stats = tree_stats(small_cache)
    assert stats["trees"] > trees and stats["sibling_accepts"] > 0 and stats["kv_moves"] > 0
    assert [len(o) for o in outputs] == [PREEMPT_MAX_TOKENS] * len(PREEMPT_PROMPTS)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"prompt {i} diverged at token {_first_diff(got, want)}"


def test_chunked_prefills_between_tree_steps(small_cache, baseline):
    """Prompts longer than a step's token budget are prefilled in chunks while other
    requests verify trees; the drafter's context must still come out right."""
    prompts = [_prompt(s, n) for s, n in ((1, 190), (2, 20), (3, 150), (4, 9))]
    assert max(map(len, prompts)) > MAX_BATCHED_TOKENS
    trees = tree_stats(small_cache)["trees"]
    assert greedy(small_cache, prompts, 60) == greedy(baseline, prompts, 60)
    assert tree_stats(small_cache)["trees"] > trees


def test_the_target_depends_on_its_context(pair_dirs, baseline):
    """The equality tests only catch K/V or mask mistakes if the target's tokens depend
    on more than the last token: many greedy tokens must differ from the bigram's."""
    tensors = load_file(f"{pair_dirs['target']}/model.safetensors")
    bigram = (tensors["model.embed_tokens.weight"] @ tensors["lm_head.weight"].T).argmax(-1)
    outputs = greedy(baseline, PREEMPT_PROMPTS, PREEMPT_MAX_TOKENS)
    pairs = [
        (a, b)
        for p, o in zip(PREEMPT_PROMPTS, outputs, strict=True)
        for a, b in itertools.pairwise(p[-1:] + o)
    ]
    off_bigram = sum(int(bigram[a]) != b for a, b in pairs) / len(pairs)
    assert off_bigram > 0.1, off_bigram


# 2. Prompts near max_model_len --------------------------------------------------------


def test_prompts_near_max_model_len(conditional, baseline):
    lengths = [200, 240, 250, 254, 255]
    prompts = [_prompt(s, n) for s, n in enumerate(lengths)]
    max_tokens = MAX_MODEL_LEN  # far more than fits: the length limit stops them
    expected = greedy(baseline, prompts, max_tokens)
    trees = tree_stats(conditional)["trees"]

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = conditional.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )

    assert tree_stats(conditional)["trees"] > trees
    for prompt, out, want in zip(prompts, outputs, expected, strict=True):
        got = list(out.outputs[0].token_ids)
        assert len(prompt) + len(got) == MAX_MODEL_LEN, (len(prompt), len(got))
        assert out.outputs[0].finish_reason == "length"
        assert got == want, f"prompt of {len(prompt)} diverged at {_first_diff(got, want)}"


# 3. Aborted requests ------------------------------------------------------------------


def _step_until(engine, finished: dict, seen: dict, done, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if done():
            return
        for out in engine.step():
            seen[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("the engine did not get there in time")


def test_abort_mid_generation(conditional, baseline):
    engine = conditional.llm_engine
    assert not engine.has_unfinished_requests()
    prompts = {f"abort-{i}": _prompt(40 + i, 5 + 3 * i) for i in range(6)}
    late_prompt = _prompt(99, 13)
    max_tokens = 80
    to_abort = ["abort-1", "abort-2", "abort-4"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    trees = tree_stats(conditional)["trees"]

    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished: dict = {}
    seen: dict = {}
    try:
        # Mid-generation: every request to abort has tokens but is far from done.
        _step_until(
            engine, finished, seen, lambda: all(len(seen.get(r, ())) >= 8 for r in to_abort)
        )
        assert not set(to_abort) & set(finished)
        assert all(len(seen[r]) < max_tokens for r in to_abort)
        engine.abort_request(to_abort)
        # A new request takes the freed batch rows while the others are mid-tree.
        engine.add_request("late", {"prompt_token_ids": late_prompt}, params)
        _step_until(engine, finished, seen, lambda: not engine.has_unfinished_requests())
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request([*prompts, "late"])
            while engine.has_unfinished_requests():
                engine.step()

    assert engine.get_num_unfinished_requests() == 0
    survivors = [r for r in prompts if r not in to_abort]
    assert set(finished) - set(to_abort) == {*survivors, "late"}
    for r in to_abort:  # aborted: never finished normally
        assert r not in finished or finished[r].outputs[0].finish_reason == "abort"
    assert tree_stats(conditional)["trees"] > trees

    expected = greedy(baseline, [prompts[r] for r in survivors] + [late_prompt], max_tokens)
    got = [list(finished[r].outputs[0].token_ids) for r in [*survivors, "late"]]
    assert got == expected
    # The aborted requests' partial outputs were on the right track, too.
    full = greedy(baseline, [prompts[r] for r in to_abort], max_tokens)
    for r, want in zip(to_abort, full, strict=True):
        assert seen[r] == want[: len(seen[r])]
    # And the engine still serves the aborted prompts correctly.
    assert greedy(conditional, [prompts[r] for r in to_abort], max_tokens) == full


# 4. Greedy and seeded sampled requests in one batch -----------------------------------


def test_mixed_greedy_and_seeded_batch(conditional, baseline):
    prompts = [_prompt(70 + i, 4 + 4 * i) for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=50, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    trees = tree_stats(conditional)["trees"]

    batch = conditional.generate(inputs, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in batch]

    assert tree_stats(conditional)["trees"] > trees
    assert [len(g) for g in got] == [p.max_tokens for p in params]
    greedy_idx = [i for i, p in enumerate(params) if p.temperature == 0]
    sampled_idx = [i for i, p in enumerate(params) if p.temperature > 0]
    for i in greedy_idx:
        assert got[i] == greedy(baseline, [prompts[i]], params[i].max_tokens)[0], i
    for i in sampled_idx:
        alone = conditional.generate(inputs[i], params[i], use_tqdm=False)
        assert got[i] == list(alone[0].outputs[0].token_ids), f"seeded request {i}"
        # It really sampled: at temperature 0.8 it leaves the greedy chain.
        assert got[i] != greedy(baseline, [prompts[i]], params[i].max_tokens)[0], i
