// Federation: one shmps-server per host, each with a full replica of the
// weights, averaging the hosts' weight deltas every period over an existing
// engine (docs/federation.md). This header holds what a configuration and
// an embedder see: the options and the engine seam. A FederationEngine is
// used by one thread at a time (the server's federation thread); its
// collectives must be called in the same order on every member.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shmps/status.hpp"

namespace shmps::server {

enum class FederationKind { kNone = 0, kMpi = 1, kGloo = 2 };

// How the averaged delta moves the anchor (the outer step): plain
// averaging (Local SGD: A' = A + mean delta), or PyTorch's SGD with
// Nesterov momentum on the pseudo-gradient -mean delta (DiLoCo).
enum class OuterStep { kAverage = 0, kNesterov = 1 };

// How the federation's threads (the round loop, and the engine's own where
// it starts them from it: Gloo's) are scheduled against local serving
// (docs/federation.md, "Running it"): as every thread (kNormal); at nice
// 19 (kLow); or under SCHED_IDLE (kIdle), on a CPU only when nothing else
// wants it. Lowered, a round waits for CPU time that serving leaves.
enum class FederationPriority { kNormal = 0, kLow = 1, kIdle = 2 };

struct FederationConfig {
  FederationKind kind = FederationKind::kNone;
  // A round starts `every_ms` after the previous one's collectives ended
  // (together on every host), and earlier once `every_versions` local
  // updates were applied since the last snapshot (0: no such trigger; an
  // early round waits in its first collective for the others' timers).
  // 1..kMaxFederationEveryMs.
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
  // The most local updates not yet in a merged round (0: no cap); beyond
  // it the server holds pushes until the next round merges.
  uint64_t max_drift = 0;
  FederationPriority priority = FederationPriority::kNormal;
  // The CPUs the federation's threads (the round loop and the engine's
  // own) may run on, ascending and distinct; empty: those the server
  // starts with. Off the cores that serve the workers, rounds take no CPU
  // time from serving (docs/federation.md, figure 4).
  std::vector<uint32_t> cpus;
  // Append ".r<host>" to --name, and "/r<host>" to --checkpoint-dir
  // (several "hosts" on one machine; the host is the MPI rank, or --fed-host).
  bool rank_in_name = false;

  // Gloo (elastic membership). The job's store, where the hosts agree on
  // each membership epoch: "file:DIR" (a directory every host sees) or
  // "redis:HOST:PORT[/JOB]"; a fresh DIR or JOB per job (its keys are
  // written once and never deleted).
  std::string store;
  uint32_t hosts = 0;  // the job's hosts, ids 0..hosts-1 (at most kMaxFederationHosts)
  uint32_t host = 0;   // this host's id
  // The address this host's collectives listen on (an interface's
  // address that the other hosts reach).
  std::string address = "127.0.0.1";
  // A collective or a rendezvous waiting longer than this fails: the host
  // it waits for is taken as hung, and the group re-forms without it.
  uint32_t timeout_ms = 5000;
};

inline constexpr uint32_t kMaxFederationHosts = 64;
inline constexpr uint32_t kMaxFederationEveryMs = 3'600'000;  // an hour

// Each option value's name ("none", "mpi", "gloo"; "average", "nesterov";
// "normal", "low", "idle"), and back: false for a text that names none.
const char* federation_kind_name(FederationKind kind) noexcept;
const char* outer_step_name(OuterStep step) noexcept;
const char* federation_priority_name(FederationPriority priority) noexcept;
bool parse_federation_kind(std::string_view text, FederationKind* out) noexcept;
bool parse_outer_step(std::string_view text, OuterStep* out) noexcept;
bool parse_federation_priority(std::string_view text, FederationPriority* out) noexcept;
// A CPU list as `taskset -c` writes it ("3", "0,2-5"), each CPU below
// kMaxCpus, into ascending distinct CPUs; false for any other text (an
// empty one too). And back, in the same form.
inline constexpr uint32_t kMaxCpus = 1024;  // CPU_SETSIZE
bool parse_cpu_list(std::string_view text, std::vector<uint32_t>* out);
std::string cpu_list_text(const std::vector<uint32_t>& cpus);

// Who this host is in the group: its rank in the current epoch, and its
// id, which stays (the MPI rank; Gloo's --fed-host). The epoch counts
// formations of the group (0 for an engine with static membership): one
// epoch is one group of the job, never reused, and it changes only in
// reform(), so that a round and its epoch name one allreduce (the join
// tells by them whether a round a host saw fail was merged elsewhere).
struct Membership {
  uint64_t epoch = 0;
  uint32_t rank = 0;
  uint32_t size = 1;
  uint32_t host = 0;
};

// The seam between the federation's rounds and the engine that carries
// them. Each call is collective: every member makes it, in the same order,
// with the same sizes. Errors: kIo naming the engine's failure (a member
// gone, a timeout); the round that saw it is abandoned. An elastic engine
// then forms a new group (reform()) and the members join again; a static
// one ends federation.
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

  // Whether the group can re-form after a member died, hung or left.
  virtual bool elastic() const noexcept { return false; }
  // Whether destroying the engine waits until every member of the job has
  // closed its own (MPI_Finalize): a stopped host's process then outlives
  // its stop, serving nothing, for as long as the others run.
  virtual bool close_waits_for_every_member() const noexcept { return false; }
  // What one reform() did.
  enum class Reform {
    kFormed,   // a group of a new epoch, this host in it (membership())
    kPaused,   // the hosts there are no majority of the last epoch's members: try again later
    kFailed,   // the hosts did not agree, or the store or a rendezvous failed: try again
    kRefused,  // this host cannot be in any group as configured (another server has its host id): give up
    // This host could not connect to the group it tried to join (a host
    // others cannot reach): the engine waits before its next try, longer
    // after each in a row (`why` says how long); try again.
    kBackedOff,
  };
  // An elastic engine: one attempt at forming the group of a new epoch
  // with the hosts that want to be in it, bounded by the engine's
  // timeouts, preceded by the wait that an earlier kBackedOff announced,
  // and given up (kFailed) once `cancelled` says so; not collective (the
  // others run theirs meanwhile). `why` says what happened unless kFormed.
  virtual Reform reform(std::string* why, const std::function<bool()>& /*cancelled*/) {
    *why = std::string(name()) + " cannot re-form";
    return Reform::kFailed;
  }
  // After a join: the group's longest round period, which a round's
  // first collective may wait for (the others' timers) beyond a timeout.
  virtual void set_group_period_ms(uint32_t /*ms*/) {}
  // An elastic engine, once per round: whether a host waits to join (the
  // members then re-form together, when any of them saw it).
  virtual bool joiner_waiting() { return false; }
};

// The engine config.kind names (MPI: MPI_Init_thread, joined to the
// launcher's group; Gloo: its device and store, the group formed later by
// reform()). Errors: kInvalidArgument for kNone, kIo when the engine
// cannot start or was not built in (the message says which package to
// install). At most one MPI engine per process.
Result<std::unique_ptr<FederationEngine>> make_federation_engine(const FederationConfig& config);

}  // namespace shmps::server
