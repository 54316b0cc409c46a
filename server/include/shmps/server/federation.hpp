// Federation: one shmps-server per host, each with a full replica of the
// weights, averaging the hosts' weight deltas every period over an existing
// engine (docs/federation.md). This header holds what a configuration and
// an embedder see: the options and the engine seam. A FederationEngine is
// used by one thread at a time (the server's federation thread); its
// collectives must be called in the same order on every member.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "shmps/status.hpp"

namespace shmps::server {

enum class FederationKind { kNone = 0, kMpi = 1 };

// How the averaged delta moves the anchor (the outer step): plain
// averaging (Local SGD: A' = A + mean delta), or PyTorch's SGD with
// Nesterov momentum on the pseudo-gradient -mean delta (DiLoCo).
enum class OuterStep { kAverage = 0, kNesterov = 1 };

struct FederationConfig {
  FederationKind kind = FederationKind::kNone;
  // A round starts `every_ms` after the previous one's collectives ended
  // (together on every host), and earlier once `every_versions` local
  // updates were applied since the last snapshot (0: no such trigger; an
  // early round waits in its first collective for the others' timers).
  uint32_t every_ms = 250;
  uint64_t every_versions = 0;
  OuterStep outer = OuterStep::kAverage;
  float outer_lr = 0.7f;        // kNesterov only
  float outer_momentum = 0.9f;  // kNesterov only
  // Weight each host's delta by its local updates of the round, so that
  // an idle host does not dilute the average; false: a plain mean.
  bool weight_by_updates = true;
  // Apply local pushes while a round exchanges (true), or hold them from
  // the snapshot until the merge (pulls are served either way).
  bool overlap = true;
  // The most local updates since the last merged snapshot (0: no cap);
  // beyond it the server holds pushes until the next round merges.
  uint64_t max_drift = 0;
  // Append ".r<rank>" to --name, and "/r<rank>" to --checkpoint-dir
  // (several "hosts" on one machine).
  bool rank_in_name = false;
};

// Each option value's name ("none", "mpi"; "average", "nesterov"), and
// back: false for a text that names none.
const char* federation_kind_name(FederationKind kind) noexcept;
const char* outer_step_name(OuterStep step) noexcept;
bool parse_federation_kind(std::string_view text, FederationKind* out) noexcept;
bool parse_outer_step(std::string_view text, OuterStep* out) noexcept;

// Who this host is in the group; epoch counts re-formations (0 for an
// engine with static membership).
struct Membership {
  uint64_t epoch = 0;
  uint32_t rank = 0;
  uint32_t size = 1;
};

// The seam between the federation's rounds and the engine that carries
// them. Each call is collective: every member makes it, in the same order,
// with the same sizes. Errors: kIo naming the engine's failure (a member
// gone, a timeout); the round that saw it is abandoned.
class FederationEngine {
 public:
  virtual ~FederationEngine() = default;
  virtual const char* name() const noexcept = 0;
  virtual Membership membership() const noexcept = 0;
  // Sums `data` element-wise over all members, in place. Every member must
  // get the same bits (the rounds check it through the anchors' hash).
  virtual Status allreduce_sum(std::span<float> data) = 0;
  // Each member's `mine` (all the same size), in rank order, into `all`
  // (size() * mine.size() bytes).
  virtual Status allgather(std::span<const std::byte> mine, std::span<std::byte> all) = 0;
  // `data` of member `root` into every member's `data`.
  virtual Status broadcast(std::span<std::byte> data, uint32_t root) = 0;
};

// The engine --federation names, joined to its group (MPI: MPI_Init_thread,
// ranks from the launcher). Errors: kInvalidArgument for kNone, kIo when
// the engine cannot start or was not built in (the message says which
// package to install). At most one MPI engine per process.
Result<std::unique_ptr<FederationEngine>> make_federation_engine(FederationKind kind);

}  // namespace shmps::server
