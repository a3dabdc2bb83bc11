"""Test configuration: the Triton interpreter on CPU, set before ``halo.kernels`` is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Compute-then-patch at every size (halo.nn.conv.PATCH_MIN_ELEMENTS: on CPU, shards this small would take
# pad-then-conv): the suite's tiny shapes then run the path large fields take. test_fast_paths checks the default.
os.environ.setdefault("HALO_PATCH_MIN_ELEMENTS", "0")

import torch  # noqa: E402 - after the environment above

# One intra-op thread in the test process: the ranks it starts need the cores, and on a loaded 2-core
# machine a multi-threaded reference conv spends more time spinning than computing.
torch.set_num_threads(1)
