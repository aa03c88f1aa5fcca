// Every inline-PTX wrapper of the CUDA kernels, in one place: byte permutes and conversions,
// streaming global loads, cp.async into shared memory, shared-memory loads, named barriers,
// GPU-scope acquire / release, (sm_90+) mbarriers, cluster barriers, TMA copies and programmatic
// dependent launch, mma.sync (sm_80+) and wgmma with its fences and shared-memory descriptors
// (sm_90a), setmaxnreg, and the empty-asm register fences that pin values in registers. Device
// only.
#ifndef JAX_FP4_CUDA_PTX_CUH_
#define JAX_FP4_CUDA_PTX_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

// 1 in the sm_90a device pass (wgmma, setmaxnreg), 0 in every other pass (host, other targets).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_FP4_SM90A 1
#else
#define JAX_FP4_SM90A 0
#endif

namespace jax_fp4 {
namespace cuda {

// ---- registers and global memory ---------------------------------------------------------------

// Byte permute (prmt.b32): result byte i = byte sel_nibble_i of the 8-byte value {hi:lo}.
__device__ __forceinline__ uint32_t prmt(uint32_t lo, uint32_t hi, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
  return r;
}

// sm_89+: two E4M3 bytes (the low 16 bits of `bytes`) as an exact fp16 pair (NaN stays NaN).
__device__ __forceinline__ uint32_t cvt_f16x2_e4m3x2(uint32_t bytes) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<unsigned short>(bytes)));
  return h2;
}

// Streaming 16-byte load (read once: do not keep it in L1, where activations live).
// L2PrefetchBytes = 256: a miss fetches the 256 bytes around the address into L2 (the L2::256B
// prefetch-size hint), for loads whose neighbours other warps are about to read.
template <int L2PrefetchBytes = 0>
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  static_assert(L2PrefetchBytes == 0 || L2PrefetchBytes == 256, "no hint, or 256 bytes");
  uint4 r;
  if constexpr (L2PrefetchBytes == 256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  }
  return r;
}

// Compiler-only fences: the value must be in a register here (no instruction is emitted).
__device__ __forceinline__ void FenceReg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void FenceReg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <typename P>
__device__ __forceinline__ void FencePtr(const P*& p) {
  asm volatile("" : "+l"(p));
}

// ---- shared memory -----------------------------------------------------------------------------

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

__device__ __forceinline__ uint32_t LdShared8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint2 LdShared64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
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

// The two halves of a cluster barrier (sm_90). The arrival is relaxed: it publishes none of this
// thread's writes, so it does not wait for them to drain; for a barrier that only has to follow
// reads whose values are already consumed (distributed shared memory kept alive until every rank
// has read it).
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
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
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
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

// ---- mma.sync (sm_80+) ------------------------------------------------------------------------

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: c[0..3] += A * B (the decode GEMV's fragment
// layout: ffi/cuda/gemv/mma.cuh). Compiles to nothing below sm_80.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

// ---- wgmma, setmaxnreg (sm_90a) ----------------------------------------------------------------

__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Moves this warpgroup's register budget to N per thread (warp-specialized kernel).
template <int N, bool Increase>
__device__ __forceinline__ void SetMaxRegisters() {
  if constexpr (Increase) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
  }
}

template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// wgmma shared-memory descriptor: K-major operand, 128-byte swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t MakeDesc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// ---- wgmma m64nNk16, A from registers, B K-major from shared memory --------------------------
// One macro per N (= BM; N / 2 fp32 accumulators per thread, 8 per JAX_FP4_ACC8); TYPE is "f16"
// or "bf16". They name WgmmaRS's operands d, a0..a3, desc and scale_d; scale_d == 0: D = A * B.
#if JAX_FP4_SM90A
#define JAX_FP4_ACC8(I)                                                                       \
  "+f"(d[I]), "+f"(d[I + 1]), "+f"(d[I + 2]), "+f"(d[I + 3]), "+f"(d[I + 4]), "+f"(d[I + 5]), \
      "+f"(d[I + 6]), "+f"(d[I + 7])
#define JAX_FP4_WGMMA_M64N16(TYPE)                                \
  asm volatile(                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE \
      " {"                                                        \
      "%0, %1, %2, %3, %4, %5, %6, %7"                            \
      "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"              \
      : JAX_FP4_ACC8(0)                                           \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N32(TYPE)                                           \
  asm volatile(                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                           \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE            \
      " {"                                                                   \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
      "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"                       \
      : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8)                                     \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N64(TYPE)                                                     \
  asm volatile(                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                     \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                      \
      " {"                                                                             \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                 \
      : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8), JAX_FP4_ACC8(16), JAX_FP4_ACC8(24)           \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N128(TYPE)                                                             \
  asm volatile(                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE                              \
      " {"                                                                                      \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "        \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "        \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"          \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                          \
      : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8), JAX_FP4_ACC8(16), JAX_FP4_ACC8(24), JAX_FP4_ACC8(32), \
        JAX_FP4_ACC8(40), JAX_FP4_ACC8(48), JAX_FP4_ACC8(56)                                    \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N256(TYPE)                                                                \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE                                 \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "           \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "           \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "           \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "           \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "           \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "     \
      "%111, "                                                                                     \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, " \
      "%127"                                                                                       \
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"                                        \
      : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8), JAX_FP4_ACC8(16), JAX_FP4_ACC8(24), JAX_FP4_ACC8(32),    \
        JAX_FP4_ACC8(40), JAX_FP4_ACC8(48), JAX_FP4_ACC8(56), JAX_FP4_ACC8(64), JAX_FP4_ACC8(72),  \
        JAX_FP4_ACC8(80), JAX_FP4_ACC8(88), JAX_FP4_ACC8(96), JAX_FP4_ACC8(104),                   \
        JAX_FP4_ACC8(112), JAX_FP4_ACC8(120)                                                       \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#endif  // JAX_FP4_SM90A

template <typename T, int BM>
__device__ __forceinline__ void WgmmaRS(float (&d)[BM / 2], const uint32_t (&a)[4], uint64_t desc,
                                        uint32_t scale_d) {
#if JAX_FP4_SM90A
  const uint32_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
#define JAX_FP4_WGMMA_TYPED(WGMMA)           \
  if constexpr (std::is_same_v<T, __half>) { \
    WGMMA("f16");                            \
  } else {                                   \
    WGMMA("bf16");                           \
  }
  if constexpr (BM == 16) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N16)
  } else if constexpr (BM == 32) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N32)
  } else if constexpr (BM == 64) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N64)
  } else if constexpr (BM == 128) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N128)
  } else {
    static_assert(BM == 256, "BM must be 16, 32, 64, 128 or 256");
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N256)
  }
#undef JAX_FP4_WGMMA_TYPED
#endif
}
#if JAX_FP4_SM90A
#undef JAX_FP4_ACC8
#undef JAX_FP4_WGMMA_M64N16
#undef JAX_FP4_WGMMA_M64N32
#undef JAX_FP4_WGMMA_M64N64
#undef JAX_FP4_WGMMA_M64N128
#undef JAX_FP4_WGMMA_M64N256
#endif

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_PTX_CUH_
