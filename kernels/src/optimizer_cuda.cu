// CUDA implementation of optimizer_cuda.hpp: one kernel per optimizer
// variant, gradient dtype and gradient access (optimizer_cuda_body.hpp holds
// what each thread does), launched with a grid-stride loop over as many
// blocks as fit on the device at once. Built with --fmad=false so the
// results are apply_cpu's bits (docs/optimizers.md, "CUDA").
#include "shmps/kernels/optimizer_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "optimizer_cuda_body.hpp"
#include "shmps/cuda_check.hpp"
#include "shmps/kernels/update.hpp"

namespace shmps::kernels {
namespace cuda_detail {
namespace {

// 256 threads: 8 blocks fill an SM (2048 threads) when registers allow;
// a multiple of the warp, as nonfinite_kernel's vote requires.
constexpr int kBlockThreads = 256;
// Devices whose resident block count is cached; others query every call.
constexpr int kMaxCachedDevices = 64;

template <class Op, GradDtype kDtype, GradAccess kAccess>
__global__ void __launch_bounds__(kBlockThreads) apply_kernel(const typename Op::Params params, const Arrays arrays) {
  const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  apply_thread<Op, kDtype, kAccess>(params, arrays, thread, threads);
}

template <GradDtype kDtype, GradAccess kAccess>
__global__ void __launch_bounds__(kBlockThreads) nonfinite_kernel(const Arrays arrays, int* flag) {
  const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint32_t bad = nonfinite_thread<kDtype, kAccess>(arrays, thread, threads);
  // One atomic per warp that saw a non-finite value, not one per thread: an
  // all-NaN gradient must not serialise a million atomics on one address.
  if (__any_sync(0xFFFFFFFFu, bad != 0) && threadIdx.x % 32 == 0) atomicOr(flag, 1);
}

// How many blocks of one kernel the current device runs at once (SMs x
// blocks per SM at kBlockThreads), cached per device: a grid-stride grid of
// exactly that size keeps every SM busy with no second, partial wave.
class ResidentBlocks {
 public:
  template <class Kernel>
  std::string get(Kernel kernel, int* blocks) {
    int device = 0;
    SHMPS_CUDA_CHECK(cudaGetDevice(&device));
    const bool cacheable = device >= 0 && device < kMaxCachedDevices;
    // Relaxed: the value is a pure function of (kernel, device); racing
    // threads store the same number and nothing else is published with it.
    const int cached = cacheable ? cache_[device].load(std::memory_order_relaxed) : 0;
    if (cached > 0) {
      *blocks = cached;
      return "";
    }
    int sms = 0;
    int per_sm = 0;
    SHMPS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    SHMPS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, 0));
    *blocks = std::max(1, sms) * std::max(1, per_sm);
    if (cacheable) cache_[device].store(*blocks, std::memory_order_relaxed);  // relaxed: see the load
    return "";
  }

 private:
  std::atomic<int> cache_[kMaxCachedDevices] = {};
};

// Blocks for `work` grid-stride items: no more than are resident, no more
// than have work, at least one (the head and tail elements need < 256 threads).
unsigned grid_blocks(int resident, uint64_t work) {
  const uint64_t needed = (work + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(needed, static_cast<uint64_t>(resident))));
}

// Items of the grid-stride loop: vectors, or elements when scalar.
uint64_t work_items(const Plan& plan, uint64_t n) { return plan.access == GradAccess::kVector ? plan.vectors : n; }

template <class Op, GradDtype kDtype, GradAccess kAccess>
std::string launch_apply(const typename Op::Params& params, const Arrays& arrays, uint64_t work, cudaStream_t stream) {
  static ResidentBlocks resident;
  int blocks = 0;
  if (std::string error = resident.get(apply_kernel<Op, kDtype, kAccess>, &blocks); !error.empty()) return error;
  apply_kernel<Op, kDtype, kAccess><<<grid_blocks(blocks, work), kBlockThreads, 0, stream>>>(params, arrays);
  SHMPS_CUDA_CHECK(cudaGetLastError());
  return "";
}

