"""Making a drafter: the SmolLM2 conversion (smollm2.py), self-distilled data
(distill.py) and the training loop in resumable chunks (trainer.py). Tools a user runs,
not part of the plugin's runtime:

    python -m vllm_dominotree.training.smollm2 OUT_DIR [--gguf FILE]
    python -m vllm_dominotree.training.distill --target DIR --out data.jsonl
    python -m vllm_dominotree.training --target DIR --data FILE.jsonl --out DIR --minutes M
"""
