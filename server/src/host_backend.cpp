// The host-memory backend: weights and optimizer state in the server's
// private memory, worker buffers are POSIX shm objects mapped read-write.
#include <algorithm>
#include <cstring>

#include "backend.hpp"
#include "peer_guard.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {
namespace {

class HostPeer final : public PeerBuffer {
 public:
  HostPeer(std::unique_ptr<shm::ShmObject> object, uint64_t offset, uint64_t length)
      : object_(std::move(object)), offset_(offset), length_(length),
        guard_(guard_range(object_->data(), object_->size())) {}
  ~HostPeer() override { release_range(guard_); }
  uint64_t length() const noexcept override { return length_; }
  bool intact() const noexcept { return !range_poisoned(guard_); }
  char* at(uint64_t byte_offset) const noexcept {
    return static_cast<char*>(object_->data()) + offset_ + byte_offset;
  }

 private:
  std::unique_ptr<shm::ShmObject> object_;
  uint64_t offset_;
  uint64_t length_;
  GuardId guard_;
};

class HostBackend final : public Backend {
 public:
  HostBackend() { install_peer_guard(); }
  const char* name() const noexcept override { return "host"; }

  Status peer_intact(const PeerBuffer& peer) override {
    if (static_cast<const HostPeer&>(peer).intact()) return Status::Ok();
    return {ErrorCode::kBadRange, "the buffer object shrank under the server (SIGBUS); dropped"};
  }

  Status allocate(const std::vector<TensorExtent>& tensors, size_t state_arrays,
                  std::vector<float> initial) override {
    tensors_ = tensors;
    weights_ = std::move(initial);
    // One array at a time, no zeroed temporary to copy from (it would
    // raise the peak resident memory by a whole tensor).
    state_.resize(state_arrays);
    for (auto& array : state_) array.assign(weights_.size(), 0.0f);
    return Status::Ok();
  }

  Result<std::unique_ptr<PeerBuffer>> open_peer(const shm::BufferDesc& desc,
                                                const std::string& expected_prefix) override {
    if (desc.kind != static_cast<uint32_t>(shm::BufferKind::kHostShm))
      return Status{ErrorCode::kBadRequest, "the host backend takes only POSIX shm buffers"};
    auto opened = open_worker_object(desc, expected_prefix);
    if (!opened.ok()) return opened.status();
    return std::unique_ptr<PeerBuffer>(new HostPeer(std::move(opened).value(), desc.offset, desc.length));
  }

  Result<bool> all_finite(const PeerBuffer& grad, uint64_t byte_offset, uint64_t n,
                          kernels::GradDtype dtype) override {
    return kernels::all_finite_cpu(static_cast<const HostPeer&>(grad).at(byte_offset), dtype, n);
  }

  Status apply(const kernels::OptimizerConfig& config, uint32_t tensor, uint64_t step,
               const PeerBuffer& grad, uint64_t byte_offset, kernels::GradDtype dtype) override {
    const TensorExtent& t = tensors_[tensor];
    kernels::TensorState ts;
    ts.weights = weights_.data() + t.element_offset;
    for (size_t i = 0; i < state_.size(); ++i) ts.state[i] = state_[i].data() + t.element_offset;
    ts.n = t.element_count;
    kernels::apply_cpu(config, ts, static_cast<const HostPeer&>(grad).at(byte_offset), dtype, step);
    return Status::Ok();
  }

  Status copy_out(uint64_t element_offset, uint64_t n, PeerBuffer& dst, uint64_t byte_offset) override {
    std::memcpy(static_cast<HostPeer&>(dst).at(byte_offset), weights_.data() + element_offset,
                n * sizeof(float));
    return Status::Ok();
  }

  std::vector<float> read_weights() const override { return weights_; }

  std::vector<float> read_state() const override {
    std::vector<float> out;
    out.reserve(state_.size() * weights_.size());
    for (const auto& array : state_) out.insert(out.end(), array.begin(), array.end());
    return out;
  }

  Status load(std::span<const float> weights, std::span<const float> state) override {
    if (weights.size() != weights_.size() || state.size() != state_.size() * weights_.size())
      return {ErrorCode::kInternal, "load: sizes differ from the allocation"};
    std::copy(weights.begin(), weights.end(), weights_.begin());
    for (size_t a = 0; a < state_.size(); ++a)
      std::copy(state.begin() + static_cast<std::ptrdiff_t>(a * weights_.size()),
                state.begin() + static_cast<std::ptrdiff_t>((a + 1) * weights_.size()), state_[a].begin());
    return Status::Ok();
  }

 private:
  std::vector<TensorExtent> tensors_;
  std::vector<float> weights_;
  std::vector<std::vector<float>> state_;
};

}  // namespace

Result<std::unique_ptr<shm::ShmObject>> open_worker_object(const shm::BufferDesc& desc,
                                                           const std::string& expected_prefix) {
  if (std::memchr(desc.handle, '\0', sizeof desc.handle) == nullptr)
    return Status{ErrorCode::kBadRequest, "buffer handle is not a terminated name"};
  const std::string object_name(reinterpret_cast<const char*>(desc.handle));
  // Only objects this worker created: never the control segment or
  // another worker's buffer.
  if (object_name.rfind(expected_prefix, 0) != 0)
    return Status{ErrorCode::kBadRequest, "buffer name must start with " + expected_prefix};
  auto opened = shm::ShmObject::open(object_name, /*read_only=*/false);
  if (!opened.ok()) {
    if (opened.status().code() == ErrorCode::kPermission) return opened.status();
    return Status{ErrorCode::kUnknownBuffer, opened.status().message()};
  }
  const uint64_t size = (*opened)->size();
  if (desc.offset > size || desc.length > size - desc.offset)
    return Status{ErrorCode::kBadRange, "buffer offset " + std::to_string(desc.offset) + " + length " +
                                            std::to_string(desc.length) + " exceeds object size " +
                                            std::to_string(size)};
  return opened;
}

std::unique_ptr<Backend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace shmps::server
