"""Test configuration: the Triton interpreter on CPU, set before ``halo.kernels`` is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
