"""One shifted Swin block (timm's structure, tests/test_swin.py) sharded over 2 gloo ranks vs unsharded, on CPU.

    python benchmarks/swin_attention.py [--shape 1 56 112 96] [--window 7] [--heads 3] [--iters 5] [--world 2]

``--shape``: the global (B, H, W, C) of the channels-last field; H must be a multiple of the window and split into
whole windows (``halo.shard(..., granularity=window)``). Per configuration: the median over iterations of the
slowest rank's forward + backward time (ms); per rank the bytes saved for backward (the activations the block
keeps, from autograd's saved-tensor hooks) and the peak resident memory of the process (ru_maxrss, MB, includes
torch itself); the bytes a rank sends in one step (the two rolls forward, their adjoints backward, from the
exchange plans) against the bytes of its input shard.
"""

import argparse
import copy
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _saved_bytes(fn):
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _bench(rank, world, shape, window, heads, iters):
    import torch.distributed as dist
    from test_swin import SwinTransformerBlock

    import halo
    from halo.nn import DomainSwinTransformerBlock
    from halo.nn.window import roll_needs
    from halo.plan.partition import offsets, plan_exchange, split_sizes
    from halo.tools.bench import gather_times

    torch.set_num_threads(1)
    halo.initialize_domain_parallel(world, world)
    b, h, w, c = shape
    torch.manual_seed(0)
    ref = SwinTransformerBlock(c, (h, w), num_heads=heads, window_size=window, shift_size=window // 2)
    block = DomainSwinTransformerBlock(copy.deepcopy(ref)) if world > 1 else ref
    sizes = split_sizes(h, world, window)
    offs = offsets(sizes)
    full = torch.randn(b, h, w, c)
    x = full[:, offs[rank]:offs[rank + 1]].clone().requires_grad_(True)
    g = torch.randn(x.shape)
    times, saved = [], 0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(iters + 1):
        if world > 1:
            dist.barrier()
        x.grad = None
        t0 = time.perf_counter()
        y, saved = _saved_bytes(lambda: block(x))
        y.backward(g)
        if i:
            times.append(time.perf_counter() - t0)
    elt = x.element_size()
    sent = 0
    if world > 1:
        for shift in (-(window // 2), window // 2):  # roll and roll back; the adjoints send as much back
            plan = plan_exchange(sizes, roll_needs(tuple(sizes), shift), "circular").ranks[rank]
            sent += 2 * sum(n for q, runs in plan.sends if q != rank for _, n in runs) * w * c * b * elt
    return {"ms": statistics.median(gather_times(times)) * 1e3, "saved_mb": saved / 2**20,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss0_mb": rss0 / 1024,
            "sent_mb": sent / 2**20, "act_mb": x.numel() * elt / 2**20, "rows": sizes[rank]}


def main():
    from halo.testing import run_on_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 56, 112, 96], help="global (B, H, W, C)")
    ap.add_argument("--window", type=int, default=7)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    print(f"Swin block (shift {args.window // 2}), global (B, H, W, C) = {tuple(args.shape)}, window {args.window}, "
          f"{args.heads} heads, fp32, fwd + bwd, 1 thread per rank")
    print(f"{'run':<14}{'rank':>5}{'rows':>6}{'time ms':>10}{'saved MB':>10}{'peak RSS MB':>13}"
          f"{'sent MB':>9}{'sent/act':>10}")
    for world in (1, args.world):
        res = run_on_ranks(_bench, world, args.shape, args.window, args.heads, args.iters, timeout=600)
        for r, m in enumerate(res):
            name = "unsharded" if world == 1 else f"{world} ranks"
            print(f"{name:<14}{r:>5}{m['rows']:>6}{m['ms']:>10.1f}{m['saved_mb']:>10.1f}{m['rss_mb']:>13.0f}"
                  f"{m['sent_mb']:>9.2f}{m['sent_mb'] / m['act_mb']:>10.3f}")


if __name__ == "__main__":
    main()
