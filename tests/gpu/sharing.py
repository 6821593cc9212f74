"""What every GPU test engine is given, so that test processes can share the GPU."""


# Each engine takes a fixed KV cache instead of a share found by vLLM's memory profiler:
# the profiler asserts that no other process frees GPU memory meanwhile, which breaks when
# several test processes share the GPU (scripts/gpu_jobs.sh parallel). The utilization is
# only the startup check's floor, small enough for six engines at once.
def engine_memory(kv_gib: float) -> dict:
    return {"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": int(kv_gib * 2**30)}
