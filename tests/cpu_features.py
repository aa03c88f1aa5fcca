"""What this machine's CPU offers the `cpu` path's run-time choice of builds (Linux /proc/cpuinfo)."""

from __future__ import annotations

AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})  # x86-64-v4


def cpu_flags() -> set[str]:
    """The CPU's feature flags; empty where /proc/cpuinfo is not there to read."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def cpu_has_avx512() -> bool:
    """Whether this CPU has x86-64-v4 (the CPU kernel's AVX-512 panel product)."""
    return AVX512_FLAGS <= cpu_flags()
