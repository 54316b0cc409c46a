// The one CUDA runtime error check of the project (the CUDA kernels, the
// server's CUDA backend, the CUDA tests and benchmark): every runtime call
// goes through SHMPS_CUDA_CHECK or SHMPS_CUDA_ERROR, which turn a failure
// into a message naming the expression, cudaGetErrorName,
// cudaGetErrorString and file:line. Stateless; safe from any thread. Needs
// cuda_runtime.h: only targets built against the CUDA toolkit include it.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace shmps::cuda {

// "cudaMalloc(&p, bytes) failed: cudaErrorMemoryAllocation (out of memory)
// at optimizer_cuda.cu:42". `file` is shortened to its last component.
inline std::string error_text(const char* expression, cudaError_t error, const char* file, int line) {
  const char* base = file;
  for (const char* c = file; *c != '\0'; ++c) {
    if (*c == '/') base = c + 1;
  }
  return std::string(expression) + " failed: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ") at " +
         base + ":" + std::to_string(line);
}

}  // namespace shmps::cuda

// The message for `expr` (a cudaError_t expression), "" when it succeeded.
#define SHMPS_CUDA_ERROR(expr)                                                                                         \
  [&]() -> std::string {                                                                                               \
    const cudaError_t shmps_cuda_error_ = (expr);                                                                      \
    return shmps_cuda_error_ == cudaSuccess ? std::string()                                                            \
                                            : ::shmps::cuda::error_text(#expr, shmps_cuda_error_, __FILE__, __LINE__); \
  }()

// Evaluates `expr`; on failure returns its message from the enclosing
// function (which returns std::string). After a kernel launch, check
// cudaGetLastError() with it.
#define SHMPS_CUDA_CHECK(expr)                                                        \
  do {                                                                                \
    const cudaError_t shmps_cuda_error_ = (expr);                                     \
    if (shmps_cuda_error_ != cudaSuccess) {                                           \
      return ::shmps::cuda::error_text(#expr, shmps_cuda_error_, __FILE__, __LINE__); \
    }                                                                                 \
  } while (false)
