"""jax_fp4.matmul's decoder-layer fusions (norm_weight: an RMSNorm of the activations,
activation="silu_mul" on a gate/up weight, residual) through the public API, on each device
present (the `device` fixture): every backend the device serves, spec and tiled layouts, fp16 and
bf16, M from 1 to 64, against a float64 NumPy model of the unfused composition; the CUDA
lowering's choice between the GEMV's fused kernel and the composed fusions (checked on any
machine); bad input; jit, vmap, grad, export and sharding against the unfused composition."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp4
from jax_fp4 import ffi as _ffi
from jax_fp4 import native as _native
from tests import reference
from tests._helpers import EPS, check, gemv_attributes

EPSILON = 1e-5  # the RMSNorm's epsilon in these tests


# ---- the float64 model --------------------------------------------------------------------------


def fused_reference(a, w, bias, norm_weight, activation, residual, *, weight_dtype=None):
    """The unfused composition in float64: a_n = round(a * rsqrt(mean(a^2) + eps) * norm_weight)
    to a's dtype (the rounding is part of the semantics), y = a_n @ W^T + bias, silu(g) * u with
    g, u the halves of y, + residual. `weight_dtype`: W as the dequantizing paths hold it (rounded
    once to a's dtype)."""
    w = jax_fp4.unprepack(w) if w.layout == "tiled" else w
    a64 = np.asarray(a, np.float64)
    if norm_weight is not None:
        inv = 1.0 / np.sqrt(np.mean(a64**2, axis=-1, keepdims=True) + EPSILON)
        a64 = reference.round_once(a64 * inv * np.asarray(norm_weight, np.float64), a.dtype)
        a64 = a64.astype(np.float64)
    y = reference.matmul(
        a64,
        w.packed,
        w.scale_bytes,
        w.global_scale,
        w.block_size,
        None if bias is None else np.asarray(bias, np.float64),
        weight_dtype=weight_dtype,
    )
    if activation == "silu_mul":
        half = y.shape[-1] // 2
        gate, up = y[..., :half], y[..., half:]
        y = gate / (1.0 + np.exp(-gate)) * up
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y


FUSIONS = {
    # name: (norm, activation, residual)
    "residual": (False, None, True),
    "silu_mul": (False, "silu_mul", False),
    "norm": (True, None, False),
    "norm+residual": (True, None, True),
    "silu_mul+residual": (False, "silu_mul", True),
    "norm+silu_mul+residual": (True, "silu_mul", True),
}


def random_fused_case(
    rng, lead, n, k, dtype, *, bias, norm, activation, residual, layout="spec", norm_dtype=None
):
    """Random operands of a fused call (a's rows with RMS far from 1 where the norm applies, a
    weight of unit row norm so that silu(g) * u stays well inside fp16's range)."""
    packed, scale, gs = reference.random_weight(rng, n, k, unit_gain=True)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    a = rng.standard_normal(lead + (k,)).astype(np.float32)
    if norm:
        a = a * rng.uniform(0.05, 20.0, size=lead + (1,)).astype(np.float32)
    a = jnp.asarray(a, dtype)
    n_out = n // 2 if activation == "silu_mul" else n
    out = dict(
        bias=jnp.asarray(rng.standard_normal(n), dtype) if bias else None,
        norm_weight=(jnp.asarray(rng.uniform(0.5, 1.5, k), norm_dtype or dtype) if norm else None),
        activation=activation,
        residual=jnp.asarray(rng.standard_normal(lead + (n_out,)), dtype) if residual else None,
    )
    return a, w, out


def every_fusion_case(rng, lead, n, k):
    """random_fused_case with every fusion (bias, RMSNorm, silu_mul, residual) on bfloat16."""
    return random_fused_case(
        rng, lead, n, k, "bfloat16", bias=True, norm=True, activation="silu_mul", residual=True
    )


def fused_operands(kw):
    """The operands of a fused call after a and w: bias, norm_weight, residual (None if absent)."""
    return kw["bias"], kw["norm_weight"], kw["residual"]


def _call(backend, **static):
    def f(a, w, bias, norm_weight, residual):
        return jax_fp4.matmul(
            a,
            w,
            bias,
            norm_weight=norm_weight,
            norm_eps=EPSILON,
            residual=residual,
            backend=backend,
            **static,
        )

    return f


def _run(backend, a, w, kw, jit=True):
    f = _call(backend, activation=kw["activation"])
    f = jax.jit(f) if jit else f
    return f(a, w, *fused_operands(kw))


def _expect(a, w, kw, backend):
    """The float64 model a backend is checked against: the dequantizing paths (xla, dequant;
    "auto" where it takes one) multiply the weight rounded to a's dtype."""
    path = jax_fp4.dispatch_path(a, w) if backend in ("auto", None) else backend
    rounds_weight = path in ("xla", "dequant")
    return fused_reference(
        a,
        w,
        kw["bias"],
        kw["norm_weight"],
        kw["activation"],
        kw["residual"],
        weight_dtype=a.dtype if rounds_weight else None,
    )


def backends(device, a, w):
    """The backends that serve this matmul on `device` (tests/test_matmul.py's rules)."""
    if not device.is_gpu:
        return ["auto", "cpu", "reference"] + (["xla"] if a.dtype != jnp.float32 else [])
    names = ["auto", "reference"]
    if a.dtype == jnp.float32:
        return names
    names += ["dequant", "xla"]
    if w.block_size == 16 and w.k % 32 == 0:
        names.append("gemv")
    if device.is_hopper and w.block_size == 16 and w.k % 128 == 0:
        names.append("fused")
    return names


# (layout, N, N with silu_mul, K): odd N and K % 128 != 0 (the scalar GEMV on a GPU), odd N with
# K % 128 == 0 (the tensor-core GEMV), and the tiled layout (N % 16 == 0; silu_mul: N / 2 % 16).
SHAPES = {
    "spec-k160": ("spec", 45, 46, 160),
    "spec-k256": ("spec", 75, 74, 256),
    "tiled": ("tiled", 48, 64, 256),
}


@pytest.mark.parametrize("m", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fusions_match_the_float64_composition(device, shape, fusion, m, dtype):
    """Every backend the device serves against the float64 model, with and without bias (both
    for every shape, fusion and dtype, alternating with M), the norm weight in a's dtype or in
    float32 (alternating too)."""
    layout, n, n_silu, k = SHAPES[shape]
    norm, activation, residual = FUSIONS[fusion]
    index = [1, 3, 8, 17, 64].index(m)
    rng = np.random.default_rng()
    lead = (m,) if m != 3 else (1, 3)  # leading dims too
    a, w, kw = random_fused_case(
        rng,
        lead,
        n_silu if activation else n,
        k,
        dtype,
        bias=index % 2 == 1,
        norm=norm,
        activation=activation,
        residual=residual,
        layout=layout,
        norm_dtype="float32" if index % 2 == 0 else None,
    )
    for backend in backends(device, a, w):
        y = _run(backend, a, w, kw)
        check(y, _expect(a, w, kw, backend), dtype)


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_float32_activations(device, fusion):
    """float32 activations (the CPU kernel and the reference path): the same fusions."""
    norm, activation, residual = FUSIONS[fusion]
    rng = np.random.default_rng()
    a, w, kw = random_fused_case(
        rng,
        (5,),
        46,
        96,
        "float32",
        bias=True,
        norm=norm,
        activation=activation,
        residual=residual,
    )
    for backend in backends(device, a, w):
        check(_run(backend, a, w, kw), _expect(a, w, kw, backend), "float32")


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("layout", ["spec", "tiled"])
def test_decode_sized_weight(device, m, layout):
    """A decode-sized layer (the GEMV's k_split and two column tiles at work on a GPU): the
    three fusions of a decoder layer's projections, auto's path."""
    rng = np.random.default_rng()
    for n, fusion in ((1024, "norm"), (2048, "norm+silu_mul+residual"), (512, "residual")):
        norm, activation, residual = FUSIONS[fusion]
        a, w, kw = random_fused_case(
            rng,
            (m,),
            n,
            4096,
            "bfloat16",
            bias=False,
            norm=norm,
            activation=activation,
            residual=residual,
            layout=layout,
        )
        check(_run("auto", a, w, kw), _expect(a, w, kw, "auto"), "bfloat16")


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_scalar_gemv_on_tiled_weights(device, monkeypatch, fusion):
    """JAX_FP4_GEMV_MMA=0 (CUDA devices): the scalar GEMV's fused kernel (on the spec layout the
    lowering restores from the tiled one)."""
    if not device.is_gpu:
        pytest.skip("the GEMV runs on CUDA devices")
    monkeypatch.setenv("JAX_FP4_GEMV_MMA", "0")
    norm, activation, residual = FUSIONS[fusion]
    rng = np.random.default_rng()
    for m in (1, 5, 17):
        a, w, kw = random_fused_case(
            rng,
            (m,),
            64,
            256,
            "bfloat16",
            bias=True,
            norm=norm,
            activation=activation,
            residual=residual,
            layout="tiled",
        )
        check(_run("gemv", a, w, kw), _expect(a, w, kw, "gemv"), "bfloat16")


def test_tiled_silu_mul_over_partial_tiles(device):
    """silu_mul on a tiled weight whose halves split a 16-row tile (I = 24): on a GPU the
    tensor-core GEMV cannot pair gate and up tiles, so the lowering composes silu_mul around it."""
    rng = np.random.default_rng()
    for m in (1, 9):
        a, w, kw = random_fused_case(
            rng,
            (m,),
            48,
            256,
            "bfloat16",
            bias=True,
            norm=False,
            activation="silu_mul",
            residual=True,
            layout="tiled",
        )
        for backend in ["auto"] + (["gemv"] if device.is_gpu else []):
            check(_run(backend, a, w, kw), _expect(a, w, kw, backend), "bfloat16")


@pytest.mark.parametrize("m", [1, 8, 64])
def test_reruns_are_bit_identical(device, m):
    rng = np.random.default_rng()
    a, w, kw = every_fusion_case(rng, (m,), 1024, 2048)
    f = jax.jit(_call(None, activation="silu_mul"))
    args = (a, w, *fused_operands(kw))
    first = np.asarray(f(*args)).view(np.uint16)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(*args)).view(np.uint16), first)


