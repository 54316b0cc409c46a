// ServerConfig: everything a shmps-server instance is started with. Built
// from the command line / config file by parse_options() (options.hpp) or
// directly by tests and embedders. A plain value type; validate() is
// reentrant.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "shmps/kernels/lr_schedule.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/federation.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

enum class BackendKind { kHost, kCuda, kAuto };

// Severity of a log line. The values are syslog priorities, which journald
// reads from a "<N>" line prefix.
enum class LogLevel : int { kError = 3, kWarn = 4, kInfo = 6, kDebug = 7 };

// How the weights start: zero, seeded random, or read from a file of raw
// little-endian fp32 (all tensors in table order, exactly total*4 bytes).
struct InitSpec {
  enum class Kind { kZero, kNormal, kUniform, kFile } kind = Kind::kZero;
  float scale = 0.01f;  // kNormal: stddev; kUniform: values in [-scale, scale)
  uint64_t seed = 1;
  std::string file;
};

// The most --apply-threads takes (CPU_SETSIZE: the CPUs an affinity mask
// can name).
inline constexpr uint32_t kMaxApplyThreads = 1024;
// The longest --idle-spin-us: 1 s of a core spinning on an idle ring;
// past that, sleeping costs nothing in comparison.
inline constexpr uint32_t kMaxIdleSpinUs = 1'000'000;
// The most --checkpoint-keep takes: each file kept is a whole copy of the
// model, and the start's allowance for its restore (EXTEND_TIMEOUT_USEC)
// grows with their count.
inline constexpr uint32_t kMaxCheckpointKeep = 1000;

// --max-worker-buffer-bytes auto: this many times the model's fp32 bytes
// (a worker's weights and gradients, each twice over, with room to spare:
// every worker of this repository registers at most 2x, and a re-created
// torch optimizer's buffers awaiting their unregister 4x), ...
inline constexpr uint64_t kAutoWorkerBufferFactor = 8;
// ... and at least this much (1 GiB), for small models: buffers of their
// own for small tensors, a benchmark's buffer of its largest push.
inline constexpr uint64_t kMinAutoWorkerBufferBytes = uint64_t{1} << 30;

struct ServerConfig {
  std::string name;  // segment is /dev/shm/shmps.<name>
  std::vector<shm::TensorSpec> tensors;
  kernels::OptimizerConfig optimizer;
  // The lr of each update, from optimizer.lr and the updates applied
  // before it (the version): torch.optim.lr_scheduler's schedules.
  kernels::LrSchedule lr_schedule;
  uint64_t max_staleness = 4;
  // What max_staleness bounds, and how (layout.hpp, StalenessPolicy;
  // docs/design.md, "Staleness policies"): reject stale pushes, hold pulls
  // of workers that run ahead (SSP), or apply every push, the stale ones
  // with a reduced lr.
  shm::StalenessPolicy staleness_policy = shm::StalenessPolicy::kReject;
  bool allow_nonfinite = false;  // accept NaN/Inf gradients
  uint32_t lane_capacity = 64;   // per worker request lane, power of two
  uint32_t max_workers = 16;
  uint32_t max_buffers = 16;  // per worker
  // The most bytes one worker's registered buffers may span together (the
  // sum of their windows' lengths, each of which the server maps): a
  // shm object of terabytes costs its maker nothing (ftruncate alone), and
  // without a bound a few workers could fill the server's address space so
  // that no other worker can register a buffer. 0 (auto):
  // kAutoWorkerBufferFactor times the model's fp32 bytes, at least
  // kMinAutoWorkerBufferBytes (worker_buffer_budget()).
  uint64_t max_worker_buffer_bytes = 0;
  BackendKind backend = BackendKind::kAuto;
  // The CUDA device (cuda/auto backends): a UUID as `nvidia-smi -L` prints
  // it ("GPU-xxxxxxxx-...") or a PCI bus id ("0000:3b:00.0"); empty: the
  // first visible device. Never an ordinal: CUDA_VISIBLE_DEVICES may differ
  // between the server and its workers.
  std::string device;
  InitSpec init;
  bool group_access = false;  // segment mode 0660 instead of 0600
  // The consumer spins this long on an empty ring before sleeping on the
  // futex (a push then pays a wake-up, ~tens of us). At most
  // kMaxIdleSpinUs.
  uint32_t idle_spin_us = 50;
  // The most threads one update of a large tensor (from
  // kernels::kCpuSplitMinElements) runs on, host backend. 0 (auto): the
  // CPUs of the server's affinity mask, less one for each attached worker
  // that may run on them and has no request waiting (it is computing, on
  // one of them), at least 1. A thread that shares its CPU with a
  // computing worker can be preempted and stall the whole update
  // (docs/operations.md, "CPUs").
  uint32_t apply_threads = 0;
  // A worker whose process stays stopped (SIGSTOP/SIGTSTP, or a tracer)
  // this long is evicted: its session ends and its buffers are unmapped;
  // its entry is reused once its process frees it or dies (0: never evict).
  uint32_t stopped_worker_timeout_ms = 5000;
  // Lines above this severity are not written (--log-level).
  LogLevel log_level = LogLevel::kInfo;
  // Checkpoints (server/src/checkpoint.hpp): off while checkpoint_dir is
  // empty. Written every `checkpoint_every` applied updates and/or every
  // `checkpoint_interval_s` seconds (0: that trigger off), and at shutdown;
  // the newest `checkpoint_keep` (1..kMaxCheckpointKeep) are kept. At
  // start the newest valid one is restored.
  std::string checkpoint_dir;
  uint64_t checkpoint_every = 0;
  uint32_t checkpoint_interval_s = 0;
  uint32_t checkpoint_keep = 3;
  // Averaging this server's weight deltas with other hosts' servers
  // (federation.hpp; docs/federation.md): off with kind kNone.
  FederationConfig federation;
};

// Checks what Server::create() would refuse before touching the system:
// optimizer hyperparameters, the tensors (shm::validate_tensors()), the
// init scale (finite, > 0 for normal/uniform), ring capacity, worker and
// buffer limits. Errors: kInvalidArgument whose message starts with the
// option ("--ring-capacity must be ..."), so parse_options() can point at the
// config-file line that set it.
Status validate(const ServerConfig& config);

// The bytes each worker's registered buffers may span together:
// config.max_worker_buffer_bytes, or for auto (0) max(kAutoWorkerBufferFactor
// x 4 x the tensors' elements, kMinAutoWorkerBufferBytes). Reentrant.
uint64_t worker_buffer_budget(const ServerConfig& config);

// Reads an --init-file as the server starts from it: a regular file
// (opened without blocking, so a FIFO is refused rather than waited on) of
// exactly 4 * total_elements bytes of raw little-endian fp32, all finite.
// Read in chunks, so neither a check nor a start holds a copy of the model.
// Each chunk, once checked, goes to `sink` in order (`first`: the index of
// values[0]); an error `sink` returns ends the read with it. Without a sink
// the file is only checked (--check-config). A sink may have seen the
// chunks before a later one fails the read. Errors: kIo naming the path
// with the errno text (cannot open, read failed), kInvalidArgument (not a
// regular file, the wrong size, NaN or Inf), the sink's. Reentrant.
using WeightsSink = std::function<Status(uint64_t first, std::span<const float> values)>;
Status read_init_file(const std::string& path, uint64_t total_elements, const WeightsSink& sink = {});

}  // namespace shmps::server
