"""Helpers shared by the layer tests."""

import contextlib

import torch

from halo.partition import split_offsets


@contextlib.contextmanager
def virtual_rank(full, parts, rank, module):
    """Make ``module`` see ``parts`` ranks, this being ``rank``; its exchanges slice ``full``."""
    import halo.exchange as hx

    offs = split_offsets(full.shape[-2], parts)
    fakes = {
        "group_info": lambda group: hx.GroupInfo(None, parts, rank, tuple(range(parts))),
        "shard_sizes": lambda x, dim, group=None, op="", allow_empty=False, check_grad=False: tuple(
            offs[i + 1] - offs[i] for i in range(parts)),
        "make_exchanger": lambda x, dim, group, boundary, needs=None, op="", sizes=None: needs[rank],
        "exchange": lambda x, need: full.narrow(-2, need[0], need[1] - need[0]),
    }
    saved = {name: getattr(module, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(module, name, fake)
    try:
        yield full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def portable(obj):
    """Tensors as numpy arrays (bf16 as float32), recursively: results a rank returns, in a form the tests
    compare with numpy."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj
