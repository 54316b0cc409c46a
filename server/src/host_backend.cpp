// The host-memory backend: weights and optimizer state in the server's
// private memory, worker buffers are POSIX shm objects mapped read-write.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <string_view>

#include "backend.hpp"
#include "peer_guard.hpp"
#include "shmps/kernels/model_passes.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {
namespace {

// A worker's buffer: the window of its object that the descriptor names,
// mapped and guarded alone (open_worker_object()).
class HostPeer final : public PeerBuffer {
 public:
  explicit HostPeer(std::unique_ptr<shm::ShmObject> window)
      : window_(std::move(window)), guard_(guard_range(window_->mapping(), window_->mapping_size())) {}
  ~HostPeer() override { release_range(guard_); }
  uint64_t length() const noexcept override { return window_->size(); }
  const shm::ShmObject* host_object() const noexcept override { return window_.get(); }
  bool intact() const noexcept { return !range_poisoned(guard_); }
  bool guarded() const noexcept { return guard_ != 0; }
  char* at(uint64_t byte_offset) const noexcept { return static_cast<char*>(window_->data()) + byte_offset; }

 private:
  std::unique_ptr<shm::ShmObject> window_;
  GuardId guard_;
};

// An fp32 array in an anonymous mapping of its own, starting kStagger bytes
// in. Why: AMD Zen's L1 data cache predicts a line's way from a hash of
// virtual address bits 12-27 (the "utag"); two lines streamed together whose
// addresses differ by a multiple of 256 MiB get the same hash and keep
// evicting each other. The kernel maps a worker's buffer right below the
// mappings before it, so with a buffer of 256 MiB (or a multiple) the
// gradient sat exactly 256 MiB + 16 B below weights that started a malloc
// header into their mapping: a 1 MiB SGD apply took 96.6 us instead of 25.1,
// a 4 KiB one 161 ns instead of 60 (measured in one process with that
// distance: docs/benchmarks.md, "Profile"). Starting every array half of
// that period into its mapping puts such neighbours 128 MiB apart in that
// hash. The skipped bytes are address space only: an inaccessible
// reservation (PROT_NONE, MAP_NORESERVE), never touched; the array itself
// is an ordinary mapping over the rest, counted against the commit limit
// like any allocation.
class HostArray {
 public:
  static constexpr size_t kStagger = size_t{1} << 27;
  HostArray() = default;
  explicit HostArray(size_t n) : n_(n) {
    const size_t data_bytes = std::max<size_t>(n * sizeof(float), 1);
    bytes_ = kStagger + data_bytes;
    void* base = ::mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();  // caught at allocate()
    void* data = ::mmap(static_cast<char*>(base) + kStagger, data_bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (data == MAP_FAILED) {
      ::munmap(base, bytes_);
      throw std::bad_alloc();
    }
    base_ = base;
  }
  HostArray(HostArray&& o) noexcept { swap(o); }
  HostArray& operator=(HostArray&& o) noexcept {
    swap(o);
    return *this;
  }
  ~HostArray() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }
  float* data() const noexcept {
    return base_ == nullptr ? nullptr : reinterpret_cast<float*>(static_cast<char*>(base_) + kStagger);
  }
  size_t size() const noexcept { return n_; }  // elements; zero until written

 private:
  void swap(HostArray& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    std::swap(n_, o.n_);
  }
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t n_ = 0;
};

class HostBackend final : public Backend {
 public:
  HostBackend() { install_peer_guard(); }
  shm::Backend kind() const noexcept override { return shm::Backend::kHost; }

  Status peer_intact(const PeerBuffer& peer) override {
    if (static_cast<const HostPeer&>(peer).intact()) return Status::Ok();
    return {ErrorCode::kBadRange, "the buffer object shrank under the server (SIGBUS); dropped"};
  }

