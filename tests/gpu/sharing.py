"""What every GPU test engine is given, so that test processes can share the GPU, and the
one way the tests run an engine."""

# The float32 toy pair's prompts (demo/toy_pair.py): lengths 1 to 39, repeats, runs.
PROMPTS = [
    [5],
    [40, 41],
    [5, 9, 12, 3],
    list(range(10, 30)),
    [i % 60 for i in range(3, 120, 3)],
    [7] * 27,
    [1, 2, 3, 4, 5, 6, 7],
    [30, 31, 32, 33, 34, 35],
]


# Each engine takes a fixed KV cache instead of a share found by vLLM's memory profiler:
# the profiler asserts that no other process frees GPU memory meanwhile, which breaks when
# several test processes share the GPU (scripts/gpu_jobs.sh parallel). The utilization is
# only the startup check's floor, small enough for six engines at once.
def engine_memory(kv_gib: float) -> dict:
    return {"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": int(kv_gib * 2**30)}


def smollm2_prompts(count: int) -> tuple[str, list[list[int]]]:
    """(the converted SmolLM2 target folder, `count` chat prompts as token ids spread over
    the HumanEval, MT-Bench and MATH-500 first turns); skips without DOMINOTREE_SMOLLM2
    (scripts/gpu_jobs.sh converts the GGUF and sets it)."""
    import os

    import pytest
    from transformers import AutoTokenizer

    from vllm_dominotree.evaluation.datasets import chat_token_ids, load_dataset

    target = os.environ.get("DOMINOTREE_SMOLLM2")
    if not target:
        pytest.skip("set DOMINOTREE_SMOLLM2 to a converted SmolLM2 folder")
    tokenizer = AutoTokenizer.from_pretrained(target)
    turns = [c[0] for name in ("humaneval", "mtbench", "math500") for c in load_dataset(name)]
    return target, [chat_token_ids(tokenizer, t) for t in turns[:: len(turns) // count]][:count]


def run_engine(
    model: str,
    prompts: list[list[int]],
    params,
    speculative_config: dict | None = None,
    env: dict | None = None,
    margins: bool = False,
    **engine,
) -> tuple:
    """One engine over the prompts: their output tokens, and the plugin's report when the
    engine speculates with it (`dominotree_stats`), with vLLM's spec-decode counters
    added for any other speculative config and for the plugin's V2 runner; with `margins`
    (params asking for logprobs >= 2) also, per prompt and output position, (the top
    token's log-prob lead over the runner-up, the runner-up). env: variables for the
    engine's processes (spawned with it); engine: LLM's arguments (engine_memory's among
    them)."""
    import gc

    import pytest
    from vllm import LLM

    config = speculative_config or {}
    plugin = config.get("method") == "dominotree"
    # vLLM's own methods and the plugin's V2 runner (which keeps no step counters yet):
    # vLLM's spec-decode counters, which LLM keeps only with stat logging on.
    counters = bool(config) and not (plugin and config.get("model_runner", "v1") == "v1")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        # No JIT kernel warm-up (about 30 s per engine start on the H200): kernels compile
        # on first use all the same.
        llm = LLM(
            model=model,
            seed=0,
            kernel_config={"enable_jit_warmup": False},
            speculative_config=speculative_config,
            disable_log_stats=not counters,
            **engine,
        )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stats = llm.collective_rpc("dominotree_stats")[0] if plugin else None
    if counters:
        stats = (stats or {}) | {
            m.name: getattr(m, "value", None) or getattr(m, "values", None)
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")
        }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if margins:
        from divergence_stats import top_two_margins

        return tokens, stats, [top_two_margins(o.outputs[0].logprobs) for o in outputs]
    return tokens, stats
