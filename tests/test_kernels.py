"""halo.kernels: the reference against plain torch formulas, and the Triton kernels against the reference.

The Triton tests run twice: on CPU through Triton's interpreter (``impl="triton"`` on CPU tensors always
interprets, whatever ``TRITON_INTERPRET`` says) and compiled on CUDA where a GPU exists. Copies (pack,
unpack) must agree bit for bit; outputs are poisoned first so an element a kernel never writes fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import halo.kernels as hk
from halo.kernels import reference as ref
from halo.kernels.layout import MAX_RANK, UnsupportedLayout, plan

needs_triton = pytest.mark.skipif(
    not hk.HAS_TRITON, reason=f"triton is not importable ({hk.TRITON_IMPORT_ERROR})"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (this test's CPU form runs Triton's interpreter)"
)
DEVICES = [
    pytest.param("cpu", marks=needs_triton, id="interpreter"),
    pytest.param("cuda", marks=[needs_triton, needs_cuda], id="cuda"),
]
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "channels_last", "permuted", "narrowed", "stepped", "expanded"]
# pack_adjoint sums. Both paths add in fp32 (fp64 for fp64) in range order and round once, so they normally
# agree bit for bit; allow one rounding of the output dtype (another valid summation order, or the extra
# rounding per chunk beyond MAX_RANGES ranges): rtol = eps, atol = eps x 16 (partial sums reach ~|16|).
SUM_TOL = {dt: (16 * torch.finfo(dt).eps, torch.finfo(dt).eps) for dt in FLOATS}
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


def rand(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def make(shape, layout: str, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """A tensor of logical ``shape`` whose memory follows ``layout`` (views share a larger storage)."""
    gen = torch.Generator().manual_seed(seed)
    nd = len(shape)
    if layout == "channels_last" and nd in (4, 5):
        fmt = torch.channels_last if nd == 4 else torch.channels_last_3d
        return rand(shape, dtype, gen).to(device).contiguous(memory_format=fmt)
    if layout in ("permuted", "channels_last"):
        perm = torch.randperm(nd, generator=gen).tolist()
        base = rand([shape[p] for p in perm], dtype, gen).to(device)
        return base.permute([perm.index(i) for i in range(nd)])
    if layout == "narrowed":  # every dim a window of a larger tensor: storage offset, padded strides
        x = rand([s + 3 for s in shape], dtype, gen).to(device)
        for i, s in enumerate(shape):
            x = x.narrow(i, 1, s)
        return x
    if layout == "expanded":  # stride 0 along every other dim (inputs only: outputs must not overlap)
        return rand([1 if i % 2 else s for i, s in enumerate(shape)], dtype, gen).to(device).expand(*shape)
    if layout == "stepped":
        x = rand([2 * s + 1 for s in shape], dtype, gen).to(device)
        return x[tuple(slice(1, None, 2) for _ in shape)]
    return rand(shape, dtype, gen).to(device)


def poisoned(expected: torch.Tensor, view: bool) -> torch.Tensor:
    """A tensor shaped like ``expected`` that differs from it everywhere, optionally a view into more."""
    if view:  # a window of a larger buffer, like a padded activation the caller owns
        big = torch.empty([s + 2 for s in expected.shape], dtype=expected.dtype, device=expected.device)
        out = big[tuple(slice(1, s + 1) for s in expected.shape)]
    else:
        out = torch.empty_like(expected)
    if expected.dtype.is_floating_point:
        return out.fill_(float("nan"))
    return out.copy_(~expected if expected.dtype == torch.bool else expected + 1)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.cpu().contiguous(), want.cpu().contiguous()
    if got.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        got, want = got.view(bits), want.view(bits)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"


@st.composite
def cases(draw, ndims=(3, 4, 5)):
    """(shape, dim, layout, ranges, seed) with odd sizes, overlapping and empty ranges."""
    nd = draw(st.sampled_from(ndims))
    # Small extents keep the interpreter's grid small (each program costs ~ms there): <= 7^3, 6^4, 5^5.
    shape = draw(st.lists(st.integers(1, 10 - nd), min_size=nd, max_size=nd))
    dim = draw(st.sampled_from([-1, -2, *range(nd)]))
    n = shape[dim]
    one_range = st.integers(0, n).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, n - s)))
    ranges = draw(st.lists(one_range, max_size=5))
    return shape, dim, draw(st.sampled_from(LAYOUTS)), ranges, draw(st.integers(0, 2**31 - 1))


def cat_pack(x, dim, ranges):
    rest = [s for i, s in enumerate(x.shape) if i != dim % x.dim()]
    blocks = [x.narrow(dim, s, n).movedim(dim, 0) for s, n in ranges]
    return torch.cat(blocks) if blocks else x.new_empty((0, *rest))


# ---------------------------------------------------------------- the reference against torch formulas


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(0, 3), st.integers(0, 3))
def test_reference_matches_cat(case, rows_lo, rows_hi):
    shape, dim, layout, ranges, seed = case
    x = make(shape, layout, torch.float64, seed)
    assert_bitwise(ref.pack(x, dim, ranges), cat_pack(x, dim, ranges).contiguous())
    assert ref.pack(x, dim, ranges).is_contiguous()
    rest = cat_pack(x, dim, [(0, 0)]).shape[1:]
    lo = make((rows_lo, *rest), "contiguous", x.dtype, seed + 1)
    hi = make((rows_hi, *rest), "contiguous", x.dtype, seed + 2)
    out = ref.unpack(x, lo, hi, dim)
    assert_bitwise(out, torch.cat([lo.movedim(0, dim), x, hi.movedim(0, dim)], dim))
    if x.dim() == 4 and layout == "channels_last" and not x.is_contiguous():
        assert out.is_contiguous(memory_format=torch.channels_last)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_reference_pack_adjoint_is_the_adjoint(case):
    """Against autograd of the cat formula, and <pack x, b> == <x, pack_adjoint(0, b)> in float64."""
    shape, dim, layout, ranges, seed = case
    grad = make(shape, layout, torch.float64, seed)
    buf = make(cat_pack(grad, dim, ranges).shape, "contiguous", torch.float64, seed + 1)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    packed = cat_pack(x, dim, ranges)
    vjp = torch.autograd.grad(packed, x, buf)[0] if packed.requires_grad else torch.zeros_like(grad)
    torch.testing.assert_close(ref.pack_adjoint(grad, dim, ranges, buf), grad + vjp, rtol=1e-12, atol=1e-12)
    lhs = (ref.pack(x.detach(), dim, ranges) * buf).sum()
    rhs = (x.detach() * ref.pack_adjoint(torch.zeros_like(grad), dim, ranges, buf)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


def test_reference_low_precision_sums_in_fp32():
    grad = torch.full((4, 3), 256.0, dtype=torch.bfloat16)  # 256 + 1 + 1 in bf16 steps stays 256; in fp32 258
    buf = torch.ones((2, 3), dtype=torch.bfloat16)
    out = ref.pack_adjoint(grad, 0, [(1, 1), (1, 1)], buf)
    assert out[1].tolist() == [258.0] * 3 and out[0].tolist() == [256.0] * 3


# ---------------------------------------------------------------- Triton against the reference


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(case=cases(), view=st.booleans())
def test_pack_triton_matches_reference(device, dtype, case, view):
    shape, dim, layout, ranges, seed = case
    x = make(shape, layout, dtype, seed, device)
    want = ref.pack(x, dim, ranges)
    assert_bitwise(hk.pack(x, dim, ranges, impl="triton"), want)
    out = poisoned(want, view)
    assert hk.pack(x, dim, ranges, out=out, impl="triton") is out
    assert_bitwise(out, want)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(case=cases(), rows_lo=st.integers(0, 3), rows_hi=st.integers(0, 3), view=st.booleans())
def test_unpack_triton_matches_reference(device, dtype, case, rows_lo, rows_hi, view):
    shape, dim, layout, _, seed = case
    x = make(shape, layout, dtype, seed, device)
    rest = ref.pack(x, dim, []).shape[1:]
    lo = make((rows_lo, *rest), "contiguous", dtype, seed + 1, device)
    hi = make((rows_hi, *rest), "contiguous", dtype, seed + 2, device)
    want = ref.unpack(x, lo, hi, dim)
    got = hk.unpack(x, lo, hi, dim, impl="triton")
    assert_bitwise(got, want)
    assert got.stride() == want.stride()  # the same memory format as the reference allocates
    out = poisoned(want, view)
    assert hk.unpack(x, lo, hi, dim, out, impl="triton") is out
    assert_bitwise(out, want)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(case=cases())
def test_pack_adjoint_triton_matches_reference(device, dtype, case):
    shape, dim, layout, ranges, seed = case
    grad = make(shape, layout, dtype, seed, device)
    buf = make(ref.pack(grad, dim, ranges).shape, "contiguous", dtype, seed + 1, device)
    want = ref.pack_adjoint(grad, dim, ranges, buf)
    got = hk.pack_adjoint(grad, dim, ranges, buf, impl="triton")
    atol, rtol = SUM_TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert got.stride() == want.stride()
    out = poisoned(want, view=True)
    torch.testing.assert_close(hk.pack_adjoint(grad, dim, ranges, buf, out=out, impl="triton"), want,
                               atol=atol, rtol=rtol)


NAMED = [  # (shape, layout, dim, ranges): the cases an exchange produces, and the edges
    ((2, 5, 9, 7), "contiguous", -2, [(0, 2), (7, 2)]),  # both halo sides of H
    ((2, 5, 9, 7), "channels_last", -2, [(0, 1), (8, 1)]),
    ((2, 5, 9, 7), "channels_last", -1, [(0, 3), (4, 3)]),
    ((3, 9, 6), "narrowed", -1, [(1, 4), (0, 6), (3, 0), (5, 1)]),  # overlapping and zero-length, 3-D
    ((2, 3, 4, 5, 6), "channels_last", 2, [(0, 4), (1, 2)]),  # 5-D channels_last_3d
    ((2, 3, 11, 5), "stepped", 2, [(k, 2) for k in range(10)]),  # > MAX_RANGES: chunked launches
    ((2, 3, 5, 4), "contiguous", -2, []),  # no ranges at all
    ((1, 1, 1, 1), "contiguous", -1, [(0, 1), (0, 1), (0, 0)]),
]


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "layout", "dim", "ranges"), NAMED)
def test_named_cases(device, shape, layout, dim, ranges):
    x = make(shape, layout, torch.float32, 0, device)
    want = ref.pack(x, dim, ranges)
    assert_bitwise(hk.pack(x, dim, ranges, out=poisoned(want, True), impl="triton"), want)
    grad = make(shape, layout, torch.bfloat16, 1, device)
    buf = make(want.shape, "contiguous", torch.bfloat16, 2, device)
    want_adj = ref.pack_adjoint(grad, dim, ranges, buf)
    atol, rtol = SUM_TOL[torch.bfloat16]
    got_adj = hk.pack_adjoint(grad, dim, ranges, buf, impl="triton")
    torch.testing.assert_close(got_adj, want_adj, atol=atol, rtol=rtol)
    lo, hi = want[:1], want[1:]
    assert_bitwise(hk.unpack(x, lo, hi, dim, poisoned(ref.unpack(x, lo, hi, dim), True), impl="triton"),
                   ref.unpack(x, lo, hi, dim))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool])
def test_integer_and_bool_copies(device, dtype):
    x = make((2, 3, 7, 5), "channels_last", dtype, 3, device)
    ranges = [(0, 2), (5, 2), (1, 3)]
    want = ref.pack(x, -2, ranges)
    assert_bitwise(hk.pack(x, -2, ranges, out=poisoned(want, False), impl="triton"), want)
    lo, hi = want[:3], want[3:]
    expected = ref.unpack(x, lo, hi, -2)
    assert_bitwise(hk.unpack(x, lo, hi, -2, poisoned(expected, True), impl="triton"), expected)
    assert hk.backend_for(x, "pack_adjoint") == "reference"  # sums of integers take the reference
    assert_bitwise(hk.pack_adjoint(x, -2, ranges, want), ref.pack_adjoint(x, -2, ranges, want))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_in_place_forms(device):
    """unpack into the buffer x already sits in writes the halos only; pack_adjoint(out=grad) accumulates."""
    big = make((2, 3, 12, 6), "channels_last", torch.float32, 4, device)
    x = big.narrow(2, 2, 7)
    lo = make((2, 2, 3, 6), "contiguous", torch.float32, 5, device)
    hi = make((3, 2, 3, 6), "contiguous", torch.float32, 6, device)
    out = big.narrow(2, 0, 12)
    want = torch.cat([lo.movedim(0, 2), x, hi.movedim(0, 2)], 2)
    assert hk.unpack(x, lo, hi, 2, out, impl="triton") is out
    assert_bitwise(out, want)
    grad = make((2, 3, 9, 5), "contiguous", torch.float64, 7, device)
    buf = make((5, 2, 3, 5), "contiguous", torch.float64, 8, device)
    want = ref.pack_adjoint(grad, 2, [(0, 2), (6, 3)], buf)
    assert hk.pack_adjoint(grad, 2, [(0, 2), (6, 3)], buf, out=grad, impl="triton") is grad
    torch.testing.assert_close(grad, want, rtol=0, atol=0)  # fp64, one add per element: exact


# ---------------------------------------------------------------- dispatch, layout folding, errors


def test_dispatch(monkeypatch):
    x = torch.zeros(2, 3, 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert hk.backend_for(x) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hk.backend_for(x) == ("triton" if hk.HAS_TRITON else "reference")
    assert hk.backend_for(x.to(torch.complex64)) == "reference"
    with pytest.raises(ValueError, match="impl must be"):
        hk.pack(x, 0, [(0, 1)], impl="cuda")
    if hk.HAS_TRITON:
        calls = []
        real = hk.dispatch.triton_kernels.unpack
        monkeypatch.setattr(hk.dispatch.triton_kernels, "unpack", lambda *a: calls.append(1) or real(*a))
        hk.unpack(x, x[:1], x[:0], 0)
        assert calls == [1]  # TRITON_INTERPRET=1 sends CPU tensors through the interpreter
    else:
        with pytest.raises(RuntimeError, match="needs triton"):
            hk.pack(x, 0, [(0, 1)], impl="triton")


def test_layout_folding():
    # unpack's interior of a contiguous NCHW activation along H: out and x fold to (N*C, H*W) rows.
    out, x = torch.empty(2, 3, 11, 8), torch.empty(2, 3, 9, 8)
    p = plan(tuple(x.shape), -1, (out.narrow(2, 1, 9).stride(), x.stride()))
    assert p.sizes == (1, 1, 1, 6, 72) and p.dim_axis == -1
    # channels_last x into a dim-major buffer along H: the tile spans C (x's fastest), W (buffer's fastest).
    x = torch.empty(2, 5, 9, 7).contiguous(memory_format=torch.channels_last)
    buf = torch.empty(2, 2, 5, 7).movedim(0, 2)
    p = plan((2, 5, 2, 7), 2, (buf.stride(), x.stride()))
    assert p.sizes[3:] == (5, 7) and p.strides[1][3:] == (1, 5) and p.strides[0][3:] == (7, 1)
    assert plan((7, 1440), -1, ((1536, 1), (1440, 1)), tile=4096).bn == 512  # 1440 lanes: 512 wide, 6 % idle
    y = torch.empty(2, 3, 2, 3, 2, 3).permute(5, 3, 1, 4, 2, 0)  # six axes nothing can fold
    with pytest.raises(UnsupportedLayout):
        plan(tuple(y.shape), 0, (torch.empty(y.shape).stride(), y.stride()))
    assert MAX_RANK == 5
    if hk.HAS_TRITON:  # the dispatcher falls back to the reference for such layouts
        assert_bitwise(hk.pack(y, 0, [(0, 2)], impl="triton"), ref.pack(y, 0, [(0, 2)]))


def test_errors_name_the_numbers():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"dim 3 is out of range for a 3-D tensor"):
        ref.pack(x, 3, [])
    with pytest.raises(ValueError, match=r"start 3, length 2.*within the 4 rows"):
        hk.pack(x, -1, [(3, 2)])
    with pytest.raises(ValueError, match=r"expected a torch.float32 tensor of shape \(3, 2, 3\)"):
        hk.pack_adjoint(x, -1, [(0, 3)], torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match=r"unpack lo: expected a dim-major buffer"):
        hk.unpack(x, torch.zeros(1, 2, 3), torch.zeros(0, 2, 4), 1)


@needs_triton
@needs_cuda
def test_cuda_offsets_beyond_int32():
    """> 2**31 elements: every offset is int64 (program ids are cast before they multiply)."""
    cols, rows = 1024, 2**31 // 1024 + 8
    if torch.cuda.mem_get_info()[0] < 3 * rows * cols * 2 + 2**31:
        pytest.skip("needs ~16 GB of free GPU memory")
    x = torch.arange(rows, device="cuda", dtype=torch.int32).remainder_(127).to(torch.uint8)
    x = x[:, None].expand(-1, cols).contiguous()
    buf = hk.pack(x, 0, [(rows - 3, 3), (0, 1)])
    assert torch.equal(buf[:3], x[-3:]) and torch.equal(buf[3:], x[:1])
    out = hk.unpack(x, buf[:2], buf[2:], 0)
    assert torch.equal(out[-2:], buf[2:]) and torch.equal(out[2:-2], x) and torch.equal(out[:2], buf[:2])
    del out
    g = x.to(torch.bfloat16)
    del x
    adj = hk.pack_adjoint(g, 0, [(rows - 1, 1)], torch.ones(1, cols, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(adj[-1], g[-1] + 1) and torch.equal(adj[:-1], g[:-1])


def _compile_cases(fn, kernel: str):
    """(signature, constexprs, an instruction the PTX must hold) for each build of ``kernel`` checked."""
    if kernel == "PHILOX":  # draws (int32 out), dropout in bf16 (fp32 math) and float64
        for mode, f64, dt in ((0, False, "*i32"), (1, False, "*bf16"), (1, True, "*fp64")):
            consts = {"MODE": mode, "F64": f64, "BLOCK": 1024}
            sig = {a: ("*i64" if a == "key_ptr" else dt) if a.endswith("_ptr") else "i64" for a in fn.arg_names}
            sig.update(dict.fromkeys(consts, "constexpr"))
            yield sig, consts, "st.global"
        return
    tiles = {"BM": 16, "BN": 256, "AM": 1, "AN": 4096, "NR": 8, "F64": False}
    for da, int_type in ((0, "i32"), (3, "i64"), (4, "i32")):
        consts = {k: v for k, v in {**tiles, "DA": da}.items() if k in fn.arg_names}
        sig = {a: "*bf16" if a.endswith("_ptr") else int_type for a in fn.arg_names}
        sig.update(dict.fromkeys(consts, "constexpr"))
        yield sig, consts, "ld.global"


@needs_triton
@pytest.mark.parametrize("kernel", ["PACK", "UNPACK", "PACK_ADJOINT", "PHILOX"])
def test_kernels_compile_for_cuda(kernel, tmp_path, monkeypatch):
    """Code generation of the *compiled* build for sm_90 via ptxas, no GPU needed, in this process where
    TRITON_INTERPRET=1 was set before triton was imported (conftest): a kernel calling a @jit stdlib function
    (``tl.zeros``, ``tl.cdiv``) gets its interpreted build and fails here, as it would on a GPU under pytest. An
    empty cache directory: a kernel compiled earlier by a process without the interpreter cannot hide it."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this triton has no ahead-of-time compile API: {exc}")
    from halo.kernels import triton_jit

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = getattr(triton_jit, kernel)[0]
    assert triton_jit.MAX_RANGES == 8
    for sig, consts, instruction in _compile_cases(fn, kernel):
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        except RuntimeError as exc:  # no ptxas in this install: nothing to check here
            if "ptxas" not in str(exc):
                raise
            pytest.skip(f"no CUDA toolchain in this triton install: {exc}")
        assert instruction in compiled.asm["ptx"], (kernel, consts)
    assert any(tmp_path.iterdir()), "triton did not compile into the fresh cache directory"
