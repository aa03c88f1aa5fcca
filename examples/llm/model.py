"""The forward pass of a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE decoder with a KV cache
(`forward`, `empty_cache`): NVFP4 projections through jax_fp4.matmul with the norms, SiLU(gate) *
up and the residual adds folded in, dense ones through XLA's dot, Qwen3-MoE's experts through
jax_fp4.ragged_matmul, a decode step's attention through XLA or cuDNN (`attend`); and, for
measurement, the experts a sequence's tokens route to (`routed_experts`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4

from .config import Config
from .weights import FUSED

ACTIVATIONS = (None, "silu_mul")


def linear(x, w, bias=None, *, norm=None, norm_eps=1e-6, activation=None, residual=None):
    """x [..., K] @ w^T (+ bias) with a decoder layer's fusions: `norm` an RMSNorm weight [K]
    applied to x first (eps `norm_eps`); activation "silu_mul" for a fused gate/up weight [2I, K]
    (rows [:I] gate, [I:] up), giving silu(gate) * up [..., I]; `residual` [..., N out] added last.
    An NVFP4 weight runs through jax_fp4.matmul, which takes them as arguments (the decode GEMV
    applies them in its kernel: no separate launches, no normed copy of x); a dense one through
    XLA's dot, the norm before it and the rest after it in float32, rounded once (XLA fuses them
    into the ops around the dot)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(w, jax_fp4.NVFP4Weight):
        return jax_fp4.matmul(
            x,
            w,
            bias,
            norm_weight=norm,
            norm_eps=norm_eps,
            activation=activation,
            residual=residual,
        )
    if norm is not None:
        x = rms_norm(x, norm, norm_eps)
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype))
    return _epilogue(y if bias is None else y + bias.astype(y.dtype), activation, residual)


def _epilogue(y, activation, residual):
    """silu(gate) * up of y's halves (activation "silu_mul") and + residual, in float32, rounded
    once to y's dtype."""
    if activation is None and residual is None:
        return y
    out = y.astype(jnp.float32)
    if activation == "silu_mul":
        gate, up = jnp.split(out, 2, axis=-1)
        out = jax.nn.silu(gate) * up
    if residual is not None:
        out = out + residual.astype(jnp.float32)
    return out.astype(y.dtype)


def rms_norm(x, weight, eps):
    return _normalized(x.astype(jnp.float32), weight, eps).astype(x.dtype)


def _normalized(x32, weight, eps):
    """The RMSNorm of float32 x32's last axis, in float32."""
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * weight


def apply_rope(x, positions, inv_freq, *, norm=None, norm_eps=1e-6):
    """x [B, S, heads, head_dim] rotated by positions [S] (Hugging Face's rotate-half pairing),
    in float32 and rounded once to x's dtype; `norm` an RMSNorm weight [head_dim] applied first
    (Qwen3's q/k norms), its output rotated unrounded: one pass over x, one rounding."""
    x32 = x.astype(jnp.float32)
    if norm is not None:
        x32 = _normalized(x32, norm, norm_eps)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [S, hd / 2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(cfg: Config, h, layer):
    """q [B, S, heads, head_dim], k and v [B, S, kv_heads, head_dim] of the layer's input h: one
    matmul with the input norm folded in (fused q/k/v), or the norm then three."""
    b, s, _ = h.shape
    q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if "qkv_proj" in layer:
        qkv = linear(
            h,
            layer["qkv_proj"],
            layer.get("qkv_proj_bias"),
            norm=layer["input_layernorm"],
            norm_eps=cfg.rms_eps,
        )
        q, k, v = split_fused(qkv, [q_size, kv_size, kv_size], cfg.shards)
    else:
        x = rms_norm(h, layer["input_layernorm"], cfg.rms_eps)
        q, k, v = (linear(x, layer[p], layer.get(f"{p}_bias")) for p in FUSED["qkv_proj"])
    return (
        q.reshape(b, s, cfg.heads, cfg.head_dim),
        k.reshape(b, s, cfg.kv_heads, cfg.head_dim),
        v.reshape(b, s, cfg.kv_heads, cfg.head_dim),
    )


def _mlp(cfg: Config, h, layer):
    """h + the MLP of h: gate/up as one matmul with the norm and SiLU(gate) * up folded in, then
    down_proj adding the residual; or the norm and the parts one by one."""
    if "gate_up_proj" in layer and cfg.shards > 1:
        # Each shard's gate rows pair with its own up rows, not with row j + I of the whole.
        y = linear(
            h, layer["gate_up_proj"], norm=layer["post_attention_layernorm"], norm_eps=cfg.rms_eps
        )
        gated = silu_mul(*split_fused(y, [cfg.intermediate] * 2, cfg.shards))
    elif "gate_up_proj" in layer:
        gated = linear(
            h,
            layer["gate_up_proj"],
            norm=layer["post_attention_layernorm"],
            norm_eps=cfg.rms_eps,
            activation="silu_mul",
        )
    else:
        x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_eps)
        gated = silu_mul(linear(x, layer["gate_proj"]), linear(x, layer["up_proj"]))
    return linear(gated, layer["down_proj"], residual=h)


