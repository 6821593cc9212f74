"""The engine drafts the same trees as the reference decoder: the drafter's context is
exactly the accepted rows.

After a verification step the drafter takes the step's rows as its new context, at the
rows' positions: vLLM's DFlash proposer derives each context row's drafter KV slot from
its position (`set_inputs_first_pass`, `copy_and_expand_dflash_inputs_kernel`), and only
the slots up to the last accepted row count. The runner therefore has to give the root
and the accepted path the linear positions start .. start + k and every rejected row a
position past them. If a rejected row kept its tree position (start + depth) with a
depth <= k, it would share a slot with the accepted row of that depth, the drafter would
see whichever row was written last, and the next tree would be drafted from a context
the target never committed. Greedy outputs stay right (verification catches everything),
so only the trees, and hence the acceptance per round, show it.

The check: per prompt, the tokens committed per verification round must equal the
reference decoder's (vllm_dominotree/reference.py, which appends exactly the accepted
rows to the drafter's context) for the same target, drafter, scorer and max_tokens. The
prompts share one batch (a request's trees depend only on its own rows) and the engine
is stepped, so that each step's new tokens are one round's commit for each request. The
chain scorer is the control: its rejected rows are all deeper than its accepted path,
so it agrees whether or not rejected rows keep their tree positions; if it disagrees,
the comparison itself is not like-for-like.

The shared toy drafter barely reads its context (its backbone's output projections are
PairSpec.backbone_noise = 0.02), so a wrong context rarely changes a tree. This module
writes a drafter for the same target whose backbone reads it five times more
(backbone_noise 0.1): drafts stay good (more than 2 tokens per round), and a drafter
context with rejected rows in it changes the acceptance within 48 tokens on several of
the prompts.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.demo.toy_pair import PairSpec, write_drafter

from .conftest import PROMPTS, make_llm, shutdown

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
# conftest's pair (noise 0.8, context 1.4) with a drafter that depends on its context.
# The target depends on neither noise nor backbone_noise: it is pair_dirs["target"].
CONTEXT_DRAFTER = PairSpec(noise=0.8, context=1.4, backbone_noise=0.1)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> str:
    return str(write_drafter(tmp_path_factory.mktemp("context-drafter"), CONTEXT_DRAFTER))


@pytest.fixture(scope="module")
def reference_models(pair_dirs, drafter_dir):
    from transformers import AutoModelForCausalLM

    from vllm_dominotree.drafter import Drafter

    target = AutoModelForCausalLM.from_pretrained(pair_dirs["target"], dtype=torch.float32)
    return target.eval(), Drafter.load(drafter_dir)


def reference_commits(reference_models, scorer: str, prompt: list[int]) -> list[int]:
    """Tokens committed per round by the reference decoder, cut at MAX_TOKENS the way the
    engine cuts its output (the prefill's token counts first)."""
    from vllm_dominotree.config import DominoTreeConfig
    from vllm_dominotree.reference import ReferenceDecoder

    target, drafter = reference_models
    # DominoTreeConfig's defaults (budget 16, candidates 64), as the engine below sets.
    result = ReferenceDecoder(target, drafter, DominoTreeConfig(scorer=scorer)).generate(
        prompt, MAX_TOKENS
    )
    commits, produced = [], 1
    for length in result.accept_lengths:
        commits.append(min(length, MAX_TOKENS - produced))
        produced += commits[-1]
    return commits


def engine_commits(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Tokens committed per verification step, per request (all requests in one batch:
    each request's trees depend only on its own rows)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    steps: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        steps[str(i)] = []
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids:
                steps[out.request_id].append(len(out.outputs[0].token_ids))
    for per_step in steps.values():
        assert per_step[0] == 1 and sum(per_step) == MAX_TOKENS, per_step
    return [steps[str(i)][1:] for i in range(len(prompts))]  # step 0: the prefill's token


@pytest.mark.parametrize("scorer", ["chain", "conditional"])
def test_engine_rounds_match_the_reference_decoder(
    scorer, pair_dirs, drafter_dir, reference_models
):
    # The reference decodes one request at a time: its trees are whole, so the engine's
    # batch must not share out leaves or nodes (step_leaves, step_nodes) for the rounds
    # to compare.
    spec = {"method": "dominotree", "model": drafter_dir, "scorer": scorer, "budget": 16}
    llm = make_llm(pair_dirs, {**spec, "step_leaves": 0, "step_nodes": 0})
    try:
        engine = engine_commits(llm, PROMPTS)
    finally:
        shutdown(llm)
    reference = [reference_commits(reference_models, scorer, p) for p in PROMPTS]
    mismatches = [
        f"prompt {i}: {len(e)} rounds in the engine, {len(r)} in the reference\n"
        f"  engine    {e}\n  reference {r}"
        for i, (e, r) in enumerate(zip(engine, reference, strict=True))
        if e != r
    ]
    assert not mismatches, f"{scorer}: tokens committed per round differ\n" + "\n".join(mismatches)
    # The comparison only means something if trees take partial, deep and varied paths.
    lengths = [n for e in engine for n in e[:-1]]
    assert sum(lengths) / len(lengths) > 2.0 and max(lengths) >= 5 and min(lengths) == 1
