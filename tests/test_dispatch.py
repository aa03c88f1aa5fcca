"""Path selection (`dispatch.plan`): pure Python, no device needed.

The crossovers are data (`dispatch.TABLES`, `CAPABILITY_FALLBACK`, `DEFAULT`): the tests check the
table's invariants, and `plan` against the table by reading its fields, with the rules' shape
restated here (which rule applies where) but none of their numbers: empty first, then a forced
backend (or a clear ValueError), else on CUDA the GEMV up to the largest bound of the rules that
apply, the fused GEMM where it serves (compute capability 9.x, block 16, K % 128 == 0) in its
early wide-weight range or past the GEMV up to its bound, native only when enabled on 12.x past the
decode range, dequant for fp16/bf16, reference otherwise; on CPU the fused C++ kernel; elsewhere
(other platforms, CUDA without jax_fp4's kernels) xla for fp16/bf16 and reference otherwise.
reference and xla (fp16/bf16) can be forced on any platform.
"""

import dataclasses
import itertools

import ml_dtypes
import numpy as np
import pytest

from jax_fp4 import config as _config
from jax_fp4 import dispatch as _dispatch
from jax_fp4.dispatch import DECODE_MAX_M, Crossovers, Entry, Problem, Target, plan

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
ENTRIES = {
    **{f"kind {kind!r}": e for kind, e in _dispatch.TABLES.items()},
    **{f"capability {cap}": e for cap, e in _dispatch.CAPABILITY_FALLBACK.items()},
    "DEFAULT": _dispatch.DEFAULT,
}
CROSSOVERS = [
    pytest.param(getattr(e, layout), id=f"{name}-{layout}")
    for name, e in ENTRIES.items()
    for layout in ("spec", "tiled")
]
GEMV_RULES = (
    "gemv_max_m_without_fused",
    "gemv_max_m_small",
    "gemv_max_m_small_weight",
    "gemv_max_m_narrow_long",
)


def _gemv_bounds(c: Crossovers) -> list[int]:
    return [c.gemv_max_m] + [b for b in (getattr(c, r) for r in GEMV_RULES) if b is not None]


# ---- the table's invariants ---------------------------------------------------------------------


@pytest.mark.parametrize("c", CROSSOVERS)
def test_every_entry_keeps_decode_on_the_gemv(c):
    assert all(bound >= DECODE_MAX_M for bound in _gemv_bounds(c))
    assert all(bound >= c.gemv_max_m for bound in _gemv_bounds(c))  # a rule only widens the range


@pytest.mark.parametrize("c", CROSSOVERS)
def test_the_fused_range_starts_past_decode_and_reaches_past_the_gemv(c):
    if c.fused_min_m_wide_long is not None:
        assert DECODE_MAX_M < c.fused_min_m_wide_long <= c.gemv_max_m
        assert c.wide_n > 0 and c.long_k > 0
    assert c.fused_max_m_large >= c.fused_max_m >= 0
    if c.fused_max_m:
        assert c.fused_max_m >= max(_gemv_bounds(c))
        assert c.large_weight > 0 and c.wide_n > 0


@pytest.mark.parametrize("c", CROSSOVERS)
def test_every_rule_has_its_thresholds(c):
    needs = {
        "gemv_max_m_small": ("small_n", "long_k"),
        "gemv_max_m_small_weight": ("small_weight",),
        "gemv_max_m_narrow_long": ("narrow_n", "long_k"),
    }
    for rule, thresholds in needs.items():
        if getattr(c, rule) is not None:
            assert all(getattr(c, t) > 0 for t in thresholds), rule


def test_the_default_entry_is_the_most_conservative():
    for layout in ("spec", "tiled"):
        default = getattr(_dispatch.DEFAULT, layout)
        assert default.fused_max_m == default.fused_max_m_large == 0  # never the fused GEMM
        assert default.fused_min_m_wide_long is None
        assert all(
            getattr(default, r) is None for r in GEMV_RULES if r != "gemv_max_m_without_fused"
        )
        for e in ENTRIES.values():
            c = getattr(e, layout)
            assert default.gemv_max_m <= c.gemv_max_m
            assert default.gemv_max_m_without_fused <= c.gemv_max_m_without_fused


