"""vLLM's Model Runner V2 on this CPU, for the V2 port's tests (docs/v2-runner-port.md).

vLLM's CPU build runs V2 only beside a Triton with a CPU backend (triton-cpu, which PyPI
does not have), because V2 prepares every step's inputs with Triton kernels. Here those
kernels run in Triton's interpreter instead: `enable()` sets TRITON_INTERPRET=1, gives
Triton's backends a stand-in "cpu" entry (vLLM's import-time check, vllm/triton_utils/
importing.py, wants one; nothing compiles through it) and keeps the engine core in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the stand-in lives in this process only). It
must run before vLLM is imported, so each engine runs in a process of its own:

    python tests/engine/v2_on_cpu.py RUNNER TARGET '{"speculative_config": ...}' [SAMPLED]

RUNNER is v1 or v2 (VLLM_USE_V2_MODEL_RUNNER). It prints one JSON line: the runner's
class, the greedy tokens of the engine tests' prompts (OPTIONS may name others,
"prompts", and "max_tokens"; the rest are LLM's arguments), or with SAMPLED that many
seeded requests of conftest.SAMPLED_PROMPT sampled with SAMPLED_LAW, and vLLM's
spec-decode counters (and the preemptions; with the plugin, its runner's report and the
counters of its /metrics block). With
"trace": true in OPTIONS the requests run under the benchmarks' worker trace
(profiling.KernelTraceExtension), and the line holds the host's milliseconds per named
stage ("host_ms").
"""

from __future__ import annotations

import json
import os
import sys
import types

# Temperature only: V2's top-k / top-p kernel (topk_topp_triton.py) fails in Triton's
# interpreter ("'int' object has no attribute 'to'").
SAMPLED_LAW = (0.9, 0, 1.0)


def enable() -> None:
    """Triton's interpreter in place of a Triton CPU backend, the engine core in process."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if "vllm" in sys.modules:
        raise RuntimeError("v2_on_cpu.enable() must run before vLLM is imported")
    from triton.backends import backends

    driver = types.SimpleNamespace(is_active=lambda: True)
    backends.setdefault("cpu", types.SimpleNamespace(driver=driver, compiler=None))


def main() -> None:
    runner, target, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = {"v1": "0", "v2": "1"}[runner]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    enable()
    from conftest import MAX_MODEL_LEN, PROMPTS, greedy, sampled_runs, spec_metrics
    from vllm import LLM

    prompts = options.pop("prompts", PROMPTS)
    max_tokens = options.pop("max_tokens", 48)
    trace = options.pop("trace", False)
    if trace:
        options["worker_extension_cls"] = "vllm_dominotree.engine.profiling.KernelTraceExtension"

    llm = LLM(
        model=target,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        skip_tokenizer_init=True,
        **options,
    )
    model_runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    if trace:
        llm.collective_rpc("kernel_trace", args=(True,))
    result = {
        "runner": f"{type(model_runner).__module__}.{type(model_runner).__name__}",
        "tokens": sampled_runs(llm, int(sys.argv[4]), SAMPLED_LAW)
        if len(sys.argv) > 4
        else greedy(llm, prompts, max_tokens),
        "spec": spec_metrics(llm),
        "preemptions": sum(
            getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"
        ),
    }
    if trace:
        result["host_ms"] = llm.collective_rpc("kernel_trace", args=(False,))[0]["host_ms"]
    if options.get("speculative_config", {}).get("method") == "dominotree":
        result["report"] = llm.collective_rpc("dominotree_stats")[0]
        result["metrics"] = {
            m.name.removeprefix("dominotree_"): m.value
            for m in llm.get_metrics()
            if m.name.startswith("dominotree_") and hasattr(m, "value")
        }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]
    main()
