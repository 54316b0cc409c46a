// The CUDA backend: weights and optimizer state in device memory of one
// device (chosen by UUID or PCI bus id), each array in its own cudaMalloc
// rounded up to 2 MiB; worker buffers are CUDA IPC allocations opened once
// per registration (kCudaIpc), with the worker's interprocess event.
// Every apply and copy is enqueued on one stream, in request order; the
// server learns when it is done through fences (backend.hpp) and never
// waits for one request's device work while serving the ring.
// Used only by the server's consumer thread. Compiled in CI without a
// driver; its tests run where a GPU is (docs/cuda.md, "Status").
#include <cuda.h>  // CUdeviceptr / CUresult for cuMemGetAddressRange (types only; no link to libcuda)
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "backend.hpp"
#include "device_spec.hpp"
#include "shmps/cuda_check.hpp"
#include "shmps/kernels/model_passes.hpp"
#include "shmps/kernels/optimizer_cuda.hpp"
#include "shmps/server/log.hpp"
#include "shmps/shm/in_process.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {
namespace {

constexpr uint64_t kAllocationGranule = 2ull << 20;  // every allocation rounded up to 2 MiB

// Why cudaGetDeviceCount found no device, for the logs. The runtime is
// linked statically and loads the driver itself: without libcuda.so.1, or
// with a driver older than the runtime, it answers
// cudaErrorInsufficientDriver.
std::string no_device_text(cudaError_t e) {
  if (e == cudaSuccess) return "0 devices";
  if (e == cudaErrorInsufficientDriver)
    return "cudaErrorInsufficientDriver: no NVIDIA driver (libcuda.so.1) on this host, or one older than this build's "
           "CUDA runtime " +
           std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  return cudaGetErrorName(e);
}

uint64_t round_up(uint64_t bytes) {
  const uint64_t n = std::max<uint64_t>(bytes, 1);
  return (n + kAllocationGranule - 1) / kAllocationGranule * kAllocationGranule;
}

// Errors that leave the CUDA context unusable: every later call of this
// process fails with them too (CUDA's "sticky" errors).
bool is_sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorExternalDevice:
    case cudaErrorMpsClientTerminated:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

// cuMemGetAddressRange through the runtime's driver entry point: the base
// and size of the allocation holding `ptr`, without linking libcuda (the
// build machines have no driver).
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
GetAddressRangeFn address_range_fn(std::string* error) {
  static GetAddressRangeFn fn = nullptr;
  if (fn != nullptr) return fn;
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const std::string e =
      SHMPS_CUDA_ERROR(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &found));
  if (!e.empty() || found != cudaDriverEntryPointSuccess || p == nullptr) {
    *error = e.empty() ? std::string("cuMemGetAddressRange: driver entry point not found") : e;
    return nullptr;
  }
  fn = reinterpret_cast<GetAddressRangeFn>(p);
  return fn;
}

// Whether this process's primary context of runtime device `device` is
// active: cuDevicePrimaryCtxGetState through the runtime's driver entry
// points (no link to libcuda), which makes no context; kUnknown where the
// driver does not say.
enum class PrimaryContext { kInactive, kActive, kUnknown };
PrimaryContext primary_context_state(int device) {
  using DeviceGetFn = CUresult (*)(CUdevice*, int);
  using GetStateFn = CUresult (*)(CUdevice, unsigned int*, int*);
  void* get = nullptr;
  void* get_state = nullptr;
  cudaDriverEntryPointQueryResult found_get{}, found_state{};
  if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 12000, cudaEnableDefault, &found_get) != cudaSuccess ||
      cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &get_state, 12000, cudaEnableDefault,
                                       &found_state) != cudaSuccess ||
      found_get != cudaDriverEntryPointSuccess || found_state != cudaDriverEntryPointSuccess || get == nullptr ||
      get_state == nullptr) {
    (void)cudaGetLastError();
    return PrimaryContext::kUnknown;
  }
  CUdevice dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (reinterpret_cast<DeviceGetFn>(get)(&dev, device) != CUDA_SUCCESS ||
      reinterpret_cast<GetStateFn>(get_state)(dev, &flags, &active) != CUDA_SUCCESS)
    return PrimaryContext::kUnknown;
  return active != 0 ? PrimaryContext::kActive : PrimaryContext::kInactive;
}

class CudaBackend;

// One cudaIpcOpenMemHandle of a worker's allocation, shared by every
// registration of that worker naming the same allocation (the driver would
// refcount a second open anyway). Closed when the last PeerBuffer using it
// is gone, which the server defers until the device work reading it is done.
// The close is counted in StatsBlock::ipc_handles_closed when it succeeds.
struct IpcMapping {
  void* base = nullptr;
  uint64_t size = 0;
  int device = 0;
  shm::StatsBlock* stats = nullptr;  // the segment's (Backend::set_stats()), or null
  std::shared_ptr<const bool> lost;  // the backend's: its context lost, or its stream stalled
  ~IpcMapping() {
    // No CUDA call on a lost context (it would fail), nor under a stalled
    // stream whose queued work may still read this memory: the server
    // stops, and the process's end unmaps it.
    if (base == nullptr || (lost && *lost)) return;
    (void)cudaSetDevice(device);
    if (std::string e = SHMPS_CUDA_ERROR(cudaIpcCloseMemHandle(base)); !e.empty()) {
      log::warn("closing a worker's IPC mapping: " + e);
      (void)cudaGetLastError();  // else the next launch check (cudaGetLastError) reports it
    } else if (stats != nullptr) {
      stats->ipc_handles_closed.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
    }
  }
};

