"""Run a function on N local ranks (gloo on CPU by default): the test harness, also useful to users.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes from a forkserver that has torch and
halo preloaded (a rank starts in a fraction of a second; ``spawn`` costs seconds per rank and plain ``fork``
after a threaded torch op can deadlock), initialises a process group in each, runs ``fn(rank, world_size,
*args)`` and returns the per-rank results in rank order. It is bounded in time: a rank that raises makes the
call raise with that rank's traceback, and a run that outlives ``timeout`` is killed and reported, naming the
ranks that had not finished. A hang is a failure, never a stuck test run.

Test pattern: let ``fn`` compute and *return* what it measured; assert in the parent, where all ranks'
results are seen together (so every rank reaches the same verdict and none waits alone on a failed peer).

``run_on_ranks_outcomes`` is the same launch for tests of failures (a rank that dies, a peer that never answers,
a write interrupted half-way): every rank's own outcome, ``("ok", result)``, ``("error", traceback)``,
``("died", exit code)`` or ``("timeout", None)``, instead of the first error; so a test can check that the
survivors raised the clear error they should, within their bound, rather than hang.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

__all__ = ["HostWorkCounter", "RankError", "RankTimeout", "run_on_ranks", "run_on_ranks_outcomes"]

class RankError(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


class RankTimeout(TimeoutError):
    """The ranks did not all finish in time."""


@functools.cache
def _context() -> Any:
    """The forkserver context the ranks start from, made once (a pure function of nothing: cached, not a global)."""
    ctx = mp.get_context("forkserver")
    # halo.nn too: nearly every rank converts a model, and importing the layers costs each rank ~0.2 s of CPU
    # (measured by H6), about a minute over the suite's few hundred launches on 2 cores. (torch._dynamo and
    # inductor cost ~1.5 s a rank, but only the compile tests need them: measure before preloading those.)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "halo", "halo.nn"])
    return ctx


def _worker(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, store_path: str,
            backend: str, pg_timeout: float, threads: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(store_path, world_size)
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device_id = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout), device_id=device_id)
        if backend == "gloo":
            # Every rank has its connections before any runs ``fn``: a rank whose ``fn`` fails at once must not exit
            # while a peer is still inside gloo's connectFullMesh ("Connection closed by peer" there, seen in the
            # suite, instead of the error the test expects)
            dist.barrier()
        try:
            result = fn(rank, world_size, *args)
        finally:
            from .dist import mesh
            mesh.destroy_domain_parallel()
        # Plain pickle, not the multiprocessing pickler: tensors travel by value, not as shared-memory handles
        # that die with this process before the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
        # Leave the group without a barrier: a peer that failed must not make this rank wait.
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
        except Exception:  # noqa: BLE001 - the parent will report the missing result
            pass
    finally:
        conn.close()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                 timeout: float = 120.0, pg_timeout: float | None = None, threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return results in rank order.

    Args:
        fn: a picklable (module-level) function.
        timeout: seconds for the whole run; past it every rank is killed and ``RankTimeout`` raised.
        pg_timeout: the process group's own timeout for collectives and point-to-point ops (default: the run
            timeout), so a rank whose peer died raises instead of waiting.
        threads: torch intra-op threads per rank (1: ranks share the cores fairly).

    Raises:
        RankError: a rank raised (the lowest failing rank's traceback is in the message).
        RankTimeout: not all ranks finished within ``timeout``.
    """
    with tempfile.TemporaryDirectory(prefix="halo_ranks_") as tmp:
        procs, conns = _start(fn, world_size, args, os.path.join(tmp, "store"), backend, pg_timeout or timeout, threads)
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        pending = {c: r for r, c in enumerate(conns)}
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sentinels = {procs[r].sentinel: r for r in pending.values()}
                ready = wait(list(pending) + list(sentinels), timeout=left)
                for obj in ready:
                    if obj in pending:
                        r = pending.pop(obj)
                        try:
                            results[r] = pickle.loads(obj.recv_bytes())
                        except EOFError:
                            results[r] = ("error", f"rank {r} exited without a result "
                                                   f"(exit code {procs[r].exitcode})")
                    elif obj in sentinels:
                        r = sentinels[obj]
                        conn = conns[r]
                        if conn in pending and not conn.poll(0.5):
                            pending.pop(conn)
                            procs[r].join(1)
                            results[r] = ("error", f"rank {r} died without a result "
                                                   f"(exit code {procs[r].exitcode})")
                if any(s == "error" for s, _ in results.values()):
                    # Give the others a moment to report their own errors, then stop waiting.
                    grace = time.monotonic() + 5.0
                    while pending and time.monotonic() < grace:
                        for obj in wait(list(pending), timeout=max(0.0, grace - time.monotonic())):
                            r = pending.pop(obj)
                            try:
                                results[r] = pickle.loads(obj.recv_bytes())
                            except EOFError:
                                results[r] = ("error", f"rank {r} exited without a result")
                    break
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
            for c in conns:
                c.close()

    errors = sorted((r, payload) for r, (status, payload) in results.items() if status == "error")
    if errors:
        r, payload = errors[0]
        others = [e[0] for e in errors[1:]]
        extra = f" (ranks {others} failed too)" if others else ""
        raise RankError(f"rank {r} of {world_size} failed{extra}:\n{payload}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
    return [results[r][1] for r in range(world_size)]


def _start(fn: Callable[..., Any], world_size: int, args: tuple, store_path: str, backend: str, pg_timeout: float,
           threads: int) -> tuple[list[Any], list[Any]]:
    """Start the ranks from the forkserver: their processes and the parent's ends of their result pipes."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = _context()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, name=f"halo-rank-{rank}",
                        args=(fn, rank, world_size, args, store_path, backend, pg_timeout, threads, child_conn))
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    return procs, conns


def run_on_ranks_outcomes(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                          pg_timeout: float = 30.0, backend: str = "gloo", threads: int = 1) -> list[tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` as :func:`run_on_ranks` does, but return every rank's own outcome.

    A rank that raises or dies does not hide the others (``run_on_ranks`` raises at the first error): the result
    is, in rank order, ``("ok", result)``, ``("error", "Type: message\ntraceback")``, ``("died", exit code)``
    (the process ended without sending a result) or ``("timeout", None)`` (still running at ``timeout``: killed).
    For tests of what the survivors of a failure do; ``pg_timeout`` (the process group's own bound) should be
    shorter than ``timeout`` so that a rank waiting on a dead peer reports its error instead of being killed.
    """
    with tempfile.TemporaryDirectory(prefix="halo_ranks_") as tmp:
        procs, conns = _start(fn, world_size, args, os.path.join(tmp, "store"), backend, pg_timeout, threads)
        results: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(conns))
        deadline = time.monotonic() + timeout
        try:
            while pending and time.monotonic() < deadline:
                for c in wait(list(pending.values()), timeout=deadline - time.monotonic()):
                    r = next(q for q, cc in pending.items() if cc is c)
                    del pending[r]
                    try:
                        results[r] = pickle.loads(c.recv_bytes())
                    except EOFError:
                        procs[r].join(5)
                        results[r] = ("died", procs[r].exitcode)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            for c in conns:
                c.close()
    return [results.get(r, ("timeout", None)) for r in range(world_size)]


