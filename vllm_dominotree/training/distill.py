"""Self-distillation data for drafter training: prompts that are not benchmark prompts,
answered by the target itself.

    python -m vllm_dominotree.training.distill --target DIR --out data.jsonl \
        [--prompts 4000] [--self-written 0.75]

Two sources of prompts, both with no benchmark text in them:
- self-written: user turns the target writes itself, sampled from its chat template cut
  where a user's text begins (the "Magpie" recipe, Xu et al. 2024): as broad as what the
  target saw in its own chat tuning;
- templates over the Python standard library's own modules and functions (code,
  explanation, writing and arithmetic tasks).
A drafter trained on the templates alone predicts their answers far better than any
other text (the shipped drafter: first draft right 59% of the time on template prompts,
30% on the evaluation sets'; loss 4.8 on self-written prompts' answers against 1.6 on
its own data; benchmarks/results/smollm2_drafter_data.md). `overlap` proves by n-gram
comparison against every built-in evaluation set (datasets.py) that no prompt shares
text with one before any response is generated (self-written prompts that do are
dropped, templates never do). Responses come from the target through vLLM (greedy,
chat template, thinking off) and are written as the JSONL that
`vllm_dominotree.training` reads: {"tokens": [...], "prompt_len": n}.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
from pathlib import Path

from ..evaluation.datasets import BUILT_IN, chat_token_ids, load_dataset

# Four kinds of task, drawn evenly: Python (over the standard library's own functions),
# other code, arithmetic word problems with random numbers, and everyday writing.
PYTHON_TEMPLATES = [
    "Explain what the Python function `{qualname}` does, with a short example.",
    "Write a Python function that uses `{qualname}` and explain each line.",
    "What are common mistakes when using `{qualname}` in Python? Give two examples.",
    'Summarize in plain words: "{doc}"',
    "Write a short poem about the idea behind Python's `{module}` module.",
    "Compare `{qualname}` with a way to do the same thing without the `{module}` module.",
    "Write unit tests for a function that wraps `{qualname}`.",
]
CODE_TEMPLATES = [
    "Write a {language} function that {task}. Add a short docstring.",
    "In {language}, how would you write code that {task}? Show the code and explain it.",
    "Here is a task: a program that {task}. Write it in {language} and list two edge cases.",
    "Review this plan for a {language} program that {task}: loop over the input once and "
    "keep a running result. Is it correct? Write the code.",
]
CODE_TASKS = [
    "counts the vowels in a sentence",
    "reverses the words of a line of text",
    "merges two sorted lists into one sorted list",
    "finds the second largest number in a list",
    "converts a temperature from Celsius to Fahrenheit",
    "removes duplicate items but keeps order",
    "checks whether two strings are anagrams",
    "groups words by their first letter",
    "computes a running average of a stream of numbers",
    "turns a list of pairs into a dictionary",
    "finds the longest word in a text file",
    "validates that brackets in a string are balanced",
    "rotates a matrix by ninety degrees",
    "splits a list into chunks of equal size",
    "computes the greatest common divisor of two numbers",
    "counts words and sorts them by count",
    "parses a date string and prints the weekday",
    "flattens a nested list of any depth",
    "simulates rolling two dice many times and reports the frequencies",
    "implements a stack with push, pop and peek",
    "implements a small queue using two stacks",
    "encodes text with a Caesar shift",
    "finds all prime numbers below a limit",
    "returns the n-th Fibonacci number without recursion",
    "formats a number with thousands separators",
]
LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript", "Bash"]
MATH_TEMPLATES = [
    "A shop sells {a} pens at {b} dollars each and {c} notebooks at {d} dollars each. "
    "How much do they cost together? Explain your steps.",
    "A train travels {a}0 kilometers in {b} hours. What is its average speed, and how far "
    "does it go in {c} hours at that speed?",
    "Solve for x: {a}x + {b} = {c}{d}. Show each step.",
    "What is {a}% of {b}{c}? Explain how to compute it.",
    "A rectangle is {a} meters long and {b} meters wide. Find its area and its perimeter.",
    "Tom is {a} years old and his sister is {b} years older. How old will they be together "
    "in {c} years?",
    "Add the fractions {a}/{b} and {c}/{d} and simplify the result.",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people?",
    "Is {a}{b}{c} divisible by {d}? Explain with the remainder.",
]
WRITING_TEMPLATES = [
    "Write a short story about a {adjective} {animal} who wants to {goal}.",
    "Give {a} practical tips for {activity}.",
    "Explain the difference between {thing} and {other} to a ten-year-old.",
    "Write a polite email to a {person} about {topic}.",
    "Describe a day in the life of a {person} in five sentences.",
    "What are the pros and cons of {activity}? Answer in a short list.",
    "Write a haiku about {topic}.",
    "Plan a {a}-day trip for someone who likes {activity}. Keep it brief.",
    "Pretend you are a {person}. Introduce yourself and describe your work.",
    "Explain how {process} works, step by step, in simple words.",
    "Write a short dialogue between a {person} and a {animal} about {topic}.",
    "Summarize the main arguments for and against {debate}.",
    "Suggest {a} creative names for a shop that sells {goods}, with one line each.",
    "Write a limerick about a {adjective} {person}.",
]
ADJECTIVES = [
    "curious",
    "tired",
    "brave",
    "tiny",
    "grumpy",
    "clever",
    "lonely",
    "cheerful",
    "forgetful",
    "stubborn",
    "gentle",
    "noisy",
]
ANIMALS = [
    "fox",
    "turtle",
    "owl",
    "otter",
    "goat",
    "whale",
    "sparrow",
    "hedgehog",
    "lizard",
    "badger",
    "penguin",
    "squirrel",
]
GOALS = [
    "learn to sing",
    "cross the river",
    "find a lost key",
    "open a bakery",
    "see the ocean",
    "win a race",
    "make a new friend",
    "build a boat",
    "climb a mountain",
    "write a book",
]
ACTIVITIES = [
    "learning to cook",
    "running in winter",
    "saving money",
    "gardening on a balcony",
    "studying for exams",
    "working from home",
    "painting with watercolors",
    "keeping a journal",
    "learning a new language",
    "hiking with kids",
    "baking bread",
    "cycling to work",
    "bird watching",
    "playing chess",
]
THINGS = [
    "weather",
    "climate",
    "a virus",
    "bacteria",
    "a lake",
    "a sea",
    "speed",
    "velocity",
    "a planet",
    "a star",
    "rent",
    "a mortgage",
    "memory",
    "storage",
    "a comet",
    "an asteroid",
    "a law",
    "a rule",
]
PEOPLE = [
    "teacher",
    "neighbor",
    "landlord",
    "colleague",
    "nurse",
    "librarian",
    "baker",
    "bus driver",
    "farmer",
    "software tester",
    "pilot",
    "museum guide",
]
TOPICS = [
    "a late delivery",
    "the autumn rain",
    "a broken window",
    "a team lunch",
    "the first snow",
    "a noisy street",
    "a new schedule",
    "an old bicycle",
    "a lost umbrella",
    "the city park",
]
PROCESSES = [
    "a rainbow forms",
    "bread rises",
    "a bicycle gear works",
    "a fridge keeps food cold",
    "plants make food from light",
    "a compass finds north",
    "ice melts",
    "a vaccine trains the body",
    "a search engine ranks pages",
]
DEBATES = [
    "school uniforms",
    "working four days a week",
    "banning cars in city centers",
    "homework for young children",
    "paying with cash only",
]
GOODS = ["tea", "old maps", "houseplants", "bicycles", "handmade soap", "board games"]
MODULES = [
    "json",
    "re",
    "math",
    "itertools",
    "functools",
    "collections",
    "pathlib",
    "string",
    "datetime",
    "random",
    "statistics",
    "textwrap",
    "heapq",
    "bisect",
    "fractions",
    "decimal",
    "csv",
    "difflib",
    "shutil",
    "os.path",
    "operator",
    "enum",
    "dataclasses",
    "typing",
    "hashlib",
    "base64",
    "zlib",
    "calendar",
    "secrets",
    "uuid",
]


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


def _prompt(rng: random.Random, pool: list[tuple[str, str, str]]) -> str:
    kind = rng.randrange(4)
    numbers = {k: rng.randint(2, 40) for k in "abcd"}
    if kind == 0:
        module, qualname, doc = rng.choice(pool)
        return rng.choice(PYTHON_TEMPLATES).format(module=module, qualname=qualname, doc=doc)
    if kind == 1:
        return rng.choice(CODE_TEMPLATES).format(
            language=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS)
        )
    if kind == 2:
        return rng.choice(MATH_TEMPLATES).format(**numbers)
    thing, other = rng.sample(THINGS, 2)
    return rng.choice(WRITING_TEMPLATES).format(
        adjective=rng.choice(ADJECTIVES),
        animal=rng.choice(ANIMALS),
        goal=rng.choice(GOALS),
        activity=rng.choice(ACTIVITIES),
        thing=thing,
        other=other,
        person=rng.choice(PEOPLE),
        topic=rng.choice(TOPICS),
        process=rng.choice(PROCESSES),
        debate=rng.choice(DEBATES),
        goods=rng.choice(GOODS),
        **numbers,
    )


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts (deterministic for a seed; a shorter list is a prefix)."""
    rng = random.Random(seed)
    pool = [(m, q, d) for m in MODULES for q, d in _functions(m)]
    prompts: dict[str, None] = {}
    for _ in range(50 * count):
        prompts[_prompt(rng, pool)] = None
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
    return [
        turn for name in BUILT_IN for conversation in load_dataset(name) for turn in conversation
    ]


