"""MoE benchmark: jax_fp4.ragged_matmul on Qwen3-30B-A3B's experts.

    python benchmarks/moe.py                        # both parts; JSON: results/moe_<gpu>.json
    python benchmarks/moe.py --parts gemv           # the grouped decode GEMV alone
    python benchmarks/moe.py --parts block          # the fused block (jax_fp4.moe) alone
    python benchmarks/moe.py --quick                # tiny shapes: a CPU smoke run (seconds)
    python benchmarks/moe.py --markdown-from benchmarks/results/moe_h200.json

The MoE model's decode step is benchmarks/decode.py's, run on the example's qwen3-30b-a3b preset:
`python benchmarks/decode.py --model qwen3-30b-a3b --batches 1,8 --no-gemv` (the example's own
decode loop against the model with its experts dequantized to bf16 through jax.lax.ragged_dot,
the GPU-busy time and both byte floors; add --layers 24 on an H100, whose 78 GB do not hold the
bf16 twin of all 48 layers beside the NVFP4 model).

Parts (--parts, default both):

  gemv     the grouped decode GEMV on the expert shapes, gate_up [E=128, N=1536, K=2048] (plain,
           and with activation="silu_mul" as the decode step runs it) and down
           [128, 2048, 768], with 1, 8 and 32 tokens x top-8 (M = 8, 64, 256 rows), under uniform
           random routing (each token's 8 experts drawn without replacement) and Zipf-skewed
           routing (expert of popularity rank r drawn with weight 1 / r^--zipf, ranks a random
           permutation). Yardstick: the bytes a grouped matmul must move (the active experts'
           NVFP4 bytes, the activations and the outputs) at the same run's streaming-read bandwidth
           for that many bytes (benchmarks/bench.py's `read`: `fraction_of_read_bw`, `floor_us`).
           --gemv-bf16 adds jax.lax.ragged_dot on the bf16 experts.
  prefill  4096 tokens x top-8 (M = 32768 rows) on both shapes, both routings, against (a)
           jax.lax.ragged_dot on the bf16 experts ([E, K, N], its natural layout) as XLA runs it,
           and (b) the bf16 active-bytes floor: the active experts' bf16 bytes plus activations and
           outputs at the same run's read bandwidth for that many bytes. Prints what XLA compiles
           ragged_dot to on this device (custom calls, fusions, dots and how much work the largest
           dot does against the ragged product: a dense dot over all experts shows as E x).

  block    the mixture-of-experts block itself, routing included (jax_fp4.route_top_k on the
           layer's router logits, then jax_fp4.moe with the layer's input as its residual), at
           1, 8 and 32 tokens, both routings (the logits built so that the top-8 are the drawn
           experts), on Qwen3-30B-A3B's experts: gate/up [128, 1536, 2048] with silu_mul, down
           [128, 2048, 768]. Rows (one per stage): "routing" (route_top_k alone), "gate_up" (its
           kernel alone), "down" (the kernels' chain less the gate/up chain: the down kernel with
           its combine), "block" (routing and the block); each against the same run's streaming
           read of the bytes the stage must move (the experts it touches, its activations and
           outputs: the routing's logits and pairs), `fraction_of_read_bw`. The block row once
           per path jax_fp4.moe can take here, "composed" (two grouped matmuls) and, where they
           serve, "kernels" (its own two kernels; the gate_up and down rows are theirs), so one
           run compares them. Off the kernels' path (a CPU, --quick) only the routing and the
           composed block.

Method (as benchmarks/bench.py): each grouped matmul runs as a jitted chain of L layers, every layer
its own random weights (normal / sqrt(K), quantized by jax_fp4.quantize, prepacked with
--layout tiled) and its own activations, so that the active experts of the layers the difference
measures span several times the 60 MB L2; per-layer time = (t(L2) - t(L1)) / (L2 - L1). Every
layer of a row shares the row's routing (group sizes), so its byte count is exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS, _BENCHMARKS.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench  # noqa: E402
import decode  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fp4  # noqa: E402

RESULTS_DIR = _BENCHMARKS / "results"

PARTS = ("gemv", "prefill", "block")
ROUTINGS = ("uniform", "zipf")


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """A stacked expert weight [experts, n, k] (NVFP4Weight [E, N, K]); `activation` the
    ragged_matmul activation its product runs with ("silu_mul": gate/up experts, [M, N / 2] out;
    timed in the gemv part only, as the decode step runs it)."""

    name: str
    experts: int
    n: int
    k: int
    activation: str | None = None

    @property
    def n_out(self) -> int:
        return self.n // 2 if self.activation == "silu_mul" else self.n

    def runs_in(self, part: str) -> bool:
        return part == "gemv" or (part == "prefill" and self.activation is None)

    def nvfp4_bytes(self, experts: int | None = None) -> int:
        count = self.experts if experts is None else experts
        return count * bench.nvfp4_weight_bytes(self.n, self.k)

    def bf16_bytes(self, experts: int | None = None) -> int:
        count = self.experts if experts is None else experts
        return count * self.n * self.k * 2


# Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768 (gate and up fused: 1536 rows); the
# decode step runs gate_up with SiLU(gate) * up in the grouped GEMV's epilogue.
EXPERT_SHAPES = (
    ExpertShape("gate_up", 128, 1536, 2048),
    ExpertShape("gate_up+silu_mul", 128, 1536, 2048, "silu_mul"),
    ExpertShape("down", 128, 2048, 768),
)
QUICK_EXPERT_SHAPES = (
    ExpertShape("gate_up", 8, 64, 128),
    ExpertShape("gate_up+silu_mul", 8, 64, 128, "silu_mul"),
    ExpertShape("down", 8, 128, 32),
)


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """The experts of one mixture-of-experts block: gate/up [experts, 2 inter, hidden] (silu_mul),
    down [experts, hidden, inter]."""

    experts: int
    hidden: int
    inter: int

    @property
    def gate_up(self) -> ExpertShape:
        return ExpertShape(
            "gate_up+silu_mul", self.experts, 2 * self.inter, self.hidden, "silu_mul"
        )

    @property
    def down(self) -> ExpertShape:
        return ExpertShape("down", self.experts, self.hidden, self.inter)


QWEN3_BLOCK = BlockShape(experts=128, hidden=2048, inter=768)
QUICK_BLOCK = BlockShape(experts=8, hidden=128, inter=128)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs: shapes, token counts and routings."""

    shapes: tuple[ExpertShape, ...] = EXPERT_SHAPES
    top_k: int = 8
    gemv_tokens: tuple[int, ...] = (1, 8, 32)
    prefill_tokens: int = 4096
    routings: tuple[str, ...] = ROUTINGS
    zipf: float = 1.2
    mem_cap_bytes: int = 10 * bench.GB  # most weight bytes one chain holds
    gemv_bf16: bool = False
    block: BlockShape = QWEN3_BLOCK
    block_tokens: tuple[int, ...] = (1, 8, 32)


