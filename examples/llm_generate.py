"""Greedy text generation from an NVFP4 checkpoint of a Llama / Qwen-style decoder: the command line
of the examples/llm package (`python examples/llm_generate.py --help` says what it does).

    python examples/llm_generate.py CHECKPOINT_DIR --prompt "The capital of France is"
    python examples/llm_generate.py --random llama3-8b --batch 1,8 --compare-bf16 --gpu-busy

Imported by its path, this module gives the package's functions under their names, e.g.
`load_model(dir, dtype=, layout=)`, `empty_cache(cfg, params, batch, max_len)`,
`forward(cfg, params, tokens, start, k_cache, v_cache)` -> (logits, k, v) and
`generate(cfg, params, prompt, n)` -> (tokens, timings).
"""

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parent)
if _EXAMPLES not in sys.path:  # the package beside this file, whichever directory runs it
    sys.path.insert(0, _EXAMPLES)

import llm  # (imports neither jax nor jax_fp4 until a name is used)


def __getattr__(name: str):
    return getattr(llm, name)


def __dir__() -> list[str]:
    return dir(llm)


if __name__ == "__main__":
    raise SystemExit(llm.main())
