"""Helpers shared by the layer tests."""

import contextlib

import torch

from halo.partition import split_offsets


@contextlib.contextmanager
def virtual_rank(full, parts, rank, module):
    """Make ``module`` see ``parts`` ranks, this being ``rank``: its plans are made for that split of ``full``
    (``halo.plans.resolve`` replaced by the plan's pure ``make``), and its exchanges slice ``full``."""
    import halo.exchange as hx
    from halo.comm import CommGroup

    offs = split_offsets(full.shape[-2], parts)
    cg = CommGroup(None, parts, rank, tuple(range(parts)))
    sizes = tuple(offs[i + 1] - offs[i] for i in range(parts))

    def resolve(x, group, op, make, extra=(), **kwargs):
        return make(cg, (sizes,), *extra)

    def exchange(x, ex_id, rows, dim=-2, owned=False):
        lo, hi = hx._SPECS[ex_id].needs[rank]
        assert hi - lo == rows
        return full.narrow(-2, lo, hi - lo)

    fakes = {"resolve": resolve, "exchange": exchange}
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