QUICK_PLAN = Plan(
    shapes=QUICK_EXPERT_SHAPES,
    top_k=2,
    gemv_tokens=(2,),
    prefill_tokens=16,
    mem_cap_bytes=64 * bench.MB,
    block=QUICK_BLOCK,
    block_tokens=(3,),
)
QUICK_MAX_LAYERS = 3  # --quick: chains of 1 and 3 layers


# ---- routing -------------------------------------------------------------------------------------


def route(rng: np.random.Generator, kind: str, tokens: int, experts: int, top_k: int, zipf: float):
    """Each token's top_k distinct experts, [tokens, top_k]: uniform, or Zipf-skewed (the expert of
    popularity rank r, ranks a random permutation, drawn with weight 1 / r^zipf)."""
    if kind not in ROUTINGS:
        raise ValueError(f"route: kind must be one of {ROUTINGS}, got {kind!r}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"route: top_k must be in 1..{experts}, got {top_k}")
    p = None
    if kind == "zipf":
        ranks = rng.permutation(experts) + 1
        p = 1.0 / ranks.astype(np.float64) ** zipf
        p /= p.sum()
    return np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(tokens)])


def group_sizes(choice: np.ndarray, experts: int) -> np.ndarray:
    """Rows per expert (int32 [experts]) of a routing: the group sizes of the sorted rows."""
    return np.bincount(np.asarray(choice).reshape(-1), minlength=experts).astype(np.int32)


# ---- what XLA makes of ragged_dot ----------------------------------------------------------------

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\w+\[[^\]]*\])\S*\s+"
    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4}
