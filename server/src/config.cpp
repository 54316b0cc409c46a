#include "shmps/server/config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <vector>

#include "device_spec.hpp"
#include "fed_store.hpp"

namespace shmps::server {
namespace {

// Shortest text that reads back as `v` (0.001, not 0.001000).
std::string number_text(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace

Status validate(const ServerConfig& config) {
  const auto invalid = [](std::string message) { return Status{ErrorCode::kInvalidArgument, std::move(message)}; };
  if (Status s = kernels::validate(config.optimizer); !s.ok()) return invalid(s.message());
  if (config.tensors.empty()) return invalid("at least one --tensor is required");
  if (Status s = shm::validate_tensors(config.tensors); !s.ok()) return invalid("--tensor: " + s.message());
  // At most 1e30: a normal draw reaches several standard deviations, and
  // a uniform one spans twice the half-width; far larger ones overflow the
  // float range into Inf and NaN weights.
  constexpr float kMaxInitScale = 1e30f;
  if ((config.init.kind == InitSpec::Kind::kNormal || config.init.kind == InitSpec::Kind::kUniform) &&
      !(std::isfinite(config.init.scale) && config.init.scale > 0.0f && config.init.scale <= kMaxInitScale))
    return invalid("--init-scale must be > 0 and at most 1e30 for --init normal or uniform, got " +
                   number_text(config.init.scale));
  const uint32_t cap = config.lane_capacity;
  if (cap < 2 || cap > shm::kMaxLaneCapacity || (cap & (cap - 1)) != 0)
    return invalid("--ring-capacity must be a power of two in 2..65536, got " + std::to_string(cap));
  if (config.max_workers == 0 || config.max_workers > shm::kMaxWorkersLimit)
    return invalid("--max-workers must be in 1..256, got " + std::to_string(config.max_workers));
  if (config.max_buffers == 0 || config.max_buffers > shm::kMaxBuffersLimit)
    return invalid("--max-buffers must be in 1..64, got " + std::to_string(config.max_buffers));
  if (config.apply_threads > kMaxApplyThreads)
    return invalid("--apply-threads must be auto or a number in 1.." + std::to_string(kMaxApplyThreads) + ", got " +
                   std::to_string(config.apply_threads));
  if (config.idle_spin_us > kMaxIdleSpinUs)
    return invalid("--idle-spin-us must be at most " + std::to_string(kMaxIdleSpinUs) + " (1 s), got " +
                   std::to_string(config.idle_spin_us));
  if (config.checkpoint_keep == 0 || config.checkpoint_keep > kMaxCheckpointKeep)
    return invalid("--checkpoint-keep must be in 1.." + std::to_string(kMaxCheckpointKeep) + ", got " +
                   std::to_string(config.checkpoint_keep));
  if (config.checkpoint_dir.empty() && (config.checkpoint_every != 0 || config.checkpoint_interval_s != 0))
    return invalid("--checkpoint-every and --checkpoint-interval-s need --checkpoint-dir");
  // Checked whether or not federated: an embedder may inject an engine.
  const FederationConfig& f = config.federation;
  if (f.every_ms == 0 || f.every_ms > kMaxFederationEveryMs)
    return invalid("--fed-every-ms must be in 1.." + std::to_string(kMaxFederationEveryMs) + ", got " +
                   std::to_string(f.every_ms));
  if (!(std::isfinite(f.outer_lr) && f.outer_lr > 0.0f))
    return invalid("--fed-outer-lr must be finite and > 0, got " + number_text(f.outer_lr));
  if (!(std::isfinite(f.outer_momentum) && f.outer_momentum >= 0.0f && f.outer_momentum < 1.0f))
    return invalid("--fed-outer-momentum must be in [0, 1), got " + number_text(f.outer_momentum));
  if (f.kind == FederationKind::kGloo) {
    if (f.hosts == 0 || f.hosts > kMaxFederationHosts)
      return invalid("--federation gloo needs --fed-hosts in 1.." + std::to_string(kMaxFederationHosts) + ", got " +
                     std::to_string(f.hosts));
    if (f.host >= f.hosts)
      return invalid("--fed-host must be below --fed-hosts (" + std::to_string(f.hosts) + "), got " +
                     std::to_string(f.host));
    if (f.store.empty())
      return invalid("--federation gloo needs --fed-store file:DIR or redis:HOST[:PORT][/JOB] (where the hosts meet)");
    if (auto store = parse_fed_store(f.store); !store.ok()) return invalid(store.status().message());
    if (f.address.empty()) return invalid("--fed-address must name an address of this host");
  }
  if (f.timeout_ms < 100 || f.timeout_ms > 3'600'000)
    return invalid("--fed-timeout-ms must be in 100..3600000, got " + std::to_string(f.timeout_ms));
  if (f.rank_in_name && config.name.size() > 32 - 5)
    return invalid(
        "--fed-rank-in-name appends '.r<rank>' to --name: a name of at most 27 characters (ranks up "
        "to 999), got " +
        std::to_string(config.name.size()));
  if (!config.device.empty()) {
    // The form only; whether such a device exists is the backend's check.
    const std::string& d = config.device;
    const bool uuid = is_device_uuid_spec(d);
    const bool bus_id = d.find(':') != std::string::npos && d.find('.') != std::string::npos;
    if (!uuid && !bus_id)
      return invalid(
          "--device must be a UUID as nvidia-smi -L prints it (GPU-xxxxxxxx-...) or a PCI bus id "
          "(0000:3b:00.0), got '" +
          d +
          "' (ordinals are not accepted: CUDA_VISIBLE_DEVICES may differ "
          "between the server and its workers)");
  }
  return Status::Ok();
}

uint64_t worker_buffer_budget(const ServerConfig& config) {
  if (config.max_worker_buffer_bytes != 0) return config.max_worker_buffer_bytes;
  // At most 2^40 elements (validate_tensors()): 2^45 bytes, no overflow.
  const uint64_t model_bytes = std::min(shm::total_elements(config.tensors), shm::kMaxTotalElements) * sizeof(float);
  return std::max(kAutoWorkerBufferFactor * model_bytes, kMinAutoWorkerBufferBytes);
}

Status read_init_file(const std::string& path, uint64_t total_elements, const WeightsSink& sink) {
  const std::string what = "--init-file " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return {ErrorCode::kIo, what + ": cannot open: " + errno_text(errno)};
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {ErrorCode::kIo, what + ": fstat: " + errno_text(errno)};
  if (!S_ISREG(st.st_mode)) return {ErrorCode::kInvalidArgument, what + ": not a regular file"};
  const auto size = static_cast<uint64_t>(st.st_size);
  const uint64_t need = total_elements * sizeof(float);  // at most 2^42 (validate_tensors())
  if (size != need)
    return {ErrorCode::kInvalidArgument, what + " holds " + std::to_string(size) + " bytes; the tensors need " +
                                             std::to_string(need) + " (raw fp32, all tensors in order)"};
  constexpr uint64_t kChunkElements = 1 << 20;
  std::vector<float> chunk(std::min(total_elements, kChunkElements));
  for (uint64_t done = 0; done < total_elements;) {
    const uint64_t n = std::min(total_elements - done, kChunkElements);
    float* into = chunk.data();
    auto* bytes = reinterpret_cast<char*>(into);
    for (uint64_t got = 0; got < n * sizeof(float);) {
      const ssize_t r = ::read(fd, bytes + got, std::min<uint64_t>(n * sizeof(float) - got, 1 << 30));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return {ErrorCode::kIo, what + ": read failed: " + errno_text(errno)};
      if (r == 0)
        return {ErrorCode::kIo, what + ": read failed: the file ended after " +
                                    std::to_string(done * sizeof(float) + got) + " of " + std::to_string(need) +
                                    " bytes"};
      got += static_cast<uint64_t>(r);
    }
    if (!std::all_of(into, into + n, [](float x) { return std::isfinite(x); }))
      return {ErrorCode::kInvalidArgument, what + " contains NaN or Inf"};
    if (sink)
      if (Status s = sink(done, std::span<const float>(into, n)); !s.ok()) return s;
    done += n;
  }
  return Status::Ok();
}

}  // namespace shmps::server