class CudaPeer final : public PeerBuffer {
 public:
  CudaPeer(int device, std::shared_ptr<const bool> lost, uint64_t length)
      : length_(length), device_(device), lost_(std::move(lost)) {}
  uint64_t length() const noexcept override { return length_; }
  const shm::ShmObject* host_object() const noexcept override { return host_.get(); }
  char* at(uint64_t byte_offset) const noexcept { return data_ + byte_offset; }
  cudaEvent_t event() const noexcept { return event_; }
  ~CudaPeer() override {
    if (lost_ && *lost_) {  // as ~IpcMapping()
      // The window stays mapped and page-locked for work still queued on
      // it until the process ends: munmap of a registered range under
      // that work would free the address for a later mapping.
      static_cast<void>(host_.release());
      return;
    }
    if (host_) {
      (void)cudaSetDevice(device_);
      if (std::string e = SHMPS_CUDA_ERROR(cudaHostUnregister(host_->mapping())); !e.empty()) {
        log::warn("unregistering a worker's shm buffer: " + e);
        (void)cudaGetLastError();
      }
    }
    if (event_ != nullptr && own_event_) {
      (void)cudaSetDevice(device_);
      if (std::string e = SHMPS_CUDA_ERROR(cudaEventDestroy(event_)); !e.empty()) {
        log::warn("closing a worker's IPC event: " + e);
        (void)cudaGetLastError();
      }
    }
  }