# ---- the CUDA lowering: the GEMV's fused kernel or the composed fusions (any machine) ----------


@pytest.fixture
def cuda_device(monkeypatch):
    """Lower for a pretend CUDA device of compute capability 9.0 (an H200)."""
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(_native, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_native, "device_kind", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: _ffi.ALL_CUDA_ARCHITECTURES)


def _cuda_hlo(fn, *args):
    """The text of jax.jit(fn) lowered for CUDA on args."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _gemv_calls(fn, *args, target="jax_fp4_gemv_cuda"):
    """[(operand count, {attribute: value})] of each `target` call in fn's CUDA HLO."""
    text = _cuda_hlo(fn, *args)
    calls = []
    for operands, config in re.findall(
        rf"custom_call @{target}\(([^)]*)\).*?backend_config = \{{([^}}]*)\}}", text
    ):
        attributes = dict(re.findall(r"(\w+) = ([\w.+-]+)", config))
        calls.append((len([x for x in operands.split(",") if x.strip()]), attributes))
    return calls


def _lowering_case(m, n, k, layout="spec"):
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, n, k)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    w = jax_fp4.prepack(w) if layout == "tiled" else w
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return a, w


def test_gemv_runs_the_epilogue_fusions_in_its_kernel(cuda_device):
    """A decode call takes the GEMV's fused kernel for silu_mul and the residual: 7 operands (the
    residual and row_sq_sum added, [0] when absent) and the attributes activation and norm_eps,
    after the RMSNorm (an XLA fusion); a plain call, or one with only the RMSNorm, keeps the
    plain target's 5 operands and 8 attributes."""
    a, w = _lowering_case(4, 256, 512)
    nw, res = jnp.ones((512,), jnp.float32), jnp.ones((4, 128), jnp.bfloat16)

    def fused(a, w, nw, res):
        return jax_fp4.matmul(
            a, w, norm_weight=nw, norm_eps=1e-5, activation="silu_mul", residual=res
        )

    [(operands, attributes)] = _gemv_calls(fused, a, w, nw, res)
    assert operands == 7 and attributes["activation"] == "1" and len(attributes) == 10
    for plain in (
        jax_fp4.matmul,
        lambda a, w: jax_fp4.matmul(a, w, norm_weight=jnp.ones((512,), jnp.bfloat16)),
    ):
        [(operands, attributes)] = _gemv_calls(plain, a, w)
        assert operands == 5 and "activation" not in attributes and len(attributes) == 8
    # the residual only: activation 0
    [(operands, attributes)] = _gemv_calls(
        lambda a, w, r: jax_fp4.matmul(a, w, residual=r), a, w, jnp.ones((4, 256), jnp.bfloat16)
    )
    assert operands == 7 and attributes["activation"] == "0"


