"""Real vLLM (CPU) engines for the integration tests.

Engine starts cost 17-30 s here, so engines are shared: `baseline` (no speculation) and
`conditional` (DominoTree with its defaults) live for the whole session; others are
module-scoped. Every engine uses the toy pair in float32 with eager execution.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from stats_helpers import pooled_chi2_pvalue

from vllm_dominotree.demo.toy_pair import PairSpec, write_drafter, write_pair

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_MODEL_LEN = 256
# Eight prompts of different lengths (token ids of the toy vocabulary, EOS = 63 excluded).
PROMPTS = [
    [5],
    [40, 41],
    [5, 9, 12, 3],
    [1, 2, 3, 4, 5, 6, 7],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
    list(range(10, 30)),
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
    [i % 60 for i in range(3, 120, 3)],
]


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory):
    """target/, drafter/ (Domino, often right) and dflash/ (plain DFlash) folders. The
    target's attention matters (PairSpec.context), so wrong tree masks, positions or KV
    moves change its tokens and fail the equality tests."""
    root = tmp_path_factory.mktemp("engine-pair")
    spec = PairSpec(noise=0.8, context=1.4)
    target, drafter = write_pair(root, spec)
    dflash = write_drafter(root / "dflash", spec, domino=False, shift_label=False)
    return {"target": str(target), "drafter": str(drafter), "dflash": str(dflash)}


SERVED_NAME = "toy"


def server_args(*extra: str) -> list[str]:
    """vLLM's OpenAI server options for the toy target (float32, eager, seeded)."""
    return [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--seed",
        "0",
        *extra,
    ]


def make_llm(pair_dirs, speculative_config=None, **kwargs):
    from vllm import LLM

    options = dict(
        model=pair_dirs["target"],
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
    )
    options.update(kwargs)
    return LLM(speculative_config=speculative_config, **options)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def dominotree(pair_dirs, **options):
    """The tests' trees are 16 nodes whatever the batch unless they say otherwise (the
    CPU's default budget is smaller and shared over a step's rows, config.CPU_BUDGET and
    CPU_STEP_NODES; configs written out in full get them)."""
    return {
        "method": "dominotree",
        "model": pair_dirs["drafter"],
        "budget": 16,
        "step_nodes": 0,
        **options,
    }


@pytest.fixture(scope="session")
def baseline(pair_dirs):
    llm = make_llm(pair_dirs)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def conditional(pair_dirs):
    llm = make_llm(pair_dirs, dominotree(pair_dirs))
    yield llm
    shutdown(llm)


def greedy(llm, prompts=PROMPTS, max_tokens=48):
    from vllm import SamplingParams

    # ignore_eos: the context-dependent target may predict its EOS; comparisons want
    # full-length outputs.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_metrics(llm) -> dict[str, float | list[float]]:
    """vLLM's own speculative-decoding counters."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "value", None) or getattr(metric, "values", None)
    return out


def tree_stats(llm) -> dict:
    return llm.collective_rpc("dominotree_stats")[0]


def target_law(target_dir: str, prefixes: list[tuple[int, ...]], params) -> dict:
    """The target's own next-token law (after temperature / top-k / top-p) after each
    prefix, from transformers."""
    from transformers import AutoModelForCausalLM

    from vllm_dominotree.tree import target_probs

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    law = {}
    with torch.no_grad():
        for prefix in prefixes:
            logits = model(torch.tensor([prefix])).logits[0, -1:]
            law[prefix] = target_probs(logits, params)[0].double()
    return law


SAMPLED_PROMPT = [5, 9, 12]
SAMPLED_PARAMS = (0.9, 12, 0.95)  # temperature, top-k, top-p of the sampled-law tests


def sampled_runs(llm, requests: int, law=SAMPLED_PARAMS) -> list[list[int]]:
    """`requests` seeded requests of 3 sampled tokens after SAMPLED_PROMPT (law:
    temperature, top-k, top-p): each run's prompt and tokens."""
    from vllm import SamplingParams

    temperature, top_k, top_p = law
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_tokens=3,
            seed=s,
            ignore_eos=True,
        )
        for s in range(requests)
    ]
    prompts = [{"prompt_token_ids": SAMPLED_PROMPT}] * requests
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [SAMPLED_PROMPT + list(o.outputs[0].token_ids) for o in outputs]


def assert_runs_follow_the_target(
    runs: list[list[int]], target_dir: str, law=SAMPLED_PARAMS
) -> None:
    """For each sampled position, the counts of the sampled tokens must match the sum over
    runs of the target's exact law given that run's own prefix."""
    from vllm_dominotree.tree import SamplingParams as TreeParams

    start = len(SAMPLED_PROMPT)
    runs = [tuple(r) for r in runs]
    prefixes = {r[: start + i] for r in runs for i in range(3)}
    target = target_law(target_dir, sorted(prefixes), TreeParams(*law))
    for i in range(start, start + 3):
        observed = torch.bincount(torch.tensor([r[i] for r in runs]), minlength=64).double()
        expected = sum(target[r[:i]] for r in runs)
        assert pooled_chi2_pvalue(observed, expected) > 1e-3


def assert_sampled_law(llm, target_dir: str, requests: int = 600) -> None:
    """Seeded requests of 3 tokens through the trees follow the target's law."""
    before = tree_stats(llm)["trees"]
    runs = sampled_runs(llm, requests)
    assert tree_stats(llm)["trees"] > before, "the sampled run did not use trees"
    assert_runs_follow_the_target(runs, target_dir)