def test_the_measured_gpus_and_the_public_bound():
    assert _dispatch.TABLES[H200] is _dispatch.TABLES[H100] is _dispatch.CAPABILITY_FALLBACK[(9, 0)]
    from jax_fp4 import GEMV_MAX_M

    assert GEMV_MAX_M == min(c.gemv_max_m for e in ENTRIES.values() for c in (e.spec, e.tiled))
    assert GEMV_MAX_M > DECODE_MAX_M
    hash(_dispatch.HOPPER)  # frozen: usable as data, not edited in place
    with pytest.raises(dataclasses.FrozenInstanceError):
        _dispatch.HOPPER_SPEC.gemv_max_m = 1


def test_entry_lookup_by_kind_then_capability_then_default():
    assert _dispatch.entry_for(H200, (9, 0)) is _dispatch.TABLES[H200]
    assert _dispatch.entry_for(H100, None) is _dispatch.TABLES[H100]  # the kind decides
    assert (
        _dispatch.entry_for("NVIDIA GH200 480GB", (9, 0)) is _dispatch.CAPABILITY_FALLBACK[(9, 0)]
    )
    assert _dispatch.entry_for(None, (9, 0)) is _dispatch.CAPABILITY_FALLBACK[(9, 0)]
    assert _dispatch.entry_for("NVIDIA A100-SXM4-80GB", (8, 0)) is _dispatch.DEFAULT
    assert _dispatch.entry_for("Some future GPU", (13, 0)) is _dispatch.DEFAULT
    assert _dispatch.entry_for(None, None) is _dispatch.DEFAULT
    assert Target("cuda", capability=(9, 0)).crossovers is _dispatch.CAPABILITY_FALLBACK[(9, 0)]


# ---- plan against the table ---------------------------------------------------------------------


def _expected(platform, backend, cap, kind, native_env, has_cuda, mma, m, n, k, bs, dtype, tiled):
    """The path, with every number read from the table entry of (kind, cap)."""
    half = dtype.name in ("float16", "bfloat16")
    gemv_ok = half and bs == 16 and k % 32 == 0
    native_ok = (
        cap is not None and cap[0] == 12 and bs == 16 and k % 32 == 0 and n % 32 == 0 and half
    )
    fused_ok = cap is not None and cap[0] == 9 and half and bs == 16 and k > 0 and k % 128 == 0
    shape_ok = {
        "gemv": gemv_ok,
        "dequant": half,
        "xla": half,
        "native": native_ok,
        "fused": fused_ok,
        "cpu": True,
        "reference": True,
        "auto": True,
    }[backend]
    if backend in ("gemv", "dequant", "xla") and not shape_ok:
        return ValueError
    if m == 0 or n == 0 or k == 0:
        return "empty"
    if backend in ("reference", "xla"):
        return backend
    if backend != "auto":
        needed = "cpu" if backend == "cpu" else "cuda"
        if platform != needed or (needed == "cuda" and not has_cuda) or not shape_ok:
            return ValueError
        return backend
    if platform == "cpu":
        return "cpu"
    if platform == "cuda" and has_cuda:
        c = _dispatch.entry_for(kind, cap).for_layout(tiled)
        native = native_env and native_ok and m > DECODE_MAX_M
        tensor_cores = mma and cap is not None and cap >= (8, 0) and (tiled or k % 128 == 0)
        rules = [
            (c.gemv_max_m_without_fused, tensor_cores and not fused_ok),
            (c.gemv_max_m_small, tensor_cores and n <= c.small_n and k <= c.long_k),
            (c.gemv_max_m_small_weight, tensor_cores and n * k <= c.small_weight),
            (c.gemv_max_m_narrow_long, n <= c.narrow_n and k >= c.long_k),
        ]
        gemv_max = c.gemv_max_m
        if not native:
            gemv_max = max([gemv_max] + [b for b, applies in rules if applies and b is not None])
        wide = n >= c.wide_n
        fused_max = c.fused_max_m_large if wide and n * k >= c.large_weight else c.fused_max_m
        early = (
            c.fused_min_m_wide_long is not None
            and c.fused_min_m_wide_long <= m <= gemv_max
            and wide
            and k >= c.long_k
        )
        if fused_ok and (early or gemv_max < m <= fused_max):
            return "fused"
        if gemv_ok and m <= gemv_max:
            return "gemv"
        if native:
            return "native"
        if half:
            return "dequant"
    return "xla" if half else "reference"


