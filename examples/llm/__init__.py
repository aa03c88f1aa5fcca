"""The LLM example as a package: greedy generation from an NVFP4 (or mixed FP8 + NVFP4) checkpoint
of a Llama / Qwen-style decoder, dense or mixture-of-experts, in plain JAX with jax_fp4's kernels.

    config      config.json -> Config (shapes, RoPE, experts) and the presets of public models
    weights     a checkpoint's tensors -> params (fused q/k/v and gate/up, stacked experts);
                `load_model`, `assemble`, `dense_twin`
    synthetic   random models of a config's shapes, random prompts, the demo checkpoint writer
    model       the forward pass with a KV cache: `forward`, `empty_cache`
    generation  prefill, the donated decode step and the timed loop: `generate`
    measure     GPU-busy time, streaming-read bandwidth, the bytes a step reads
    runs        one batch of the command line, printed and recorded
    cli         the command line (`python examples/llm_generate.py --help`)

Every name of these modules is also an attribute of the package (`llm.forward`,
`llm.load_model`, ...), each module imported on first use: `import llm` alone imports neither jax
nor jax_fp4, so the command line parses its arguments first.
"""

from __future__ import annotations

import importlib

# The order names are looked up in: the modules that do not import jax first.
_MODULES = ("config", "cli", "weights", "synthetic", "model", "generation", "measure", "runs")


def __getattr__(name: str):
    for module_name in _MODULES:
        module = importlib.import_module(f".{module_name}", __name__)
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    names = set(globals())
    for module_name in _MODULES:
        names.update(vars(importlib.import_module(f".{module_name}", __name__)))
    return sorted(names)
