// device_buffer.hpp over the CUDA driver API, loaded at run time from the
// NVIDIA driver's libcuda.so.1 (docs/cuda.md, "Linking"). The worker library
// links nothing of CUDA: a CPU worker, or a consumer built on a host without
// the toolkit, never needs it, and a GPU worker needs only the driver that
// its own CUDA work already uses. Driver objects are the runtime's: a
// cudaStream_t is a CUstream, a cudaEvent_t a CUevent, and the runtime of
// the caller (PyTorch's, or the in-process server's) works in the same
// primary context this file retains.
#include <cuda.h>  // types and prototypes only: every function is looked up with dlsym
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>

#include "device_buffer.hpp"

namespace shmps::detail {
namespace {

// The driver functions used here. The versioned ABI names come from cuda.h
// (cuMemGetAddressRange is cuMemGetAddressRange_v2, ...): SHMPS_CU_NAME
// expands the macro before quoting it.
#define SHMPS_CU_QUOTE(x) #x
#define SHMPS_CU_NAME(x) SHMPS_CU_QUOTE(x)
// clang-format off
#define SHMPS_CU_FUNCTIONS(X) \
  X(cuInit) \
  X(cuGetErrorName) \
  X(cuGetErrorString) \
  X(cuDeviceGetCount) \
  X(cuDeviceGet) \
  X(cuDeviceGetUuid) \
  X(cuPointerGetAttribute) \
  X(cuMemGetAddressRange) \
  X(cuIpcGetMemHandle) \
  X(cuIpcGetEventHandle) \
  X(cuDevicePrimaryCtxRetain) \
  X(cuDevicePrimaryCtxRelease) \
  X(cuCtxPushCurrent) \
  X(cuCtxPopCurrent) \
  X(cuEventCreate) \
  X(cuEventRecord) \
  X(cuEventDestroy) \
  X(cuEventQuery) \
  X(cuMemAlloc) \
  X(cuMemFree)
// clang-format on

struct Driver {
#define SHMPS_CU_FIELD(name) decltype(&name) name##_ = nullptr;
  SHMPS_CU_FUNCTIONS(SHMPS_CU_FIELD)
#undef SHMPS_CU_FIELD
  std::string error;  // why the driver is unusable; empty when loaded and initialised
};

// Loads libcuda.so.1 once per process and keeps it loaded. Thread-safe.
const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      d.error = std::string("no NVIDIA driver in this process: libcuda.so.1 could not be loaded (") +
                (why != nullptr ? why : "unknown reason") +
                "); install the NVIDIA driver for device buffers (host buffers, register_buffer, need none)";
      return;
    }
#define SHMPS_CU_LOAD(name)                                                             \
  d.name##_ = reinterpret_cast<decltype(d.name##_)>(::dlsym(lib, SHMPS_CU_NAME(name))); \
  if (d.name##_ == nullptr && d.error.empty())                                          \
    d.error = std::string("the NVIDIA driver's libcuda.so.1 has no ") + SHMPS_CU_NAME(name) + ": the driver is too old";
    SHMPS_CU_FUNCTIONS(SHMPS_CU_LOAD)
#undef SHMPS_CU_LOAD
    if (!d.error.empty()) return;
    if (const CUresult r = d.cuInit_(0); r != CUDA_SUCCESS) {
      const char* name = nullptr;
      if (d.cuGetErrorName_(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown CUresult";
      d.error = std::string("no usable CUDA device in this process: cuInit failed: ") + name +
                ": check nvidia-smi, access to /dev/nvidia* and CUDA_VISIBLE_DEVICES";
    }
  });
  return d;
}

// "cuIpcGetMemHandle(&h, base) failed: CUDA_ERROR_INVALID_VALUE (invalid
// argument) at device_buffer_cuda.cpp:120".
std::string cu_error_text(const Driver& d, const char* expression, CUresult r, int line) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName_(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown CUresult";
  if (d.cuGetErrorString_(r, &text) != CUDA_SUCCESS || text == nullptr) text = "no description";
  return std::string(expression) + " failed: " + name + " (" + text +
         ") at device_buffer_cuda.cpp:" + std::to_string(line);
}

// The message for a CUresult expression of driver `d`, "" on success.
#define SHMPS_CU_ERROR(d, expr)                                                                                    \
  [&]() -> std::string {                                                                                           \
    const CUresult shmps_cu_result_ = (expr);                                                                      \
    return shmps_cu_result_ == CUDA_SUCCESS ? std::string() : cu_error_text(d, #expr, shmps_cu_result_, __LINE__); \
  }()

Status failed(const std::string& text) { return {ErrorCode::kCuda, "device buffer: " + text}; }

// Makes `context` current for the scope and restores the caller's.
class ContextScope {
 public:
  ContextScope(const Driver& d, CUcontext context) : d_(d) { ok_ = d_.cuCtxPushCurrent_(context) == CUDA_SUCCESS; }
  ~ContextScope() {
    CUcontext popped = nullptr;
    if (ok_) (void)d_.cuCtxPopCurrent_(&popped);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
  bool ok() const { return ok_; }

 private:
  const Driver& d_;
  bool ok_ = false;
};

// The part of describe_device_buffer() that runs with the buffer's primary
// context (b->context, retained) current: its allocation, IPC handle, UUID
// and event.
Status describe_in_context(const Driver& d, CUdevice device, CUdeviceptr address, size_t bytes, bool in_process,
                           DeviceBuffer* b) {
  ContextScope scope(d, static_cast<CUcontext>(b->context));
  if (!scope.ok()) return failed("cuCtxPushCurrent of the device's primary context failed");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuMemGetAddressRange_(&base, &size, address)); !e.empty()) return failed(e);
  b->base = reinterpret_cast<void*>(base);
  b->allocation_bytes = size;
  b->offset = static_cast<uint64_t>(address - base);
  if (b->offset > size || bytes > size - b->offset)
    return {ErrorCode::kInvalidArgument, "device buffer: " + std::to_string(bytes) + " bytes at offset " +
                                             std::to_string(b->offset) + " run past its allocation of " +
                                             std::to_string(size) + " bytes"};
  if (!in_process) {
    CUipcMemHandle h{};
    if (const CUresult r = d.cuIpcGetMemHandle_(&h, base); r != CUDA_SUCCESS)
      return failed("this memory cannot be exported by legacy CUDA IPC (" +
                    cu_error_text(d, "cuIpcGetMemHandle(&h, base)", r, __LINE__) +
                    "); cudaMallocAsync pools, cuMemCreate/VMM memory and PyTorch's expandable segments cannot be: "
                    "allocate the gradient buffer with cudaMalloc (PyTorch: "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)");
    static_assert(sizeof h == sizeof b->mem_handle);
    std::memcpy(b->mem_handle, &h, sizeof h);
  }
  CUuuid uuid{};
  if (std::string e = SHMPS_CU_ERROR(d, d.cuDeviceGetUuid_(&uuid, device)); !e.empty()) return failed(e);
  static_assert(sizeof uuid == sizeof b->device_uuid);
  std::memcpy(b->device_uuid, &uuid, sizeof b->device_uuid);
  CUevent ev = nullptr;
  // Interprocess events must not time.
  if (std::string e = SHMPS_CU_ERROR(d, d.cuEventCreate_(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
      !e.empty())
    return failed(e);
  b->event = ev;
  CUevent mark = nullptr;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuEventCreate_(&mark, CU_EVENT_DISABLE_TIMING)); !e.empty()) return failed(e);
  b->stream_mark = mark;
  if (!in_process) {
    CUipcEventHandle eh{};
    if (std::string e = SHMPS_CU_ERROR(d, d.cuIpcGetEventHandle_(&eh, ev)); !e.empty()) return failed(e);
    static_assert(sizeof eh == sizeof b->event_handle);
    std::memcpy(b->event_handle, &eh, sizeof eh);
  }
  return Status::Ok();
}

}  // namespace