template <GradDtype kDtype, GradAccess kAccess>
std::string launch_nonfinite(const Arrays& arrays, uint64_t work, int* flag, cudaStream_t stream) {
  static ResidentBlocks resident;
  int blocks = 0;
  if (std::string error = resident.get(nonfinite_kernel<kDtype, kAccess>, &blocks); !error.empty()) return error;
  nonfinite_kernel<kDtype, kAccess><<<grid_blocks(blocks, work), kBlockThreads, 0, stream>>>(arrays, flag);
  SHMPS_CUDA_CHECK(cudaGetLastError());
  return "";
}

}  // namespace
}  // namespace cuda_detail

int cuda_device_count(std::string* reason) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    count = 0;
    (void)cudaGetLastError();  // clear it, so the next launch check does not report it
  }
  if (count == 0 && reason != nullptr) *reason = cudaGetErrorName(error);
  return count;
}

namespace {
// A launch's error text ("" = success) as the API's Status.
Status launched(const std::string& error) { return error.empty() ? Status::Ok() : Status{ErrorCode::kCuda, error}; }
}  // namespace

Status apply_cuda(const OptimizerConfig& config, const TensorState& device_tensor, const void* device_grad,
                  GradDtype dtype, uint64_t step, void* stream) {
  using namespace cuda_detail;
  Arrays arrays;
  Plan plan;
  if (std::string error = prepare_apply(config, device_tensor, device_grad, dtype, step, &arrays, &plan);
      !error.empty())
    return {ErrorCode::kInvalidArgument, error};
  if (arrays.n == 0) return Status::Ok();
  const uint64_t work = work_items(plan, arrays.n);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const auto launch = [&](auto op, auto dtype_c, auto access_c, const auto& params) {
    return launch_apply<decltype(op), decltype(dtype_c)::value, decltype(access_c)::value>(params, arrays, work,
                                                                                           cuda_stream);
  };
  return launched(dispatch_apply(config, dtype, step, plan.access, launch));
}

Status all_finite_cuda_async(const void* device_grad, GradDtype dtype, uint64_t n, int* device_nonfinite_flag,
                             void* stream) {
  using namespace cuda_detail;
  const size_t grad_bytes = dtype_size(dtype);
  if (grad_bytes == 0) {
    return {ErrorCode::kInvalidArgument, "all_finite_cuda: gradient dtype " +
                                             std::to_string(static_cast<uint32_t>(dtype)) +
                                             " is not f32 (1), f16 (2) or bf16 (3)"};
  }
  if (device_nonfinite_flag == nullptr) return {ErrorCode::kInvalidArgument, "all_finite_cuda: null flag"};
  if (n > 0 && device_grad == nullptr) return {ErrorCode::kInvalidArgument, "all_finite_cuda: null gradient"};
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (std::string e = SHMPS_CUDA_ERROR(cudaMemsetAsync(device_nonfinite_flag, 0, sizeof(int), cuda_stream)); !e.empty())
    return launched(e);
  if (n == 0) return Status::Ok();
  Arrays arrays;
  arrays.grad = static_cast<const unsigned char*>(device_grad);
  arrays.n = n;
  const Plan plan = plan_access(nullptr, 0, device_grad, static_cast<uint32_t>(grad_bytes), n);
  arrays.head = plan.head;
  arrays.vectors = plan.vectors;
  return launched(visit_dtype(dtype, [&](auto dtype_c) {
    return visit_access(plan.access, [&](auto access_c) {
      return launch_nonfinite<decltype(dtype_c)::value, decltype(access_c)::value>(arrays, work_items(plan, n),
                                                                                   device_nonfinite_flag, cuda_stream);
    });
  }));
}

Status all_finite_cuda(const void* device_grad, GradDtype dtype, uint64_t n, int* device_nonfinite_flag, void* stream,
                       bool* all_finite) {
  if (Status s = all_finite_cuda_async(device_grad, dtype, n, device_nonfinite_flag, stream); !s.ok()) return s;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  int nonfinite = 0;
  if (std::string e = SHMPS_CUDA_ERROR(
          cudaMemcpyAsync(&nonfinite, device_nonfinite_flag, sizeof nonfinite, cudaMemcpyDeviceToHost, cuda_stream));
      !e.empty())
    return launched(e);
  if (std::string e = SHMPS_CUDA_ERROR(cudaStreamSynchronize(cuda_stream)); !e.empty()) return launched(e);
  if (all_finite != nullptr) *all_finite = nonfinite == 0;
  return Status::Ok();
}

}  // namespace shmps::kernels