def _has_rsqrt(fn, *args):
    """Whether fn's CUDA HLO computes an RMSNorm's 1 / RMS in XLA (its rsqrt)."""
    return "rsqrt" in _cuda_hlo(fn, *args)


@pytest.mark.parametrize("layout", ["spec", "tiled"])
def test_gemv_norm_scale_splits_the_rmsnorm_around_the_kernel(cuda_device, layout):
    """KernelTuning(gemv_norm_scale=True) on bfloat16: the GEMV takes the rows' sums of squares
    as its seventh operand and norm_eps as an attribute, and XLA computes no 1 / RMS (the kernel's
    epilogue does), with or without the other fusions; on float16 activations, and without the
    tuning, the RMSNorm stays whole in XLA."""
    a, w = _lowering_case(4, 256, 512, layout)
    nw = jnp.ones((512,), jnp.float32)
    split = jax_fp4.KernelTuning(gemv_norm_scale=True)

    def normed(tuning, **fusions):
        return lambda a, w, nw: jax_fp4.matmul(
            a, w, norm_weight=nw, norm_eps=1e-5, tuning=tuning, **fusions
        )

    for fusions in ({}, dict(activation="silu_mul")):
        [(operands, attributes)] = _gemv_calls(normed(split, **fusions), a, w, nw)
        assert operands == 7 and attributes["norm_eps"].startswith("9.99999"), fusions
        assert not _has_rsqrt(normed(split, **fusions), a, w, nw)
    for tuning, args in ((split, (a.astype(jnp.float16), w, nw)), (None, (a, w, nw))):
        [(operands, attributes)] = _gemv_calls(normed(tuning), *args)
        assert operands == 5 and "norm_eps" not in attributes
        assert _has_rsqrt(normed(tuning), *args)


