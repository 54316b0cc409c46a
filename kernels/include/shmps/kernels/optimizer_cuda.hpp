// The CUDA backend of the optimizers (optimizer.hpp): the same SGD, Adam and
// AdamW from the same per-element code (update.hpp), on the current device.
// No CUDA types, so any code may include it (a stream is a `void*`). Calls
// are reentrant; no two may touch one tensor at once. Errors: a Status,
// kInvalidArgument for bad arguments, kCuda naming the failed CUDA call.
#pragma once

#include <cstdint>
#include <string>

#include "shmps/kernels/optimizer.hpp"

namespace shmps::kernels {

// Number of CUDA devices this process can use. Returns 0, never aborting,
// when there is no driver, no device or the runtime fails; then `reason`
// (when not null) receives the cudaGetErrorName of cudaGetDeviceCount's
// result, e.g. "cudaErrorNoDevice" or "cudaErrorInsufficientDriver".
int cuda_device_count(std::string* reason = nullptr);

// Enqueues one optimizer step on `stream` (a cudaStream_t; nullptr is the
// default stream) and returns without waiting: the result is there once the
// stream reaches it. Same arguments and meaning as apply_cpu(), except that
// device_tensor's arrays and device_grad are device memory of the current
// device (cudaSetDevice), and nothing may read or write them until the step
// has run. The per-step scalars are computed here, on the host, exactly as
// apply_cpu computes them, so the device gives apply_cpu's bits (see
// docs/optimizers.md, "CUDA").
// Alignment: the weights and state arrays must be float-aligned, the
// gradient may have any alignment. 16-byte vector loads are used when all
// arrays can be brought to 16-byte alignment by the same element offset;
// otherwise (e.g. the gradient at an odd offset) a slower scalar loop runs.
// Precondition: validate_update(config) is ok, state_arrays(config) state arrays.
// Errors: kInvalidArgument (step 0, an unknown dtype or kind, a null
// array), kCuda (a failed launch: "<expression> failed:
// cudaErrorInvalidDevicePointer (...) at optimizer_cuda.cu:123"). Errors of
// the kernel itself (a bad pointer) surface at the next synchronising call.
Status apply_cuda(const OptimizerConfig& config, const TensorState& device_tensor, const void* device_grad,
                  GradDtype dtype, uint64_t step, void* stream);

// Enqueues a check of n gradient elements on `stream`: sets
// *device_nonfinite_flag (one int of device memory) to 0, then to 1 if any
// element is NaN or +-Inf. Asynchronous like apply_cuda: the flag is valid
// once the stream reaches it (copy it back, then synchronise). Any gradient
// alignment. Errors as apply_cuda.
Status all_finite_cuda_async(const void* device_grad, GradDtype dtype, uint64_t n, int* device_nonfinite_flag,
                             void* stream);

// all_finite_cuda_async, then copies the flag back and waits for `stream`
// (which also waits for everything enqueued on it before). *all_finite is
// true when no element is NaN or +-Inf; it is left unchanged on error.
// `device_nonfinite_flag` is scratch (one int of device memory).
Status all_finite_cuda(const void* device_grad, GradDtype dtype, uint64_t n, int* device_nonfinite_flag, void* stream,
                       bool* all_finite);

}  // namespace shmps::kernels
