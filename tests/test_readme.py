"""README.md's Python snippets run as pasted, in order, on the CPU; its headline figures are the
ones in benchmarks/results/*.json."""

import json
import re
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, list-item indentation removed."""
    pattern = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)
    return [textwrap.dedent(match[2]) for match in pattern.finditer(text)]


def test_python_blocks_are_found():
    blocks = python_blocks("a\n```python\nx = 1\n```\n- item\n\n  ```python\n  y = x\n  ```\n")
    assert blocks == ["x = 1\n", "y = x\n"]
    assert len(python_blocks(README)) == README.count("```python") == 5


def test_readme_snippets_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    pytest.importorskip("flax")
    monkeypatch.chdir(tmp_path)  # the checkpoint snippet writes model.safetensors
    namespace: dict = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for block in python_blocks(README):
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "(4, 512) cpu"
    assert printed[1].startswith("{'xla': \"could serve it; auto prefers 'cpu'")
    assert namespace["h"].shape == (4, 256) and namespace["out"].shape == (4, 512)
    assert sorted(namespace["tensors"]) == [
        "layers.0",
        "layers.0.bias",
        "layers.1",
        "layers.1.bias",
    ]
    np.testing.assert_array_equal(
        np.asarray(namespace["y"]),
        np.asarray(jax.jit(namespace["model"])(namespace["x"], namespace["w"])),
    )


# ---- the headline figures ----------------------------------------------------------------------


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _span(values, digits: int, suffix: str = "x") -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return (low if low == high else f"{low}-{high}") + suffix


def headline_figures() -> list[str]:
    """README's Performance claims, each written from its JSON as README words it."""
    kernels = _json("h200.json")
    speedup = {}
    for row in kernels["rows"]:
        speedup.setdefault(row["m"], []).append(row["speedup_vs_bf16"])
    decode = [v for m, values in speedup.items() if m <= 8 for v in values]
    prefill_256_1024 = speedup[256] + speedup[512] + speedup[1024]
    # The decode loop at a 72-token context (the file also has a batch-1 run at 2112).
    loop = {r["batch"]: r for r in _json("decode_h200.json")["runs"] if r["context"] == 72}
    busy = [100 * (run["loop_over_gpu_busy"] - 1) for run in loop.values()]
    moe = _json("moe_h200.json")["rows"]
    moe_prefill = [
        r["speedup_vs_ragged_dot"] for r in moe if r["part"] == "prefill" and r["tokens"] == 4096
    ]
    moe_loop = {run["batch"]: run for run in _json("moe_step_h100.json")["runs"]}
    return [
        f"the GEMV runs {_span(decode, 1)} faster than bf16",
        f"({kernels['decode_step']['matmuls']} matmuls) {kernels['decode_step']['speedup_vs_bf16']:.1f}x",
        f"{_span(speedup[16], 1)} bf16 at M = 16",
        f"{_span(speedup[64], 1)} at M = 64",
        f"{_span(speedup[128], 2)} at M = 128",
        f"{_span(prefill_256_1024, 1)} from M = 256 to 1024",
        f"({_span(speedup[4096], 2)} at M = 4096)",
        f"{loop[1]['nvfp4_ms']:.2f} ms a step at batch 1 against bf16's {loop[1]['bf16_ms']:.2f} "
        f"({loop[1]['ratio']:.2f}x)",
        f"{loop[8]['ratio']:.2f}x at batch 8",
        f"{_span([loop[32]['ratio'], loop[64]['ratio']], 1)} at batch 32-64",
        f"within {_span(busy, 0, '%')} of the GPU's busy time",
        f"prefill of 4096 tokens {_span(moe_prefill, 0)} faster",
        f"{moe_loop[1]['ratio']:.2f}x the same model with bf16 experts at batch 1",
    ]


@pytest.mark.parametrize("figure", headline_figures())
def test_readme_headline_figures_are_the_results(figure):
    performance = README[README.index("## Performance") : README.index("## Layout")]
    assert figure in " ".join(performance.split())