def test_tiled_silu_mul_needs_whole_tiles_in_each_half(cuda_device):
    """On the tiled layout the tensor-core kernel pairs 16-row gate and up tiles: N / 2 % 16 != 0
    composes silu_mul around the plain GEMV instead."""
    a, w = _lowering_case(2, 96, 256, "tiled")  # I = 48: whole tiles
    silu = lambda a, w: jax_fp4.matmul(a, w, activation="silu_mul")  # noqa: E731
    [(operands, attributes)] = _gemv_calls(silu, a, w)
    assert operands == 7 and attributes["activation"] == "1"
    a, w = _lowering_case(2, 48, 256, "tiled")  # I = 24
    [(operands, attributes)] = _gemv_calls(silu, a, w)
    assert operands == 5 and "activation" not in attributes


def test_prefill_composes_around_its_gemm(cuda_device):
    """Past the GEMV (here the fused GEMM on sm_90) the fusions are composed around the product."""
    a, w = _lowering_case(256, 2112, 4096)
    nw = jnp.ones((4096,), jnp.bfloat16)
    text = _cuda_hlo(
        lambda a, w, nw: jax_fp4.matmul(a, w, norm_weight=nw, activation="silu_mul"), a, w, nw
    )
    assert re.findall(r"custom_call @(\w+)", text) == ["jax_fp4_fused_cuda"]
    assert "exponential" in text and "rsqrt" in text  # silu and the RMSNorm, in XLA


