import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the H200)", allow_module_level=True)