_ITEMSIZE.update({"s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_VIEWS = ("parameter", "bitcast", "get-tuple-element", "tuple", "constant")


def _dims(text: str) -> list[int]:
    match = _SHAPE.search(text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _nbytes(text: str) -> int:
    """Bytes of the first array type in an HLO type (a tuple's first element)."""
    match = _SHAPE.search(text)
    if not match:
        return 0
    return _ITEMSIZE.get(match.group(1), 4) * math.prod(_dims(text))


def hlo_summary(hlo: str, m: int, g: int, k: int, n: int) -> dict:
    """Custom calls, fusions, while loops and dots of an optimized HLO module's text, how many
    times the ragged product's 2*M*K*N FLOPs its largest dot (plain or a cuBLAS custom call) does
    (about G for a dense dot over all experts), and the largest array its entry computation makes
    (a dense dot's masked copy of the activations for every expert shows there)."""
    shapes: dict[str, list[int]] = {}
    custom_calls: dict[str, int] = {}
    fusions = whiles = ragged = 0
    dots: list[dict] = []
    buffer = {"type": None, "bytes": 0}
    entry = False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            entry = True
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, op, attrs = match.group("name"), match.group("op"), match.group("attrs")
        shapes[name] = _dims(match.group("type"))
        operands = [
            o.strip().split(" ")[-1].lstrip("%") for o in match.group("operands").split(",")
        ]
        if entry and op not in _VIEWS and _nbytes(match.group("type")) > buffer["bytes"]:
            buffer = {
                "type": match.group("type").split("{")[0],
                "bytes": _nbytes(match.group("type")),
            }
        if op == "fusion" and entry:
            fusions += 1
        elif op == "while":
            whiles += 1
        elif op == "ragged-dot":
            ragged += 1
        contracting = None
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', attrs)
            target = target.group(1) if target else "?"
            custom_calls[target] = custom_calls.get(target, 0) + 1
            dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attrs)
            if "gemm" in target.lower() or "matmul" in target.lower():
                contracting = [int(d.strip('" ')) for d in dims.group(1).split(",")] if dims else []
        elif op in ("dot", "ragged-dot"):
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
            contracting = [int(d) for d in dims.group(1).split(",") if d] if dims else []
        if contracting is not None and operands and operands[0] in shapes:
            lhs = shapes[operands[0]]
            out = _dims(match.group("type"))
            size = math.prod(lhs[c] for c in contracting if c < len(lhs))
            flops = 2 * math.prod(out) * size
            dots.append({"op": op, "lhs": lhs, "out": out, "flops": flops})
    ragged_flops = 2 * m * k * n
    largest = max(dots, key=lambda d: d["flops"], default=None)
    work = largest["flops"] / ragged_flops if largest else 0.0
    return {
        "m": m,
        "g": g,
        "k": k,
        "n": n,
        "custom_calls": custom_calls,
        "fusions": fusions,
        "while_loops": whiles,
        "ragged_dot_ops": ragged,
        "dots": len(dots),
        "largest_dot": largest,
        "largest_dot_work": work,
        "dense_over_all_experts": bool(largest) and work >= 0.9 * g,
        "largest_buffer": buffer,
    }


def ragged_dot_hlo(m: int, g: int, k: int, n: int, dtype=jnp.bfloat16) -> str:
    """The optimized HLO text of jax.lax.ragged_dot(a [M, K], w [G, K, N], group_sizes) here."""
    args = (
        jax.ShapeDtypeStruct((m, k), dtype),
        jax.ShapeDtypeStruct((g, k, n), dtype),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    )
    return jax.jit(jax.lax.ragged_dot).lower(*args).compile().as_text()


def format_hlo_summary(s: dict) -> str:
    calls = ", ".join(f"{t} x{c}" for t, c in sorted(s["custom_calls"].items())) or "none"
    largest = s["largest_dot"]
    dot = (
        f"largest dot {largest['op']} lhs {largest['lhs']} -> {largest['out']}: "
        f"{s['largest_dot_work']:.1f}x the ragged product's FLOPs"
        if largest
        else "no dot"
    )
    verdict = (
        f"a dense dot over all {s['g']} experts"
        if s["dense_over_all_experts"]
        else "not a dense dot over all experts"
    )
    buffer = s["largest_buffer"]
    made = (
        f"; largest array made: {buffer['type']} ({buffer['bytes'] / 1e9:.3g} GB)"
        if buffer["type"]
        else ""
    )
    return (
        f"XLA's ragged_dot (M={s['m']}, G={s['g']}, K={s['k']}, N={s['n']}): {s['fusions']} "
        f"fusions, custom calls: {calls}, {s['while_loops']} while loops, {s['ragged_dot_ops']} "
        f"ragged-dot ops, {s['dots']} dots; {dot}: {verdict}{made}"
    )


# ---- grouped matmul rows -------------------------------------------------------------------------


@dataclasses.dataclass
class GroupedRow:
    """One (part, shape, tokens, routing) measurement; times per grouped matmul."""

    part: str
    shape: str
    experts: int
    n: int
    k: int
    tokens: int
    top_k: int
    routing: str
    m: int
    active_experts: int
    max_group: int
    path: str
    layout: str
    us: float
    us_iqr: float
    bytes: int  # active experts' NVFP4 bytes + activations + outputs
    tbps: float
    tflops: float
    read_bw_tbps: float
    fraction_of_read_bw: float
    floor_us: float
    bf16_bytes: int  # active experts' bf16 bytes + activations + outputs
    bf16_read_bw_tbps: float
    bf16_floor_us: float  # (b)
    # bf16_floor_us / us: above 1, faster than any bf16 grouped matmul can be
    fraction_of_bf16_floor: float
    ragged_dot_us: float | None  # (a)
    speedup_vs_ragged_dot: float | None
    layers: tuple[int, int]
    noisy: bool


def _grouped_layer(backend: str | None, tuning, activation: str | None):
    def jax_fp4_ragged_matmul(a, w, sizes):
        return jax_fp4.ragged_matmul(
            a, w, sizes, activation=activation, backend=backend, tuning=tuning
        )

    return jax_fp4_ragged_matmul


def _ragged_dot_layer(activation: str | None):
    def ragged_dot_layer(a, w, sizes):
        y = jax.lax.ragged_dot(a, w, sizes)
        if activation is None:
            return y
        # jax_fp4's own epilogue (float32, one rounding), as its composed paths apply it.
        return jax_fp4.lowering.epilogue(y.astype(jnp.float32), activation, None, a.dtype)

    return ragged_dot_layer


def _chain_lengths(active_bytes: int, held_bytes: int, plan: Plan, budget: bench.Budget):
    """(L1, L2) for layers whose active weights are `active_bytes` (what must exceed the cache) and
    that hold `held_bytes` each (all experts: what the memory cap counts)."""
    capped = dataclasses.replace(budget, dense_cap_bytes=plan.mem_cap_bytes)
    return bench.chain_lengths(active_bytes, held_bytes, capped)


@functools.partial(jax.jit, static_argnums=(1,))
def _expert_floats(key, shape: tuple[int, int, int]):
    return jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[-1])


@jax.jit
def _ragged_dot_operand(w):
    return jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)