@pytest.mark.parametrize("layout", ["spec", "tiled"])
def test_fused_gemm_runs_the_epilogue_fusions_in_its_kernel_up_to_64_rows(cuda_device, layout):
    """Serving batches past the GEMV (M = 17-64, the fused GEMM on sm_90): silu_mul and the
    residual in the fused GEMM's epilogue (6 operands, the attribute activation; no exponential
    or float32 add left in XLA), after the RMSNorm; at M = 65 (where stream-K may run) and under
    a tuning forcing stream-K they compose around the plain product (activation 0)."""
    fused_target = "jax_fp4_fused_cuda"
    k = 4096

    def mlp_gate(tuning):
        return lambda a, w, nw, res: jax_fp4.matmul(
            a, w, norm_weight=nw, norm_eps=1e-5, activation="silu_mul", residual=res, tuning=tuning
        )

    for m, in_kernel, tuning in [
        (32, True, None),
        (64, True, None),
        (65, False, None),
        (32, False, jax_fp4.KernelTuning(fused_stream_k=True)),
    ]:
        a, w = _lowering_case(m, 8192, k, layout)  # 2^25 weights: the fused GEMM from M = 17
        nw, res = jnp.ones((k,), jnp.float32), jnp.ones((m, 4096), jnp.bfloat16)
        f = mlp_gate(tuning)
        text = _cuda_hlo(f, a, w, nw, res)
        [(operands, attributes)] = _gemv_calls(f, a, w, nw, res, target=fused_target)
        assert operands == 6 and attributes["activation"] == ("1" if in_kernel else "0"), m
        assert ("exponential" in text) != in_kernel and "rsqrt" in text
    # The residual alone: activation 0, the residual as the sixth operand.
    a, w = _lowering_case(32, 8192, k, layout)
    [(operands, attributes)] = _gemv_calls(
        lambda a, w, r: jax_fp4.matmul(a, w, residual=r),
        a,
        w,
        jnp.ones((32, 8192), jnp.bfloat16),
        target=fused_target,
    )
    assert operands == 6 and attributes["activation"] == "0"
    text = _cuda_hlo(
        lambda a, w, r: jax_fp4.matmul(a, w, residual=r), a, w, jnp.ones((32, 8192), jnp.bfloat16)
    )
    assert "stablehlo.add" not in text


def test_tuning_with_one_column_tile_composes_silu_mul(cuda_device):
    a, w = _lowering_case(2, 256, 512)
    tuning = jax_fp4.KernelTuning(gemv_col_tiles=1)
    [(operands, attributes)] = _gemv_calls(
        lambda a, w: jax_fp4.matmul(a, w, activation="silu_mul", tuning=tuning), a, w
    )
    assert operands == 5 and attributes["col_tiles"] == "1"
    [(operands, attributes)] = _gemv_calls(
        lambda a, w: jax_fp4.matmul(a, w, activation="silu_mul", tuning=None), a, w
    )
    assert operands == 7


def norm_scale_reference(a, w, bias, norm_weight, activation, residual):
    """The GEMV with its RMSNorm split around it (KernelTuning.gemv_norm_scale) in float64: each
    a[m, k] * norm_weight[k] rounded once to bfloat16, times the weight, the row's product scaled
    by 1 / rms(a[m]) (+ bias), then silu_mul and the residual: one rounding per value."""
    a64 = np.asarray(a, np.float64)
    inv = 1.0 / np.sqrt(np.mean(a64**2, axis=-1, keepdims=True) + EPSILON)
    scaled = reference.round_once(a64 * np.asarray(norm_weight, np.float64), a.dtype)
    w = jax_fp4.unprepack(w) if w.layout == "tiled" else w
    y = inv * reference.matmul(
        scaled.astype(np.float64), w.packed, w.scale_bytes, w.global_scale, w.block_size
    )
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if activation == "silu_mul":
        gate, up = np.split(y, 2, axis=-1)
        y = gate / (1.0 + np.exp(-gate)) * up
    return y if residual is None else y + np.asarray(residual, np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 21])
