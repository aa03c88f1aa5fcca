"""The CPU's features, for the files that import them from here; the helpers live in
tests/_helpers.py."""

from tests._helpers import AVX512_FLAGS, cpu_flags, cpu_has_avx512  # noqa: F401