def make_expert_weights(b: bench.Bench, shape: ExpertShape, count: int, dense_count: int):
    """`count` random stacked weights, NVFP4 [E, N, K] in the bench's layout, and the first
    `dense_count` of them in bf16 as ragged_dot takes them, [E, K, N]."""
    quantize = jax.jit(jax_fp4.quantize)
    fp4, bf16 = [], []
    for i, key in enumerate(jax.random.split(b._next_key(), count)):
        w = _expert_floats(key, (shape.experts, shape.n, shape.k))
        fp4.append(b.laid_out(quantize(w)))
        if i < dense_count:
            bf16.append(_ragged_dot_operand(w))
        del w
    return fp4, bf16


def grouped_path(a, w, backend: str | None) -> str:
    """The path jax_fp4.ragged_matmul takes for these operands."""
    return jax_fp4.ragged_dispatch_path(a, w, backend=backend)


def grouped_rows(
    b: bench.Bench, plan: Plan, shape: ExpertShape, parts: Sequence[str], rng: np.random.Generator
) -> list[GroupedRow]:
    """The rows of one weight shape in `parts` ("gemv", "prefill"): its weights made once (as many
    layers as the longest chain needs; bf16 ones for the chains that time ragged_dot), then each
    (part, tokens, routing) timed against its byte yardsticks."""
    s = b.settings
    itemsize = np.dtype(s.dtype).itemsize
    cases = []
    for part in filter(shape.runs_in, parts):
        with_ragged_dot = part == "prefill" or plan.gemv_bf16
        held = shape.nvfp4_bytes() + (shape.bf16_bytes() if with_ragged_dot else 0)
        for tokens in plan.gemv_tokens if part == "gemv" else (plan.prefill_tokens,):
            for routing in plan.routings:
                choice = route(rng, routing, tokens, shape.experts, plan.top_k, plan.zipf)
                sizes = group_sizes(choice, shape.experts)
                active = int(np.count_nonzero(sizes))
                lengths = _chain_lengths(shape.nvfp4_bytes(active), held, plan, s.budget)
                cases.append((part, tokens, routing, sizes, active, with_ragged_dot, lengths))
    count = max(l2 for *_, (_, l2) in cases)
    dense_count = max((l2 for *_, dense, (_, l2) in cases if dense), default=0)
    fp4_ws, bf16_ws = make_expert_weights(b, shape, count, dense_count)
    rows = []
    for part, tokens, routing, sizes, active, with_ragged_dot, (l1, l2) in cases:
        started = time.perf_counter()
        m = tokens * plan.top_k
        acts = bench.make_activations(b._next_key(), m, shape.k, l2, s.dtype)
        size_list = [jnp.asarray(sizes)] * l2
        io = bench.io_bytes(m, shape.n_out, shape.k, itemsize)
        nbytes, bf16_nbytes = shape.nvfp4_bytes(active) + io, shape.bf16_bytes(active) + io
        read, bf16_read = b.read_bandwidth(nbytes), b.read_bandwidth(bf16_nbytes)
        layer = _grouped_layer(s.backend, s.tuning, shape.activation)
        fp4 = b._time(bench.chain_of(layer), (acts, fp4_ws[:l2], size_list), l1, l2)
        ragged = None
        if with_ragged_dot:
            ragged = b._time(
                bench.chain_of(_ragged_dot_layer(shape.activation)),
                (acts, bf16_ws[:l2], size_list),
                l1,
                l2,
            )
        fp4_tbps = bench.tbps(nbytes, fp4.us)
        bf16_floor = bf16_nbytes / (bf16_read.tbps * 1e12) * 1e6
        row = GroupedRow(
            part=part,
            shape=shape.name,
            experts=shape.experts,
            n=shape.n,
            k=shape.k,
            tokens=tokens,
            top_k=plan.top_k,
            routing=routing,
            m=m,
            active_experts=active,
            max_group=int(sizes.max()),
            path=grouped_path(acts[0], fp4_ws[0], s.backend),
            layout=fp4_ws[0].layout,
            us=fp4.us,
            us_iqr=fp4.iqr_us,
            bytes=nbytes,
            tbps=fp4_tbps,
            tflops=bench.tflops(bench.matmul_flops(m, shape.n, shape.k), fp4.us),
            read_bw_tbps=read.tbps,
            fraction_of_read_bw=fp4_tbps / read.tbps,
            floor_us=nbytes / (read.tbps * 1e12) * 1e6,
            bf16_bytes=bf16_nbytes,
            bf16_read_bw_tbps=bf16_read.tbps,
            bf16_floor_us=bf16_floor,
            fraction_of_bf16_floor=bf16_floor / fp4.us,
            ragged_dot_us=None if ragged is None else ragged.us,
            speedup_vs_ragged_dot=None if ragged is None else ragged.us / fp4.us,
            layers=(l1, l2),
            noisy=fp4.noisy or read.noisy or (ragged is not None and ragged.noisy),
        )
        b.log(f"{format_grouped_row(row)}   [{time.perf_counter() - started:.1f} s]")
        rows.append(row)
        del acts
    return rows


