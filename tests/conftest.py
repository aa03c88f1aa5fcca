"""Test setup shared by every test file.

8 host (CPU) devices, so the sharding tests can build meshes: XLA reads XLA_FLAGS once, when jax
initialises its backends, so this must run before any test module imports jax. Every other test
works the same with 8 CPU devices (un-sharded programs still run on one device). If jax was
imported earlier (e.g. by a plugin), the flag cannot take effect and the sharding tests skip
themselves.

One suite on every machine: where a GPU is jax's default, the tests not marked `gpu` still run on
the CPU device (`jax.default_device`), which is what they check; the `gpu` tests take the GPU.

The devices present: a test that takes the `device` fixture runs once per device kind, as
`test[cpu]` and `test[gpu]`, with that device as jax's default while it runs. The `gpu` instance
carries the `gpu` marker (`pytest -m gpu` selects it) and skips where jax sees no CUDA device. The
fixture's value (tests/_helpers.py's Device) names the platform and the compute capability, so a
test states its device-specific expectations (the path auto takes, the kernels it may force) from
it. A test that parametrizes `device` itself keeps its own list.

Replayable fresh inputs: tests draw fresh random inputs with `np.random.default_rng()` (no seed).
Inside a test those draws come from one seed per test, fresh each run and printed with its failure
("random inputs" section), so a failure seen once can be replayed with JAX_FP4_TEST_SEED=<seed>.
Draws with an explicit seed are left as they are.
"""

import os

import numpy as np
import pytest

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

SEED_VARIABLE = "JAX_FP4_TEST_SEED"
_numpy_default_rng = np.random.default_rng
_seed_key = pytest.StashKey[int]()


def seeded_default_rng(seed: int):
    """np.random.default_rng as seen inside a test: unseeded calls get successive independent
    streams of `seed` (the same streams, in the same order, for the same seed)."""
    root = np.random.SeedSequence(seed)

    def default_rng(seed=None):
        return _numpy_default_rng(root.spawn(1)[0] if seed is None else seed)

    return default_rng


def _test_seed() -> int:
    value = os.environ.get(SEED_VARIABLE, "").strip()
    if not value:
        return int(np.random.SeedSequence().entropy)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_VARIABLE} must be an integer seed, got {value!r}") from None


DEVICE_KINDS = (pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu))


def pytest_generate_tests(metafunc):
    if "device" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "device" in names:
            return
    metafunc.parametrize("device", DEVICE_KINDS, indirect=True)


@pytest.fixture
def device(request):
    """The device the test body runs on ("cpu" or "gpu", from the parametrization), as jax's
    default device."""
    import jax

    from tests._helpers import Device, gpus

    kind = getattr(request, "param", "cpu")
    if kind == "gpu":
        found = gpus()
        if not found:
            pytest.skip("needs a CUDA device")
        chosen = found[0]
    elif kind == "cpu":
        chosen = jax.devices("cpu")[0]
    else:
        raise ValueError(f"device must be 'cpu' or 'gpu', got {kind!r}")
    with jax.default_device(chosen):
        yield Device(chosen)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request):
    import jax  # only now: XLA_FLAGS above must be set before jax starts

    if request.node.get_closest_marker("gpu") is not None or jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def _replayable_random_inputs(request, monkeypatch):
    seed = _test_seed()
    request.node.stash[_seed_key] = seed
    monkeypatch.setattr(np.random, "default_rng", seeded_default_rng(seed))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = item.stash.get(_seed_key, None)
    if report.failed and seed is not None:
        report.sections.append(
            ("random inputs", f"seed {seed}; replay: {SEED_VARIABLE}={seed} pytest '{item.nodeid}'")
        )
    return report
