"""Test session setup: 8 host (CPU) devices, so the sharding tests can build meshes.

XLA reads XLA_FLAGS once, when jax initialises its backends, so this must run before any test
module imports jax. Every other test works the same with 8 CPU devices (un-sharded programs still
run on one device). If jax was imported earlier (e.g. by a plugin), the flag cannot take effect and
the sharding tests skip themselves.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