USER_TEXT = "\x00user-text\x00"  # where a user's text begins in the chat template


def user_turn_prefix(tokenizer) -> str:
    """The chat template up to where a user's text begins (its system turn, if any,
    and the user turn's header)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": USER_TEXT}], tokenize=False, enable_thinking=False
    )
    if USER_TEXT not in text:
        raise ValueError("the chat template does not render the user's text verbatim")
    return text[: text.index(USER_TEXT)]


def self_written_prompts(llm, count: int, max_tokens: int = 96) -> list[str]:
    """`count` distinct user turns the target writes itself: sampled at temperature 1
    (top-p 0.95) from its chat template's user-turn prefix, kept when they end their
    turn within max_tokens, are 20-1000 characters long and share no 8-gram with any
    evaluation prompt. Repeatable for the engine's seed."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    # No per-request seeds: vLLM's CPU sampler refuses them with top-p; the engine's
    # seed makes the draws repeatable.
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens)
    eval_texts = evaluation_texts()
    prompts: dict[str, None] = {}
    drawn = 0
    for _ in range(20):
        asked = 2 * (count - len(prompts)) + 16  # about half are kept
        drawn += asked
        outputs = llm.generate([{"prompt_token_ids": prefix}] * asked, params, use_tqdm=False)
        texts = [o.outputs[0].text.strip() for o in outputs if o.outputs[0].finish_reason == "stop"]
        texts = [t for t in texts if 20 <= len(t) <= 1000]
        leaked = {i for i, _ in overlap(texts, eval_texts)}
        for i, text in enumerate(texts):
            if i not in leaked and len(prompts) < count:
                prompts[text] = None
        if len(prompts) == count:
            return list(prompts)
    raise ValueError(f"the target wrote {len(prompts)} usable prompts of {count} in {drawn}")


