"""spec-cli: speculative decoding of GGUF models in PyTorch, shaped like llama.cpp's tools."""

import os

# Thread policy, set before torch loads OpenMP: torch's own threads sleep as soon as a parallel region ends instead of
# spinning (they would fight the compiled kernels' pool for the cores, and other processes on a busy machine: 2
# threads ran at half the speed of 1 with OpenMP's default). The kernels' workers spin for SPEC_CLI_SPIN_US (1000)
# after a task, enough to stay hot from one layer to the next and one token to the next, then sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