  Status allocate(const std::vector<TensorExtent>& tensors, size_t state_arrays, uint64_t total) override {
    tensors_ = tensors;
    try {
      // Zeroed in place and touched now, so memory the host lacks fails
      // the start, not a later update.
      weights_ = HostArray(total);
      std::memset(weights_.data(), 0, weights_.size() * sizeof(float));
      state_.clear();
      for (size_t a = 0; a < state_arrays; ++a) {
        state_.emplace_back(weights_.size());
        std::memset(state_.back().data(), 0, weights_.size() * sizeof(float));
      }
    } catch (const std::bad_alloc&) {
      return {ErrorCode::kNoCapacity, "cannot map " + std::to_string(total * sizeof(float) * (1 + state_arrays)) +
                                          " bytes of weights and optimizer state"};
    }
    return Status::Ok();
  }

  Status write_weights(uint64_t first, std::span<const float> values) override {
    if (first > weights_.size() || values.size() > weights_.size() - first)
      return {ErrorCode::kInvalidArgument, "write_weights beyond the weights"};
    std::memcpy(weights_.data() + first, values.data(), values.size_bytes());
    return Status::Ok();
  }

  Result<std::unique_ptr<PeerBuffer>> open_peer(const shm::BufferDesc& desc, const PeerObjectRule& rule) override {
    if (desc.kind != static_cast<uint32_t>(shm::BufferKind::kHostShm))
      return Status{ErrorCode::kBadRequest, "the host backend takes only POSIX shm buffers"};
    auto opened = open_worker_object(desc, rule);
    if (!opened.ok()) return opened.status();
    auto peer = std::make_unique<HostPeer>(std::move(opened).value());
    // Unguarded, a buffer truncated under the server would kill it (SIGBUS).
    if (!peer->guarded())
      return Status{ErrorCode::kNoCapacity,
                    "this process guards " + std::to_string(kGuardedRanges) + " buffers at most, all in use"};
    return std::unique_ptr<PeerBuffer>(std::move(peer));
  }

  Result<bool> all_finite(const PeerBuffer& grad, uint64_t byte_offset, uint64_t n, kernels::GradDtype dtype) override {
    return kernels::all_finite_cpu(static_cast<const HostPeer&>(grad).at(byte_offset), dtype, n);
  }

  uint32_t set_apply_threads(uint32_t threads) noexcept override { return kernels::set_cpu_threads(threads); }

  Status apply(const kernels::OptimizerConfig& config, uint32_t tensor, uint64_t step, const PeerBuffer& grad,
               uint64_t byte_offset, kernels::GradDtype dtype) override {
    const TensorExtent& t = tensors_[tensor];
    kernels::TensorState ts;
    ts.weights = weights_.data() + t.element_offset;
    for (size_t i = 0; i < state_.size(); ++i) ts.state[i] = state_[i].data() + t.element_offset;
    ts.n = t.element_count;
    kernels::apply_cpu(config, ts, static_cast<const HostPeer&>(grad).at(byte_offset), dtype, step);
    return Status::Ok();
  }

  Status copy_out(uint64_t element_offset, uint64_t n, PeerBuffer& dst, uint64_t byte_offset) override {
    std::memcpy(static_cast<HostPeer&>(dst).at(byte_offset), weights_.data() + element_offset, n * sizeof(float));
    return Status::Ok();
  }

  Status copy_in(uint64_t element_offset, uint64_t n, const PeerBuffer& src, uint64_t byte_offset) override {
    std::memcpy(weights_.data() + element_offset, static_cast<const HostPeer&>(src).at(byte_offset), n * sizeof(float));
    return Status::Ok();
  }

  Result<std::vector<float>> read_weights() override {
    return std::vector<float>(weights_.data(), weights_.data() + weights_.size());
  }

  Status snapshot_weights(std::span<float> dst) override {
    if (dst.size() != weights_.size()) return {ErrorCode::kInternal, "snapshot_weights: the length differs"};
    std::memcpy(dst.data(), weights_.data(), dst.size() * sizeof(float));
    return Status::Ok();
  }

  Status add_to_weights(std::span<const float> delta) override {
    if (delta.size() != weights_.size()) return {ErrorCode::kInternal, "add_to_weights: the length differs"};
    kernels::add_cpu(weights_.data(), delta.data(), delta.size());
    return Status::Ok();
  }