@pytest.mark.parametrize("fusion", ["norm", "norm+residual", "norm+silu_mul+residual"])
@pytest.mark.parametrize("layout", ["spec", "tiled"])
@pytest.mark.parametrize(
    "tuning",
    [{}, dict(gemv_k_split=1), dict(gemv_k_split=3), dict(gemv_col_tiles=1, gemv_k_split=4)],
    ids=["heuristic", "split1", "split3", "onetile-split4"],
)
def test_gemv_norm_scale_matches_its_float64_model(m, fusion, layout, tuning):
    """The GEMV with its RMSNorm split around it (bfloat16) against the float64 model of that
    computation (`norm_scale_reference`) and against the unfused composition, whose rounding of
    the normalized activations it does not share: rows of RMS 0.05-20, K of 7 windows (a ragged
    share per warp at splits 3 and 4), M past one and two row tiles, both layouts, the norm
    weight in float32 or bfloat16; bit-identical on a rerun."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA device")
    norm, activation, residual = FUSIONS[fusion]
    rng = np.random.default_rng()
    a, w, kw = random_fused_case(
        rng,
        (m,),
        96 if activation else 80,
        896,
        "bfloat16",
        bias=m % 2 == 1,
        norm=norm,
        activation=activation,
        residual=residual,
        layout=layout,
        norm_dtype="float32" if m % 2 else None,
    )
    # silu_mul needs two column tiles in the tensor-core kernel: with one, every fusion composes.
    split = not (activation and tuning.get("gemv_col_tiles") == 1)
    f = jax.jit(
        _call(
            "gemv",
            activation=activation,
            tuning=jax_fp4.KernelTuning(gemv_norm_scale=True, **tuning),
        )
    )
    args = (a, w, *fused_operands(kw))
    assert _gemv_calls(f, *args)[0][0] == (7 if split else 5)
    y = f(*args)
    if split:
        bias, norm_weight, residual = fused_operands(kw)
        check(y, norm_scale_reference(a, w, bias, norm_weight, activation, residual), "bfloat16")
    check(y, _expect(a, w, kw, "gemv"), "bfloat16")
    np.testing.assert_array_equal(
        np.asarray(f(*args)).view(np.uint16), np.asarray(y).view(np.uint16)
    )


@pytest.mark.gpu
def test_gemv_target_checks_row_sq_sum():
    """jax_fp4_gemv_cuda called directly (the lowering never sends these): row_sq_sum must be
    float32 [M] or [0], and a fused call passes both fused operands; a valid one scales each
    row's product by rsqrt(row_sq_sum / K + norm_eps)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA device")
    packed, scale, gs = reference.random_weight(np.random.default_rng(), 32, 256)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    a = jnp.asarray(np.random.default_rng().standard_normal((2, 256)), jnp.bfloat16)

    def call(*fused):
        target = jax.ffi.ffi_call("jax_fp4_gemv_cuda", jax.ShapeDtypeStruct((2, 32), a.dtype))
        return target(
            a, w.packed, w.scale, w.global_scale, jnp.zeros((0,), a.dtype), *fused,
            block_size=np.int64(16), activation=np.int64(0), norm_eps=np.float32(0.0),
            **gemv_attributes(256),
        )  # fmt: skip

    no_residual = jnp.zeros((0,), a.dtype)
    ss = jnp.asarray([256.0 * 4.0, 256.0 / 9.0], jnp.float32)  # 1 / RMS = 1 / 2 and 3
    plain = np.asarray(jax_fp4.matmul(a, w), np.float32)
    got = np.asarray(call(no_residual, ss), np.float32)
    np.testing.assert_allclose(got, plain * np.array([[0.5], [3.0]]), rtol=2**-7, atol=1e-6)
    for fused, match in [
        ((no_residual, jnp.ones((3,), jnp.float32)), r"row_sq_sum must be float32 \[M\]"),
        ((no_residual, jnp.ones((2,), jnp.bfloat16)), "row_sq_sum must be float32"),
        ((no_residual,), "a fused call passes the operands residual and row_sq_sum"),
    ]:
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(call(*fused))


# ---- bad input: errors at trace time naming the argument ----------------------------------------


def _weight(n=8, k=32):
    packed, scale, gs = reference.random_weight(np.random.default_rng(), n, k)
    return jax_fp4.NVFP4Weight(packed, scale, gs)


A = jnp.ones((2, 32), jnp.bfloat16)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(norm_weight=jnp.ones((31,))), ValueError, r"norm_weight must have shape \(K,\)"),
        (dict(norm_weight=jnp.ones((1, 32))), ValueError, "norm_weight must have shape"),
        (dict(norm_weight=jnp.ones((32,), jnp.int32)), TypeError, "norm_weight must be a float"),
        (dict(norm_weight=jnp.ones((32,)), norm_eps=-1.0), ValueError, "norm_eps must be finite"),
        (dict(norm_weight=jnp.ones((32,)), norm_eps=float("nan")), ValueError, "norm_eps"),
        (dict(norm_weight=jnp.ones((32,)), norm_eps="1e-6"), TypeError, "norm_eps must be"),
        (dict(activation="gelu"), ValueError, "activation must be one of"),
        (dict(activation="silu_mul", w=_weight(n=7)), ValueError, "silu_mul.*even N"),
        (
            dict(residual=jnp.ones((2, 7), jnp.bfloat16)),
            ValueError,
            r"residual must have .*\(2, 8\)",
        ),
        (dict(residual=jnp.ones((8,), jnp.bfloat16)), ValueError, "residual must have"),
        (dict(residual=jnp.ones((2, 8), jnp.float32)), TypeError, "residual must have a's dtype"),
        (
            dict(activation="silu_mul", residual=jnp.ones((2, 8), jnp.bfloat16)),
            ValueError,
            r"residual must have .*\(2, 4\)",
        ),
    ],
)
def test_bad_input(kwargs, error, match):
    w = kwargs.pop("w", _weight())
    with pytest.raises(error, match=match):
        jax.jit(lambda a, w: jax_fp4.matmul(a, w, **kwargs))(A, w)