Result<DeviceBuffer> describe_device_buffer(const void* ptr, size_t bytes, bool in_process) {
  if (ptr == nullptr || bytes == 0)
    return Status{ErrorCode::kInvalidArgument, "device buffer: null pointer or 0 bytes"};
  // No driver or no device first, with that name: every later call would
  // fail with a less telling error.
  const Driver& d = driver();
  if (!d.error.empty()) return failed(d.error);
  int count = 0;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuDeviceGetCount_(&count)); !e.empty()) return failed(e);
  if (count == 0)
    return failed("no CUDA device in this process (0 devices): check nvidia-smi and CUDA_VISIBLE_DEVICES");
  const auto address = reinterpret_cast<CUdeviceptr>(ptr);
  // Host memory the driver never saw answers CUDA_ERROR_INVALID_VALUE.
  unsigned int memory_type = 0;
  if (d.cuPointerGetAttribute_(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address) != CUDA_SUCCESS)
    memory_type = 0;
  unsigned int managed = 0;
  if (memory_type != 0 && d.cuPointerGetAttribute_(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, address) != CUDA_SUCCESS)
    managed = 0;
  if (managed != 0)
    return Status{ErrorCode::kInvalidArgument,
                  "device buffer: managed memory (cudaMallocManaged) cannot be exported by CUDA "
                  "IPC; allocate gradient buffers with cudaMalloc"};
  if (memory_type != CU_MEMORYTYPE_DEVICE)
    return Status{ErrorCode::kInvalidArgument,
                  "device buffer: the pointer is not device memory (use register_buffer for "
                  "host memory)"};
  DeviceBuffer b;
  if (std::string e =
          SHMPS_CU_ERROR(d, d.cuPointerGetAttribute_(&b.device, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address));
      !e.empty())
    return failed(e);
  CUdevice device = 0;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuDeviceGet_(&device, b.device)); !e.empty()) return failed(e);
  CUcontext context = nullptr;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuDevicePrimaryCtxRetain_(&context, device)); !e.empty()) return failed(e);
  b.context = context;
  if (Status s = describe_in_context(d, device, address, bytes, in_process, &b); !s.ok()) {
    release_device_buffer(b);  // outside the context scope: the context may go with the release
    return s;
  }
  return b;
}

