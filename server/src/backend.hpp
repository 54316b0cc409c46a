// The seam between the protocol and the memory that holds the weights: the
// host backend (host memory, POSIX shm peer buffers) and the CUDA backend
// (device memory, CUDA IPC peer buffers) implement it. Used only by the
// server's consumer thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

// A worker's registered buffer, mapped by the server once.
class PeerBuffer {
 public:
  virtual ~PeerBuffer() = default;
  virtual uint64_t length() const noexcept = 0;  // bytes requests may use
};

struct TensorExtent {
  uint64_t element_offset;
  uint64_t element_count;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const noexcept = 0;

  // Allocates the weights (sum of extents, fp32) and `state_arrays` optimizer
  // state arrays of the same length (zeroed), from `initial` (taken: the
  // host backend keeps that very vector, so the peak is one copy).
  virtual Status allocate(const std::vector<TensorExtent>& tensors, size_t state_arrays,
                          std::vector<float> initial) = 0;

  // Opens the buffer a worker described (already checked for kind and a
  // terminated name). Errors: kUnknownBuffer (cannot open), kBadRange
  // (offset + length beyond the object), kPermission.
  virtual Result<std::unique_ptr<PeerBuffer>> open_peer(const shm::BufferDesc& desc,
                                                        const std::string& expected_prefix) = 0;

  // After an access: kBadRange when the peer's memory vanished under it (a
  // worker truncated its object); the buffer must then be dropped.
  virtual Status peer_intact(const PeerBuffer& peer) = 0;

  // Gradient range checks were done by the caller: [byte_offset, +n*size)
  // lies inside `grad`.
  virtual bool all_finite(const PeerBuffer& grad, uint64_t byte_offset, uint64_t n,
                          kernels::GradDtype dtype) = 0;
  // One optimizer step of tensor `tensor` (index into the extents).
  virtual Status apply(const kernels::OptimizerConfig& config, uint32_t tensor, uint64_t step,
                       const PeerBuffer& grad, uint64_t byte_offset, kernels::GradDtype dtype) = 0;
  // Copies weights [element_offset, +n) as fp32 into `dst` at byte_offset.
  virtual Status copy_out(uint64_t element_offset, uint64_t n, PeerBuffer& dst,
                          uint64_t byte_offset) = 0;
  // All weights, flat, to host memory (tests, checkpoints).
  virtual std::vector<float> read_weights() const = 0;
  // All optimizer state arrays, one after another (state_arrays x total).
  virtual std::vector<float> read_state() const = 0;
  // Replaces weights and state (a checkpoint's; sizes as allocated).
  virtual Status load(std::span<const float> weights, std::span<const float> state) = 0;
};

std::unique_ptr<Backend> make_host_backend();

}  // namespace shmps::server