  Result<std::vector<float>> read_state() override {
    std::vector<float> out;
    out.reserve(state_.size() * weights_.size());
    for (const auto& array : state_) out.insert(out.end(), array.data(), array.data() + array.size());
    return out;
  }

  Status load(std::span<const float> weights, std::span<const float> state) override {
    if (weights.size() != weights_.size() || state.size() != state_.size() * weights_.size())
      return {ErrorCode::kInternal, "load: sizes differ from the allocation"};
    std::copy(weights.begin(), weights.end(), weights_.data());
    for (size_t a = 0; a < state_.size(); ++a)
      std::copy(state.begin() + static_cast<std::ptrdiff_t>(a * weights_.size()),
                state.begin() + static_cast<std::ptrdiff_t>((a + 1) * weights_.size()), state_[a].data());
    return Status::Ok();
  }

 private:
  std::vector<TensorExtent> tensors_;
  HostArray weights_;
  std::vector<HostArray> state_;
};

}  // namespace

Result<std::unique_ptr<shm::ShmObject>> open_worker_object(const shm::BufferDesc& desc, const PeerObjectRule& rule) {
  if (std::memchr(desc.handle, '\0', sizeof desc.handle) == nullptr)
    return Status{ErrorCode::kBadRequest, "buffer handle is not a terminated name"};
  const std::string object_name(reinterpret_cast<const char*>(desc.handle));
  // Only objects named as this worker's buffers ("<prefix><n>", n digits):
  // never a control segment (a server may be named "job.p42.x") or another
  // worker's buffer ("shmps.job.p42.p43.1" is worker 43's of server
  // "job.p42").
  const std::string& prefix = rule.prefix;
  const std::string_view n = std::string_view(object_name).substr(std::min(object_name.size(), prefix.size()));
  if (!object_name.starts_with(prefix) || n.empty() || n.size() > 20 ||
      n.find_first_not_of("0123456789") != std::string_view::npos)
    return Status{ErrorCode::kBadRequest, "buffer name must be " + prefix + "<n>"};
  if (desc.length == 0) return Status{ErrorCode::kBadRange, "buffer length 0"};
  // The name alone proves nothing of the object: with protected_hardlinks
  // a process may link any object it may read and write (the control
  // segment, another worker's buffer) under this worker's name, or rename
  // one of its user's there. So the object opened must have one name (a
  // worker's buffer has the one its worker created, O_EXCL) and be none
  // the rule names (a link whose other names were removed since). Its
  // owner is not compared with the worker's: the pid is the claimer's word
  // (its /proc owner is that of whichever process the claim names), and
  // an object of another user has a name that only its owner may remove
  // (sticky /dev/shm), so a link to it has two.
  const auto accept = [&](const shm::ShmObject::Identity& id) -> Status {
    if (id.links > 1)
      return {ErrorCode::kBadRequest, "buffer '" + object_name + "' has " + std::to_string(id.links) +
                                          " names (a hard link): a worker's buffer has only the one it was created "
                                          "under; nothing registered"};
    if (rule.taken_as)
      if (std::string what = rule.taken_as(id); !what.empty())
        return {ErrorCode::kBadRequest,
                "buffer '" + object_name + "' is " + what + ", not this worker's buffer; nothing registered"};
    return Status::Ok();
  };
  // The window alone: the object's size costs the server nothing.
  auto opened =
      shm::ShmObject::open_window(object_name, /*read_only=*/false, desc.offset, desc.length, nullptr, accept);
  if (!opened.ok()) {
    const ErrorCode code = opened.status().code();
    if (code == ErrorCode::kPermission || code == ErrorCode::kBadRequest) return opened.status();
    if (code == ErrorCode::kBadRange) return Status{ErrorCode::kBadRange, "buffer " + opened.status().message()};
    return Status{ErrorCode::kUnknownBuffer, opened.status().message()};
  }
  return opened;
}

std::unique_ptr<Backend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace shmps::server