def split_fused(y, sizes, shards: int = 1):
    """The parts [..., size] of a fused projection's output y [..., sum(sizes)] whose rows are
    `shards` groups, each holding sizes / shards rows of every part in turn (Config.shards)."""
    if shards == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    grouped = y.reshape(*y.shape[:-1], shards, y.shape[-1] // shards)
    parts = jnp.split(grouped, np.cumsum([s // shards for s in sizes])[:-1].tolist(), axis=-1)
    return [p.reshape(*y.shape[:-1], size) for p, size in zip(parts, sizes)]


def silu_mul(gate, up):
    """silu(gate) * up in float32, rounded once to gate's dtype."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def experts_matmul(a, w, group_sizes, activation=None):
    """a [M, K], rows sorted by expert (group_sizes [E] of them each), times each row's expert:
    [M, N] in a's dtype; activation "silu_mul" on fused gate/up experts gives silu(gate) * up
    [M, N / 2]. NVFP4 experts w [E, N, K] (as checkpoints store each expert) through
    jax_fp4.ragged_matmul, which reads only the experts that have rows and runs silu_mul in its
    kernel; dense ones [E, K, N] (jax.lax.ragged_dot's own layout) through ragged_dot."""
    if isinstance(w, jax_fp4.NVFP4Weight):
        return jax_fp4.ragged_matmul(a, w, group_sizes, activation=activation)
    y = jax.lax.ragged_dot(a, w.astype(a.dtype), group_sizes)
    return silu_mul(*jnp.split(y, 2, -1)) if activation == "silu_mul" else y


def mixture_of_experts(cfg: Config, x, router, experts: dict, residual=None):
    """The MoE block on normed tokens x [T, H]: residual (if given) + the sum over each token's
    top-k experts of its router weight times the expert's down(silu(gate(x)) * up(x)), in float32
    and rounded once to x's dtype."""
    t, k = x.shape[0], cfg.experts_per_token
    # The router's logits in x's dtype, as HF's; their float32 softmax, top k (renormalised where
    # norm_topk_prob) and the (token, slot) pairs grouped by expert: one GPU kernel when decoding.
    r = jax_fp4.route_top_k(linear(x, router), k, renormalize=cfg.norm_topk_prob)
    fused, down = experts.get("gate_up_proj"), experts["down_proj"]
    if isinstance(fused, jax_fp4.NVFP4Weight) and isinstance(down, jax_fp4.NVFP4Weight):
        # The whole block in jax_fp4.moe: on a GPU at decode sizes two kernels after the routing
        # (the tokens gathered inside the gate/up kernel, the weighted sum and the residual in the
        # down kernel's epilogue).
        return jax_fp4.moe(x, r, fused, down, residual=residual)
    group_sizes = r.group_sizes
    rows = x[r.order // k]
    if fused is not None:
        hidden = experts_matmul(rows, fused, group_sizes, "silu_mul")
    else:
        gate = experts_matmul(rows, experts["gate_proj"], group_sizes)
        hidden = silu_mul(gate, experts_matmul(rows, experts["up_proj"], group_sizes))
    out = experts_matmul(hidden, down, group_sizes)
    # Back to (token, slot) order through the inverse permutation, then each token's k outputs
    # summed in slot order: a gather and a fixed-order sum, where a scatter-add of the pairs onto
    # their tokens would add in the order the GPU's atomics happen to land (not bit-reproducible).
    out = out[r.inverse].astype(jnp.float32).reshape(t, k, -1)
    y = jnp.sum(out * r.weights[..., None], axis=1)
    return (y if residual is None else residual.astype(jnp.float32) + y).astype(x.dtype)


def _moe(cfg: Config, h, layer):
    """h + the MoE block of h (its post-attention norm first)."""
    b, s, d = h.shape
    x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_eps).reshape(b * s, d)
    y = mixture_of_experts(cfg, x, layer["router"], layer["experts"], residual=h.reshape(b * s, d))
    return y.reshape(b, s, d)


def _attention(cfg: Config, inv_freq, positions, h, layer, k_cache, v_cache):
    """h + the attention block of h [B, S, hidden] at positions [S] (o_proj adding the residual),
    and the caches [B, kv_heads, T, head_dim] with these positions' keys and values written."""
    b, s, _ = h.shape
    q, k, v = _qkv(cfg, h, layer)
    q = apply_rope(q, positions, inv_freq, norm=layer.get("q_norm"), norm_eps=cfg.rms_eps)
    k = apply_rope(k, positions, inv_freq, norm=layer.get("k_norm"), norm_eps=cfg.rms_eps)
    # The caches hold each head's positions together ([B, kv_heads, T, head_dim]): the layout of
    # the attention's batched matmuls, read where it lies. Caches of [B, T, kv_heads, head_dim]
    # were transposed whole, every layer of every step (XLA's CPU program; docs/design.md).
    k_cache = jax.lax.dynamic_update_slice_in_dim(
        k_cache, k.swapaxes(1, 2).astype(k_cache.dtype), positions[0], axis=2
    )
    v_cache = jax.lax.dynamic_update_slice_in_dim(
        v_cache, v.swapaxes(1, 2).astype(v_cache.dtype), positions[0], axis=2
    )

    attn = attend(cfg, q, k_cache, v_cache, positions)
    attn = attn.reshape(b, s, cfg.heads * cfg.head_dim).astype(h.dtype)
    return linear(attn, layer["o_proj"], residual=h), k_cache, v_cache


def decode_attention(cfg: Config, cache_dtype) -> str:
    """What runs a decode step's attention on caches of `cache_dtype`: Config.attention, with
    "auto" resolved to "cudnn" where cuDNN's fused attention runs (the default device a CUDA GPU
    of compute capability 8.0+, bfloat16 or float16 caches, jax's cuDNN attention module present)
    and to "xla" elsewhere, and in a tensor-parallel placement (Config.shards > 1, where cuDNN's
    kernel over sharded heads is not measured). One kernel for the scores, softmax and values
    instead of ~4 measured 4-5% faster a step at batch 1 and even at batch 16 (H100;
    docs/design.md)."""
    if cfg.attention != "auto":
        return cfg.attention
    if cfg.shards > 1:
        return "xla"
    if np.dtype(cache_dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return "xla"
    device = jax.config.jax_default_device or jax.devices()[0]  # jax.default_device's, if set
    if isinstance(device, str):
        device = jax.devices(device)[0]
    capability = str(getattr(device, "compute_capability", "") or "")
    if device.platform != "gpu" or not capability or int(capability.split(".")[0]) < 8:
        return "xla"
    try:
        from jax._src.cudnn import fused_attention_stablehlo  # noqa: F401
    except ImportError:
        return "xla"
    return "cudnn"


def attend(cfg: Config, q, k_cache, v_cache, positions):
    """Grouped-query attention of q [B, S, heads, head_dim] at positions [S] over the caches
    [B, kv_heads, T, head_dim] holding them, each query seeing the positions up to its own:
    [B, S, heads, head_dim] in the caches' dtype. A decode step's (S = 1) runs as
    `decode_attention` says: cuDNN's fused attention (`_cudnn_decode_attention`) or, like every
    prefill, XLA's batched dots around a float32 softmax."""
    if q.shape[1] == 1 and decode_attention(cfg, k_cache.dtype) == "cudnn":
        return _cudnn_decode_attention(q, k_cache, v_cache, positions[0])
    # On the caches' own dtype, accumulated in float32 (the product with the values rounds to that
    # dtype, as the next projection takes it): no float32 copy of the caches to read (an H100 at
    # 1024-2048 new tokens: 3-4% off the step; benchmarks/RESULTS.md).
    b, s, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    qg = q.reshape(b, s, kv_heads, heads // kv_heads, head_dim).astype(k_cache.dtype)
    scores = jnp.einsum(
        "bskgd,bktd->bkgst", qg, k_cache, preferred_element_type=jnp.float32
    ) / math.sqrt(head_dim)
    visible = jnp.arange(k_cache.shape[2])[None, :] <= positions[:, None]  # [S, T], causal
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v_cache.dtype)
    return jnp.einsum("bkgst,bktd->bskgd", probs, v_cache).reshape(b, s, heads, head_dim)


def _cudnn_decode_attention(q, k_cache, v_cache, position):
    """`attend` for one query position a sequence (q [B, 1, heads, head_dim]) at `position`: one
    cuDNN fused-attention kernel (scores, softmax and the product with the values) that reads the
    cached positions 0 .. position only (a padding mask of position + 1 keys), where XLA's dots
    read the whole cache and the softmax takes kernels of its own. jax.nn.dot_product_attention's
    cuDNN path takes [B, T, heads, head_dim] operands only, into which the caches would be copied
    every layer of every step; the function under it takes their own layout ("BNTH")."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError as err:  # a private module: another jax may move it
        raise ValueError(
            f"attention 'cudnn' needs jax's cuDNN fused attention, which jax {jax.__version__} "
            f"does not have where this example looks ({err}): use 'xla'"
        ) from err

    if k_cache.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention 'cudnn' runs bfloat16 or float16 caches, got {k_cache.dtype}: use 'xla'"
        )
    b = q.shape[0]
    out = dot_product_attention(
        q.swapaxes(1, 2).astype(k_cache.dtype),  # [B, heads, 1, head_dim]
        k_cache,
        v_cache,
        q_seqlen=jnp.ones((b,), jnp.int32),
        kv_seqlen=jnp.full((b,), position + 1, jnp.int32),
        scale=1 / math.sqrt(q.shape[-1]),
        mask_type=MaskType.PADDING,
        qkv_layout="BNTH",
    )
    return out.swapaxes(1, 2)


def _layer(cfg: Config, inv_freq, positions, h, layer, k_cache, v_cache):
    """One decoder layer on h [B, S, hidden] at positions [S]; caches [B, kv_heads, T, head_dim]."""
    h, k_cache, v_cache = _attention(cfg, inv_freq, positions, h, layer, k_cache, v_cache)
    h = _moe(cfg, h, layer) if "experts" in layer else _mlp(cfg, h, layer)
    return h, k_cache, v_cache


def forward(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """Logits [B, S, vocab] (float32) of tokens [B, S] placed at positions start .. start + S - 1,
    and the caches with their keys and values written. The caches are `empty_cache`'s for these
    params: a list of [B, kv_heads, T, head_dim] arrays per layer for unrolled layers, one
    [layers, B, kv_heads, T, head_dim] array for stacked ones."""
    h, k_cache, v_cache = hidden_states(cfg, params, tokens, start, k_cache, v_cache)
    return lm_logits(cfg, params, h), k_cache, v_cache


def hidden_states(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """`forward` up to the last layer's output [B, S, hidden] (before the final norm), and the
    caches."""
    positions = start + jnp.arange(tokens.shape[1])
    layer_step = functools.partial(_layer, cfg, params["inv_freq"], positions)

    def step(h, layer, k_layer, v_layer):
        return (*layer_step(h, layer, k_layer, v_layer), None)

    h, k_cache, v_cache, _ = _decoder(step, params, tokens, k_cache, v_cache)
    return h, k_cache, v_cache


def lm_logits(cfg: Config, params: dict, h):
    """Logits [..., vocab] (float32) of hidden states h [..., hidden]: the final norm, lm_head."""
    return linear(rms_norm(h, params["norm"], cfg.rms_eps), params["lm_head"]).astype(jnp.float32)


def _decoder(layer_step, params: dict, tokens, k_cache, v_cache):
    """tokens [B, S] embedded and through every layer of params: layer_step(h, layer, k_layer,
    v_layer) -> (h, k_layer, v_layer, aux) per layer; returns (h, k_cache, v_cache, the layers'
    aux, stacked on a leading axis)."""
    h = params["embed"][tokens]
    stacked = isinstance(params["layers"], dict)
    if stacked == isinstance(k_cache, (list, tuple)):
        expected = "one stacked array" if stacked else "a list of arrays, one per layer"
        raise TypeError(
            f"forward: k_cache must be {expected} for these params' "
            f"{'stacked' if stacked else 'unrolled'} layers (empty_cache makes it), "
            f"got {type(k_cache).__name__}"
        )
    if stacked:  # assemble's stack_layers: one layer compiled, under lax.scan

        def body(h, xs):
            h, k_layer, v_layer, aux = layer_step(h, *xs)
            return h, (k_layer, v_layer, aux)

        h, (k_cache, v_cache, aux) = jax.lax.scan(body, h, (params["layers"], k_cache, v_cache))
        return h, k_cache, v_cache, aux
    # unrolled: every weight passed to its kernel as the buffer it is, and each layer's cache its
    # own buffer, which the step's keys and values update in place (a stacked cache was copied a
    # layer at a time through .at[i].set: an H100 at batch 1 and 2048 new tokens took 3.98 ms a
    # step that way, 3.30 this way).
    k_cache, v_cache, aux = list(k_cache), list(v_cache), []
    for i, layer in enumerate(params["layers"]):
        h, k_cache[i], v_cache[i], layer_aux = layer_step(h, layer, k_cache[i], v_cache[i])
        aux.append(layer_aux)
    return h, k_cache, v_cache, jax.tree.map(lambda *xs: jnp.stack(xs), *aux)


def routed_experts(cfg: Config, params: dict, tokens):
    """The experts each MoE layer routes each of tokens [B, S] (positions 0 .. S - 1) to: int32
    [layers, B, S, experts_per_token]. A forward pass for measurement only (`forward` returns no
    routing, so the timed step computes nothing more): the whole sequence at once, each layer's
    router on its post-attention norm as the MoE block takes it."""
    positions = jnp.arange(tokens.shape[1])
    k_cache, v_cache = empty_cache(cfg, params, *tokens.shape)

    def step(h, layer, k_layer, v_layer):
        h, k_layer, v_layer = _attention(
            cfg, params["inv_freq"], positions, h, layer, k_layer, v_layer
        )
        x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_eps).reshape(-1, h.shape[-1])
        r = jax_fp4.route_top_k(
            linear(x, layer["router"]), cfg.experts_per_token, renormalize=cfg.norm_topk_prob
        )
        experts = r.experts.reshape(*h.shape[:2], -1)
        return _moe(cfg, h, layer), k_layer, v_layer, experts

    return _decoder(step, params, tokens, k_cache, v_cache)[3]


def empty_cache(cfg: Config, params: dict, batch: int, max_len: int, sharding=None):
    """Zeroed key and value caches for `forward` on these params, in their embedding's dtype;
    `sharding` (e.g. a NamedSharding of one cache array) places each array, else the default
    device holds them."""
    shape, dtype = (batch, cfg.kv_heads, max_len, cfg.head_dim), params["embed"].dtype
    if isinstance(params["layers"], dict):
        shape, count = (cfg.layers, *shape), 2
    else:
        count = 2 * cfg.layers
    zeros = [jnp.zeros(shape, dtype, device=sharding) for _ in range(count)]
    if isinstance(params["layers"], dict):
        return zeros[0], zeros[1]
    return zeros[: cfg.layers], zeros[cfg.layers :]
