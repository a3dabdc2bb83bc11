"""Test configuration: the Triton interpreter on CPU, set before ``halo.kernels`` is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402 - after the environment above

# One intra-op thread in the test process: the ranks it starts need the cores, and on a loaded 2-core
# machine a multi-threaded reference conv spends more time spinning than computing.
torch.set_num_threads(1)