def format_grouped_row(r: GroupedRow) -> str:
    ragged = (
        ""
        if r.ragged_dot_us is None
        else f", ragged_dot {r.ragged_dot_us:.1f} us (x{r.speedup_vs_ragged_dot:.2f})"
    )
    return (
        f"{r.part} {r.shape} [{r.experts}, {r.n}, {r.k}] {r.tokens} tokens x top-{r.top_k} "
        f"{r.routing} ({r.active_experts} experts active, M {r.m}): {r.path} {r.us:.2f} us, "
        f"{r.tbps:.2f} TB/s = {100 * r.fraction_of_read_bw:.0f}% of read "
        f"(floor {r.floor_us:.2f} us)"
        f"{ragged}, bf16 floor {r.bf16_floor_us:.1f} us{' (noisy)' if r.noisy else ''}"
    )


# ---- the fused block (part "block") ----------------------------------------------------------------

BLOCK_STAGES = ("routing", "gate_up", "down", "block")


@dataclasses.dataclass
class BlockRow:
    """One stage of the block at one (tokens, routing): times per layer."""

    part: str  # "block"
    stage: str  # BLOCK_STAGES
    experts: int
    hidden: int
    inter: int
    tokens: int
    top_k: int
    routing: str
    active_experts: int
    max_group: int
    path: str  # jax_fp4.moe's path ("kernels" or "composed")
    layout: str
    us: float
    us_iqr: float
    bytes: int  # what the stage must move (module docstring)
    tbps: float
    read_bw_tbps: float
    fraction_of_read_bw: float
    floor_us: float
    layers: tuple[int, int]
    noisy: bool


def router_logits(choice: np.ndarray, experts: int, rng: np.random.Generator) -> np.ndarray:
    """float32 logits [tokens, experts] whose top-k are `choice` [tokens, k] (in that order):
    the chosen experts 8 and up, the others normal draws well below."""
    tokens, k = choice.shape
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    np.put_along_axis(logits, choice, (8.0 + np.arange(k, 0, -1)).astype(np.float32), axis=1)
    return logits


def block_stage_bytes(shape: BlockShape, tokens: int, top_k: int, active: int, itemsize: int):
    """{stage: bytes it must move}: the experts it touches, its activations and its outputs."""
    pairs = tokens * top_k
    routing = tokens * shape.experts * 4 + pairs * 4 * 4 + shape.experts * 4
    # gate/up reads x and writes the hidden rows; down reads them and the residual and writes y.
    gate_up = shape.gate_up.nvfp4_bytes(active) + (tokens * shape.hidden + pairs * shape.inter) * (
        itemsize
    )
    down = shape.down.nvfp4_bytes(active) + (pairs * shape.inter + 2 * tokens * shape.hidden) * (
        itemsize
    )
    return {"routing": routing, "gate_up": gate_up, "down": down, "block": routing + gate_up + down}


def _block_layer(top_k: int, path: str):
    def jax_fp4_moe_block(x, logits, w_gu, w_d):
        r = jax_fp4.route_top_k(logits, top_k, renormalize=True)
        return jax_fp4.moe(x, r, w_gu, w_d, residual=x, backend=path)

    return jax_fp4_moe_block


def _routing_layer(top_k: int):
    def jax_fp4_route_top_k(logits):
        return jax_fp4.route_top_k(logits, top_k, renormalize=True).weights

    return jax_fp4_route_top_k


def _stage_layer(top_k: int, with_down: bool):
    """The block's kernels on a fixed routing: the gate/up launch alone, or both launches."""
    from jax_fp4 import moe_block  # noqa: PLC0415 - the kernels' own calls, not public API

    def kernels(x, logits, w_gu, w_d):
        r = jax_fp4.route_top_k(logits, top_k, renormalize=True)
        routing = (r.weights, r.order, r.inverse, r.group_sizes)
        gate_up, down = moe_block.stack_operands(w_gu), moe_block.stack_operands(w_d)
        meta = dict(gate_up_meta=(w_gu.block_size, w_gu.layout))
        hidden, counters = moe_block.gate_up_kernel(x, gate_up, routing, **meta)
        if not with_down:
            return hidden
        return moe_block.down_kernel(
            hidden,
            counters,
            down,
            routing,
            x,
            down_meta=(w_d.block_size, w_d.layout),
            dtype=x.dtype,
        )

    return kernels


def block_paths(x, top_k: int, w_gu, w_d) -> list[str]:
    """The paths jax_fp4.moe can take for this block on this device: "composed", and "kernels"
    where they serve."""
    platform = jax.devices()[0].platform
    try:
        jax_fp4.moe_dispatch_path(x, top_k, w_gu, w_d, backend="kernels", platform=platform)
    except ValueError:
        return ["composed"]
    return ["composed", "kernels"]


