"""The conftest's per-test seed for fresh random inputs: replayable, independent, opt-out by seeding."""

import numpy as np

from tests.conftest import _numpy_default_rng, seeded_default_rng


def _draws(default_rng, calls=3):
    return [default_rng().integers(0, 2**62, size=4) for _ in range(calls)]


def test_the_same_seed_replays_the_same_draws():
    seed = int(_numpy_default_rng().integers(0, 2**63))
    first, again = _draws(seeded_default_rng(seed)), _draws(seeded_default_rng(seed))
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    other = _draws(seeded_default_rng(seed + 1))
    assert not np.array_equal(np.stack(first), np.stack(other))


def test_successive_unseeded_draws_are_independent_streams():
    a, b, c = _draws(seeded_default_rng(7))
    assert not np.array_equal(a, b) and not np.array_equal(b, c)


def test_seeded_calls_pass_through_and_tests_run_under_the_patch():
    np.testing.assert_array_equal(
        seeded_default_rng(7)(123).integers(0, 2**62, size=4),
        _numpy_default_rng(123).integers(0, 2**62, size=4),
    )
    assert np.random.default_rng is not _numpy_default_rng  # the autouse fixture is active here