def test_norm_eps_must_be_static():
    w = _weight()
    with pytest.raises(TypeError, match="norm_eps must be a Python float"):
        jax.jit(lambda a, e: jax_fp4.matmul(a, w, norm_weight=jnp.ones((32,)), norm_eps=e))(A, 1e-6)


# ---- transforms against the unfused composition ------------------------------------------------


def unfused(a, w, bias, norm_weight, residual, activation, backend="reference"):
    """The composition written by a user, with the plain matmul."""
    if norm_weight is not None:
        a32 = a.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(a32 * a32, axis=-1, keepdims=True) + EPSILON)
        a = (a32 * rms * norm_weight.astype(jnp.float32)).astype(a.dtype)
    y = jax_fp4.matmul(a, w, bias, backend=backend).astype(jnp.float32)
    if activation == "silu_mul":
        half = y.shape[-1] // 2
        y = jax.nn.silu(y[..., :half]) * y[..., half:]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(a.dtype)


def _close(x, y, dtype, scale=None):
    eps = EPS[np.dtype(dtype).name]
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = np.abs(y).max() if scale is None else scale
    np.testing.assert_allclose(x, y, rtol=4 * eps, atol=8 * eps * scale)


def test_jit_eager_and_vmap(device):
    rng = np.random.default_rng()
    a, w, kw = every_fusion_case(rng, (6, 4), 64, 128)
    args = fused_operands(kw)
    f = _call(None, activation="silu_mul")
    eager = np.asarray(f(a, w, *args))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(a, w, *args)), eager)
    check(eager, _expect(a, w, kw, "auto"), "bfloat16")
    # vmap over the activations and residuals (axis 1), and over activations only.
    vm = jax.jit(jax.vmap(lambda x, r: f(x, w, args[0], args[1], r), in_axes=1, out_axes=1))
    np.testing.assert_array_equal(np.asarray(vm(a, args[2])), eager)
    res0 = args[2][0]
    vm = jax.jit(jax.vmap(lambda x: f(x, w, args[0], args[1], res0)))
    np.testing.assert_array_equal(
        np.asarray(vm(a)),
        np.asarray(jax.jit(f)(a, w, *args[:2], jnp.broadcast_to(res0, (6, 4, 32)))),
    )


def test_vmap_over_stacked_weights(device):
    rng = np.random.default_rng()
    ws = [
        random_fused_case(
            rng, (3,), 32, 64, "float16", bias=False, norm=False, activation=None, residual=False
        )[1]
        for _ in range(2)
    ]
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *ws)
    a = jnp.asarray(rng.standard_normal((3, 64)), jnp.float16)
    nw = jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.float16)
    res = jnp.asarray(rng.standard_normal((2, 3, 16)), jnp.float16)
    f = lambda w, r: jax_fp4.matmul(  # noqa: E731
        a, w, norm_weight=nw, norm_eps=EPSILON, activation="silu_mul", residual=r
    )
    y = jax.jit(jax.vmap(f))(stacked, res)
    for i, w in enumerate(ws):
        kw = dict(bias=None, norm_weight=nw, activation="silu_mul", residual=res[i])
        check(y[i], _expect(a, w, kw, "auto"), "float16")


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_grad_matches_the_unfused_composition(device, fusion):
    """Gradients with respect to a, bias, the global scale, norm_weight and residual: those of
    the user-written composition (plain matmul, reference path), in float32."""
    norm, activation, residual = FUSIONS[fusion]
    rng = np.random.default_rng()
    a, w, kw = random_fused_case(
        rng,
        (5,),
        32,
        64,
        "float32",
        bias=True,
        norm=norm,
        activation=activation,
        residual=residual,
    )
    n_out = 16 if activation else 32
    ct = jnp.asarray(rng.standard_normal((5, n_out)), jnp.float32)

    def loss(fn):
        def value(a, bias, nw, res, gs):
            wg = jax_fp4.NVFP4Weight(w.packed, w.scale, gs)
            return jnp.sum(fn(a, wg, bias, nw, res) * ct)

        return value

    fused = loss(lambda a, w, b, nw, r: _call(None, activation=activation)(a, w, b, nw, r))
    plain = loss(lambda a, w, b, nw, r: unfused(a, w, b, nw, r, activation, None))
    argnums = (0, 1, 4) + ((2,) if norm else ()) + ((3,) if residual else ())
    args = (a, *fused_operands(kw), jnp.float32(w.global_scale))
    got = jax.jit(jax.grad(fused, argnums=argnums))(*args)
    want = jax.jit(jax.grad(plain, argnums=argnums))(*args)
    # float32 sums of many terms that cancel (the global scale's is one scalar): 1e-4.
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-4 * np.abs(h).max())
    # forward mode too
    tangents = jax.tree_util.tree_map(jnp.ones_like, args)  # None stays None
    _, jvp_got = jax.jvp(fused, args, tangents)
    _, jvp_want = jax.jvp(plain, args, tangents)
    np.testing.assert_allclose(jvp_got, jvp_want, rtol=1e-4)