def block_rows(b: bench.Bench, plan: Plan, rng: np.random.Generator) -> list[BlockRow]:
    """The block part's rows: per (tokens, routing) the routing alone, the block on each path,
    and each of the kernels' path's kernels (module docstring)."""
    s = b.settings
    shape, top_k = plan.block, plan.top_k
    itemsize = np.dtype(s.dtype).itemsize
    held = shape.gate_up.nvfp4_bytes() + shape.down.nvfp4_bytes()
    cases = []
    for tokens in plan.block_tokens:
        for routing in plan.routings:
            choice = route(rng, routing, tokens, shape.experts, top_k, plan.zipf)
            sizes = group_sizes(choice, shape.experts)
            active = int(np.count_nonzero(sizes))
            active_bytes = shape.gate_up.nvfp4_bytes(active) + shape.down.nvfp4_bytes(active)
            lengths = _chain_lengths(active_bytes, held, plan, s.budget)
            cases.append((tokens, routing, choice, sizes, active, lengths))
    count = max(l2 for *_, (_, l2) in cases)
    w_gu, _ = make_expert_weights(b, shape.gate_up, count, 0)
    w_d, _ = make_expert_weights(b, shape.down, count, 0)
    rows = []
    for tokens, routing, choice, sizes, active, (l1, l2) in cases:
        started = time.perf_counter()
        xs = bench.make_activations(b._next_key(), tokens, shape.hidden, l2, s.dtype)
        logits = [jnp.asarray(router_logits(choice, shape.experts, rng))] * l2
        stage_bytes = block_stage_bytes(shape, tokens, top_k, active, itemsize)
        operands = (xs, logits, w_gu[:l2], w_d[:l2])
        routing_t = b._time(bench.chain_of(_routing_layer(top_k)), (logits,), l1, l2)
        paths = block_paths(xs[0], top_k, w_gu[0], w_d[0])
        # (stage, path, timing): the routing is the same on both paths.
        timings = [("routing", "composed", routing_t)]
        for path in paths:
            block_t = b._time(bench.chain_of(_block_layer(top_k, path)), operands, l1, l2)
            timings.append(("block", path, block_t))
        if "kernels" in paths:
            both = b._time(bench.chain_of(_stage_layer(top_k, True)), operands, l1, l2)
            gate_up = b._time(bench.chain_of(_stage_layer(top_k, False)), operands, l1, l2)
            # Both chains route first (a fixed cost in each): the difference is the down kernel.
            timings.append(
                ("gate_up", "kernels", dataclasses.replace(gate_up, us=gate_up.us - routing_t.us))
            )
            down_t = dataclasses.replace(
                both, us=both.us - gate_up.us, noisy=both.noisy or gate_up.noisy
            )
            timings.append(("down", "kernels", down_t))
        timings.sort(key=lambda entry: BLOCK_STAGES.index(entry[0]))
        for stage, path, t in timings:
            nbytes = stage_bytes[stage]
            read = b.read_bandwidth(nbytes)
            us = max(t.us, 1e-3)
            row = BlockRow(
                part="block",
                stage=stage,
                experts=shape.experts,
                hidden=shape.hidden,
                inter=shape.inter,
                tokens=tokens,
                top_k=top_k,
                routing=routing,
                active_experts=active,
                max_group=int(sizes.max()),
                path=path,
                layout=w_gu[0].layout,
                us=us,
                us_iqr=t.iqr_us,
                bytes=nbytes,
                tbps=bench.tbps(nbytes, us),
                read_bw_tbps=read.tbps,
                fraction_of_read_bw=bench.tbps(nbytes, us) / read.tbps,
                floor_us=nbytes / (read.tbps * 1e12) * 1e6,
                layers=(l1, l2),
                noisy=t.noisy or read.noisy or t.us <= 0,
            )
            b.log(f"{format_block_row(row)}   [{time.perf_counter() - started:.1f} s]")
            rows.append(row)
        del xs
    return rows


def format_block_row(r: BlockRow) -> str:
    return (
        f"block {r.stage} [{r.experts} experts, H {r.hidden}, I {r.inter}] {r.tokens} tokens x "
        f"top-{r.top_k} {r.routing} ({r.active_experts} experts active): {r.path} {r.us:.2f} us, "
        f"{r.tbps:.2f} TB/s = {100 * r.fraction_of_read_bw:.0f}% of read "
        f"(floor {r.floor_us:.2f} us){' (noisy)' if r.noisy else ''}"
    )


# ---- output --------------------------------------------------------------------------------------


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _mark(r: dict) -> str:
    return "?" if r.get("noisy") else ""


