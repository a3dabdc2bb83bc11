"""The old module paths (halo's flat modules before issue 31's packages) keep working for one release: each is the
same module object as its new path (a monkeypatch or an isinstance through the old path sees the real thing), and
importing it warns with the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from halo._moved import MOVED

#: every flat module of the last release that moved (halo.exchange, halo.io, halo.check, halo.guard and
#: halo.parallel are packages of the same name now)
OLD = {"agree", "comm", "entry", "exchange_ops", "exchange_registry", "exchanger", "geometry", "groups",
       "guard_follow", "guard_ops", "guard_rules", "io_grid", "io_steps", "io_watch", "io_write", "mesh",
       "partition", "plans", "reduce", "reduce_grads", "reduce_layout", "reduce_marks", "reduce_weights",
       "replicated", "reroute", "sampler", "transport", "check_boundary", "check_record", "check_report"}


def test_every_old_module_has_an_alias():
    assert {f"halo.{m}" for m in OLD} == set(MOVED)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        aliased = importlib.import_module(old)
    assert aliased is new
    assert new.__spec__.name == MOVED[old] and new.__name__ == MOVED[old]  # the alias leaves the real spec alone


def test_the_old_forms_of_import_work_in_a_fresh_interpreter():
    """``from halo import plans``, ``import halo.reduce as r``, a name from an old path, and the old module
    ``halo.parallel``'s names from the package of that name."""
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from halo import plans, reduce_marks\n"
            "import halo.reduce as r\n"
            "from halo.comm import set_timeout\n"
            "from halo.parallel import parallelize, data_parallel_mesh, DATA_PARALLEL\n"
            "import halo.plan.plans, halo.parallel.reduce, halo.dist.comm, halo\n"
            "assert plans is halo.plan.plans and r is halo.parallel.reduce\n"
            "assert set_timeout is halo.dist.comm.set_timeout is halo.set_timeout\n"
            "assert parallelize is halo.parallelize and 'ddp' in DATA_PARALLEL\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_layers_have_one_prefix_and_the_old_names_resolve():
    """halo.nn's layers are ``Domain*`` (the ``Halo*`` half renamed); each old name, from ``halo.nn``, is the same
    class with a DeprecationWarning naming the new one, and, from its defining module, the same class (so pickles of
    converted models made before the rename load)."""
    import pickle

    import halo.nn
    from halo._moved import RENAMED

    layers = [n for n in halo.nn.__all__ if isinstance(getattr(halo.nn, n), type)
              and issubclass(getattr(halo.nn, n), torch.nn.Module)]
    assert layers and not [n for n in layers if not n.startswith("Domain")], layers
    assert not [n for n in halo.nn.__all__ if n.startswith("Halo")]
    defined = {k: v for name, mod in list(sys.modules.items()) if name.startswith("halo.nn.")
               for k, v in vars(mod).items() if k in RENAMED.values() and isinstance(v, type)}
    assert set(defined) == set(RENAMED.values()), set(RENAMED.values()) - set(defined)
    for old, new in RENAMED.items():
        cls = defined[new]
        if new in halo.nn.__all__:  # (the smp decoders and the base class were never halo.nn's names)
            with pytest.warns(DeprecationWarning, match=f"halo.nn.{old} is now halo.nn.{new}"):
                assert getattr(halo.nn, old) is cls
        assert getattr(sys.modules[cls.__module__], old) is cls
    with pytest.raises(AttributeError, match="HaloNoSuchLayer"):
        halo.nn.HaloNoSuchLayer  # noqa: B018
    conv = halo.nn.DomainConv2d(torch.nn.Conv2d(2, 3, 3, padding=1))
    new_pickle = pickle.dumps(conv, protocol=0)  # (protocol 0 names a class as a line: "c<module>\n<name>\n")
    assert b"\nDomainConv2d\n" in new_pickle
    old_pickle = new_pickle.replace(b"\nDomainConv2d\n", b"\nHaloConv2d\n")  # as the last release wrote it
    assert type(pickle.loads(old_pickle)) is halo.nn.DomainConv2d
