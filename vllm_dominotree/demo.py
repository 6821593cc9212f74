"""The main job on the embedded default: speculative decoding on the toy pair.

    python -m vllm_dominotree.demo [--max-new-tokens N] [--noise X] [--budget B]

Writes the toy target/drafter pair (see toy_pair.py) to a cache folder, then decodes a
few prompts with the reference decoder in every mode (autoregressive, chain, marginal
tree, conditional tree), checks each against the target alone, and prints the text,
the accept lengths and the per-round stage timings.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import DominoTreeConfig
from .drafter import Drafter
from .reference import STAGES, ReferenceDecoder
from .toy_pair import PairSpec, write_pair

PROMPTS = ["the quick brown fox", "Speculative decoding", "42 trees."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--noise", type=float, default=0.8, help="drafter error knob")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dominotree",
    )
    args = parser.parse_args()
    torch.manual_seed(0)

    target_dir, drafter_dir = write_pair(args.workdir / "toy-pair", PairSpec(noise=args.noise))
    print(f"toy pair: target {target_dir}, drafter {drafter_dir}")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = Drafter.load(str(drafter_dir))
    decoders = {"ar": ReferenceDecoder(target)}
    for scorer in ("chain", "marginal", "conditional"):
        config = DominoTreeConfig(budget=args.budget, candidates=args.candidates, scorer=scorer)
        decoders[scorer] = ReferenceDecoder(target, drafter, config)

    header = f"{'mode':<12}{'tau':>6}{'tok/s':>9}" + "".join(f"{s + ' ms':>11}" for s in STAGES)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
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


if __name__ == "__main__":
    main()
