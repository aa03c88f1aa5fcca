// Activation functions of the kernels' epilogue fusions (the GEMV's GemvFusion, the fused GEMM's
// EpilogueFusion), in f32 before the one rounding. Device only.
#ifndef JAX_FP4_CUDA_ACTIVATIONS_CUH_
#define JAX_FP4_CUDA_ACTIVATIONS_CUH_

namespace jax_fp4 {
namespace cuda {

// silu(x) = x * sigmoid(x), as jax.nn.silu.
__device__ __forceinline__ float Silu(float x) { return x / (1.0f + expf(-x)); }

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_ACTIVATIONS_CUH_
