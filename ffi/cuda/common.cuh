// Host-side helpers shared by the CUDA FFI handlers (gemv/, fused/, dequant.cu).
#ifndef JAX_FP4_CUDA_COMMON_CUH_
#define JAX_FP4_CUDA_COMMON_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace cuda {

struct DeviceInfo {
  int sm = 0;       // compute capability, major * 10 + minor
  int num_sms = 0;  // multiprocessor count
};

// The current device's compute capability and SM count, queried once per device and cached.
// cudaGetDevice / cudaDeviceGetAttribute neither synchronise nor touch a stream, so this is legal
// while XLA captures the call into a CUDA graph.
inline cudaError_t GetDeviceInfo(DeviceInfo* info) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cache[kMaxDevices];  // (sm << 32) | num_sms; 0 = not queried yet
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxDevices) {
    const int64_t packed = cache[device].load(std::memory_order_relaxed);
    if (packed != 0) {
      info->sm = static_cast<int>(packed >> 32);
      info->num_sms = static_cast<int>(packed & 0xFFFFFFFF);
      return cudaSuccess;
    }
  }
  int major = 0, minor = 0, sms = 0;
  if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) !=
      cudaSuccess)
    return err;
  if ((err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) !=
      cudaSuccess)
    return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return err;
  info->sm = major * 10 + minor;
  info->num_sms = sms > 0 ? sms : 1;
  if (device >= 0 && device < kMaxDevices) {
    cache[device].store((static_cast<int64_t>(info->sm) << 32) | info->num_sms,
                        std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Raises Kernel's dynamic shared memory limit to at least `bytes` on the current device (the
// default cap is 48 KB). Done once per device and size; like GetDeviceInfo it touches no stream,
// so it is legal during graph capture.
template <auto* Kernel>
cudaError_t AllowDynamicSmem(int bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> allowed[kMaxDevices];  // the largest size set so far, per device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && allowed[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && cached) {
    int seen = allowed[device].load(std::memory_order_relaxed);
    while (seen < bytes && !allowed[device].compare_exchange_weak(seen, bytes)) {
    }
  }
  return err;
}

inline xla::ffi::Error CudaError(const char* where, cudaError_t err) {
  return xla::ffi::Error::Internal(std::string(where) + ": " + cudaGetErrorName(err) + ": " +
                                   cudaGetErrorString(err));
}

// The launch just made (checked without synchronising).
inline xla::ffi::Error CheckLaunch(const char* where) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError(where, err);
  return xla::ffi::Error::Success();
}

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// The kernels' vector loads: a and packed 16 bytes at a time, scale `scale_bytes` at a time. Empty
// when the operands allow them, else what is misaligned.
inline std::string CheckOperandAlignment(const void* a, const void* packed, const void* scale,
                                         int scale_bytes) {
  if (IsAligned(a, 16) && IsAligned(packed, 16) && IsAligned(scale, scale_bytes)) return "";
  return "a and packed must be 16-byte aligned, scale " + std::to_string(scale_bytes) +
         "-byte aligned";
}

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The launch attribute of a programmatic dependent launch: the kernel may start before the
// previous one of its stream has finished (it must call WaitForPrerequisiteGrids, ptx.cuh, before
// its first global memory access).
inline cudaLaunchAttribute ProgrammaticLaunchAttribute() {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch
// (cudaLaunchAttributeProgrammaticStreamSerialization) when `programmatic`: the kernel must then
// call WaitForPrerequisiteGrids (ptx.cuh) before its first global memory access.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, bool programmatic, Args... args) {
  if (!programmatic) {  // the plain launch every default call takes
    kernel<<<grid, block, smem, stream>>>(static_cast<Params>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute = ProgrammaticLaunchAttribute();
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_COMMON_CUH_