def _edges(values):
    return sorted({x + d for x in values for d in (-1, 0, 1) if x + d >= 0})


def _grid():
    """M, N and K at and around every bound and threshold of the table."""
    cs = [c for e in ENTRIES.values() for c in (e.spec, e.tiled)]
    ms = _edges(
        [0, 1, DECODE_MAX_M + 1]
        + [b for c in cs for b in _gemv_bounds(c)]
        + [c.fused_max_m for c in cs]
        + [c.fused_max_m_large for c in cs]
        + [c.fused_min_m_wide_long or 0 for c in cs]
    )
    ns, ks = {0, 33, 1040}, {0, 48, 5120}
    for c in cs:
        half_k = max(c.long_k // 2, 128)
        ns |= {
            c.small_n,
            c.small_n + 16,
            c.narrow_n,
            c.narrow_n + 16,
            c.wide_n - 128,
            c.wide_n,
            c.small_weight // half_k,
            c.small_weight // half_k + 16,
            c.large_weight // half_k,
            c.large_weight // half_k - 16,
        }
        ks |= {half_k, c.long_k, c.long_k + 128, 2 * c.long_k}
    return ms, sorted(n for n in ns if n >= 0), sorted(k for k in ks if k >= 0)


CAPABILITIES = [None, (7, 5), (8, 0), (9, 0), (10, 0), (12, 0)]
DTYPES = [np.dtype("float16"), np.dtype(ml_dtypes.bfloat16), np.dtype("float32")]


def _check_all(
    targets, ms, ns, ks, backends=_dispatch.BACKENDS, blocks=(16, 32, 7), dtypes=DTYPES
) -> int:
    count = 0
    for t, backend, m, n, k, bs, dtype, tiled in itertools.product(
        targets, backends, ms, ns, ks, blocks, dtypes, (False, True)
    ):
        problem = Problem(m=m, n=n, k=k, block_size=bs, dtype=dtype, tiled=tiled)
        want = _expected(
            t.platform,
            backend,
            t.capability,
            t.device_kind,
            t.native_enabled,
            t.has_cuda_kernels,
            t.gemv_mma,
            m,
            n,
            k,
            bs,
            dtype,
            tiled,
        )
        if want is ValueError:
            with pytest.raises(ValueError, match=f"backend={backend!r}"):
                plan(problem, t, backend)
        else:
            got = plan(problem, t, backend)
            assert got.path == want, (t, backend, m, n, k, bs, dtype, tiled)
            assert got.gemv_tensor_cores == (
                got.path == "gemv" and _dispatch.gemv_tensor_cores(problem, t)
            )
        count += 1
    return count


def _targets(kinds=(None, H200)):
    for platform in ("cpu", "rocm"):
        yield Target(platform)
    for cap, env, has_cuda in itertools.product(CAPABILITIES, (False, True), (False, True)):
        for kind in kinds if cap == (9, 0) else [None]:
            yield Target(
                "cuda",
                capability=cap,
                device_kind=kind,
                has_cuda_kernels=has_cuda,
                native_enabled=env,
            )


def test_every_combination():
    ms, ns, ks = _grid()
    assert (
        _check_all(
            list(_targets()),
            ms,
            ns,
            ks,
            backends=("auto", "gemv", "fused", "native", "dequant"),
            blocks=(16, 7),
            dtypes=DTYPES[1:],
        )
        > 100_000
    )


def test_every_backend_and_dtype_at_a_few_shapes():
    assert (
        _check_all(
            list(_targets(kinds=(None, H200, H100))),
            [0, 1, 17, 65, 4096],
            [0, 33, 4096],
            [0, 48, 4096],
        )
        > 10_000
    )


def test_the_tensor_core_switch_plans_for_the_scalar_gemv():
    ms, ns, ks = _grid()
    targets = [
        Target("cuda", capability=cap, has_cuda_kernels=True, gemv_mma=False)
        for cap in ((8, 0), (9, 0))
    ]
    _check_all(targets, ms, ns, ks, backends=("auto", "gemv"), blocks=(16,), dtypes=DTYPES[1:2])


def _random_crossovers(rng) -> Crossovers:
    def maybe(x):
        return None if rng.random() < 0.3 else x

    gemv = int(rng.integers(DECODE_MAX_M + 1, 40))
    fused = int(rng.choice([0, int(rng.integers(128, 3000))]))
    return Crossovers(
        gemv_max_m=gemv,
        gemv_max_m_without_fused=gemv + int(rng.integers(0, 80)),
        gemv_max_m_small=maybe(gemv + int(rng.integers(0, 90))),
        gemv_max_m_small_weight=maybe(gemv + int(rng.integers(0, 50))),
        gemv_max_m_narrow_long=maybe(gemv + int(rng.integers(0, 50))),
        fused_min_m_wide_long=maybe(int(rng.integers(DECODE_MAX_M + 1, gemv + 1))),
        fused_max_m=fused,
        fused_max_m_large=fused and fused + int(rng.integers(0, 3000)),
        small_n=int(rng.choice([512, 1024, 2048])),
        small_weight=int(rng.choice([1 << 22, 1 << 23])),
        narrow_n=int(rng.choice([2048, 4096])),
        wide_n=int(rng.choice([4096, 8192])),
        long_k=int(rng.choice([4096, 8192])),
        large_weight=int(rng.choice([1 << 24, 3 << 24])),
    )


def test_plan_follows_any_table_entry(monkeypatch):
    """A new GPU's entry is data: plan takes whatever crossovers the table holds."""
    rng = np.random.default_rng()
    for _ in range(4):
        entry = Entry(spec=_random_crossovers(rng), tiled=_random_crossovers(rng))
        monkeypatch.setitem(_dispatch.TABLES, "Test GPU", entry)
        monkeypatch.setitem(_dispatch.CAPABILITY_FALLBACK, (8, 9), entry)
        targets = [
            Target("cuda", capability=(9, 0), device_kind="Test GPU", has_cuda_kernels=True),
            Target("cuda", capability=(8, 9), has_cuda_kernels=True),
        ]
        cs = (entry.spec, entry.tiled)
        ms = _edges(
            [1, DECODE_MAX_M]
            + [b for c in cs for b in _gemv_bounds(c)]
            + [c.fused_max_m for c in cs]
            + [c.fused_max_m_large for c in cs]
        )
        ns = sorted({33, 1024, 1040, 2048, 4096, 4112, 8192, 12288} | {c.wide_n - 128 for c in cs})
        _check_all(
            targets,
            ms,
            ns,
            [4096, 8192, 16384],
            backends=("auto",),
            blocks=(16,),
            dtypes=DTYPES[1:2],
        )


def _auto(m, n, k, tiled, target):
    return plan(
        Problem(m=m, n=n, k=k, block_size=16, dtype=np.dtype("bfloat16"), tiled=tiled), target
    ).path


@pytest.mark.parametrize("kind", [H200, H100, None])
@pytest.mark.parametrize("tiled", [False, True])
def test_each_rule_at_its_edges_on_hopper(kind, tiled):
    """Each bound of the Hopper entry, on a shape where that rule is the one that applies."""
    target = Target("cuda", capability=(9, 0), device_kind=kind, has_cuda_kernels=True)
    c = _dispatch.entry_for(kind, (9, 0)).for_layout(tiled)
    half_k = c.long_k // 2
    plain = (max(c.small_n, c.small_weight // half_k) + 64, half_k)  # past the small rules
    assert plain[0] * plain[1] > c.small_weight and plain[0] < c.wide_n
    g = c.gemv_max_m
    assert [_auto(m, *plain, tiled, target) for m in (1, g, g + 1)] == ["gemv", "gemv", "fused"]
    assert _auto(c.fused_max_m, *plain, tiled, target) == "fused"
    assert _auto(c.fused_max_m + 1, *plain, tiled, target) == "dequant"
    large = (c.wide_n, -(-c.large_weight // c.wide_n))
    assert _auto(c.fused_max_m_large, *large, tiled, target) == "fused"
    assert _auto(c.fused_max_m_large + 1, *large, tiled, target) == "dequant"
    small = (c.small_n, c.long_k)
    assert _auto(c.gemv_max_m_small, *small, tiled, target) == "gemv"
    assert _auto(c.gemv_max_m_small + 1, *small, tiled, target) == "fused"
    narrow_long = (c.narrow_n, c.long_k)
    bound = c.gemv_max_m_narrow_long or g
    assert _auto(bound, *narrow_long, tiled, target) == "gemv"
    assert _auto(bound + 1, *narrow_long, tiled, target) == "fused"
    small_weight = (c.small_weight // half_k, half_k)
    bound = c.gemv_max_m_small_weight or g
    assert _auto(bound, *small_weight, tiled, target) == "gemv"
    assert _auto(bound + 1, *small_weight, tiled, target) == "fused"
    wide_long = (c.wide_n, c.long_k)
    first = c.fused_min_m_wide_long
    assert _auto(DECODE_MAX_M, *wide_long, tiled, target) == "gemv"
    assert _auto(first or g + 1, *wide_long, tiled, target) == "fused"
    if first is not None:
        assert _auto(first - 1, *wide_long, tiled, target) == "gemv"


def test_the_gemv_variant_is_decided_once():
    """Plan.gemv_tensor_cores: the mma.sync kernel on sm_80+ for 128-wide K windows or a tiled
    weight, unless JAX_FP4_GEMV_MMA is off; the lowering passes it to the kernel as is."""
    spec = Problem(m=4, n=256, k=4096, block_size=16, dtype=np.dtype("float16"))
    short = dataclasses.replace(spec, k=160)
    tiled = dataclasses.replace(spec, tiled=True)
    hopper = Target("cuda", capability=(9, 0), has_cuda_kernels=True)
    assert plan(spec, hopper).gemv_tensor_cores and plan(tiled, hopper).gemv_tensor_cores
    assert not plan(short, hopper).gemv_tensor_cores  # K % 128 != 0
    assert not plan(spec, dataclasses.replace(hopper, gemv_mma=False)).gemv_tensor_cores
    assert not plan(tiled, dataclasses.replace(hopper, capability=(7, 5))).gemv_tensor_cores
    assert not plan(spec, dataclasses.replace(hopper, capability=None)).gemv_tensor_cores
    assert not plan(dataclasses.replace(spec, m=4096), hopper).gemv_tensor_cores  # not the GEMV
    assert plan(spec, hopper, "gemv") == _dispatch.Plan(
        "gemv", gemv_tensor_cores=True, epilogue_in_kernel=True
    )


DEFAULT_BUILD = "80-real;90a-real;120a-real;80-virtual"


@pytest.mark.parametrize(
    "architectures, capability, runs",
    [
        (DEFAULT_BUILD, (7, 5), False),  # T4: older than every cubin and the PTX
        (DEFAULT_BUILD, (7, 0), False),
        (DEFAULT_BUILD, (8, 0), True),
        (DEFAULT_BUILD, (8, 6), True),  # the 8.0 cubin runs on later 8.x
        (DEFAULT_BUILD, (8, 9), True),
        (DEFAULT_BUILD, (9, 0), True),
        (DEFAULT_BUILD, (10, 0), True),  # through the 8.0 PTX
        (DEFAULT_BUILD, (12, 1), True),
        ("90a-real", (9, 0), True),  # a Hopper-only build (benchmarks/run_gpu_suite.sh)
        ("90a-real", (10, 0), False),  # arch-specific: 9.0 only
        ("90a-real", (8, 0), False),
        ("80-real", (9, 0), False),  # a cubin stays within its major version
        ("80-real", (8, 6), True),
        ("86-real", (8, 0), False),
        ("80-virtual", (12, 0), True),
        ("75", (7, 5), True),  # no suffix: cubin and PTX
        ("75", (9, 0), True),
        ("120a-real;80-real", (12, 0), True),
        ("120a-real;80-real", (12, 1), False),
        ("80-real,90a-real,120a-real,80-virtual", (7, 5), False),  # as the compiled module reports
        ("80-real,90a-real,120a-real,80-virtual", (8, 9), True),
        ("native", (7, 5), True),  # cannot tell: assume it runs
        (DEFAULT_BUILD, None, True),
        ("", (7, 5), True),
    ],
)
def test_cuda_kernels_run_on(architectures, capability, runs):
    assert _dispatch.cuda_kernels_run_on(architectures, capability) is runs


def test_auto_on_a_gpu_the_build_has_no_code_for():
    # jax_fp4's kernels compiled for sm_80+ on a T4: XLA alone (fp16/bf16), the reference (float32).
    t4 = _dispatch.cuda_target((7, 5), architectures=DEFAULT_BUILD)
    a100 = _dispatch.cuda_target((8, 0), architectures=DEFAULT_BUILD)

    def auto(m, dtype, target):
        return plan(Problem(m=m, n=4096, k=4096, block_size=16, dtype=np.dtype(dtype)), target).path

    assert auto(1, ml_dtypes.bfloat16, t4) == "xla"
    assert auto(4096, "float16", t4) == "xla"
    assert auto(1, "float32", t4) == "reference"
    assert auto(1, ml_dtypes.bfloat16, a100) == "gemv"


@pytest.mark.parametrize(
    "raw, value",
    [
        ("1", True),
        ("yes", True),
        ("TRUE", True),
        ("0", False),
        ("off", False),
        ("no", False),
        ("", True),
    ],
)
def test_env_flag_parses_booleans(monkeypatch, raw, value):
    monkeypatch.setenv("JAX_FP4_GEMV_MMA", raw)
    assert _config.env_flag("JAX_FP4_GEMV_MMA", True) is value
    assert _config.gemv_tensor_cores() is value


def test_env_flag_rejects_garbage(monkeypatch):
    monkeypatch.setenv("JAX_FP4_GEMV_ROW_TILING", "2")
    with pytest.raises(ValueError, match="JAX_FP4_GEMV_ROW_TILING must be a boolean"):
        _config.env_flag("JAX_FP4_GEMV_ROW_TILING", True)
    with pytest.raises(ValueError, match="JAX_FP4_GEMV_ROW_TILING must be a boolean"):
        _config.gemv_row_tiling()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(gemv_col_tiles=3), "gemv_col_tiles must be one of 0, 1, 2, got 3"),
        (dict(gemv_k_split=-1), "gemv_k_split"),
        (dict(gemv_rows_per_block=3), "gemv_rows_per_block"),
        (dict(fused_split=9), "fused_split"),
        (dict(fused_tile_m=48), "fused_tile_m"),
        (dict(fused_tile_n=64), "fused_tile_n"),
        (dict(fused_warp_specialized=1), "fused_warp_specialized"),
        (dict(fused_stream_k="yes"), "fused_stream_k"),
        (dict(programmatic_launch=None), "programmatic_launch"),
        (dict(fused_split=True), "fused_split"),
    ],
)
def test_kernel_tuning_validates_its_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        _config.KernelTuning(**fields)


def test_kernel_tuning_attributes():
    assert _config.KernelTuning().fused_attributes() == dict(
        split=0, tile_m=0, tile_n=0, warp_specialized=-1, stream_k=-1, programmatic=False
    )
    t = _config.KernelTuning(
        gemv_col_tiles=2,
        gemv_k_split=4,
        gemv_rows_per_block=1,
        fused_split=3,
        fused_tile_m=64,
        fused_tile_n=128,
        fused_warp_specialized=False,
        fused_stream_k=True,
        programmatic_launch=True,
    )
    assert t.gemv_attributes() == dict(col_tiles=2, k_split=4, rows_per_block=1, programmatic=True)
    assert t.fused_attributes() == dict(
        split=3, tile_m=64, tile_n=128, warp_specialized=0, stream_k=1, programmatic=True
    )
    assert hash(t) == hash(dataclasses.replace(t))