def answer(llm, prompts: list[str], out: Path, max_tokens: int) -> None:
    """Greedy responses through vLLM, written to `out` only when all are done."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    ids = [chat_token_ids(tokenizer, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w") as f:
        for prompt_ids, output in zip(ids, outputs, strict=True):
            tokens = prompt_ids + list(output.outputs[0].token_ids)
            f.write(json.dumps({"tokens": tokens, "prompt_len": len(prompt_ids)}) + "\n")
    partial.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument(
        "--self-written",
        type=float,
        default=0.75,
        help="the fraction of prompts the target writes itself (the rest: templates)",
    )
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    if not 0 <= args.self_written <= 1:
        parser.error("--self-written is a fraction between 0 and 1")
    from vllm import LLM

    written = round(args.self_written * args.prompts)
    templates = training_prompts(args.prompts - written, args.seed)
    llm = LLM(model=args.target, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs)
    prompts = self_written_prompts(llm, written) + templates
    hits = overlap(prompts, evaluation_texts())
    if hits:
        raise SystemExit(f"{len(hits)} training prompts overlap evaluation sets, e.g. {hits[0]}")
    print(
        f"{len(prompts)} prompts ({written} written by the target), "
        "no 8-gram shared with any evaluation prompt",
        flush=True,
    )
    answer(llm, prompts, args.out, args.max_tokens)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