# -- what a step costs on the host ---------------------------------------------------------------------------------

_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")
_FROM_DATA = ("tensor", "as_tensor", "asarray", "from_numpy")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                "broadcast_object_list", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "barrier",
                "batch_isend_irecv", "send", "recv")  # not isend/irecv: P2POp checks their identity


class HostWorkCounter:
    """Counts, while active, what a step asks of the host besides launching kernels.

    ====================  ===========================================================================================
    key                   counts
    ====================  ===========================================================================================
    ``read``              reads of a tensor's value into Python (``item``, ``tolist``, ``cpu``, ``bool``/``int``/
                          ``float``/``index`` of a tensor): each one waits for the device
    ``from_data``         tensors built from Python data (``torch.tensor``, ``as_tensor``, ``asarray``,
                          ``from_numpy``, ``Tensor.new_tensor``): on a GPU, a blocking host-to-device copy
    ``agreement``         halo's agreements of metadata between ranks (host data on the host group; no device sync)
    ``c10d.<name>``       calls of each ``torch.distributed`` collective or point-to-point op (agreements included)
    ====================  ===========================================================================================

    ``where[key]`` keeps a short stack of each hit (``keep_stacks=True``), to find the line that made it. Use as a
    context manager; patches are undone on exit. Not thread-safe, for tests and benchmarks.
    """

    def __init__(self, keep_stacks: bool = False) -> None:
        import collections

        self.counts: collections.Counter = collections.Counter()
        self.where: dict[str, list[str]] = collections.defaultdict(list)
        self.keep_stacks = keep_stacks
        self._saved: list[tuple[Any, str, Any]] = []

    def _hit(self, key: str) -> None:
        self.counts[key] += 1
        if self.keep_stacks:
            stack = traceback.extract_stack(limit=8)[:-2]
            self.where[key].append(" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack[::-1]))

    def _patch(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._hit(key)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> HostWorkCounter:
        import torch
        import torch.distributed as dist

        from .dist import comm
        from .parallel import layout as reduce_layout
        from .plan import agree, entry, plans

        for name in _READS:
            self._patch(torch.Tensor, name, "read")
        for name in _FROM_DATA:
            self._patch(torch, name, "from_data")
        self._patch(torch.Tensor, "new_tensor", "from_data")
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, f"c10d.{name}")
        for module in (comm, agree, entry, plans, reduce_layout):  # the modules that agree (a name imported: own copy)
            for name in ("gather_words", "all_gather_object"):
                if hasattr(module, name):
                    self._patch(module, name, "agreement")
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))