 private:
  friend class CudaBackend;
  std::shared_ptr<IpcMapping> mapping_;   // null: an in-process buffer, used by pointer
  std::unique_ptr<shm::ShmObject> host_;  // a POSIX shm buffer's window, page-locked (cudaHostRegister)
  char* data_ = nullptr;                  // base + offset
  uint64_t length_;
  cudaEvent_t event_ = nullptr;
  bool own_event_ = false;  // opened here (cudaIpcOpenEventHandle): destroyed here
  int device_;
  std::shared_ptr<const bool> lost_;  // the backend's (IpcMapping::lost)
};

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override {
    if (!started_) {
      release_failed_start();
      return;
    }
    if (!sticky_.ok()) return;  // the context is gone; the process exits soon
    (void)cudaSetDevice(device_);
    if (!synchronize().ok()) return;  // stuck or lost: nothing is freed under work that may still run
    for (auto& [id, ev] : fences_) (void)cudaEventDestroy(ev);
    for (cudaEvent_t ev : free_events_) (void)cudaEventDestroy(ev);
    for (void* p : blocks_) (void)cudaFree(p);
    if (flag_host_ != nullptr) (void)cudaFreeHost(flag_host_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  shm::Backend kind() const noexcept override { return shm::Backend::kCuda; }

  // Selects the device and runs the start-up probes.
  Status start(const std::string& device_spec) {
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0)
      return fail_probe("no usable CUDA device (" + no_device_text(e) +
                        "): check that nvidia-smi lists the GPU, that the service user may open /dev/nvidia* (groups "
                        "video/render), and CUDA_VISIBLE_DEVICES; or run with --backend host");
    if (Status s = select_device(device_spec, count); !s.ok()) return s;
    // The device's attributes are read before cudaSetDevice, which makes
    // its primary context at once (CUDA 12 and later): on a device in
    // PROHIBITED mode, or one another process holds in EXCLUSIVE_PROCESS
    // mode, it fails (cudaErrorDeviceUnavailable) before the message below
    // could name the fix, and on a free EXCLUSIVE_PROCESS device our
    // context would take it. Attribute queries need no context.
    context_before_start_ = primary_context_state(device_);
    int mode = 0, unified = 0, ipc_events = 0;
    if (Status s = call(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device_),
                        "cudaDeviceGetAttribute(ComputeMode)", __LINE__);
        !s.ok())
      return s;
    if (mode == cudaComputeModeExclusiveProcess || mode == cudaComputeModeProhibited)
      return fail_probe("device " + uuid_ + " is in compute mode " +
                        (mode == cudaComputeModeProhibited ? "PROHIBITED" : "EXCLUSIVE_PROCESS") +
                        ": the server and the workers must share it; run `nvidia-smi -i " + pci_bus_id_ +
                        " -c DEFAULT` (as root)");
    (void)call(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device_),
               "cudaDeviceGetAttribute(UnifiedAddressing)", __LINE__);
    (void)call(cudaDeviceGetAttribute(&ipc_events, cudaDevAttrIpcEventSupport, device_),
               "cudaDeviceGetAttribute(IpcEventSupport)", __LINE__);
    if (unified == 0 || ipc_events == 0)
      return fail_probe("device " + uuid_ + " supports no CUDA IPC (unified addressing " + std::to_string(unified) +
                        ", IPC events " + std::to_string(ipc_events) +
                        "): CUDA IPC needs Linux with unified addressing; "
                        "use --backend host");
    // From here a context that is active and was not before is this start's.
    setting_device_ = true;
    if (Status s = call(cudaSetDevice(device_), "cudaSetDevice(device_)", __LINE__); !s.ok()) return s;
    if (Status s =
            call(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", __LINE__);
        !s.ok())
      return s;
    if (Status s = probe_ipc(); !s.ok()) return s;
    probe_peers(count);
    // The peer probes report their failures as text; a kernel of theirs
    // that lost our context (a sticky error, which no cudaGetLastError
    // clears) fails the start here, not the first request.
    if (Status s = call(cudaDeviceSynchronize(), "cudaDeviceSynchronize() after the peer probes", __LINE__); !s.ok())
      return s;
    started_ = true;
    log::info("cuda backend on device " + std::to_string(device_) + " (" + uuid_ + ", PCI " + pci_bus_id_ + ")");
    return Status::Ok();
  }

  // ---------------------------------------------------------------- fences
  bool asynchronous() const noexcept override { return true; }
  Fence fence() override {
    bind();
    if (!dirty_) return fences_.empty() ? 0 : fences_.back().first;
    cudaEvent_t ev = nullptr;
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    } else if (!call(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags", __LINE__)
                    .ok()) {
      return fence_fallback();
    }
    if (!call(cudaEventRecord(ev, stream_), "cudaEventRecord(ev, stream_)", __LINE__).ok()) {
      (void)cudaEventDestroy(ev);
      return fence_fallback();
    }
    dirty_ = false;
    fences_.emplace_back(++last_fence_, ev);
    return last_fence_;
  }

  Result<bool> fence_done(Fence f) override {
    bind();
    while (!fences_.empty() && fences_.front().first <= f) {
      const cudaError_t e = cudaEventQuery(fences_.front().second);
      if (e == cudaErrorNotReady) return false;
      free_events_.push_back(fences_.front().second);
      fences_.pop_front();
      if (e != cudaSuccess) return call(e, "cudaEventQuery(fence)", __LINE__);
    }
    if (!sticky_.ok()) return sticky_;
    return true;
  }

  Status healthy() override { return sticky_; }

  Status synchronize() override {
    if (!sticky_.ok()) return sticky_;
    bind();
    // Polled, not cudaStreamSynchronize(): the stream may wait on the event
    // of a worker killed before its own stream reached the record, for
    // ever, and the server must stop with an error rather than hang (no
    // heartbeat, no SIGTERM) after kDeviceStallNs. Yields first (a copy
    // ends in microseconds), then sleeps in short steps.
    const uint64_t start = shm::monotonic_ns();
    for (uint32_t polls = 0;; ++polls) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) return call(e, "cudaStreamQuery(stream_)", __LINE__);
      if (shm::monotonic_ns() - start > kDeviceStallNs) {
        // Sticky, as a lost context: healthy() reports it, so the shutdown
        // and the destructor wait no more on this stream (nor free memory
        // its work may still use), and completions are failed, not posted.
        return become_sticky({ErrorCode::kCuda, "the device's work has not finished in " +
                                                    std::to_string(kDeviceStallNs / 1'000'000'000) +
                                                    " s (a dead worker's event never recorded?): the weights may "
                                                    "be half-written"});
      }
      if (polls < 1000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    while (!fences_.empty()) {
      free_events_.push_back(fences_.front().second);
      fences_.pop_front();
    }
    dirty_ = false;
    return Status::Ok();
  }

  WeightsExport weights_export() const override { return export_; }
  void set_stats(shm::StatsBlock* stats) override { stats_ = stats; }

  // ---------------------------------------------------------------- memory
  Status allocate(const std::vector<TensorExtent>& tensors, size_t state_arrays, uint64_t total) override {
    bind();
    tensors_ = tensors;
    total_ = total;
    const uint64_t bytes = total_ * sizeof(float);
    weights_alloc_ = round_up(bytes);
    if (Status s = alloc(&weights_, weights_alloc_); !s.ok()) return s;
    for (size_t a = 0; a < state_arrays; ++a) {
      float* p = nullptr;
      if (Status s = alloc(&p, weights_alloc_); !s.ok()) return s;
      state_.push_back(p);
    }
    int* flag = nullptr;
    if (Status s = alloc(&flag, sizeof(int)); !s.ok()) return s;
    flag_dev_ = flag;
    void* pinned = nullptr;
    if (Status s = call(cudaMallocHost(&pinned, sizeof(int)), "cudaMallocHost(&pinned, sizeof(int))", __LINE__);
        !s.ok())
      return s;
    flag_host_ = static_cast<int*>(pinned);
    cudaIpcMemHandle_t handle{};
    if (Status s = call(cudaIpcGetMemHandle(&handle, weights_), "cudaIpcGetMemHandle(&handle, weights_)", __LINE__);
        !s.ok())
      return s;
    static_assert(sizeof handle == sizeof export_.ipc_handle);
    export_.present = true;
    std::memcpy(export_.ipc_handle, &handle, sizeof handle);
    export_.allocation_bytes = weights_alloc_;
    std::memcpy(export_.device_uuid, uuid_bytes_, sizeof uuid_bytes_);
    return call(cudaDeviceSynchronize(), "cudaDeviceSynchronize()", __LINE__);
  }

  Status write_weights(uint64_t first, std::span<const float> values) override {
    if (!sticky_.ok()) return sticky_;
    if (first > total_ || values.size() > total_ - first)
      return {ErrorCode::kInvalidArgument, "write_weights beyond the weights"};
    bind();
    // On our stream and waited for: a pageable cudaMemcpy may return before
    // the data reaches the device, and the first request's work must see it.
    if (Status s =
            call(cudaMemcpyAsync(weights_ + first, values.data(), values.size_bytes(), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync(weights + first, values, bytes, cudaMemcpyHostToDevice, stream_)", __LINE__);
        !s.ok())
      return s;
    return synchronize();
  }

  Result<std::unique_ptr<PeerBuffer>> open_peer(const shm::BufferDesc& desc, const PeerObjectRule& rule) override {
    return open_peer_of(desc, rule, 0);
  }

  Result<std::unique_ptr<PeerBuffer>> open_peer_of(const shm::BufferDesc& desc, const PeerObjectRule& rule,
                                                   uint32_t worker_pid) override {
    if (!sticky_.ok()) return sticky_;
    bind();
    if (desc.kind == static_cast<uint32_t>(shm::BufferKind::kHostShm)) return open_host(desc, rule);
    if (desc.kind != static_cast<uint32_t>(shm::BufferKind::kCudaIpc))
      return Status{ErrorCode::kBadRequest, "buffer kind " + std::to_string(desc.kind) + " unknown"};
    auto peer = std::make_unique<CudaPeer>(device_, lost_, desc.length);
    // The device its descriptor names, for an in-process buffer too: a
    // buffer on a device we cannot reach would fault our kernels.
    if (Status s = reachable(desc.device_uuid); !s.ok()) return s;
    const bool in_process = (desc.flags & shm::kBufferInProcess) != 0;
    if (in_process) {
      // The worker lives in our process: pointer and event, no IPC (a
      // process cannot open its own IPC handles), from the offer its token
      // names (in_process.hpp), never from the segment's bytes.
      auto offer = shm::take_in_process(desc, worker_pid);
      if (!offer.ok()) return offer.status();
      auto range = allocation_of(offer->base);
      if (!range.ok()) return Status{ErrorCode::kUnknownBuffer, range.status().message()};
      if (range->first != offer->base)
        return Status{ErrorCode::kBadRequest, "an in-process buffer must name its allocation's base"};
      if (Status s = check_range(desc, range->second); !s.ok()) return s;
      peer->data_ = static_cast<char*>(range->first) + desc.offset;
      peer->event_ = static_cast<cudaEvent_t>(offer->event);
      return std::unique_ptr<PeerBuffer>(std::move(peer));
    }
    auto mapping = open_mapping(desc, worker_pid);
    if (!mapping.ok()) return mapping.status();
    if (Status s = check_range(desc, (*mapping)->size); !s.ok()) return s;
    cudaIpcEventHandle_t eh{};
    static_assert(sizeof eh == sizeof desc.event_handle);
    std::memcpy(&eh, desc.event_handle, sizeof eh);
    if (Status s = call(cudaIpcOpenEventHandle(&peer->event_, eh), "cudaIpcOpenEventHandle(&event, handle)", __LINE__);
        !s.ok())
      return Status{ErrorCode::kUnknownBuffer, s.message()};
    peer->own_event_ = true;
    peer->data_ = static_cast<char*>((*mapping)->base) + desc.offset;
    peer->mapping_ = std::move(mapping).value();
    return std::unique_ptr<PeerBuffer>(std::move(peer));
  }

  Status peer_intact(const PeerBuffer&) override { return sticky_; }

  // A worker's POSIX shm buffer (register_buffer): the window its
  // descriptor names (open_worker_object()), page-locked and mapped for the
  // device, so the kernels read it and pulls write it over PCIe. Its pages
  // are pinned: a worker truncating the object cannot take them away under
  // a kernel.
  Result<std::unique_ptr<PeerBuffer>> open_host(const shm::BufferDesc& desc, const PeerObjectRule& rule) {
    auto opened = open_worker_object(desc, rule);
    if (!opened.ok()) return opened.status();
    auto peer = std::make_unique<CudaPeer>(device_, lost_, desc.length);
    void* host = (*opened)->mapping();  // from a page boundary
    const size_t lead = static_cast<size_t>(static_cast<char*>((*opened)->data()) - static_cast<char*>(host));
    if (Status s =
            call(cudaHostRegister(host, (*opened)->mapping_size(), cudaHostRegisterMapped | cudaHostRegisterPortable),
                 "cudaHostRegister(window, size, Mapped | Portable)", __LINE__);
        !s.ok())
      return Status{ErrorCode::kUnknownBuffer, s.message()};
    peer->host_ = std::move(opened).value();  // unregistered by ~CudaPeer
    void* device_view = nullptr;
    if (Status s =
            call(cudaHostGetDevicePointer(&device_view, host, 0), "cudaHostGetDevicePointer(&p, window, 0)", __LINE__);
        !s.ok())
      return s;
    peer->data_ = static_cast<char*>(device_view) + lead;
    return std::unique_ptr<PeerBuffer>(std::move(peer));
  }

  // Synchronous: the server must know before it applies. Waits for the
  // worker's event and for the check kernel (and what is queued before it),
  // polled under kDeviceStallNs as synchronize() does: a worker killed
  // before its stream reached its event would otherwise hold the serving
  // thread for ever. The flag comes back into pinned memory, so the copy is
  // queued, not waited for by cudaMemcpyAsync itself (as a pageable
  // destination would be).
  Result<bool> all_finite(const PeerBuffer& grad, uint64_t byte_offset, uint64_t n, kernels::GradDtype dtype) override {
    if (!sticky_.ok()) return sticky_;
    bind();
    const auto& g = static_cast<const CudaPeer&>(grad);
    if (Status s = wait_for_writer(g); !s.ok()) return s;
    if (Status s = kernels::all_finite_cuda_async(g.at(byte_offset), dtype, n, flag_dev_, stream_); !s.ok())
      return note_failure(s);
    if (Status s =
            call(cudaMemcpyAsync(flag_host_, flag_dev_, sizeof(int), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync(flag_host_, flag_dev_, sizeof(int), cudaMemcpyDeviceToHost, stream_)", __LINE__);
        !s.ok())
      return s;
    if (Status s = synchronize(); !s.ok()) return s;
    return *flag_host_ == 0;
  }

  Status apply(const kernels::OptimizerConfig& config, uint32_t tensor, uint64_t step, const PeerBuffer& grad,
               uint64_t byte_offset, kernels::GradDtype dtype) override {
    if (!sticky_.ok()) return sticky_;
    bind();
    const auto& g = static_cast<const CudaPeer&>(grad);
    // On every push our stream waits for the worker's interprocess event:
    // recorded after the gradient by push_async. A blocking push waited for
    // its stream before sending and records none: the wait is then met, or
    // orders after an earlier push_async's record (more, never less).
    if (Status s = wait_for_writer(g); !s.ok()) return s;
    const TensorExtent& t = tensors_[tensor];
    kernels::TensorState ts;
    ts.weights = weights_ + t.element_offset;
    for (size_t i = 0; i < state_.size(); ++i) ts.state[i] = state_[i] + t.element_offset;
    ts.n = t.element_count;
    dirty_ = true;
    if (Status s = kernels::apply_cuda(config, ts, g.at(byte_offset), dtype, step, stream_); !s.ok())
      return note_failure(s);
    return Status::Ok();
  }

  // Enqueued after every apply before it (one stream): no torn reads.
  Status copy_out(uint64_t element_offset, uint64_t n, PeerBuffer& dst, uint64_t byte_offset) override {
    if (!sticky_.ok()) return sticky_;
    bind();
    auto& d = static_cast<CudaPeer&>(dst);
    // The worker may still be reading the previous weights on its stream.
    if (Status s = wait_for_writer(d); !s.ok()) return s;
    dirty_ = true;
    return call(
        cudaMemcpyAsync(d.at(byte_offset), weights_ + element_offset, n * sizeof(float), cudaMemcpyDefault, stream_),
        "cudaMemcpyAsync(dst, weights, n, cudaMemcpyDefault, stream_)", __LINE__);
  }

  Status copy_in(uint64_t element_offset, uint64_t n, const PeerBuffer& src, uint64_t byte_offset) override {
    if (!sticky_.ok()) return sticky_;
    bind();
    const auto& s = static_cast<const CudaPeer&>(src);
    // The worker's event, as in apply(): init waited for its stream.
    if (Status st = wait_for_writer(s); !st.ok()) return st;
    dirty_ = true;
    return call(
        cudaMemcpyAsync(weights_ + element_offset, s.at(byte_offset), n * sizeof(float), cudaMemcpyDefault, stream_),
        "cudaMemcpyAsync(weights, src, n, cudaMemcpyDefault, stream_)", __LINE__);
  }

  Result<std::vector<float>> read_weights() override { return download(weights_); }

  // Federation's snapshot and merge, through host memory: between two
  // requests, each copy on stream_ (ordered after the applies before it,
  // and before those after it), and finished before returning, so the
  // host buffer may change hands (docs/federation.md says what a
  // device-side merge would save).
  Status snapshot_weights(std::span<float> dst) override {
    if (dst.size() != total_) return {ErrorCode::kInternal, "snapshot_weights: the length differs"};
    return copy_on_stream(dst.data(), weights_, cudaMemcpyDeviceToHost, "cudaMemcpyAsync(dst, weights_)");
  }

  Status add_to_weights(std::span<const float> delta) override {
    if (delta.size() != total_) return {ErrorCode::kInternal, "add_to_weights: the length differs"};
    merge_scratch_.resize(total_);
    if (Status s = snapshot_weights(merge_scratch_); !s.ok()) return s;
    kernels::add_cpu(merge_scratch_.data(), delta.data(), total_);
    return copy_on_stream(weights_, merge_scratch_.data(), cudaMemcpyHostToDevice, "cudaMemcpyAsync(weights_, merged)");
  }

  Result<std::vector<float>> read_state() override {
    std::vector<float> out;
    out.reserve(state_.size() * total_);
    for (float* p : state_) {
      Result<std::vector<float>> a = download(p);
      if (!a.ok()) return a.status();
      out.insert(out.end(), a->begin(), a->end());
    }
    return out;
  }

  Status load(std::span<const float> weights, std::span<const float> state) override {
    if (weights.size() != total_ || state.size() != state_.size() * total_)
      return {ErrorCode::kInternal, "load: sizes differ from the allocation"};
    if (Status s = synchronize(); !s.ok()) return s;
    bind();
    // On stream_ and waited for, as write_weights(): a pageable cudaMemcpy
    // on the legacy stream may return before its data lands, and stream_
    // (non-blocking) would not wait for it.
    if (Status s =
            call(cudaMemcpyAsync(weights_, weights.data(), total_ * sizeof(float), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync(weights_, weights, bytes, cudaMemcpyHostToDevice, stream_)", __LINE__);
        !s.ok())
      return s;
    for (size_t a = 0; a < state_.size(); ++a)
      if (Status s = call(cudaMemcpyAsync(state_[a], state.data() + a * total_, total_ * sizeof(float),
                                          cudaMemcpyHostToDevice, stream_),
                          "cudaMemcpyAsync(state_[a], state, bytes, cudaMemcpyHostToDevice, stream_)", __LINE__);
          !s.ok())
        return s;
    return synchronize();
  }

 private:
  // The backend's device is gone for good (a lost context, a stalled
  // stream): every later call reports `why`, and the peers' destructors
  // make no CUDA call (lost_). Logged once; returns `why`.
  Status become_sticky(Status why) {
    *lost_ = true;
    sticky_ = std::move(why);
    log::error(sticky_.message());
    return sticky_;
  }

  // Every CUDA call's result goes through here (the project's message
  // from shmps/cuda_check.hpp); a sticky error is remembered.
  Status call(cudaError_t e, const char* expression, int line) {
    if (e == cudaSuccess) return Status::Ok();
    const std::string text = cuda::error_text(expression, e, __FILE__, line);
    if (is_sticky(e) && sticky_.ok())
      static_cast<void>(
          become_sticky({ErrorCode::kCuda, text + "; the CUDA context is lost: the weights may be half-written"}));
    (void)cudaGetLastError();  // clear a non-sticky error so the next call does not report it
    return {ErrorCode::kCuda, text};
  }

  // A failure reported by kernels/ (apply_cuda and friends): asks the
  // stream whether the context survived.
  Status note_failure(const Status& failure) {
    const cudaError_t q = cudaStreamQuery(stream_);
    (void)call(q == cudaErrorNotReady ? cudaSuccess
               : q != cudaSuccess     ? q
                                      : cudaPeekAtLastError(),
               "after a kernel", __LINE__);
    return failure;
  }

  // The runtime's current device is per host thread: the backend may be
  // created on one thread and served from another (an embedded Server,
  // destructors run by the last holder), and cudaMalloc, launches, event
  // records and cudaIpcOpenMemHandle all act on the current device. Every
  // entry point binds device_ first. Through cudaSetDevice once per thread:
  // on a thread that has made no CUDA call, cudaGetDevice answers 0 without
  // making the primary context current, and a driver call (the in-process
  // offer's cuMemGetAddressRange) then fails with CUDA_ERROR_INVALID_CONTEXT;
  // cudaSetDevice makes it current at once (CUDA 12 and later). After that,
  // a thread-local read.
  void bind() const {
    thread_local int bound = -1;
    int current = -1;
    if (bound == device_ && cudaGetDevice(&current) == cudaSuccess && current == device_) return;
    if (cudaSetDevice(device_) == cudaSuccess) bound = device_;
  }

  Status fail_probe(const std::string& text) { return {ErrorCode::kCuda, "--backend cuda: " + text}; }

  // A start that failed after it made this process's primary context on
  // device_ (cudaSetDevice, the probes) destroys it (cudaDeviceReset, with
  // the stream and whatever the probes left): else a server that goes on
  // with the host backend (--backend auto) would hold it for its life, with
  // its memory, and alone on a device in EXCLUSIVE_PROCESS mode. Only a
  // context this start made: one active before start() is used by
  // something else in this process (an embedding program, an in-process
  // worker's device buffers), whose memory a reset would free under it;
  // then only the stream goes. Peers' contexts (probe_peers()) are left.
  // A start that failed before its cudaSetDevice made no context: a
  // context active then is another thread's. Runs on start()'s thread;
  // another thread of the process that starts using device_ after this
  // start's cudaSetDevice is not covered.
  void release_failed_start() {
    if (setting_device_ && context_before_start_ == PrimaryContext::kInactive &&
        primary_context_state(device_) == PrimaryContext::kActive) {
      if (cudaSetDevice(device_) == cudaSuccess) (void)cudaDeviceReset();
    } else if (stream_ != nullptr) {  // made in a context that exists: no new one is made here
      (void)cudaSetDevice(device_);
      (void)cudaStreamDestroy(stream_);
    }
    (void)cudaGetLastError();
  }

  Fence fence_fallback() {
    // Could not record an event: wait instead, so completions stay correct.
    // A wait that fails (a lost context, a stall) is sticky: the server's
    // next health check stops it, with this request's answer maybe posted.
    (void)synchronize();
    return 0;
  }

  Status wait_for_writer(const CudaPeer& p) {
    if (p.event() == nullptr) return Status::Ok();
    return call(cudaStreamWaitEvent(stream_, p.event(), 0), "cudaStreamWaitEvent(stream_, worker_event, 0)", __LINE__);
  }

  template <typename T>
  Status alloc(T** p, uint64_t bytes) {
    void* raw = nullptr;
    if (Status s = call(cudaMalloc(&raw, bytes), "cudaMalloc(&p, bytes)", __LINE__); !s.ok())
      return {ErrorCode::kNoCapacity,
              "device " + uuid_ + ": " + s.message() + " (" + std::to_string(bytes) + " bytes)"};
    blocks_.push_back(raw);
    *p = static_cast<T*>(raw);
    return call(cudaMemset(raw, 0, bytes), "cudaMemset(p, 0, bytes)", __LINE__);
  }

  // All weights' bytes between `src` and `dst` on stream_, waited for.
  // Into pageable host memory cudaMemcpyAsync returns only once the copy
  // is done, so it would wait, unbounded, for all the stream's work before
  // it: that is waited for first, bounded (synchronize()).
  Status copy_on_stream(void* dst, const void* src, cudaMemcpyKind kind, const char* what) {
    if (!sticky_.ok()) return sticky_;
    bind();
    if (kind == cudaMemcpyDeviceToHost)
      if (Status s = synchronize(); !s.ok()) return s;
    if (Status s = call(cudaMemcpyAsync(dst, src, total_ * sizeof(float), kind, stream_), what, __LINE__); !s.ok())
      return s;
    return synchronize();
  }

  // One device array to host memory, after the stream's work: every
  // error is returned (a sticky one also marks the context lost, which
  // healthy() then reports), never values that were not read.
  Result<std::vector<float>> download(const float* p) {
    if (!sticky_.ok()) return sticky_;
    std::vector<float> out(total_);
    if (total_ == 0) return out;
    if (Status s = synchronize(); !s.ok()) return s;
    if (Status s = call(cudaMemcpy(out.data(), p, total_ * sizeof(float), cudaMemcpyDeviceToHost),
                        "cudaMemcpy(out, p, total_ * sizeof(float), cudaMemcpyDeviceToHost)", __LINE__);
        !s.ok())
      return s;
    return out;
  }

  Result<std::pair<void*, uint64_t>> allocation_of(void* ptr) {
    std::string error;
    GetAddressRangeFn fn = address_range_fn(&error);
    if (fn == nullptr) return Status{ErrorCode::kCuda, error};
    CUdeviceptr base = 0;
    size_t size = 0;
    const CUresult r = fn(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
    if (r != CUDA_SUCCESS)
      return Status{ErrorCode::kCuda, "cuMemGetAddressRange failed: CUresult " + std::to_string(static_cast<int>(r))};
    return std::pair<void*, uint64_t>{reinterpret_cast<void*>(base), size};
  }

  static Status check_range(const shm::BufferDesc& desc, uint64_t allocation) {
    if (desc.offset > allocation || desc.length > allocation - desc.offset)
      return {ErrorCode::kBadRange, "buffer offset " + std::to_string(desc.offset) + " + length " +
                                        std::to_string(desc.length) + " exceeds the allocation's " +
                                        std::to_string(allocation) + " bytes"};
    return Status::Ok();
  }

  // Opens (or shares) the mapping of the allocation the handle names, keyed
  // by the worker and the 64 handle bytes (a recycled allocation gets a new
  // handle, so never an old mapping).
  Result<std::shared_ptr<IpcMapping>> open_mapping(const shm::BufferDesc& desc, uint32_t worker_pid) {
    std::string key(reinterpret_cast<const char*>(desc.handle), sizeof desc.handle);
    key += std::to_string(worker_pid);
    if (auto it = mappings_.find(key); it != mappings_.end()) {
      if (auto m = it->second.lock()) return m;
      mappings_.erase(it);
    }
    cudaIpcMemHandle_t h{};
    static_assert(sizeof h == sizeof desc.handle);
    std::memcpy(&h, desc.handle, sizeof h);
    void* base = nullptr;
    if (Status s = call(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess),
                        "cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess)", __LINE__);
        !s.ok())
      return Status{ErrorCode::kUnknownBuffer, s.message()};
    auto m = std::make_shared<IpcMapping>();
    m->base = base;
    m->device = device_;
    m->lost = lost_;
    m->stats = stats_;
    if (stats_ != nullptr) stats_->ipc_handles_opened.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
    auto range = allocation_of(base);
    if (!range.ok()) return range.status();  // m's destructor closes the handle
    // The bytes from the opened pointer to the end of the range: the driver
    // may map a whole 2 MiB block for a small (sub-allocated) cudaMalloc,
    // whose range then starts before the pointer we were given.
    const auto opened = reinterpret_cast<uintptr_t>(base), first = reinterpret_cast<uintptr_t>(range->first);
    if (opened < first || opened - first >= range->second)
      return Status{ErrorCode::kCuda, "cuMemGetAddressRange: the opened IPC pointer lies outside its own range"};
    m->size = range->second - (opened - first);
    // Drop expired entries now and then, so the map stays small.
    if (mappings_.size() > 1024) std::erase_if(mappings_, [](const auto& e) { return e.second.expired(); });
    mappings_[key] = m;
    return m;
  }

  Status select_device(const std::string& spec, int count) {
    device_ = 0;
    if (!spec.empty()) {
      int found = -1;
      if (is_device_uuid_spec(spec)) {
        for (int d = 0; d < count && found < 0; ++d) {
          cudaDeviceProp p{};
          if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
          }
          uint8_t b[16];
          std::memcpy(b, &p.uuid, sizeof b);
          if (device_uuid_matches(spec, b)) found = d;
        }
      } else if (cudaDeviceGetByPCIBusId(&found, spec.c_str()) != cudaSuccess) {
        (void)cudaGetLastError();
        found = -1;
      }
      if (found < 0)
        return fail_probe("--device " + spec + " is not among the " + std::to_string(count) +
                          " visible devices: give a UUID as `nvidia-smi -L` prints it (GPU-...) or a PCI bus id as "
                          "`nvidia-smi --query-gpu=pci.bus_id --format=csv` does, and check CUDA_VISIBLE_DEVICES");
      device_ = found;
    }
    cudaDeviceProp p{};
    if (Status s = call(cudaGetDeviceProperties(&p, device_), "cudaGetDeviceProperties(&p, device_)", __LINE__);
        !s.ok())
      return s;
    static_assert(sizeof p.uuid == sizeof uuid_bytes_);
    std::memcpy(uuid_bytes_, &p.uuid, sizeof uuid_bytes_);
    uuid_ = device_uuid_text(uuid_bytes_);
    char bus[32] = {};
    if (Status s =
            call(cudaDeviceGetPCIBusId(bus, sizeof bus, device_), "cudaDeviceGetPCIBusId(bus, 32, device_)", __LINE__);
        !s.ok())
      return s;
    pci_bus_id_ = bus;
    return Status::Ok();
  }

  // IPC export works on this device: a 2 MiB allocation's handle and an
  // interprocess event's handle. (A process cannot open its own handles;
  // the opening side is proven by the first registration.)
  Status probe_ipc() {
    void* p = nullptr;
    if (Status s = call(cudaMalloc(&p, kAllocationGranule), "cudaMalloc(&probe, 2 MiB)", __LINE__); !s.ok()) return s;
    cudaIpcMemHandle_t h{};
    Status s = call(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle(&h, probe)", __LINE__);
    (void)call(cudaFree(p), "cudaFree(probe)", __LINE__);
    cudaEvent_t ev = nullptr;
    if (s.ok())
      s = call(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming),
               "cudaEventCreateWithFlags(Interprocess)", __LINE__);
    cudaIpcEventHandle_t eh{};
    if (s.ok()) s = call(cudaIpcGetEventHandle(&eh, ev), "cudaIpcGetEventHandle(&eh, ev)", __LINE__);
    if (ev != nullptr) (void)cudaEventDestroy(ev);
    if (!s.ok())
      return fail_probe("CUDA IPC does not work on " + uuid_ + ": " + s.message() +
                        " (IPC needs the server and workers in one IPC namespace, not under MPS isolation or a "
                        "container without --ipc=host; use --backend host)");
    return Status::Ok();
  }

  // Peer access from our device to every other visible device, proven by a
  // kernel of ours reading the peer's memory and a copy writing it; the
  // result per UUID decides whether buffers there are accepted.
  void probe_peers(int count) {
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp p{};
      if (d == device_) continue;
      if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
        (void)cudaGetLastError();
        continue;
      }
      uint8_t b[16];
      std::memcpy(b, &p.uuid, sizeof b);
      // The probe makes a context on the peer: not on one in an exclusive
      // mode, where that context would keep its own workers off it.
      int mode = 0;
      (void)cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, d);
      const std::string why = mode == cudaComputeModeExclusiveProcess || mode == cudaComputeModeProhibited
                                  ? std::string("it is in compute mode ") +
                                        (mode == cudaComputeModeProhibited ? "PROHIBITED" : "EXCLUSIVE_PROCESS") +
                                        ", so not probed"
                                  : probe_peer(d);
      (void)cudaGetLastError();  // a failed probe must not fail the first launch check
      peers_[device_uuid_text(b)] = why;
      if (why.empty())
        log::info("peer access " + uuid_ + " -> " + device_uuid_text(b) + ": verified by a write and read-back");
      else
        log::warn("device " + device_uuid_text(b) + " is not reachable from " + uuid_ + ": " + why +
                  "; buffers on it will be refused (enable P2P: same PCIe root or NVLink, IOMMU/ACS off for P2P)");
    }
    (void)cudaSetDevice(device_);
  }

  std::string probe_peer(int peer) {
    int can = 0;
    if (std::string e = SHMPS_CUDA_ERROR(cudaDeviceCanAccessPeer(&can, device_, peer)); !e.empty()) return e;
    if (can == 0) return "cudaDeviceCanAccessPeer says no";
    const cudaError_t en = cudaDeviceEnablePeerAccess(peer, 0);
    if (en != cudaSuccess && en != cudaErrorPeerAccessAlreadyEnabled) return SHMPS_CUDA_ERROR(en);
    (void)cudaGetLastError();
    constexpr uint64_t n = 1024;
    std::vector<float> pattern(n), back(n, 0.0f);
    for (uint64_t i = 0; i < n; ++i) pattern[i] = static_cast<float>(i) * 0.5f + 1.0f;
    float* remote = nullptr;
    float* local = nullptr;
    std::string e;
    if (e = SHMPS_CUDA_ERROR(cudaSetDevice(peer)); !e.empty()) return e;
    e = SHMPS_CUDA_ERROR(cudaMalloc(&remote, n * sizeof(float)));
    (void)cudaSetDevice(device_);
    if (e.empty()) e = SHMPS_CUDA_ERROR(cudaMalloc(&local, n * sizeof(float)));
    // On stream_, as what follows (a pageable cudaMemcpy on the legacy
    // stream may return before its data lands; stream_ does not wait for it).
    if (e.empty())
      e = SHMPS_CUDA_ERROR(cudaMemcpyAsync(local, pattern.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
    // Write into the peer from our device (as a pull does) ...
    if (e.empty()) e = SHMPS_CUDA_ERROR(cudaMemcpyAsync(remote, local, n * sizeof(float), cudaMemcpyDefault, stream_));
    if (e.empty()) e = SHMPS_CUDA_ERROR(cudaMemsetAsync(local, 0, n * sizeof(float), stream_));
    // ... and read it back with a kernel of ours (as an apply does): SGD
    // with lr 1 on zero weights leaves weights == -gradient.
    for (float& x : pattern) x = -x;
    kernels::OptimizerConfig sgd;
    sgd.lr = 1.0f;
    kernels::TensorState ts;
    ts.weights = local;
    ts.n = n;
    if (e.empty()) e = kernels::apply_cuda(sgd, ts, remote, kernels::GradDtype::kF32, 1, stream_).message();
    if (e.empty()) e = SHMPS_CUDA_ERROR(cudaStreamSynchronize(stream_));
    if (e.empty()) e = SHMPS_CUDA_ERROR(cudaMemcpy(back.data(), local, n * sizeof(float), cudaMemcpyDeviceToHost));
    if (e.empty() && back != pattern) e = "the read-back differs from what was written";
    if (local != nullptr) (void)cudaFree(local);
    if (remote != nullptr) {
      (void)cudaSetDevice(peer);
      (void)cudaFree(remote);
      (void)cudaSetDevice(device_);
    }
    return e;
  }

  Status reachable(const uint8_t (&uuid)[16]) {
    const std::string u = device_uuid_text(uuid);
    if (u == uuid_) return Status::Ok();
    auto it = peers_.find(u);
    if (it == peers_.end())
      return {ErrorCode::kCuda, "the buffer is on device " + u + ", which the server (on " + uuid_ +
                                    ") cannot see: give the server every GPU its workers use (CUDA_VISIBLE_DEVICES)"};
    if (!it->second.empty())
      return {ErrorCode::kCuda,
              "the buffer is on device " + u + ", not reachable from the server's " + uuid_ + ": " + it->second};
    return Status::Ok();
  }

  int device_ = 0;
  uint8_t uuid_bytes_[16] = {};
  std::string uuid_;
  std::string pci_bus_id_;
  cudaStream_t stream_ = nullptr;
  std::vector<TensorExtent> tensors_;
  uint64_t total_ = 0;
  uint64_t weights_alloc_ = 0;
  float* weights_ = nullptr;
  std::vector<float*> state_;
  std::vector<void*> blocks_;         // every cudaMalloc, freed at the end
  std::vector<float> merge_scratch_;  // add_to_weights()'s staging copy
  int* flag_dev_ = nullptr;
  int* flag_host_ = nullptr;  // pinned: all_finite()'s copy of the flag
  WeightsExport export_;
  std::map<std::string, std::string> peers_;  // UUID -> "" (reachable) or why not
  std::map<std::string, std::weak_ptr<IpcMapping>> mappings_;
  shm::StatsBlock* stats_ = nullptr;  // the segment's (set_stats()): IPC handle opens and closes
  // Fences: events recorded on stream_, oldest first.
  std::deque<std::pair<Fence, cudaEvent_t>> fences_;
  std::vector<cudaEvent_t> free_events_;
  Fence last_fence_ = 0;
  bool dirty_ = false;  // work enqueued since the last fence
  Status sticky_;
  // True once sticky_ is set; shared with the peer buffers and mappings,
  // which may outlive this backend's use (their destructors make no CUDA
  // call then).
  std::shared_ptr<bool> lost_ = std::make_shared<bool>(false);
  // start(): whether this process had device_'s primary context before it
  // (release_failed_start()), and whether it succeeded.
  PrimaryContext context_before_start_ = PrimaryContext::kUnknown;
  bool setting_device_ = false;  // start() reached its cudaSetDevice
  bool started_ = false;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(const std::string& device) {
  auto b = std::make_unique<CudaBackend>();
  if (Status s = b->start(device); !s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(b));
}

bool cuda_backend_available(std::string* reason) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) (void)cudaGetLastError();
  if (e == cudaSuccess && count > 0) return true;
  *reason = no_device_text(e);
  return false;
}

}  // namespace shmps::server
