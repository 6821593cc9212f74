import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the H200)", allow_module_level=True)

# The tests touch CUDA before creating engines; forked engine processes could not.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