namespace {

// Records `event`, one of the buffer's, on `stream`: a null stream is the
// buffer's device's legacy default stream while its primary context is
// current.
Status record_on_stream(const DeviceBuffer& buffer, void* event, void* stream) {
  const Driver& d = driver();
  if (!d.error.empty()) return failed(d.error);
  ContextScope scope(d, static_cast<CUcontext>(buffer.context));
  if (!scope.ok()) return failed("cuCtxPushCurrent of the device's primary context failed");
  if (std::string e = SHMPS_CU_ERROR(d, d.cuEventRecord_(static_cast<CUevent>(event), static_cast<CUstream>(stream)));
      !e.empty())
    return failed(e);
  return Status::Ok();
}

}  // namespace

Status record_device_event(const DeviceBuffer& buffer, void* stream) {
  return record_on_stream(buffer, buffer.event, stream);
}

Status mark_device_stream(const DeviceBuffer& buffer, void* stream) {
  return record_on_stream(buffer, buffer.stream_mark, stream);
}

Result<bool> device_stream_marked(const DeviceBuffer& buffer) {
  const Driver& d = driver();
  if (!d.error.empty()) return failed(d.error);
  ContextScope scope(d, static_cast<CUcontext>(buffer.context));
  if (!scope.ok()) return failed("cuCtxPushCurrent of the device's primary context failed");
  const CUresult r = d.cuEventQuery_(static_cast<CUevent>(buffer.stream_mark));
  if (r == CUDA_ERROR_NOT_READY) return false;
  if (r != CUDA_SUCCESS) return failed(cu_error_text(d, "cuEventQuery(stream_mark)", r, __LINE__));
  return true;
}

void release_device_buffer(DeviceBuffer& buffer) {
  const Driver& d = driver();
  if (!d.error.empty()) return;
  if (buffer.event != nullptr || buffer.stream_mark != nullptr) {
    ContextScope scope(d, static_cast<CUcontext>(buffer.context));
    if (buffer.event != nullptr) (void)d.cuEventDestroy_(static_cast<CUevent>(buffer.event));
    if (buffer.stream_mark != nullptr) (void)d.cuEventDestroy_(static_cast<CUevent>(buffer.stream_mark));
  }
  buffer.event = nullptr;
  buffer.stream_mark = nullptr;
  if (buffer.context != nullptr) {
    CUdevice device = 0;
    if (d.cuDeviceGet_(&device, buffer.device) == CUDA_SUCCESS) (void)d.cuDevicePrimaryCtxRelease_(device);
  }
  buffer.context = nullptr;
}

Result<void*> allocate_device_memory(size_t bytes, int device) {
  const Driver& d = driver();
  if (!d.error.empty()) return failed(d.error);
  CUdevice dev = 0;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuDeviceGet_(&dev, device)); !e.empty()) return failed(e);
  CUcontext context = nullptr;
  if (std::string e = SHMPS_CU_ERROR(d, d.cuDevicePrimaryCtxRetain_(&context, dev)); !e.empty()) return failed(e);
  CUdeviceptr p = 0;
  std::string error;
  {
    ContextScope scope(d, context);
    error = scope.ok() ? SHMPS_CU_ERROR(d, d.cuMemAlloc_(&p, bytes))
                       : "cuCtxPushCurrent of the device's primary context failed";
  }
  // The allocation keeps the context's reference; free_device_memory() releases it.
  if (!error.empty()) {
    (void)d.cuDevicePrimaryCtxRelease_(dev);
    return failed(error);
  }
  return reinterpret_cast<void*>(p);
}

void free_device_memory(void* ptr, int device) {
  const Driver& d = driver();
  CUdevice dev = 0;
  if (!d.error.empty() || ptr == nullptr || d.cuDeviceGet_(&dev, device) != CUDA_SUCCESS) return;
  CUcontext context = nullptr;
  if (d.cuDevicePrimaryCtxRetain_(&context, dev) != CUDA_SUCCESS) return;
  {
    ContextScope scope(d, context);
    (void)d.cuMemFree_(reinterpret_cast<CUdeviceptr>(ptr));
  }
  (void)d.cuDevicePrimaryCtxRelease_(dev);  // this call's reference
  (void)d.cuDevicePrimaryCtxRelease_(dev);  // the allocation's
}

}  // namespace shmps::detail
