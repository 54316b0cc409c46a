// shmps-inspect's model: a plain, private snapshot of a control segment
// image (a live read-only mapping or a copy read from a file), its JSON form
// and its text rendering. Every value read from the image is untrusted: the
// decoder bounds every index itself, so it is safe on any bytes. A snapshot
// of a live segment is racy (each field is read once, the set is not
// consistent). Functions are thread-safe; they only read the image.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "inspect_source.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/status.hpp"

namespace shmps::inspect {

struct HeaderView {
  uint64_t magic = 0;
  uint32_t layout_version = 0;
  uint32_t header_size = 0;
  uint64_t segment_size = 0;
  uint64_t generation = 0;
  uint32_t server_pid = 0;
  uint64_t server_start_time = 0;            // clock ticks since boot
  bool server_alive = false;                 // process_alive(pid, start time) on this host, now; false for start time 0
                                             // and for a live object its process does not hold (judge_server_lock)
  bool server_stopped = false;               // alive but stopped (SIGSTOP, SIGTSTP, a tracer): it serves nothing
  std::optional<bool> server_holds_object;   // judge_server_lock's answer for a live process; else empty
  bool server_unseen = false;                // judge_server_lock: no process here is the pid and start time, but
                                             // one holds the object's flock (a server in a pid namespace below
                                             // this one, or one starting)
  std::optional<double> server_uptime_s;     // since server_start_time, by this host's clock; while alive
  uint32_t server_state = 0;                 // shm::ServerState, unchecked
  uint64_t heartbeat_ns = 0;                 // CLOCK_MONOTONIC
  std::optional<uint64_t> heartbeat_age_ms;  // empty when the heartbeat lies in the future
  uint32_t tensor_count = 0;
  uint32_t max_workers = 0;
  uint32_t max_buffers = 0;
  uint32_t lane_capacity = 0;
  uint64_t total_elements = 0;
  std::vector<uint64_t> doorbell;  // the lane bitmap words
};

struct ConfigView {
  uint32_t optimizer_kind = 0;  // shm::OptimizerKind, unchecked
  uint32_t flags = 0;           // shm::kConfig*
  float lr = 0, momentum = 0, dampening = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
  uint32_t backend = 0;  // shm::Backend, unchecked
  uint64_t max_staleness = 0;
  uint32_t staleness_policy = 0;  // shm::StalenessPolicy, unchecked
};

// The weights' CUDA IPC export (SegmentHeader::weights_export), when the
// server runs the CUDA backend. The handle itself is not shown.
struct WeightsExportView {
  std::string device_uuid;  // "GPU-xxxxxxxx-...", as nvidia-smi -L prints it
  uint64_t allocation_bytes = 0;
  uint64_t weights_bytes = 0;
};

struct TensorView {
  uint32_t id = 0;
  std::string name;  // printable (see printable_name)
  uint32_t dtype = 0;
  uint32_t ndim = 0;
  std::vector<uint64_t> shape;  // min(ndim, kMaxDims) dims
  uint64_t element_offset = 0;
  uint64_t element_count = 0;
};

struct BufferView {
  uint32_t id = 0;
  uint32_t kind = 0;  // shm::BufferKind, unchecked
  uint32_t flags = 0;
  uint64_t length = 0;             // bytes
  uint64_t offset = 0;             // bytes
  std::string name;                // kHostShm: the object name, printable (printable_name); kCudaIpc: ""
  bool name_unterminated = false;  // the name had no NUL: `name` ends in " (unterminated)"
  std::string device_uuid;         // kCudaIpc: 32 hex digits; otherwise ""
};

struct WorkerView {
  uint32_t id = 0;
  uint32_t pid = 0;    // from the owner word
  uint32_t state = 0;  // shm::WorkerState, unchecked
  uint64_t pid_start_time = 0;
  bool pid_alive = false;    // process_alive(pid, pid_start_time) on this host, now (start time 0: any process at pid)
  bool pid_stopped = false;  // alive but stopped (SIGSTOP, a tracer): the server evicts it after a while
  uint64_t lease = 0;
  uint64_t pushes_applied = 0;
  uint64_t pushes_rejected = 0;
  uint64_t pulls = 0;
  uint64_t applied_bytes = 0;                   // of its applied pushes
  uint64_t pulls_waited = 0;                    // held back by --staleness-policy wait
  uint64_t wait_ns = 0;                         // their time held, in all
  uint64_t pulls_timed_out = 0;                 // held past their wait
  uint64_t pushes_scaled = 0;                   // applied with a reduced lr
  uint64_t scale_factor_sum_micro = 0;          // their lr factors, in millionths
  uint64_t last_request_ns = 0;                 // 0: none yet
  std::optional<uint64_t> last_request_age_ms;  // empty when none or in the future
  std::vector<BufferView> buffers;              // the non-empty descriptors
  // Whether the counters above (pushes_applied .. scale_factor_sum_micro)
  // and last_request_ns are shown: only for an attached entry. The server
  // zeroes the counters when it attaches an entry (server/src/sessions.cpp),
  // so a claimed one still holds an earlier session's under the new pid,
  // and a detached one a session that has ended.
  bool counters_shown() const { return state == static_cast<uint32_t>(shm::WorkerState::kAttached); }
};

// A request lane (Request slots) or a completion queue (Completion slots).
template <typename Slot>
struct QueueView {
  uint32_t worker = 0;
  uint64_t head = 0;              // consumer's index
  uint64_t tail = 0;              // producer's index
  uint64_t depth = 0;             // tail - head (meaningless when corrupt)
  bool corrupt = false;           // tail - head > capacity: the slots are not decoded
  std::vector<uint64_t> indices;  // free-running index of each pending slot shown
  std::vector<Slot> slots;        // copies of the first pending slots (RingReading::max_slots), in order
  uint64_t not_shown = 0;         // pending slots past those (depth - slots.size()); 0 when corrupt
};
using LaneView = QueueView<shm::Request>;
using CompletionQueueView = QueueView<shm::Completion>;

// One of the StatsBlock's histograms (layout.hpp, Histogram).
struct HistogramView {
  uint64_t count = 0, sum = 0, max = 0;
  std::vector<uint64_t> buckets;  // shm::kHistogramBuckets
  // The upper bound of the bucket holding the q-quantile (0 < q <= 1) of
  // the counted values, capped at max; empty when nothing was counted.
  std::optional<uint64_t> quantile(double q) const;
};

// The StatsBlock's counters (layout.hpp, SHMPS_STATS_BLOCK_COUNTERS) and
// histograms (SHMPS_STATS_HISTOGRAMS).
struct StatsView {
#define SHMPS_STATS_FIELD(name, kind, help) uint64_t name = 0;
  SHMPS_STATS_BLOCK_COUNTERS(SHMPS_STATS_FIELD)
#undef SHMPS_STATS_FIELD
  std::vector<uint64_t> rejected;  // by ErrorCode value, shm::kRejectCauses entries
#define SHMPS_STATS_HISTOGRAM(name, unit, help) HistogramView name;
  SHMPS_STATS_HISTOGRAMS(SHMPS_STATS_HISTOGRAM)
#undef SHMPS_STATS_HISTOGRAM
};

// The object (or --file) the snapshot was taken from: its owner and mode,
// and, for a live segment, whether a worker of this process's user (with
// the default server user) would trust it: shm::trusted_owners,
// check_owner_and_mode and check_group_access, the worker's own rules.
struct ObjectView {
  uint32_t uid = 0, gid = 0;
  std::string owner;            // "alice:staff" (shm::owner_text)
  std::string mode;             // "0600"
  std::optional<bool> trusted;  // absent for a --file copy: not judged
  std::string trust_problem;    // the worker's refusal, when not trusted
};
// `config_flags`: the snapshot's (kConfigGroupAccess).
ObjectView judge_object(const std::string& path, uint32_t uid, uint32_t gid, uint32_t mode, uint32_t config_flags,
                        bool live);

struct Snapshot {
  std::string source;                // "/dev/shm/shmps.<name>" or the file's path
  std::optional<ObjectView> object;  // set by the caller (take_snapshot sees bytes only)
  uint64_t taken_ns = 0;             // CLOCK_MONOTONIC when it was taken
  HeaderView header;
  ConfigView config;
  std::optional<WeightsExportView> weights_export;  // absent with the host backend
  std::vector<TensorView> tensors;
  std::vector<WorkerView> workers;               // entries that are not free
  RingReading rings;                             // what of the rings was read and decoded
  std::vector<LaneView> lanes;                   // request lanes that are not empty (or corrupt)
  std::vector<CompletionQueueView> completions;  // queues of entries in use, or with indices != 0
  StatsView stats;
};

// For a snapshot of the live object (device, inode): a serving server
// holds an exclusive flock on its segment's object, so a server process
// that is alive but holds none on this one is not serving it (a copy of
// its segment under another name): server_holds_object false, and
// server_alive false with no uptime. A pid and start time that name no
// process here while some process holds the object's flock is
// server_unseen: a server in a pid namespace below this one (a container
// sharing /dev/shm, seen from the host), or a server starting under the
// name. /proc/locks leaves out the locks of processes this pid namespace
// does not see: from inside a container, a live server of the host reads
// as dead. Unchanged where /proc/locks cannot be read. Not for a --file copy. `flocks`:
// the flocks to judge by, for a caller that judges many segments; by
// default /proc/locks is read for it.
void judge_server_lock(Snapshot* snapshot, uint64_t device, uint64_t inode, const shm::FlockTable* flocks = nullptr);

// Validates the image (validate_segment) and decodes it. `size` is the
// image's length in bytes; `base` must be 64-byte aligned. `rings`: what
// of each ring to decode, as the image was loaded with (load_segment,
// load_file). Errors: kLayoutMismatch (corrupt, foreign or other version;
// the message names the problem), kServerNotRunning (not published yet).
Result<Snapshot> take_snapshot(const void* base, size_t size, const std::string& source, RingReading rings = {});

nlohmann::json to_json(const Snapshot& snapshot);

// What changed per second between two snapshots of one server (--watch):
// in total and per worker session (same entry, pid and lease in both,
// attached in both). A rate is empty (unknown: "-" in text, null in
// JSON) when its counter went back between the two snapshots: a restart
// under the same generation cannot happen, so that is a garbage write.
struct Rates {
  using Rate = std::optional<double>;
  double seconds = 0;  // between the two snapshots
  Rate pushes, pulls, bytes, requests;
  std::vector<std::pair<std::string, Rate>> rejected;  // by cause, those that moved
  struct Worker {
    uint32_t id = 0;
    uint32_t pid = 0;
    Rate pushes, rejected, pulls, bytes;
  };
  std::vector<Worker> workers;
};
// Empty when the snapshots are of different server generations or no time
// passed between them.
std::optional<Rates> rates_between(const Snapshot& before, const Snapshot& after);
std::string render_rates_text(const Rates& rates);
nlohmann::json rates_json(const Rates& rates);
// The human-readable report; one section per part of the segment:
// "== header ==", "== config ==", "== tensors", "== workers", "== request
// lanes", "== completion queues", "== stats ==".
std::string render_text(const Snapshot& snapshot);
// The Prometheus text exposition format (version 0.0.4): every StatsBlock
// counter as shmps_<name>[_total] with its HELP and TYPE, rejections by
// cause, per-worker counters of attached entries (labels worker, pid),
// liveness (shmps_up, shmps_server_stopped), shmps_inspect_error (all 0: read),
// identity (shmps_info) and the config a dashboard needs; every sample
// labelled name="<name>". For the node exporter's textfile collector.
std::string render_prometheus(const Snapshot& snapshot, const std::string& name);
// Why a segment could not be read, as --format prometheus labels it
// (shmps_inspect_error{reason}): no access (kPermission), foreign,
// corrupt or of another layout version (kBadSegment, exit 3), not
// published (kUnpublished, exit 4), a <name> no server can take (kUsage,
// exit 1: the command line to fix), any other failure (kIo). kNone: read,
// or no segment at all (a server that is down).
enum class ReadError : uint8_t { kNone, kPermission, kBadSegment, kUnpublished, kIo, kUsage };
// What --format prometheus prints without a snapshot: shmps_up 0 (no
// server seen serving the segment), so a scrape of the textfile never
// keeps a server's last values, and shmps_inspect_error 1 for `error`'s
// reason (0 for the others), which tells a segment the tool could not read
// from a server that is down.
std::string render_prometheus_down(const std::string& name, ReadError error);

// Names of raw enum values; "unknown(N)" outside the enum.
std::string opcode_name(uint32_t opcode);
std::string server_state_name(uint32_t state);
std::string worker_state_name(uint32_t state);
std::string optimizer_name(uint32_t kind);
std::string backend_name(uint32_t backend);
std::string dtype_name(uint32_t dtype);
std::string buffer_kind_name(uint32_t kind);
std::string error_name(uint32_t code);  // shmps::error_code_name, or unknown(N)
// "0x0123456789abcdef" (magic, generation and leases, in text and JSON):
// the project's shmps::hex64 (status.hpp).
using shmps::hex64;
// The config flags as "nesterov,amsgrad", "none", unknown bits as 0x...
std::string config_flags_text(uint32_t flags);
// The bytes up to the first NUL within `n` (all n and " (unterminated)"
// appended when there is none), with every byte outside printable ASCII,
// the backslash and the double quote written as \xNN: safe for a
// terminal, for JSON, and between the text's quotes.
std::string printable_name(const void* bytes, size_t n);
// All of `text` escaped as printable_name() escapes a name (no NUL rule):
// for names from elsewhere, e.g. the files in /dev/shm that --list shows.
// `keep_high`: bytes from 0x80 up are kept as they are (a Prometheus label
// carries UTF-8).
std::string printable_text(std::string_view text, bool keep_high = false);

}  // namespace shmps::inspect
