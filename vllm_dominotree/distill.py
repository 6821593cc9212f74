"""Self-distillation data for drafter training: prompts that are not benchmark prompts,
answered by the target itself.

    python -m vllm_dominotree.distill --target DIR --out data.jsonl [--prompts 4000]

Prompts are generated offline from templates over the Python standard library's own
modules and functions (code, explanation, writing and arithmetic tasks), so no benchmark
text can leak in; `overlap` proves it by n-gram comparison against every built-in
evaluation set (datasets.py) before any response is generated. Responses come
from the target through vLLM (greedy, chat template, thinking off) and are written as
the JSONL that `vllm_dominotree.training` reads: {"tokens": [...], "prompt_len": n}.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
from pathlib import Path

from .datasets import BUILT_IN, load_dataset

TEMPLATES = [
    "Explain what the Python function `{qualname}` does, with a short example.",
    "Write a Python function that uses `{qualname}` and explain each line.",
    "What are common mistakes when using `{qualname}` in Python? Give two examples.",
    'Summarize in plain words: "{doc}"',
    "Write a short poem about the idea behind Python's `{module}` module.",
    "Compare `{qualname}` with a way to do the same thing without the `{module}` module.",
    "A shop sells {a} pens at {b} dollars each and {c} notebooks at {d} dollars each. "
    "How much do they cost together? Explain your steps.",
    "Write unit tests for a function that wraps `{qualname}`.",
]
MODULES = ["json", "re", "math", "itertools", "functools", "collections", "pathlib", "string",
           "datetime", "random", "statistics", "textwrap", "heapq", "bisect", "fractions",
           "decimal", "csv", "difflib", "shutil", "os.path", "operator", "enum", "dataclasses",
           "typing", "hashlib", "base64", "zlib", "calendar", "secrets", "uuid"]  # fmt: skip


def _functions(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, first docstring line) of a module's public callables."""
    module = importlib.import_module(module_name)
    out = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not callable(obj):
            continue
        doc = (inspect.getdoc(obj) or "").strip().splitlines()
        if doc and 20 < len(doc[0]) < 160:
            out.append((f"{module_name}.{name}", doc[0]))
    return out


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts from the templates (deterministic for a seed)."""
    rng = random.Random(seed)
    pool = [(m, q, d) for m in MODULES for q, d in _functions(m)]
    prompts: dict[str, None] = {}
    for _ in range(50 * count):
        module, qualname, doc = rng.choice(pool)
        numbers = {k: rng.randint(2, 40) for k in "abcd"}
        template = rng.choice(TEMPLATES)
        prompts[template.format(module=module, qualname=qualname, doc=doc, **numbers)] = None
        if len(prompts) == count:
            return list(prompts)
    raise ValueError(f"could not make {count} distinct prompts from {len(pool)} functions")


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def overlap(prompts: list[str], eval_texts: list[str], n: int = 8) -> list[tuple[int, str]]:
    """(prompt index, shared n-gram) for every training prompt that shares a word
    n-gram with an evaluation text; empty means no overlap."""
    eval_grams = set().union(*(_ngrams(t, n) for t in eval_texts))
    hits = []
    for i, prompt in enumerate(prompts):
        shared = _ngrams(prompt, n) & eval_grams
        if shared:
            hits.append((i, " ".join(sorted(shared)[0])))
    return hits


def evaluation_texts() -> list[str]:
    """Every user turn of the built-in evaluation sets."""
    return [turn for name in BUILT_IN for conversation in load_dataset(name)
            for turn in conversation]  # fmt: skip


def generate(target: str, prompts: list[str], out: Path, max_tokens: int, dtype: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype=dtype, seed=0)
    tokenizer = llm.get_tokenizer()
    ids = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)  # fmt: skip
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    with out.open("w") as f:
        for prompt_ids, output in zip(ids, outputs, strict=True):
            tokens = prompt_ids + list(output.outputs[0].token_ids)
            f.write(json.dumps({"tokens": tokens, "prompt_len": len(prompt_ids)}) + "\n")
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = training_prompts(args.prompts, args.seed)
    hits = overlap(prompts, evaluation_texts())
    if hits:
        raise SystemExit(f"{len(hits)} training prompts overlap evaluation sets, e.g. {hits[0]}")
    print(f"{len(prompts)} prompts, no 8-gram shared with any evaluation prompt")
    generate(args.target, prompts, args.out, args.max_tokens, args.dtype)


if __name__ == "__main__":
    main()
