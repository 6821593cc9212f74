"""The draft vocabulary's product on CPU: torch's F.linear against vLLM's GEMM dispatch.

    .venv/bin/python benchmarks/results/cpu_2026-12-07h_draft_gemm/gemm_micro.py

SmolLM2's lm_head rows of an 8192-token draft vocabulary (576 wide, float32), over the
rows a step's trees draft from (budget 4: 4 a request); median of 50 calls, ms.
"""

import statistics
import time

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm


def median_ms(fn) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    weight = torch.randn(8192, 576)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    weight_bf16 = weight.bfloat16()
    for rows in (4, 12, 16, 64):
        x = torch.randn(rows, 576)
        x_bf16 = x.bfloat16()
        products = {
            "F.linear": lambda x=x: torch.nn.functional.linear(x, weight),
            "vllm": lambda x=x: layer.cpu_linear(x, weight, None),
            "bf16 F.linear": lambda x=x_bf16: torch.nn.functional.linear(x, weight_bf16),
        }
        for name, product in products.items():
            print(rows, name, round(median_ms(product), 3))
        diff = products["F.linear"]() - products["vllm"]()
        print(" max diff", diff.abs().max().item())


if __name__ == "__main__":
    main()
