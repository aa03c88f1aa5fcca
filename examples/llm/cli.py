"""Greedy text generation from an NVFP4 checkpoint of a Llama / Qwen-style decoder, dense or
mixture-of-experts (Qwen3-MoE), in plain JAX.

A Hugging Face checkpoint directory (config.json + *.safetensors) quantized by NVIDIA ModelOpt or
llm-compressor (compressed-tensors, nvfp4-pack-quantized) loads with jax_fp4.checkpoint, its NVFP4
layers prepacked (a bf16 checkpoint with --quantize: jax_fp4.quantize on load); every projection
then runs through jax_fp4.matmul: the prompt as one prefill (M = batch x prompt length: the fused
GEMM or dequantize + GEMM on a GPU), each new token as a decode step (M = batch: the decode GEMV),
with a KV cache, one jitted call per token:

    python examples/llm_generate.py CHECKPOINT_DIR --prompt "The capital of France is" --max-new-tokens 32
    python examples/llm_generate.py BF16_CHECKPOINT_DIR --quantize --compare-bf16   # NVFP4 against bf16
    python examples/llm_generate.py --demo        # a small random model, written and read back here
    python examples/llm_generate.py --random llama3-8b --batch 1,8 --compare-bf16 --gpu-busy
    python examples/llm_generate.py --random qwen3-30b-a3b --prompt-len 2048 --json run.json

A layer runs four matmuls: q/k/v as one weight ("qkv_proj", the rows of q, k then v), gate/up as
one ("gate_up_proj", gate rows first), o_proj and down_proj. ModelOpt and llm-compressor give the
parts of each one global scale, so the loader concatenates them exactly (jax_fp4.checkpoint.fuse);
parts whose global scales differ stay separate projections. On NVFP4 weights jax_fp4.matmul applies
the layer's RMSNorm as it reads the activations of qkv_proj and gate_up_proj, SiLU(gate) * up on
gate_up_proj's output and the residual add on o_proj's and down_proj's; on dense weights XLA runs
the same ops around its dot.

Qwen3-MoE (config.json with "num_experts", or transformers 5's "num_local_experts" with model_type
"qwen3_moe"; every layer an MoE layer): a bf16 router (mlp.gate),
softmax in float32, top-k renormalised where norm_topk_prob, no shared expert. jax_fp4.route_top_k
takes the top k and sorts the (token, expert) pairs by expert (one GPU kernel when decoding);
they run through jax_fp4.ragged_matmul on the layer's stacked experts
(gate/up [E, 2I, H], down [E, H, I]), which reads only the experts that have tokens; the outputs,
weighted by the router, are summed back per token. jax_fp4.checkpoint.load_experts reads the
per-expert tensors (model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj).

--random draws a model of a preset's (or a config.json's) shapes with random weights on the
device (q/k/v, gate/up and each layer's experts quantized jointly, as the tools export them);
--compare-bf16 decodes the same weights dequantized to bf16 through XLA's dot (jax.lax.ragged_dot
for experts) and prints the ratio of the decode times (one jitted call per token, compilation
excluded; the tokens, the position and the caches stay on the device, donated to each step). --gpu-busy reads the time the GPU is busy per step
from a jax.profiler trace of a few more steps: the loop's time per step close to it means the host
keeps up. Each run also prints its byte floor: the bytes a step reads (weights, the experts the
batch's tokens visit, the KV cache) at the streaming-read bandwidth measured at the start.
The layers are unrolled by default, each weight its own buffer, which every kernel reads where it
lies; --scan-layers stacks them under lax.scan instead (one layer compiled), where XLA copies each
layer's dense weights out of the stack before their dot: on an H100 the bf16 step took 2.5x as
long that way, the NVFP4 one 1.1x (benchmarks/RESULTS.md). Unrolled, each layer's KV cache is its
own buffer, updated in place. A decode step's attention runs as cuDNN's fused attention kernel,
which reads only the cached positions so far, where it can (a CUDA GPU and bf16 caches: the
default --attention auto), or as XLA's batched dots around a float32 softmax (--attention xla, and
where cuDNN's cannot run); the prefill's attention stays XLA's.

Mixed-precision exports (ModelOpt quant_algo "MIXED_PRECISION", compressed-tensors format
"mixed-precision") run their FP8 layers dense: each dequantized at load with its own scale
(per tensor or per output channel) to the activation dtype, then through XLA's dot; q/k/v or
gate/up parts in FP8 fuse after that dequantization, NVFP4 parts as above, mixed groups stay
separate. Quantization the example does not run (AWQ, INT4 / INT8, a float8 weight without its
scale) is refused at load, naming the layer and the tensor.

Architectures: Llama (2, 3 and 3.1's "llama3" RoPE scaling), Mistral, Qwen2 (q/k/v biases),
Qwen3 (q/k RMS norms) and Qwen3-MoE, told apart by the tensors present and "num_experts"
(sliding-window attention is not applied: exact while the sequence fits the window). Embeddings,
norms, routers and any layer the checkpoint keeps in bf16 (often lm_head) stay dense. With
`tokenizers` installed and a tokenizer.json beside the weights the prompt is text, otherwise token
ids (`--prompt-ids 1,2,3`, or `--prompt-len N` random ones).

config.json: the RoPE settings are read from "rope_parameters" (transformers 5, which current
ModelOpt and llm-compressor exports use) or from the top-level "rope_theta" and "rope_scaling"
(older files); RoPE types other than "default" and "llama3" are refused with an error rather than
run with the wrong frequencies. Each projection's true in_features (hidden_size,
intermediate_size, the head counts) is passed to the loader, which drops the zero padding ModelOpt
adds to a K that is not a multiple of 16 and logs what it dropped.

--json writes {"runs": [...]} with one entry per batch: "model", "batch", "context" (prompt
tokens + new tokens: the KV cache's length, which every decode step's attention reads whole),
"nvfp4_ms" and "bf16_ms" (the loop's time per decode step; "loop_ms" is nvfp4_ms), "ratio"
(bf16_ms / nvfp4_ms), "gpu_busy_ms", "floor_ms" (NVFP4's byte floor), with the bf16 run's busy time
and floor, the bytes and the per-window times beside them; and the setup around the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path

from .config import ATTENTION, PRESETS  # NumPy only: --help answers before jax is imported

GPU_BUSY_STEPS = 8  # decode steps in --gpu-busy's profile


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive int or a comma-separated list of them, got {text!r}"
        )
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/llm_generate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "checkpoint", nargs="?", help="checkpoint directory (config.json, *.safetensors)"
    )
    source.add_argument(
        "--demo", action="store_true", help="write, read back and run a small random model"
    )
    source.add_argument(
        "--random",
        metavar="PRESET|CONFIG_JSON",
        help=f"random weights for a config.json or a preset ({', '.join(PRESETS)}): timing",
    )
    parser.add_argument(
        "--prompt",
        default="The capital of France is",
        help="the prompt text (needs `tokenizers` and a tokenizer.json beside the weights)",
    )
    parser.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    parser.add_argument(
        "--prompt-len",
        type=int,
        metavar="N",
        help="N random token ids (seeded), each sequence of the batch its own, instead of --prompt",
    )
    parser.add_argument(
        "--batch",
        type=_positive_ints,
        default=[1],
        help="sequences decoded together (the prompt repeated, or --prompt-len's own each); a "
        "comma-separated list "
        "(e.g. 1,8,16) runs each batch size in turn on the same weights",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated greedily")
    parser.add_argument(
        "--num-layers",
        type=int,
        metavar="N",
        help="--random: only the first N layers of the model (its other shapes unchanged)",
    )
    parser.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="tiled",
        help="the NVFP4 weights' layout (tiled: prepacked on load where the shape allows)",
    )
    parser.add_argument(
        "--quantize",
        action="store_true",
        help="quantize a bf16 checkpoint's decoder projections to NVFP4 on load",
    )
    parser.add_argument(
        "--compare-bf16",
        action="store_true",
        help="also run the same weights dequantized to bf16 (XLA's dot) and compare",
    )
    parser.add_argument(
        "--gpu-busy",
        action="store_true",
        help=f"also profile {GPU_BUSY_STEPS} more decode steps (jax.profiler) and print the "
        "time the GPU is busy per step",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION,
        default="auto",
        help="what runs a decode step's attention: XLA's batched dots and softmax (xla), "
        "cuDNN's fused attention (cudnn: a CUDA GPU, bf16 caches), or cudnn where it runs and "
        "xla elsewhere (auto, the default)",
    )
    parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the layers under lax.scan (compiles one layer; XLA copies each "
        "layer's dense weights out of the stack every step) instead of unrolling them",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help='write {"runs": [...]} (one entry per batch: model, batch, context, nvfp4_ms, '
        "bf16_ms, ratio, gpu_busy_ms, floor_ms, ...) and the setup to this JSON file",
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.prompt_len is not None and (args.prompt_len < 1 or args.prompt_ids):
        parser.error("--prompt-len must be at least 1, and not given with --prompt-ids")
    if args.num_layers is not None and (args.num_layers < 1 or not args.random):
        parser.error("--num-layers takes a count of at least 1, with --random")
    # jax only now: --help and a wrong argument answer without loading it.
    import jax
    import numpy as np

    import jax_fp4

    from .measure import read_bandwidth
    from .runs import _tokenizer, run_batch
    from .synthetic import random_model, random_prompts, write_demo_checkpoint
    from .weights import dense_twin, load_model

    # The loader says where it dropped a K padding (ModelOpt's, for a K not a multiple of 16).
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jax_fp4.checkpoint").setLevel(logging.INFO)

    # Measured before the weights take the device's memory.
    read_bps = read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) if args.demo else Path(args.checkpoint or tmp)
        if args.random:
            config = PRESETS.get(args.random) or json.loads(Path(args.random).read_text())
            if args.num_layers:
                config = dict(config, num_hidden_layers=args.num_layers)
            cfg, params = random_model(config, layout=args.layout, stack_layers=args.scan_layers)
        else:
            if args.demo:
                write_demo_checkpoint(path)
            cfg, params = load_model(
                path, layout=args.layout, quantize=args.quantize, stack_layers=args.scan_layers
            )
        tokenizer = None if args.random else _tokenizer(path)
        # The baseline of --compare-bf16: the checkpoint's own weights in bf16 where --quantize made
        # the NVFP4 ones (a layer stored in NVFP4 dequantized), else the NVFP4 weights dequantized.
        dense = None
        if args.compare_bf16:
            dense = dense_twin(
                load_model(path, layout=args.layout, stack_layers=args.scan_layers)[1]
                if args.quantize
                else params
            )
    cfg = dataclasses.replace(cfg, attention=args.attention)
    model_name = args.random or ("demo" if args.demo else str(args.checkpoint))
    if args.prompt_len:
        ids = random_prompts(cfg.vocab, 1, args.prompt_len)[0].tolist()
    elif args.prompt_ids or tokenizer is None:
        ids = [int(t) for t in (args.prompt_ids or "1,2,3,4,5").split(",")]
        if not all(0 <= t < cfg.vocab for t in ids):
            parser.error(f"--prompt-ids: token ids must be in [0, {cfg.vocab}), got {ids}")
    else:
        ids = tokenizer.encode(args.prompt).ids

    nvfp4 = [
        w
        for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, jax_fp4.NVFP4Weight))
        if isinstance(w, jax_fp4.NVFP4Weight)
    ]
    device = next(iter(params["embed"].devices()))  # where the model lives, and so runs
    experts = f", {cfg.experts} experts (top {cfg.experts_per_token})" if cfg.experts else ""
    print(
        f"model: {cfg.layers} layers, hidden {cfg.hidden}{experts}, vocab {cfg.vocab}; NVFP4 "
        f"weights {sum(w.nbytes for w in nvfp4) / 2**20:.1f} MiB; streaming read "
        f"{read_bps / 1e9:.0f} GB/s"
    )
    print(f"prompt ({len(ids)} tokens): {ids if len(ids) <= 32 else ids[:32] + ['...']}")
    runs = [
        run_batch(
            cfg,
            params,
            dense,
            random_prompts(cfg.vocab, batch, args.prompt_len)
            if args.prompt_len
            else np.asarray([ids] * batch),
            args.max_new_tokens,
            model=model_name,
            read_bps=read_bps,
            gpu_busy_steps=GPU_BUSY_STEPS if args.gpu_busy else 0,
            tokenizer=tokenizer,
            quantized=args.quantize,
        )
        for batch in args.batch
    ]
    if args.json:
        record = {
            "command": "python examples/llm_generate.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "device": device.device_kind,
            "platform": device.platform,
            "jax": jax.__version__,
            "model": model_name,
            "config": dataclasses.asdict(cfg),
            "layout": args.layout,
            "scan_layers": args.scan_layers,
            "read_gb_per_s": read_bps / 1e9,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0
