"""Tensor-parallel greedy decoding of the LLM example (examples/llm) with NVFP4 weights:
attention heads and MLP features split over the devices of one mesh axis, Megatron style.

    python examples/llm_tensor_parallel.py --random llama3-8b --tp 2,4,8 --batch 1,8 --json tp.json
    python examples/llm_tensor_parallel.py --random tp-tiny        # 8 host devices on a CPU

What it does: draws a model of a preset's (or a config.json's) shapes with random NVFP4 weights
(llm.random_model), decodes a random prompt greedily on one device, then places the same
weights tensor-parallel over `--tp` devices (`shard_params`) and decodes again, once with the NVFP4
weights and once with them dequantized to bf16 (llm.dense_twin, XLA's dot), all through
the package's own decode loop and timer (`generate`). It is one jit program per step over the
mesh: the weights carry NamedShardings and jax_fp4's partitioning rules keep each shard where it
lies, so a step has one all-reduce per row-parallel projection (o_proj and down_proj) and nothing
else moves a weight.

The layout (`shard_params`):
  - qkv_proj and gate_up_proj (and lm_head) are column parallel: split along N. A fused weight's
    rows are reordered once, at placement, so that device d's contiguous slice holds its own q
    heads, then its k and v heads (and its gate features, then the same up features); the forward
    pass pairs them within each slice (Config.shards, llm.split_fused). A plain split of
    [q; k; v] or [gate; up] would give one device all of q or all of gate.
  - o_proj and down_proj are row parallel: split along K (the heads and features each device
    computed), partial products summed in float32 by one all-reduce, then the residual added. The
    tiled layout keeps all of K in each 16-row tile, so these stay in the spec layout.
  - The KV caches are split over kv heads (so kv_heads must divide by the width), the embedding
    table, norms and RoPE frequencies are replicated.

What it needs: jax_fp4. Two or more GPUs for timings; on a CPU-only machine it asks XLA for 8
host devices (unless XLA_FLAGS already sets a count) and runs the same programs there.

What it prints and writes: per (width, batch) the decode time per step of each run, how many of
the greedy tokens agree with the one-device run, and the largest difference of the first step's
logits. --json writes {"runs": [{"gpus", "batch", "tp_ms", "one_gpu_ms", "bf16_tp_ms",
"same_leading_tokens", "first_step_max_logit_diff", ...}]} and the setup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fp4  # noqa: E402
from jax_fp4 import sharding as _sharding  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples/llm package beside it
import llm  # noqa: E402

AXIS = "model"
PRESETS = {
    **llm.PRESETS,
    # Grouped-query attention small enough for a CPU, whose kv heads split 2, 4 and 8 ways with
    # every shard of every weight in whole 16-row tiles.
    "tp-tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 32,
        "intermediate_size": 512,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}


def make_mesh(tp: int, axis: str = AXIS):
    """A 1-D mesh of the first `tp` devices, its axis Auto (jit + NamedSharding: XLA propagates
    the weights' shardings through the program)."""
    if not 1 <= tp <= jax.device_count():
        raise ValueError(f"tp must be in [1, {jax.device_count()}] (the devices present), got {tp}")
    return jax.make_mesh((tp,), (axis,), axis_types=(AxisType.Auto,), devices=jax.devices()[:tp])


def check_width(cfg, tp: int) -> None:
    """ValueError naming what a tensor-parallel width `tp` does not divide."""
    if cfg.experts:
        raise ValueError(
            "shard_params: mixture-of-experts layers are not split tensor-parallel here "
            f"(config has {cfg.experts} experts); this example splits dense layers"
        )
    for what, count in (
        ("num_key_value_heads", cfg.kv_heads),
        ("num_attention_heads", cfg.heads),
        ("intermediate_size", cfg.intermediate),
    ):
        if count % tp:
            raise ValueError(
                f"tensor-parallel width {tp} must divide {what} = {count}: each device holds "
                f"whole heads of q, k and v (and whole KV cache heads) and an equal share of the "
                f"MLP features"
            )


def fused_row_order(sizes: list[int], shards: int) -> np.ndarray:
    """The row permutation of a fused weight of parts `sizes` (rows in order) that gives shard s
    the contiguous rows [its share of part 0, its share of part 1, ...] (Config.shards)."""
    starts = np.cumsum([0, *sizes[:-1]])
    return np.concatenate(
        [
            np.arange(start + s * size // shards, start + (s + 1) * size // shards)
            for s in range(shards)
            for start, size in zip(starts, sizes)
        ]
    )


def _rows(w, order: np.ndarray):
    """w [..., N, K] (NVFP4 in the spec layout, or dense) or a bias [..., N] with rows `order`."""
    order = jnp.asarray(order)
    if isinstance(w, jax_fp4.NVFP4Weight):
        packed, scale = _take_rows(w.packed, order), _take_rows(w.scale, order)
        return jax_fp4.NVFP4Weight(packed, scale, w.global_scale, w.block_size)
    return _take_rows(w, order) if w.ndim >= 2 else jnp.asarray(w)[order]


@jax.jit
def _take_rows(x, order):
    return jnp.take(x, order, axis=-2)


def _place(w, mesh, spec, *, layout: str | None = None):
    """w on `mesh` split by `spec` (over its logical [..., N, K], or a plain array's dims); an
    NVFP4 weight is first put in `layout` ("tiled" where its shards keep whole 16-row tiles and K
    is not split, else spec) and refused where jax_fp4's rules would gather a split dimension
    (`sharding.weight_axes`): a placement that silently replicates is no tensor parallelism."""
    sharding = NamedSharding(mesh, spec)
    if not isinstance(w, jax_fp4.NVFP4Weight):
        return jax.device_put(w, sharding)
    w = jax_fp4.unprepack(w) if w.layout == "tiled" else w
    entries = (*(None,) * w.ndim, *spec)[-2:]
    n_axes, k_axes = (() if e is None else (e,) for e in entries)
    n_shards = mesh.shape[n_axes[0]] if n_axes else 1
    if layout == "tiled" and not k_axes and (w.n // n_shards) % 16 == 0:
        w = llm._laid_out(w, "tiled")
    _, _, reasons = _sharding.weight_axes(
        mesh,
        n_axes,
        k_axes,
        n=w.n,
        k=w.k,
        block_size=w.block_size,
        tiled=w.layout == "tiled",
        local_k_check=_gemv_k_check(w.block_size),
    )
    if reasons:
        raise ValueError(f"shard_params: a weight of shape {w.shape} cannot be split: {reasons}")
    return jax.device_put(w, w.shardings(sharding))


def _gemv_k_check(block_size: int):
    """The decode GEMV's limit on a row-parallel K slice (K % 32 == 0; jax_fp4 gathers K where a
    slice breaks it), on GPUs, where decode steps run it."""
    if jax.default_backend() != "gpu" or block_size != 16:
        return None
    return lambda k: None if k % 32 == 0 else f"the decode GEMV needs K % 32 == 0, got {k}"


def shard_params(cfg, params: dict, mesh, axis: str = AXIS, *, layout: str | None = None):
    """(cfg, params) of llm_generate placed tensor-parallel over mesh axis `axis`: the returned
    config has `shards` = the axis' width, which the forward pass needs to read the fused
    projections' reordered rows (module docstring: the layout). params: the example's (NVFP4 or
    dense, e.g. dense_twin's; unrolled or stacked layers). layout: the column parallel NVFP4
    weights' layout, "tiled" where their shards keep whole 16-row tiles (None: each weight's own);
    row parallel ones are spec (the tiled layout cannot split K)."""
    if axis not in mesh.shape:
        raise ValueError(f"shard_params: mesh has no axis {axis!r} (axes {tuple(mesh.shape)})")
    if mesh.axis_types[mesh.axis_names.index(axis)] != AxisType.Auto:
        raise ValueError(
            f"shard_params: mesh axis {axis!r} must be Auto (jit + NamedSharding), got "
            f"{mesh.axis_types[mesh.axis_names.index(axis)]}"
        )
    tp = mesh.shape[axis]
    check_width(cfg, tp)
    stacked = isinstance(params["layers"], dict)
    lead = (None,) if stacked else ()
    column, row, replicated = P(*lead, axis, None), P(*lead, None, axis), P()
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    orders = {
        "qkv_proj": fused_row_order([q, kv, kv], tp),
        "gate_up_proj": fused_row_order([cfg.intermediate] * 2, tp),
    }

    def place(w, spec, tiled=False):
        if not tiled:
            return _place(w, mesh, spec)
        own = w.layout if isinstance(w, jax_fp4.NVFP4Weight) else None
        return _place(w, mesh, spec, layout=layout or own)

    def one_layer(layer: dict) -> dict:
        out = {}
        for name, w in layer.items():
            if name in orders:
                own = w.layout if isinstance(w, jax_fp4.NVFP4Weight) else None
                w = jax_fp4.unprepack(w) if own == "tiled" else w
                out[name] = _place(_rows(w, orders[name]), mesh, column, layout=layout or own)
            elif name.removesuffix("_bias") in orders:
                out[name] = place(_rows(w, orders[name.removesuffix("_bias")]), P(*lead, axis))
            elif name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                out[name] = place(w, column, tiled=True)
            elif name.endswith("_bias"):
                out[name] = place(w, P(*lead, axis))
            elif name in ("o_proj", "down_proj"):
                out[name] = place(w, row)
            else:  # norms
                out[name] = place(w, replicated)
        return out

    layers = params["layers"]
    placed = {
        "embed": place(params["embed"], replicated),
        "layers": one_layer(layers) if stacked else [one_layer(layer) for layer in layers],
        "norm": place(params["norm"], replicated),
        "inv_freq": place(params["inv_freq"], replicated),
    }
    # lm_head column parallel along the vocabulary where it divides: each device reads its
    # share. A head tied to the embedding stays the replicated table.
    if cfg.tie_embeddings:
        placed["lm_head"] = placed["embed"]
    else:
        spec = P(axis, None) if cfg.vocab % tp == 0 else replicated
        placed["lm_head"] = place(params["lm_head"], spec, tiled=True)
    return dataclasses.replace(cfg, shards=tp), placed


def cache_sharding(cfg, mesh, axis: str = AXIS, *, stacked: bool = False) -> NamedSharding:
    """The sharding of one KV cache array ([B, kv_heads, T, head_dim], or [layers, ...] for
    stacked layers): split over kv heads, as the qkv projection's k and v come out."""
    check_width(cfg, mesh.shape[axis])
    return NamedSharding(mesh, P(*((None,) if stacked else ()), None, axis))


def empty_cache(cfg, params: dict, batch: int, max_len: int, mesh, axis: str = AXIS):
    """llm.empty_cache, each array split over kv heads on `mesh`."""
    stacked = isinstance(params["layers"], dict)
    return llm.empty_cache(
        cfg, params, batch, max_len, cache_sharding(cfg, mesh, axis, stacked=stacked)
    )


def compiled_step(cfg, params: dict, batch: int, max_len: int, sharding=None) -> str:
    """The compiled (partitioned) HLO text of one decode step (llm.decode_step) at batch
    `batch` on caches of `max_len` positions placed by `sharding`."""
    caches = llm.empty_cache(cfg, params, batch, max_len, sharding)
    history, start = jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((), jnp.int32)
    return llm.decode_step(cfg).lower(params, history, start, *caches).compile().as_text()


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> dict:
    """Each collective's count in an HLO text (async pairs counted once, by their start)."""
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


@jax.jit
def _last_logits(logits):
    return logits[:, -1]


def first_step_logits(cfg, params: dict, prompt, sharding=None) -> np.ndarray:
    """The logits [B, vocab] (float32) the prefill gives for the token after prompt [B, P]."""
    prompt = jnp.asarray(prompt, jnp.int32)
    caches = llm.empty_cache(cfg, params, *prompt.shape, sharding)
    forward = jax.jit(llm.forward, static_argnums=0)
    logits, _, _ = forward(cfg, params, prompt, jnp.zeros((), jnp.int32), *caches)
    return np.asarray(_last_logits(logits))


def leading_agreement(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens every sequence of a and b [B, T] has in common."""
    return int(np.min(np.sum(np.cumprod(a == b, axis=1), axis=1)))


def _ms(timings: dict):
    steps = timings["decode_steps"]
    return timings["decode_s"] / steps * 1e3 if steps else None


def one_device_run(cfg, params: dict, prompt, max_new_tokens: int) -> dict:
    """Greedy decoding of prompt [B, P] on the device holding `params` (llm.generate):
    {"tokens", "timings", "logits" (the first step's, [B, vocab])}."""
    tokens, timings = llm.generate(cfg, params, prompt, max_new_tokens)
    return {"tokens": tokens, "timings": timings, "logits": first_step_logits(cfg, params, prompt)}


def compare(one: dict, tp_cfg, tp_params, tp_dense, sharding, prompt, max_new_tokens: int) -> dict:
    """One (width, batch) of the command line: greedy decoding of prompt [B, P] by the
    tensor-parallel NVFP4 model (`shard_params`) and its bf16 twin (tp_dense, or None), caches
    placed by `sharding`, against the one-device run `one` (`one_device_run`); the --json record."""
    prompt = np.asarray(prompt)
    batch = prompt.shape[0]
    tokens, t = llm.generate(tp_cfg, tp_params, prompt, max_new_tokens, cache_sharding=sharding)
    tp_logits = first_step_logits(tp_cfg, tp_params, prompt, sharding)
    counts = collectives(compiled_step(tp_cfg, tp_params, batch, 8, sharding))
    one_ms = _ms(one["timings"])
    run = {
        "gpus": tp_cfg.shards,
        "batch": batch,
        "prompt_len": prompt.shape[1],
        "new_tokens": max_new_tokens,
        "tp_ms": _ms(t),
        "one_gpu_ms": one_ms,
        "bf16_tp_ms": None,
        "speedup": llm._ratio(one_ms, _ms(t)),
        "same_leading_tokens": leading_agreement(tokens, one["tokens"]),
        "first_step_max_logit_diff": float(np.max(np.abs(tp_logits - one["logits"]))),
        "first_step_max_abs_logit": float(np.max(np.abs(one["logits"]))),
        "collectives_per_step": counts,
        "window_ms": {
            "tp": [w * 1e3 for w in t["window_s_per_step"]],
            "one_gpu": [w * 1e3 for w in one["timings"]["window_s_per_step"]],
        },
    }
    if tp_dense is not None:
        bf16_tokens, bf16_t = llm.generate(
            tp_cfg, tp_dense, prompt, max_new_tokens, cache_sharding=sharding
        )
        run.update(
            bf16_tp_ms=_ms(bf16_t),
            bf16_same_leading_tokens=leading_agreement(bf16_tokens, one["tokens"]),
            bf16_window_ms=[w * 1e3 for w in bf16_t["window_s_per_step"]],
        )
    show = lambda v: "-" if v is None else f"{v:.2f} ms"  # noqa: E731
    print(
        f"tp {tp_cfg.shards}, batch {batch}: a decode step {show(run['tp_ms'])} "
        f"tensor-parallel, {show(one_ms)} on one device, {show(run['bf16_tp_ms'])} bf16 "
        f"tensor-parallel; the first {run['same_leading_tokens']} of {max_new_tokens} tokens "
        f"the same; first-step logits differ by at most {run['first_step_max_logit_diff']:.3g} "
        f"(largest {run['first_step_max_abs_logit']:.3g}); collectives a step "
        f"{ {k: v for k, v in counts.items() if v} }"
    )
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/llm_tensor_parallel.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--random",
        metavar="PRESET|CONFIG_JSON",
        default="tp-tiny",
        help=f"random weights for a config.json or a preset ({', '.join(PRESETS)})",
    )
    parser.add_argument(
        "--tp",
        type=llm._positive_ints,
        help="tensor-parallel widths, comma-separated (default: every device)",
    )
    parser.add_argument(
        "--batch", type=llm._positive_ints, default=[1], help="batch sizes, comma-separated"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated greedily")
    parser.add_argument("--prompt-len", type=int, default=8, help="random prompt tokens (seeded)")
    parser.add_argument(
        "--num-layers", type=int, metavar="N", help="only the first N layers of the model"
    )
    parser.add_argument(
        "--no-bf16", action="store_true", help="skip the bf16 tensor-parallel run (saves memory)"
    )
    parser.add_argument("--json", metavar="PATH", help='write {"runs": [...]} and the setup here')
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.prompt_len < 1:
        parser.error("--max-new-tokens and --prompt-len must be at least 1")
    if args.num_layers is not None and args.num_layers < 1:
        parser.error("--num-layers must be at least 1")
    widths = args.tp or [jax.device_count()]
    if max(widths) > jax.device_count():
        parser.error(f"--tp {max(widths)}: only {jax.device_count()} devices present")
    config = PRESETS.get(args.random) or json.loads(Path(args.random).read_text())
    if args.num_layers:
        config = dict(config, num_hidden_layers=args.num_layers)
    cfg = llm.Config.from_json(config)
    for tp in widths:
        try:
            check_width(cfg, tp)
        except ValueError as err:
            parser.error(f"--tp {tp}: {err}")
    cfg, params = llm.random_model(config)
    dense = None if args.no_bf16 else llm.dense_twin(params)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, args.prompt_len)
    device = jax.devices()[0]
    print(
        f"model {args.random}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads "
        f"({cfg.kv_heads} kv); {jax.device_count()} x {device.device_kind}"
    )
    prompts = {batch: np.tile(ids, (batch, 1)) for batch in args.batch}
    one = {b: one_device_run(cfg, params, p, args.max_new_tokens) for b, p in prompts.items()}
    runs = []
    for tp in widths:  # each width's placement serves every batch
        mesh = make_mesh(tp)
        tp_cfg, tp_params = shard_params(cfg, params, mesh)
        tp_dense = None if dense is None else shard_params(cfg, dense, mesh)[1]
        sharding = cache_sharding(cfg, mesh, stacked=isinstance(params["layers"], dict))
        for batch, prompt in prompts.items():
            runs.append(
                compare(
                    one[batch], tp_cfg, tp_params, tp_dense, sharding, prompt, args.max_new_tokens
                )
            )
        del tp_params, tp_dense
    if args.json:
        record = {
            "command": "python examples/llm_tensor_parallel.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "device": device.device_kind,
            "platform": device.platform,
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "model": args.random,
            "config": dataclasses.asdict(cfg),
            "runs": runs,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
