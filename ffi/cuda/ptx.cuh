// Small PTX wrappers shared by the CUDA kernels (fused_gemm.cu, benchmarks/probes/gemv_probe.cu):
// cp.async into shared memory, shared-memory vector loads, named barriers, and (sm_90+) mbarriers
// (their cp.async completion too), TMA bulk copies and programmatic dependent launch. Device-only.
#ifndef JAX_FP4_CUDA_PTX_CUH_
#define JAX_FP4_CUDA_PTX_CUH_

#include <cstdint>

namespace jax_fp4 {
namespace cuda {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; bytes past src_bytes (0 or 16) are zero-filled.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, uint32_t src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsync8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's commit groups are pending.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 LdShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// ---- sm_90+: mbarrier completion of TMA bulk copies --------------------------------------------

// Barrier in shared memory (address `bar`) expecting `count` arrivals per phase.
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// One arrival that also expects `bytes` of bulk-copy traffic before the phase completes.
__device__ __forceinline__ void MbarExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// One plain arrival.
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Makes initialised barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Spins until the phase with parity `parity` has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One arrival on `bar` once every cp.async this thread issued so far has landed (the pending
// count is not raised: `bar` must expect this arrival in its init count).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, a multiple of 32.
__device__ __forceinline__ void NamedBarrierSync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A GPU-scope acquire load (pairs with RedReleaseGpu).
__device__ __forceinline__ int LoadAcquireGpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// *p += v as a GPU-scope release: the fence is cumulative, so by one thread right after a barrier
// it publishes the stores of every thread that took part in the barrier (one fence per CTA
// instead of one per thread).
__device__ __forceinline__ void RedReleaseGpu(int* p, int v) {
  asm volatile(
      "fence.acq_rel.gpu;\n"
      "red.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(p),
      "r"(v)
      : "memory");
}

// TMA bulk copy global -> shared of `bytes` (a multiple of 16, both addresses 16-byte aligned),
// completing on barrier `bar`. Bypasses the L1 miss path that ld.global and cp.async share.
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// TMA tiled copy of the box at element coordinates (x innermost, y) of the 2D tensor map at
// `map` (the generic address of a __grid_constant__ kernel parameter) into shared memory at
// `dst`, completing on barrier `bar`.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const void* map, int x, int y,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// Programmatic dependent launch (sm_90+; both are no-ops in a kernel launched without it, and
// compile to nothing below sm_90). A kernel launched with it may start while the previous kernel
// of its stream still runs: it must not read or write global memory before
// WaitForPrerequisiteGrids, which returns once that kernel has finished and its writes are visible.
// AllowDependentLaunch lets the next such kernel be scheduled before this one finishes.
__device__ __forceinline__ void WaitForPrerequisiteGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_PTX_CUH_
