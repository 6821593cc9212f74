import torch, time, statistics
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
torch.set_num_threads(2)
w = torch.randn(8192, 576)
m = torch.nn.Module(); m.weight = torch.nn.Parameter(w, requires_grad=False)
dispatch_cpu_unquantized_gemm(m, remove_weight=False)
for rows in (4, 12, 16, 64):
    x = torch.randn(rows, 576)
    for name, f in (("F.linear", lambda: torch.nn.functional.linear(x, w)), ("vllm", lambda: m.cpu_linear(x, w, None)), ("bf16 F.linear", None)):
        if f is None:
            wb = w.bfloat16(); xb = x.bfloat16(); f = lambda: torch.nn.functional.linear(xb, wb)
        for _ in range(5): f()
        ts = []
        for _ in range(50):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        print(rows, name, round(statistics.median(ts) * 1e3, 3))
    print(" max diff", (torch.nn.functional.linear(x, w) - m.cpu_linear(x, w, None)).abs().max().item())
