#include "shmps/server/config.hpp"

namespace shmps::server {

Status validate(const ServerConfig& config) {
  const auto invalid = [](std::string message) { return Status{ErrorCode::kInvalidArgument, std::move(message)}; };
  if (std::string err = kernels::validate(config.optimizer); !err.empty()) return invalid(err);
  if (config.tensors.empty()) return invalid("at least one --tensor is required");
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
  return Status::Ok();
}

}  // namespace shmps::server