_MD_GEMV = (
    ("weight", lambda r: f"{r['shape']} [{r['experts']}, {r['n']}, {r['k']}]"),
    ("tokens", lambda r: f"{r['tokens']} x top-{r['top_k']}"),
    ("routing", lambda r: r["routing"]),
    ("active", lambda r: f"{r['active_experts']}"),
    ("path", lambda r: r["path"]),
    ("us", lambda r: f"{r['us']:.1f}{_mark(r)}"),
    ("TB/s", lambda r: f"{r['tbps']:.2f}"),
    ("% of read BW", lambda r: f"{100 * r['fraction_of_read_bw']:.0f}%"),
    ("floor us", lambda r: f"{r['floor_us']:.1f}"),
    ("ragged_dot us", lambda r: _fmt(r["ragged_dot_us"], ".1f")),
)
_MD_PREFILL = (
    ("weight", lambda r: f"{r['shape']} [{r['experts']}, {r['n']}, {r['k']}]"),
    ("tokens", lambda r: f"{r['tokens']} x top-{r['top_k']}"),
    ("routing", lambda r: r["routing"]),
    ("active", lambda r: f"{r['active_experts']}"),
    ("path", lambda r: r["path"]),
    ("us", lambda r: f"{r['us']:.0f}{_mark(r)}"),
    ("TFLOP/s", lambda r: f"{r['tflops']:.0f}"),
    ("(a) ragged_dot us", lambda r: _fmt(r["ragged_dot_us"], ".0f")),
    ("x (a)", lambda r: _fmt(r["speedup_vs_ragged_dot"], ".2f")),
    ("(b) bf16 floor us", lambda r: f"{r['bf16_floor_us']:.0f}"),
    ("(b) / us", lambda r: f"{r['fraction_of_bf16_floor']:.2f}"),
)


_MD_BLOCK = (
    ("stage", lambda r: r["stage"]),
    ("tokens", lambda r: f"{r['tokens']} x top-{r['top_k']}"),
    ("routing", lambda r: r["routing"]),
    ("active", lambda r: f"{r['active_experts']}"),
    ("path", lambda r: r["path"]),
    ("us", lambda r: f"{r['us']:.1f}{_mark(r)}"),
    ("TB/s", lambda r: f"{r['tbps']:.2f}"),
    ("% of read BW", lambda r: f"{100 * r['fraction_of_read_bw']:.0f}%"),
    ("floor us", lambda r: f"{r['floor_us']:.1f}"),
)

_TEXT_COLUMNS = ("weight", "routing", "path", "stage")


def markdown(results: dict) -> str:
    """A results JSON as Markdown: the grouped GEMV, the prefill and XLA's ragged_dot."""
    parts = []
    gemv = [r for r in results["rows"] if r["part"] == "gemv"]
    prefill = [r for r in results["rows"] if r["part"] == "prefill"]
    if gemv:
        parts.append(
            "Grouped decode GEMV (us per grouped matmul; floor: the bytes at read bandwidth)\n\n"
            + bench.markdown_table(_MD_GEMV, gemv, _TEXT_COLUMNS)
        )
    if prefill:
        parts.append(
            "Prefill (us per grouped matmul; (a) XLA's ragged_dot on bf16 experts, (b) the "
            "bf16 active-bytes floor)\n\n"
            + bench.markdown_table(_MD_PREFILL, prefill, _TEXT_COLUMNS)
        )
    block = [r for r in results["rows"] if r["part"] == "block"]
    if block:
        parts.append(
            "The fused block, jax_fp4.moe with its routing (us per layer; down: the kernels' "
            "chain less the gate/up chain; floor: each stage's bytes at read bandwidth)\n\n"
            + bench.markdown_table(_MD_BLOCK, block, _TEXT_COLUMNS)
        )
    for summary in results.get("ragged_dot_hlo", []):
        parts.append(format_hlo_summary(summary))
    return "\n\n".join(parts)


def results_json(b: bench.Bench, plan: Plan, seed: int, rows, hlo, complete: bool) -> dict:
    s = b.settings
    return {
        "device": bench.device_description(),
        "jax_version": jax.__version__,
        "jax_fp4_version": jax_fp4.__version__,
        "dtype": s.dtype_name,
        "backend": s.backend or "auto",
        "tuning": None if s.tuning is None else dataclasses.asdict(s.tuning),
        "layout": s.layout,
        "repeats": s.repeats,
        "warmup": s.warmup,
        "seed": seed,
        "plan": dataclasses.asdict(plan),
        "read_bw": [dataclasses.asdict(r) for r in b.reads],
        "rows": [dataclasses.asdict(r) for r in rows],
        "ragged_dot_hlo": hlo,
        "complete": complete,
    }


# ---- command line --------------------------------------------------------------------------------


def _list(cast):
    def parse(text: str):
        try:
            return tuple(cast(x) for x in text.replace(",", " ").split())
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _parts(text: str) -> tuple[str, ...]:
    parts = _list(str)(text)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; got {text!r}")
    return parts


