"""bfloat16 on CUDA: how often speculative output leaves the target's own greedy output.

In bfloat16 a verification pass over many rows does not round exactly like one-token
decoding, so any speculative method can flip a near-tie and diverge; losslessness is
then judged as the papers do: the first-divergence rate must be no worse than vLLM's own
DFlash chain on the same prompts. Both drafters are the toy pair's, equally often
right (a plain DFlash checkpoint for vLLM's "dflash", the Domino one for DominoTree),
over the context-dependent toy target in bfloat16.
"""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_dominotree.toy_pair import PairSpec, write_drafter, write_pair

NUM_PROMPTS = 48
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-pair")
    spec = PairSpec(noise=0.8, context=1.4)
    target, domino = write_pair(root, spec)
    dflash = write_drafter(root / "dflash", spec, domino=False, shift_label=False)
    return {"target": str(target), "domino": str(domino), "dflash": str(dflash)}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 63, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 40, (NUM_PROMPTS,), generator=gen)]  # fmt: skip


def generate(target: str, speculative_config) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="bfloat16", max_model_len=512, seed=0,
              gpu_memory_utilization=0.3, speculative_config=speculative_config)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def test_first_divergence_no_worse_than_vllm_dflash(dirs):
    want = generate(dirs["target"], None)
    runs = {
        "dflash": generate(dirs["target"], {"method": "dflash", "model": dirs["dflash"],
                                             "num_speculative_tokens": 7}),
        "dominotree": generate(dirs["target"], {"method": "dominotree",
                                                "model": dirs["domino"]}),
    }  # fmt: skip
    diverged = {}
    for name, outputs in runs.items():
        points = [first_divergence(g, w) for g, w in zip(outputs, want, strict=True)]
        diverged[name] = [p for p in points if p is not None]
        print(f"{name}: {len(diverged[name])} of {NUM_PROMPTS} prompts diverge from no "
              f"speculation (first divergence at {sorted(diverged[name])})")  # fmt: skip
    # No worse: at most the chain's count, plus one prompt of slack for a single flip.
    assert len(diverged["dominotree"]) <= len(diverged["dflash"]) + 1
