"""How jax_fp4/ffi.py registers the compiled modules' FFI targets, and which handlers XLA may
capture into CUDA graphs: COMMAND_BUFFER_TARGETS against the traits the CUDA handlers declare in
their sources, and, on a GPU, a jitted step whose matmuls XLA runs inside its command buffers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import jax
import pytest

from jax_fp4 import ffi as _ffi
from tests._helpers import ROOT, gpus


def _declared_traits() -> dict[str, bool]:
    """FFI target name -> whether its handler's XLA_FFI_DEFINE_HANDLER_SYMBOL declares
    kCmdBufferCompatible, read from ffi/cuda (module.cc maps target names to handler symbols)."""
    module = (ROOT / "ffi/cuda/module.cc").read_text()
    symbols = dict(re.findall(r'targets\["(\w+)"\] = jax_fp4::FfiCapsule\((\w+)\)', module))
    definitions = {}
    for source in sorted((ROOT / "ffi/cuda").rglob("*.cu")):
        code = re.sub(r"//[^\n]*", "", source.read_text())  # comments may hold ");"
        for match in re.finditer(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+),(.*?)\);", code, re.DOTALL):
            definitions[match.group(1)] = "kCmdBufferCompatible" in match.group(2)
    assert set(symbols.values()) <= set(definitions), (symbols, sorted(definitions))
    return {name: definitions[symbol] for name, symbol in symbols.items()}


def test_command_buffer_table_matches_the_handlers_traits():
    declared = _declared_traits()
    assert set(declared) == set(_ffi.FFI_TARGETS["CUDA"])
    table = _ffi.COMMAND_BUFFER_TARGETS
    assert len(set(table)) == len(table)
    assert {name for name, graphable in declared.items() if graphable} == set(table)
    assert not set(table) & set(_ffi.FFI_TARGETS["cpu"])


def test_registration_passes_no_traits(monkeypatch):
    """Each handler carries its traits; registration passes none (jax's CUDA plugin refuses any,
    and only when the GPU backend starts)."""
    calls = []
    plain, graphable = object(), object()  # stand-ins for the handlers' capsules
    modules = {
        "cpu": SimpleNamespace(registrations=lambda: {"toy_cpu": plain}),
        "CUDA": SimpleNamespace(
            registrations=lambda: {
                "toy_gemv": graphable,
                "toy_dequant": graphable,
            }
        ),
    }
    monkeypatch.setattr(_ffi, "_PLATFORM_MODULES", modules)
    monkeypatch.setattr(
        jax.ffi, "register_ffi_target", lambda *args, **kwargs: calls.append((args, kwargs))
    )
    assert _ffi._register_all() == {"cpu": ["toy_cpu"], "CUDA": ["toy_gemv", "toy_dequant"]}
    assert calls == [
        (("toy_cpu", plain), {"platform": "cpu"}),
        (("toy_gemv", graphable), {"platform": "CUDA"}),
        (("toy_dequant", graphable), {"platform": "CUDA"}),
    ]
    # A build without the CUDA module registers its CPU targets only.
    modules["CUDA"] = None
    calls.clear()
    assert _ffi._register_all() == {"cpu": ["toy_cpu"]}
    assert [args[0] for args, _ in calls] == ["toy_cpu"]


_CAPTURE_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
import jax_fp4

rng = np.random.default_rng(0)
k = 256
weights = [jax_fp4.quantize(rng.standard_normal((k, k)).astype(np.float32) / 16) for _ in range(6)]
x = jnp.asarray(rng.standard_normal((2, k)), jnp.bfloat16)


@jax.jit
def graph_step(x, weights):
    for w in weights:  # each matmul between XLA fusions, as in a decoder layer
        x = jax.nn.silu(jax_fp4.matmul(x * 1.5, w)) + x
    return x


first = np.asarray(graph_step(x, weights))
for _ in range(3):  # replays of the recorded graphs give the same bits
    np.testing.assert_array_equal(np.asarray(graph_step(x, weights)), first)
"""


@pytest.mark.gpu
def test_matmuls_of_a_jitted_step_run_inside_cuda_graphs(tmp_path):
    """XLA's thunk sequence of a step of six matmuls between fusions, after its passes: the
    jax_fp4 calls sit inside command buffers (CUDA graphs), none is launched on its own."""
    if not gpus():
        pytest.skip("needs a CUDA device")
    flags = f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=graph_step"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    subprocess.run([sys.executable, "-c", _CAPTURE_SCRIPT], check=True, env=env, timeout=600)
    dumps = sorted(tmp_path.glob("*graph_step*thunk_sequence_after_thunk_passes.txt"))
    assert dumps, sorted(p.name for p in tmp_path.iterdir())
    text = dumps[-1].read_text()
    top_level = re.findall(r"^\d+: (k\w+)", text, flags=re.MULTILINE)
    assert "kCommandBuffer" in top_level, text
    assert "kCustomCall" not in top_level, text