def _routings(text: str) -> tuple[str, ...]:
    routings = _list(str)(text)
    if not routings or any(r not in ROUTINGS for r in routings):
        raise argparse.ArgumentTypeError(f"routings are {', '.join(ROUTINGS)}; got {text!r}")
    return routings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/moe.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--parts", type=_parts, default=PARTS, help=f"what to run (default {','.join(PARTS)})"
    )
    p.add_argument(
        "--tokens",
        type=_list(int),
        default=None,
        help="the gemv part's token counts (default 1,8,32)",
    )
    p.add_argument(
        "--block-tokens",
        type=_list(int),
        default=None,
        help="the block part's token counts (default 1,8,32)",
    )
    p.add_argument(
        "--prefill-tokens", type=int, default=None, help="the prefill part's tokens (default 4096)"
    )
    p.add_argument("--routings", type=_routings, default=None, help="uniform,zipf (default both)")
    p.add_argument(
        "--zipf", type=float, default=Plan.zipf, help=f"Zipf exponent (default {Plan.zipf})"
    )
    p.add_argument(
        "--gemv-bf16",
        action="store_true",
        help="also time ragged_dot on bf16 experts in the gemv part",
    )
    p.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="tiled",
        help="NVFP4 weight layout (default tiled)",
    )
    p.add_argument(
        "--backend", default=None, help="force a jax_fp4.ragged_matmul backend (default auto)"
    )
    p.add_argument(
        "--tuning",
        type=bench._tuning,
        default=None,
        help="jax_fp4.KernelTuning fields, as bench.py",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed calls per chain (default 10, quick 3)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per chain after compiling")
    p.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="seconds of timed calls per chain pair (default 0.2; quick 0)",
    )
    p.add_argument(
        "--mem-cap-gb", type=float, default=None, help="most weight bytes per chain (default 10)"
    )
    p.add_argument(
        "--cache-mb", type=float, default=None, help="the cache the chains must exceed (default 60)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="random seed (default: fresh from the OS)"
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="results JSON (default benchmarks/results/moe_<gpu>.json; none with --quick)",
    )
    p.add_argument(
        "--dump-hlo",
        metavar="PATH",
        default=None,
        help="write the optimized HLO of XLA's ragged_dot here",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and chains: a CPU smoke run")
    p.add_argument(
        "--markdown-from", metavar="JSON", help="print an earlier result as Markdown and exit"
    )
    return p


_log = bench.log_progress


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.markdown_from:
        with open(args.markdown_from) as f:
            print(markdown(json.load(f)))
        return 0
    base = QUICK_PLAN if args.quick else Plan()
    plan = dataclasses.replace(
        base,
        gemv_tokens=args.tokens or base.gemv_tokens,
        prefill_tokens=args.prefill_tokens or base.prefill_tokens,
        routings=args.routings or base.routings,
        zipf=args.zipf,
        mem_cap_bytes=int(args.mem_cap_gb * bench.GB) if args.mem_cap_gb else base.mem_cap_bytes,
        gemv_bf16=args.gemv_bf16 or base.gemv_bf16,
        block_tokens=args.block_tokens or base.block_tokens,
    )
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    cache = (
        args.cache_mb * bench.MB
        if args.cache_mb is not None
        else (bench.QUICK_CACHE_BYTES if args.quick else bench.DEFAULT_CACHE_BYTES)
    )
    settings = bench.Settings(
        dtype_name="bf16",
        backend=args.backend,
        layout=args.layout,
        tuning=args.tuning,
        repeats=args.repeats if args.repeats is not None else (3 if args.quick else 10),
        warmup=args.warmup,
        min_time_s=args.min_time if args.min_time is not None else (0.0 if args.quick else 0.2),
        budget=bench.Budget(
            cache_bytes=int(cache),
            max_layers=QUICK_MAX_LAYERS if args.quick else bench.Budget.max_layers,
        ),
        read_kernels=("sum",) if args.quick else tuple(bench.READ_KERNELS),
    )
    device = jax.devices()[0]
    json_path = args.json or (
        None
        if args.quick
        else str(RESULTS_DIR / f"moe_{decode.gpu_tag(device.device_kind, device.platform)}.json")
    )
    _log(
        f"jax_fp4 MoE bench on {bench.device_description()}, jax {jax.__version__}, parts "
        f"{','.join(args.parts)}, layout {args.layout}, backend {args.backend or 'auto'}, "
        f"seed {seed}"
    )
    b = bench.Bench(settings, jax.random.key(seed), log=_log)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    if not args.quick:
        bench.warm_up_device(1.0)
    rows: list[GroupedRow | BlockRow] = []
    hlo: list[dict] = []

    def write(complete: bool) -> dict:
        results = results_json(b, plan, seed, rows, hlo, complete)
        if json_path:
            bench.write_json_file(json_path, results)
        return results

    for shape in plan.shapes:
        if any(map(shape.runs_in, (p for p in args.parts if p != "block"))):
            rows += grouped_rows(b, plan, shape, args.parts, rng)
            write(complete=False)
    if "block" in args.parts:
        rows += block_rows(b, plan, rng)
        write(complete=False)
    if "prefill" in args.parts:
        for shape in filter(lambda s: s.runs_in("prefill"), plan.shapes):
            m = plan.prefill_tokens * plan.top_k
            text = ragged_dot_hlo(m, shape.experts, shape.k, shape.n)
            hlo.append(hlo_summary(text, m, shape.experts, shape.k, shape.n))
            _log(format_hlo_summary(hlo[-1]))
            if args.dump_hlo:
                path = Path(args.dump_hlo)
                path = path.with_name(f"{path.stem}_{shape.name}{path.suffix}")
                path.write_text(text)
                _log(f"wrote {path}")
    _log(f"done in {time.perf_counter() - started:.1f} s")
    results = write(complete=True)
    if json_path:
        _log(f"wrote {json_path}")
    print(
        f"device {results['device']}, jax {results['jax_version']}, layout {settings.layout}, "
        f"seed {seed}"
    )
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
