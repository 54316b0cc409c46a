// device_buffer.hpp with the CUDA runtime (linked shared, so the caller's
// context and streams are ours). NOT YET RUN ON A GPU (docs/cuda.md).
#include <cuda.h>  // CUdeviceptr / CUresult only; cuMemGetAddressRange comes through the runtime
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>

#include "cuda_check.hpp"
#include "device_buffer.hpp"

namespace shmps::detail {
namespace {

// Every failure path: the runtime keeps the failed call's error as the
// thread's "last error", and the caller's next launch check
// (cudaGetLastError, e.g. PyTorch's) would report it as its own.
Status failed(const std::string& text) {
  (void)cudaGetLastError();
  return {ErrorCode::kCuda, text};
}

// Restores the caller's current device when we leave.
class DeviceScope {
 public:
  DeviceScope() { ok_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceScope() {
    if (ok_) (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool ok_ = false;
};

using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// Null on failure, with the reason in *why.
GetAddressRangeFn address_range_fn(std::string* why) {
  static std::once_flag once;
  static GetAddressRangeFn fn = nullptr;
  static std::string error;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    error = SHMPS_CUDA_ERROR(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &found));
    if (error.empty() && (found != cudaDriverEntryPointSuccess || p == nullptr))
      error = "cuMemGetAddressRange: the driver has no such entry point";
    if (error.empty()) fn = reinterpret_cast<GetAddressRangeFn>(p);
  });
  if (fn == nullptr) *why = error;
  return fn;
}

}  // namespace

Result<DeviceBuffer> describe_device_buffer(const void* ptr, size_t bytes, bool in_process) {
  if (ptr == nullptr || bytes == 0) return Status{ErrorCode::kInvalidArgument, "device buffer: null pointer or 0 bytes"};
  // No device (or no driver) first, with that name: every later call would
  // fail with a less telling error.
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return failed(std::string("device buffer: no CUDA device in this process (") +
                  (e == cudaSuccess ? "0 devices" : cudaGetErrorName(e)) +
                  "): check nvidia-smi, access to /dev/nvidia* and CUDA_VISIBLE_DEVICES");
  }
  cudaPointerAttributes attr{};
  if (std::string e = SHMPS_CUDA_ERROR(cudaPointerGetAttributes(&attr, ptr)); !e.empty()) return failed("device buffer: " + e);
  if (attr.type == cudaMemoryTypeManaged)
    return Status{ErrorCode::kInvalidArgument, "device buffer: managed memory (cudaMallocManaged) cannot be exported by CUDA "
                                               "IPC; allocate gradient buffers with cudaMalloc"};
  if (attr.type != cudaMemoryTypeDevice)
    return Status{ErrorCode::kInvalidArgument, "device buffer: the pointer is not device memory (use register_buffer for "
                                               "host memory)"};
  DeviceBuffer b;
  b.device = attr.device;
  DeviceScope scope;
  if (std::string e = SHMPS_CUDA_ERROR(cudaSetDevice(b.device)); !e.empty()) return failed(e);
  std::string why;
  GetAddressRangeFn range = address_range_fn(&why);
  if (range == nullptr) return failed("device buffer: " + why);
  CUdeviceptr base = 0;
  size_t size = 0;
  if (const CUresult r = range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)); r != CUDA_SUCCESS)
    return failed("device buffer: cuMemGetAddressRange failed: CUresult " + std::to_string(static_cast<int>(r)));
  b.base = reinterpret_cast<void*>(base);
  b.allocation_bytes = size;
  b.offset = reinterpret_cast<uintptr_t>(ptr) - static_cast<uintptr_t>(base);
  if (b.offset > size || bytes > size - b.offset)
    return Status{ErrorCode::kInvalidArgument, "device buffer: " + std::to_string(bytes) + " bytes at offset " +
                                                   std::to_string(b.offset) + " run past its allocation of " +
                                                   std::to_string(size) + " bytes"};
  if (!in_process) {
    cudaIpcMemHandle_t h{};
    if (const cudaError_t e = cudaIpcGetMemHandle(&h, b.base); e != cudaSuccess) {
      const std::string text = kernels::cuda_detail::cuda_error_text("cudaIpcGetMemHandle(&h, base)", e, __FILE__, __LINE__);
      (void)cudaGetLastError();
      return failed("device buffer: this memory cannot be exported by legacy CUDA IPC (" + text +
                    "); cudaMallocAsync pools, cuMemCreate/VMM memory and PyTorch's expandable segments cannot be: "
                    "allocate the gradient buffer with cudaMalloc (PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)");
    }
    static_assert(sizeof h == sizeof b.mem_handle);
    std::memcpy(b.mem_handle, &h, sizeof h);
  }
  cudaDeviceProp prop{};
  if (std::string e = SHMPS_CUDA_ERROR(cudaGetDeviceProperties(&prop, b.device)); !e.empty()) return failed(e);
  static_assert(sizeof prop.uuid == sizeof b.device_uuid);
  std::memcpy(b.device_uuid, &prop.uuid, sizeof b.device_uuid);
  cudaEvent_t ev = nullptr;
  // Interprocess events must not time (cudaEventDisableTiming).
  if (std::string e = SHMPS_CUDA_ERROR(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming)); !e.empty())
    return failed(e);
  b.event = ev;
  if (!in_process) {
    cudaIpcEventHandle_t eh{};
    if (std::string e = SHMPS_CUDA_ERROR(cudaIpcGetEventHandle(&eh, ev)); !e.empty()) {
      release_device_buffer(b);
      return failed(e);
    }
    static_assert(sizeof eh == sizeof b.event_handle);
    std::memcpy(b.event_handle, &eh, sizeof eh);
  }
  return b;
}

Status record_device_event(const DeviceBuffer& buffer, void* stream) {
  // The event belongs to the buffer's device; a null stream means that
  // device's legacy default stream only while it is current (recording on
  // another device's stream fails with cudaErrorInvalidResourceHandle).
  int current = -1;
  if (stream == nullptr && (cudaGetDevice(&current) != cudaSuccess || current != buffer.device)) {
    DeviceScope scope;
    if (std::string e = SHMPS_CUDA_ERROR(cudaSetDevice(buffer.device)); !e.empty()) return failed(e);
    if (std::string e = SHMPS_CUDA_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(buffer.event), nullptr)); !e.empty())
      return failed(e);
    return Status::Ok();
  }
  if (std::string e = SHMPS_CUDA_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(buffer.event), static_cast<cudaStream_t>(stream)));
      !e.empty())
    return failed(e);
  return Status::Ok();
}

void release_device_buffer(DeviceBuffer& buffer) {
  if (buffer.event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(buffer.event));
  buffer.event = nullptr;
}

}  // namespace shmps::detail
