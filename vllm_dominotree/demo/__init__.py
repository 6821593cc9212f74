"""The main job (`python -m vllm_dominotree.demo`, __main__.py) and the toy pair it can
run on (toy_pair.py: a target/drafter pair whose drafts are often right, which the tests
use too)."""
