#include "shmps/server/config.hpp"

#include <cmath>

namespace shmps::server {

Status validate(const ServerConfig& config) {
  const auto invalid = [](std::string message) { return Status{ErrorCode::kInvalidArgument, std::move(message)}; };
  if (std::string err = kernels::validate(config.optimizer); !err.empty()) return invalid(err);
  if (config.tensors.empty()) return invalid("at least one --tensor is required");
  if (Status s = shm::validate_tensors(config.tensors); !s.ok()) return invalid("--tensor: " + s.message());
  if ((config.init.kind == InitSpec::Kind::kNormal || config.init.kind == InitSpec::Kind::kUniform) &&
      !(std::isfinite(config.init.scale) && config.init.scale > 0.0f))
    return invalid("--init-scale must be finite and > 0 for --init normal or uniform, got " +
                   std::to_string(config.init.scale));
  const uint32_t cap = config.lane_capacity;
  if (cap < 2 || cap > shm::kMaxLaneCapacity || (cap & (cap - 1)) != 0)
    return invalid("--ring-capacity must be a power of two in 2..65536, got " + std::to_string(cap));
  if (config.max_workers == 0 || config.max_workers > shm::kMaxWorkersLimit)
    return invalid("--max-workers must be in 1..256, got " + std::to_string(config.max_workers));
  if (config.max_buffers == 0 || config.max_buffers > shm::kMaxBuffersLimit)
    return invalid("--max-buffers must be in 1..64, got " + std::to_string(config.max_buffers));
  if (config.checkpoint_keep == 0) return invalid("--checkpoint-keep must be at least 1");
  if (config.checkpoint_dir.empty() && (config.checkpoint_every != 0 || config.checkpoint_interval_s != 0))
    return invalid("--checkpoint-every and --checkpoint-interval-s need --checkpoint-dir");
  if (!config.device.empty()) {
    // The form only; whether such a device exists is the backend's check.
    const std::string& d = config.device;
    const bool uuid = d.rfind("GPU-", 0) == 0 && d.size() > 4;
    const bool bus_id = d.find(':') != std::string::npos && d.find('.') != std::string::npos;
    if (!uuid && !bus_id)
      return invalid("--device must be a UUID as nvidia-smi -L prints it (GPU-xxxxxxxx-...) or a PCI bus id "
                     "(0000:3b:00.0), got '" + d + "' (ordinals are not accepted: CUDA_VISIBLE_DEVICES may differ "
                     "between the server and its workers)");
  }
  return Status::Ok();
}

}  // namespace shmps::server