def test_grad_of_bf16_decode_call(device):
    """bf16 activations on the path auto takes (the GEMV's fused kernel on a GPU): gradients in
    a and residual equal the composition's within bf16 rounding."""
    rng = np.random.default_rng()
    a, w, kw = random_fused_case(
        rng,
        (2,),
        128,
        256,
        "bfloat16",
        bias=False,
        norm=True,
        activation="silu_mul",
        residual=True,
    )
    ct = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)

    def loss(fn):
        return lambda a, r: jnp.sum(fn(a, r).astype(jnp.float32) * ct)

    fused = loss(lambda a, r: _call(None, activation="silu_mul")(a, w, None, kw["norm_weight"], r))
    plain = loss(lambda a, r: unfused(a, w, None, kw["norm_weight"], r, "silu_mul", "auto"))
    got = jax.jit(jax.grad(fused, argnums=(0, 1)))(a, kw["residual"])
    want = jax.jit(jax.grad(plain, argnums=(0, 1)))(a, kw["residual"])
    for g, h in zip(got, want):
        _close(g, h, "bfloat16")


def test_export_round_trip(device):
    rng = np.random.default_rng()
    a, w, kw = every_fusion_case(rng, (3,), 64, 128)
    f = jax.jit(_call(None, activation="silu_mul"))
    args = (a, w, *fused_operands(kw))
    exported = jax.export.export(f, disabled_checks=jax_fp4.export_disabled_checks())(*args)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(
        np.asarray(restored.call(*args)).view(np.uint16), np.asarray(f(*args)).view(np.uint16)
    )


# ---- sharding: the fused call under a mesh equals the single-device one -------------------------

EIGHT_CPUS = jax.device_count() >= 8 and jax.devices()[0].platform == "cpu"


@pytest.mark.skipif(not EIGHT_CPUS, reason="needs 8 CPU devices (tests/conftest.py)")
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("weight_spec", [P("x", None), P(None, "x")], ids=["column", "row"])
def test_sharded_fused_call(explicit, weight_spec):
    """Column- and row-parallel weights, fused silu_mul + norm + residual: the composed fusions
    around the partitioned product give the single-device result within rounding."""
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
    rng = np.random.default_rng()
    a, w, kw = every_fusion_case(rng, (4,), 96, 512)
    f = _call(None, activation="silu_mul")
    single = np.asarray(jax.jit(f)(a, w, *fused_operands(kw)))

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    ws = jax_fp4.NVFP4Weight(
        put(w.packed, weight_spec), put(w.scale, weight_spec), put(w.global_scale, P())
    )
    bias = put(kw["bias"], P(weight_spec[0]))
    a_s = put(a, P(None, weight_spec[1]))
    with jax.set_mesh(mesh):
        y = jax.jit(f)(a_s, ws, bias, put(kw["norm_weight"], P()), put(kw["residual"], P()))
    check(y, _expect(a, w, kw, "auto"), "bfloat16")
    _close(y, single, "bfloat16")
