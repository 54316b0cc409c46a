// The binary layout of a shmps control segment ("/dev/shm/shmps.<name>").
// This header is the only description of those bytes: plain structs of
// fixed-width integers and lock-free atomics, offsets (never pointers),
// sizes and offsets pinned by static_assert and by tests/shm/test_layout.cpp.
// Process-safety: every field names its single writer; everything a process
// reads that another wrote must be validated before use (see segment.hpp).
//
//   offset 0                +----------------------------------------------+
//                           | SegmentHeader                      4096 B    |
//                           |   magic, layout_version (published last),    |
//                           |   section offsets/sizes, server pid +        |
//                           |   start time, generation, state, heartbeat,  |
//                           |   ConfigBlock, doorbell bitmap, server wake, |
//                           |   WeightsExportBlock (CUDA backend)          |
//   tensor_table_offset     +----------------------------------------------+
//                           | TensorDesc[tensor_count]          128 B each |
//   worker_table_offset     +----------------------------------------------+
//                           | WorkerEntry[max_workers]  worker_entry_size  |
//                           |   = 512 B + BufferDesc[max_buffers] (192 B)  |
//   lanes_offset            +----------------------------------------------+
//                           | request lane per worker          lane_stride |
//                           |   LaneHeader 256 B + Request[lane_capacity]  |
//                           |   (64 B each; worker produces, server        |
//                           |   consumes: single-producer single-consumer) |
//                           |   + uint64 publish_ns[lane_capacity]         |
//   completions_offset      +----------------------------------------------+
//                           | completion queue per worker completion_stride|
//                           |   LaneHeader 256 B + Completion[capacity]    |
//                           |   (128 B each; server produces, worker       |
//                           |   consumes)                                  |
//   stats_offset            +----------------------------------------------+
//                           | StatsBlock                         2176 B    |
//   segment_size            +----------------------------------------------+
// Every section starts on a 64-byte boundary.
//
// WHEN TO BUMP kLayoutVersion: any field added, removed, moved, resized or
// given a new meaning, any change to a constant below or to the section
// order. tests/shm/test_layout.cpp pins the numbers and fails until you do.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <type_traits>

#include "shmps/server_stats.hpp"

namespace shmps::shm {

inline constexpr uint64_t kMagic = 0x31474553504d4853ull;  // "SHMPSEG1" little-endian
// 3: StatsBlock::workers_evicted. 4: SegmentHeader::weights_export, kBufferInProcess.
// 5: Completion::message is written only when code != 0. 6: Opcode::kInit.
// 7: kConfigGroupAccess (workers check the segment's mode against it);
//    StatsBlock::applied_bytes, WorkerEntry::applied_bytes; StatsBlock's
//    histograms (2048 B); each lane's publish_ns[] after its requests.
// 8: ConfigBlock::staleness_policy; Request::wait_ns (kPull); 32 counter
//    slots in StatsBlock (the staleness policies' and apply_threads);
//    WorkerEntry::pulls_waited, wait_ns, pushes_scaled.
// 9: StatsBlock's fed_* counters (federation); StatsReply's but fed_pushes_held.
// 10: StatsBlock::fed_epoch (the Gloo engine's membership).
// 11: WorkerEntry::cancel_request (a reserved word before), ErrorCode::kInterrupted.
// 12: StatsBlock::fed_state, scheduled_lr_pico (--lr-schedule),
//     checkpoints_written, checkpoint_failures; 48 counter slots
//     (StatsBlock 2176 B).
// 13: Completion::flags (a reserved word before): kCompletionMessageCut.
// 14: StatsBlock::checkpoints_deferred (a reserved counter slot before).
// 15: WorkerState::kReleasing (an entry is given back through it).
// 16: StatsBlock::ipc_handles_opened, ipc_handles_closed (reserved counter
//     slots before).
inline constexpr uint32_t kLayoutVersion = 16;
inline constexpr size_t kCacheLine = 64;

inline constexpr uint32_t kMaxWorkersLimit = 256;  // 4 doorbell words
inline constexpr uint32_t kMaxBuffersLimit = 64;   // per worker
inline constexpr uint32_t kMaxTensorsLimit = 4096;
inline constexpr uint32_t kMaxLaneCapacity = 1u << 16;
inline constexpr uint32_t kMaxDims = 4;
inline constexpr size_t kNameBytes = 64;  // tensor and shm object names, NUL-padded
inline constexpr uint32_t kAllTensors = 0xFFFFFFFFu;

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// The project's vocabulary is declared here, where the wire format lives;
// the mirrors in other layers (shmps::Dtype, kernels::GradDtype,
// kernels::OptimizerKind, shmps::kAllTensors) are tied to it with
// static_assert where both are seen, and the name tables below name them
// for the server's logs and for shmps-inspect.
enum class ServerState : uint32_t { kStarting = 1, kRunning = 2, kStopping = 3, kStopped = 4 };
enum class Backend : uint32_t { kHost = 1, kCuda = 2 };
enum class Dtype : uint32_t { kF32 = 1, kF16 = 2, kBF16 = 3 };
inline constexpr uint32_t kDtypeMax = 3;
// ConfigBlock::optimizer_kind.
enum class OptimizerKind : uint32_t { kSgd = 1, kAdam = 2, kAdamW = 3 };
inline constexpr uint32_t kOptimizerKindMax = 3;

enum class Opcode : uint32_t {
  kAttach = 1,  // -> value = lease
  kDetach = 2,
  kRegisterBuffer = 3,  // buffer_id names the BufferDesc the worker filled
  kUnregisterBuffer = 4,
  kPush = 5,   // -> version after the update, value = staleness
  kPull = 6,   // -> version of the snapshot copied out
  kStats = 7,  // server fills WorkerEntry::stats_reply first
  kPing = 8,   // empty request
  kInit = 9,   // weights at version 0 from buffer_id (all tensors, fp32); once, before any push applies
};
inline constexpr uint32_t kOpcodeMax = 9;

// Names, by value; nullptr outside the enum (a reader of untrusted bytes
// prints the number then).
constexpr const char* dtype_name(uint32_t dtype) {
  constexpr const char* kNames[] = {nullptr, "f32", "f16", "bf16"};
  return dtype <= kDtypeMax ? kNames[dtype] : nullptr;
}
// Bytes per element; 0 outside the enum.
constexpr uint32_t dtype_size(uint32_t dtype) {
  constexpr uint32_t kSizes[] = {0, 4, 2, 2};
  return dtype <= kDtypeMax ? kSizes[dtype] : 0;
}
constexpr const char* opcode_name(uint32_t opcode) {
  constexpr const char* kNames[] = {nullptr, "attach", "detach", "register_buffer", "unregister_buffer", "push", "pull",
                                    "stats", "ping",   "init"};
  static_assert(std::size(kNames) == kOpcodeMax + 1);
  return opcode <= kOpcodeMax ? kNames[opcode] : nullptr;
}
constexpr const char* optimizer_kind_name(uint32_t kind) {
  constexpr const char* kNames[] = {nullptr, "sgd", "adam", "adamw"};
  static_assert(std::size(kNames) == kOptimizerKindMax + 1);
  return kind <= kOptimizerKindMax ? kNames[kind] : nullptr;
}
constexpr const char* backend_name(uint32_t backend) {
  constexpr const char* kNames[] = {nullptr, "host", "cuda"};
  return backend <= 2 ? kNames[backend] : nullptr;
}
constexpr const char* server_state_name(uint32_t state) {
  constexpr const char* kNames[] = {nullptr, "starting", "running", "stopping", "stopped"};
  return state <= 4 ? kNames[state] : nullptr;
}

// Worker table entry states (low 32 bits of WorkerEntry::owner).
enum class WorkerState : uint32_t {
  kFree = 0,       // unused; a worker may claim it
  kClaimed = 1,    // a worker (pid in owner) claimed it and is attaching
  kAttached = 2,   // the server accepted the attach; lease is valid
  kDetached = 3,   // the server finished the detach; the worker releases it
  kReleasing = 4,  // being given back (WorkerEntry::owner): its words cleared, then kFree
};
inline constexpr uint64_t make_owner(uint32_t pid, WorkerState s) {
  return (uint64_t{pid} << 32) | static_cast<uint32_t>(s);
}
inline constexpr uint32_t owner_pid(uint64_t owner) { return static_cast<uint32_t>(owner >> 32); }
inline constexpr uint32_t owner_state(uint64_t owner) { return static_cast<uint32_t>(owner); }
constexpr const char* worker_state_name(uint32_t state) {
  constexpr const char* kNames[] = {"free", "claimed", "attached", "detached", "releasing"};
  return state <= 4 ? kNames[state] : nullptr;
}

// A futex-backed wait point: `seq` is the futex word, bumped by every
// notify; `waiters` counts sleepers so a notifier can skip the syscall.
// Protocol in futex.hpp.
struct WaitWord {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> waiters;
};
static_assert(sizeof(WaitWord) == 8);

// The server's configuration as it runs. Written by the server before it
// publishes layout_version; lr, max_staleness and staleness_policy are rewritten (relaxed
// atomic_ref stores, never torn) when SIGHUP reloads them. Read by workers
// and shmps-inspect for display; the server keeps its own copy.
struct ConfigBlock {
  uint32_t optimizer_kind;  // shmps::kernels::OptimizerKind
  uint32_t flags;           // kConfigFlag*
  float lr;
  float momentum;
  float dampening;
  float weight_decay;
  float beta1;
  float beta2;
  float eps;
  uint32_t backend;  // Backend
  uint64_t max_staleness;
  uint32_t staleness_policy;  // StalenessPolicy; rewritten on reload as max_staleness is
  uint32_t reserved32;
  uint64_t reserved[9];
};
// What the server does with work that is more than max_staleness behind
// (docs/design.md, "Staleness policies"). Values are part of the layout.
enum class StalenessPolicy : uint32_t {
  kReject = 0,  // a push more than max_staleness versions old is rejected (kStale)
  kWait = 1,    // SSP: a pull by a worker more than max_staleness clocks ahead of the slowest waits
  kScale = 2,   // every push is applied; past b = max(1, max_staleness) versions with lr * b / staleness
};
inline constexpr uint32_t kStalenessPolicyMax = 2;
// "reject", "wait", "scale"; nullptr outside the enum.
constexpr const char* staleness_policy_name(uint32_t policy) {
  constexpr const char* kNames[] = {"reject", "wait", "scale"};
  return policy <= kStalenessPolicyMax ? kNames[policy] : nullptr;
}
// StatsBlock::fed_state: where a federated server's federation stands.
// Values are part of the layout.
enum class FederationState : uint32_t {
  kOff = 0,      // not federated (--federation none), or stopping
  kForming = 1,  // forming its first group, or re-forming after a failed round
  kInGroup = 2,  // a member of a group, merging rounds
  kPaused = 3,   // no majority of the last group's hosts: serving its workers alone, trying again
  kEnded = 4,    // over for good (a misconfiguration, MPI's group broken): serving its workers alone
};
inline constexpr uint32_t kFederationStateMax = 4;
// "off", "forming", "in a group", "paused", "ended"; nullptr outside the enum.
constexpr const char* federation_state_name(uint32_t state) {
  constexpr const char* kNames[] = {"off", "forming", "in a group", "paused", "ended"};
  return state <= kFederationStateMax ? kNames[state] : nullptr;
}
inline constexpr uint32_t kConfigNesterov = 1u << 0;
inline constexpr uint32_t kConfigAmsgrad = 1u << 1;
inline constexpr uint32_t kConfigAllowNonFinite = 1u << 2;
// --group-access: the segment is mode 0660 and workers create their buffers
// 0660 in the segment's group; without it both are 0600 and a worker refuses
// a segment whose mode gives its group any access.
inline constexpr uint32_t kConfigGroupAccess = 1u << 3;
static_assert(sizeof(ConfigBlock) == 128);

// The weights' CUDA IPC export (CUDA backend): what a worker needs to map
// the server's weights itself with cudaIpcOpenMemHandle and read them on
// its own device, without a pull. Written by the server before it
// publishes layout_version and never changed afterwards (a new server
// start is a new generation with its own export); all zero with the host
// backend (flags without kWeightsExportPresent). The weights are fp32, all
// tensors in table order (TensorDesc::element_offset), from byte 0 of the
// allocation; total_elements * 4 bytes of it are meaningful.
// A mapping is READ-ONLY BY CONTRACT: CUDA IPC cannot map memory read-only,
// and the server's kernels write the weights while a reader reads them, so
// a reader sees a torn mix of versions unless it pulls (pull is the
// consistent path).
struct WeightsExportBlock {
  uint32_t flags;             // kWeightsExport*
  uint32_t dtype;             // Dtype of the weights (kF32)
  uint64_t allocation_bytes;  // size of the exported allocation (cudaMalloc, rounded up to 2 MiB)
  uint64_t weights_bytes;     // total_elements * 4: the part holding the weights
  uint8_t device_uuid[16];    // cudaDeviceProp::uuid of the device holding them
  uint8_t ipc_handle[64];     // cudaIpcMemHandle_t of the allocation
  uint64_t reserved[3];
};
inline constexpr uint32_t kWeightsExportPresent = 1u << 0;
static_assert(std::is_trivially_copyable_v<WeightsExportBlock> && std::is_standard_layout_v<WeightsExportBlock>);
static_assert(sizeof(WeightsExportBlock) == 128);
static_assert(offsetof(WeightsExportBlock, allocation_bytes) == 8);
static_assert(offsetof(WeightsExportBlock, weights_bytes) == 16);
static_assert(offsetof(WeightsExportBlock, device_uuid) == 24);
static_assert(offsetof(WeightsExportBlock, ipc_handle) == 40);

struct alignas(kCacheLine) SegmentHeader {
  // --- line 0: identity, written by the server before publication ---
  uint64_t magic;                        // kMagic
  std::atomic<uint32_t> layout_version;  // 0 until published. SYNC(segment_published)
  uint32_t header_size;                  // sizeof(SegmentHeader)
  uint64_t segment_size;                 // bytes, the whole mapping
  uint64_t generation;                   // new random value at every server start
  uint32_t server_pid;
  uint32_t reserved0;
  uint64_t server_start_time;          // /proc/<pid>/stat starttime (clock ticks)
  std::atomic<uint32_t> server_state;  // ServerState; server writes
  uint32_t reserved1;
  std::atomic<uint64_t> heartbeat_ns;  // CLOCK_MONOTONIC, server writes ~every 10 ms
  // --- lines 1-2: geometry ---
  uint64_t tensor_table_offset;
  uint32_t tensor_count;
  uint32_t tensor_desc_size;
  uint64_t worker_table_offset;
  uint32_t max_workers;
  uint32_t worker_entry_size;
  uint32_t max_buffers;    // per worker
  uint32_t lane_capacity;  // slots per request lane and completion queue
  uint64_t lanes_offset;
  uint64_t lane_stride;
  uint64_t completions_offset;
  uint64_t completion_stride;
  uint64_t stats_offset;
  uint64_t total_elements;  // all tensors, fp32 elements
  uint64_t reserved2[5];
  // --- lines 3-4: configuration ---
  ConfigBlock config;
  uint64_t reserved3[8];
  // --- line 6: written by workers: which lanes have news ---
  std::atomic<uint64_t> doorbell[kMaxWorkersLimit / 64];  // bit i: lane i was published. SYNC(doorbell)
  WaitWord server_wake;                                   // the server sleeps here when idle
  uint64_t reserved4[3];
  // --- lines 7-8: the weights' CUDA IPC export, server writes before publication ---
  WeightsExportBlock weights_export;
  uint8_t reserved5[4096 - 576];
};
static_assert(std::is_standard_layout_v<SegmentHeader>);
static_assert(sizeof(SegmentHeader) == 4096);
static_assert(offsetof(SegmentHeader, magic) == 0);
static_assert(offsetof(SegmentHeader, layout_version) == 8);
static_assert(offsetof(SegmentHeader, segment_size) == 16);
static_assert(offsetof(SegmentHeader, generation) == 24);
static_assert(offsetof(SegmentHeader, server_pid) == 32);
static_assert(offsetof(SegmentHeader, server_start_time) == 40);
static_assert(offsetof(SegmentHeader, server_state) == 48);
static_assert(offsetof(SegmentHeader, heartbeat_ns) == 56);
static_assert(offsetof(SegmentHeader, tensor_table_offset) == 64);
static_assert(offsetof(SegmentHeader, max_workers) == 88);
static_assert(offsetof(SegmentHeader, lane_capacity) == 100);
static_assert(offsetof(SegmentHeader, lanes_offset) == 104);
static_assert(offsetof(SegmentHeader, stats_offset) == 136);
static_assert(offsetof(SegmentHeader, total_elements) == 144);
static_assert(offsetof(SegmentHeader, config) == 192);
static_assert(offsetof(SegmentHeader, doorbell) == 384);
static_assert(offsetof(SegmentHeader, server_wake) == 416);
static_assert(offsetof(SegmentHeader, weights_export) == 448);
static_assert(offsetof(SegmentHeader, reserved5) == 576);

struct TensorDesc {
  char name[kNameBytes];     // NUL-terminated within the array
  uint32_t dtype;            // Dtype of the weights (kF32)
  uint32_t ndim;             // 1..kMaxDims
  uint64_t shape[kMaxDims];  // unused dims are 0
  uint64_t element_offset;   // in the flat parameter vector
  uint64_t element_count;    // product of shape
  uint64_t reserved;
};
static_assert(std::is_trivially_copyable_v<TensorDesc> && std::is_standard_layout_v<TensorDesc>);
static_assert(sizeof(TensorDesc) == 128);
static_assert(offsetof(TensorDesc, dtype) == 64);
static_assert(offsetof(TensorDesc, shape) == 72);
static_assert(offsetof(TensorDesc, element_offset) == 104);
static_assert(offsetof(TensorDesc, element_count) == 112);

enum class BufferKind : uint32_t { kEmpty = 0, kHostShm = 1, kCudaIpc = 2 };
constexpr const char* buffer_kind_name(uint32_t kind) {
  constexpr const char* kNames[] = {"empty", "host_shm", "cuda_ipc"};
  return kind <= 2 ? kNames[kind] : nullptr;
}

// BufferDesc::flags (kCudaIpc only; 0 otherwise). kBufferInProcess: the
// worker runs in the server's own process (tests, embedding), which cannot
// open its own IPC handles; `handle` then holds, as a little-endian uint64
// in its first 8 bytes, the token of the offer that holds the allocation's
// base pointer and event in the process's memory (in_process.hpp). The
// server takes it only when the worker's pid is its own, and only once.
inline constexpr uint32_t kBufferInProcess = 1u << 0;

// A buffer a worker offers the server, written by the worker into its own
// WorkerEntry before it sends kRegisterBuffer; read (and validated) by the
// server once, at registration.
struct BufferDesc {
  uint32_t kind;             // BufferKind
  uint32_t flags;            // kBuffer*
  uint64_t length;           // bytes usable by requests
  uint64_t offset;           // bytes from the start of the object/allocation
  uint8_t handle[64];        // kHostShm: NUL-terminated shm name; kCudaIpc: cudaIpcMemHandle_t
  uint8_t event_handle[64];  // kCudaIpc: cudaIpcEventHandle_t
  uint8_t device_uuid[16];   // kCudaIpc
  // The request_id of the kRegisterBuffer that carries this descriptor
  // (worker_lib writes it as it publishes the request); 0: not checked.
  // A registration that timed out and is served after the worker wrote
  // the id's descriptor anew is refused by it, not read for the new one.
  uint64_t request_id;
  uint64_t reserved[2];
};
static_assert(std::is_trivially_copyable_v<BufferDesc> && std::is_standard_layout_v<BufferDesc>);
static_assert(sizeof(BufferDesc) == 192);
static_assert(offsetof(BufferDesc, length) == 8);
static_assert(offsetof(BufferDesc, offset) == 16);
static_assert(offsetof(BufferDesc, handle) == 24);
static_assert(offsetof(BufferDesc, event_handle) == 88);
static_assert(offsetof(BufferDesc, device_uuid) == 152);
static_assert(offsetof(BufferDesc, request_id) == 168);

// What a kStats request returns: the server writes it into the requesting
// worker's entry, then publishes the completion (which orders it).
// One uint64_t per counter of shmps/server_stats.hpp, in its order.
#define SHMPS_STATS_COUNT(name, source, from) +1
inline constexpr size_t kServerStatsCount = 0 SHMPS_SERVER_STATS(SHMPS_STATS_COUNT);
#undef SHMPS_STATS_COUNT
// The 32 words of the entry's reply area are all in use: a further counter
// needs a larger area (a change of the layout).
struct StatsReply {
#define SHMPS_STATS_FIELD(name, source, from) uint64_t name;
  SHMPS_SERVER_STATS(SHMPS_STATS_FIELD)
#undef SHMPS_STATS_FIELD
};
static_assert(kServerStatsCount == 32, "the reply area holds 32 counters");
static_assert(std::is_trivially_copyable_v<StatsReply>);
static_assert(sizeof(StatsReply) == 256);
static_assert(offsetof(StatsReply, my_pulls) == 104);
static_assert(offsetof(StatsReply, workers_evicted) == 112);

struct WorkerEntry {
  // owner = (pid << 32) | WorkerState. Claimed by a worker with a CAS from
  // kFree, set to kAttached/kDetached by the server, given back by the
  // worker after a detach (or a failed attach), or by the server when the
  // owner is dead: a CAS from the word it judged to (pid, kReleasing), the
  // start time (and, by the server, the lease and buffer table) cleared,
  // then a CAS to kFree. The start time is cleared only while the word
  // says the entry is the releaser's, never over the next claimer's; a
  // releaser killed in kReleasing is judged by its pid alone.
  // SYNC(worker_claim) / SYNC(worker_release).
  std::atomic<uint64_t> owner;
  uint64_t pid_start_time;  // worker writes after claiming (0: not yet); cleared under kReleasing
  uint64_t lease;           // server writes at attach; requests must carry it
  // The last request id the worker had sent when it stopped waiting (its
  // wait was interrupted, or it detaches): the server answers kInterrupted
  // to a pull of an id up to it that it holds back (--staleness-policy
  // wait), so the rest of the lane (a detach) goes on. Worker writes, then
  // rings its doorbell; zeroed at claim and at attach (0: none); the server
  // only compares it with the id of the pull it holds for that worker, so
  // garbage can withdraw nothing but that worker's own held pulls.
  std::atomic<uint64_t> cancel_request;
  uint64_t reserved0[4];
  // --- line 1: counters, server writes (relaxed; monotonic, racy readers) ---
  std::atomic<uint64_t> pushes_applied;
  std::atomic<uint64_t> pushes_rejected;
  std::atomic<uint64_t> pulls;
  std::atomic<uint64_t> last_request_ns;  // CLOCK_MONOTONIC
  std::atomic<uint64_t> applied_bytes;    // of its applied pushes, as pushed
  std::atomic<uint64_t> pulls_waited;     // held back by --staleness-policy wait
  std::atomic<uint64_t> wait_ns;          // their time held, in all
  std::atomic<uint64_t> pushes_scaled;    // applied with a reduced lr (--staleness-policy scale)
  // --- lines 2-5: reply area of kStats ---
  StatsReply stats_reply;
  // --- line 6: more counters, server writes (as line 1) ---
  std::atomic<uint64_t> scale_factor_sum_micro;  // of its scaled pushes: their lr factors, in millionths
  std::atomic<uint64_t> pulls_timed_out;         // its pulls held past their wait (answered kTimeout)
  uint64_t reserved2[14];
  // --- followed by BufferDesc[max_buffers] ---
};
static_assert(std::is_standard_layout_v<WorkerEntry>);
static_assert(sizeof(WorkerEntry) == 512);

// Gives entry `e` back from owner word `from` (the caller's own, or the
// dead owner's it judged): a CAS to (that pid, kReleasing), so an entry
// claimed since is left alone; `clear` then clears the entry's words while
// the word says the entry is the releaser's; a CAS to kFree publishes
// them. False when the word was no longer `from`. SYNC(worker_release).
template <class Clear>
bool release_owner(WorkerEntry& e, uint64_t from, Clear clear) {
  uint64_t releasing = make_owner(owner_pid(from), WorkerState::kReleasing);
  // relaxed: this step publishes nothing; the clears after it are done
  // only once it succeeded, and the CAS to kFree publishes them.
  if (!e.owner.compare_exchange_strong(from, releasing, std::memory_order_relaxed, std::memory_order_relaxed))
    return false;
  clear();
  e.owner.compare_exchange_strong(releasing, 0, std::memory_order_release,
                                  std::memory_order_relaxed);  // SYNC(worker_release)
  return true;
}
static_assert(offsetof(WorkerEntry, owner) == 0);
static_assert(offsetof(WorkerEntry, pid_start_time) == 8);
static_assert(offsetof(WorkerEntry, lease) == 16);
static_assert(offsetof(WorkerEntry, cancel_request) == 24);
static_assert(offsetof(WorkerEntry, pushes_applied) == 64);
static_assert(offsetof(WorkerEntry, applied_bytes) == 96);
static_assert(offsetof(WorkerEntry, stats_reply) == 128);
static_assert(offsetof(WorkerEntry, scale_factor_sum_micro) == 384);

// Head of a request lane or a completion queue. The producer owns `tail`,
// the consumer owns `head` (each on its own cache line); both are free-
// running uint64 indices, slot = index & (capacity - 1).
struct LaneHeader {
  std::atomic<uint64_t> tail;  // next index to write; producer stores. SYNC(slot_published)
  uint64_t reserved0[7];
  std::atomic<uint64_t> head;  // next index to read; consumer stores. SYNC(slot_released)
  uint64_t reserved1[7];
  WaitWord data_ready;  // consumer sleeps here for new slots
  uint64_t reserved2[7];
  WaitWord space_ready;  // producer sleeps here for free slots
  uint64_t reserved3[7];
};
static_assert(std::is_standard_layout_v<LaneHeader>);
static_assert(sizeof(LaneHeader) == 256);
static_assert(offsetof(LaneHeader, head) == 64);
static_assert(offsetof(LaneHeader, data_ready) == 128);
static_assert(offsetof(LaneHeader, space_ready) == 192);

// A request descriptor: 64 bytes, no payload. Written by its worker.
struct Request {
  uint64_t request_id;   // the worker's own counter; echoed in the completion
  uint32_t opcode;       // Opcode
  uint32_t worker_id;    // index of the worker's entry
  uint64_t lease;        // WorkerEntry::lease (0 for kAttach)
  uint32_t buffer_id;    // index into the worker's BufferDesc table
  uint32_t tensor_id;    // index into the tensor table, or kAllTensors
  uint64_t byte_offset;  // within the buffer
  uint64_t byte_length;
  union {
    uint64_t worker_version;  // kPush: the version the gradient was computed at
    // kPull: the longest the server may hold it back under
    // --staleness-policy wait, ns (then it answers kTimeout); 0: not at all
    uint64_t wait_ns;
  };
  uint32_t dtype;  // kPush: Dtype of the gradient
  uint32_t flags;  // must be 0
};
static_assert(std::is_trivially_copyable_v<Request> && std::is_standard_layout_v<Request>);
static_assert(sizeof(Request) == 64);
static_assert(offsetof(Request, opcode) == 8);
static_assert(offsetof(Request, worker_id) == 12);
static_assert(offsetof(Request, lease) == 16);
static_assert(offsetof(Request, buffer_id) == 24);
static_assert(offsetof(Request, tensor_id) == 28);
static_assert(offsetof(Request, byte_offset) == 32);
static_assert(offsetof(Request, byte_length) == 40);
static_assert(offsetof(Request, worker_version) == 48);
static_assert(offsetof(Request, dtype) == 56);
static_assert(offsetof(Request, flags) == 60);

// The answer to one request. Written by the server. A success (code 0)
// writes only the first cache line: `message` then holds the bytes of an
// earlier completion in that slot and is not to be read (a consumer copies
// the first 64 bytes, and the message only when code != 0), so a successful
// round trip moves one line to the worker, not two.
struct Completion {
  uint64_t request_id;
  uint32_t opcode;
  uint32_t code;     // shmps::ErrorCode
  uint64_t version;  // the parameter version the request saw or made
  uint64_t value;    // opcode-specific (see Opcode)
  uint32_t flags;    // kCompletionMessageCut
  uint32_t reserved0;
  uint64_t reserved[3];
  char message[64];  // NUL-terminated short reason; written only when code != 0
};
// Completion::flags: the reason was longer than `message` holds, which has
// its first 63 bytes (the server's log has it whole).
inline constexpr uint32_t kCompletionMessageCut = 1;

// Writes `reason` into c.message (NUL-terminated, cut to fit, and then
// flagged kCompletionMessageCut).
inline void set_message(Completion& c, std::string_view reason) noexcept {
  const size_t n = std::min(reason.size(), sizeof c.message - 1);
  std::copy_n(reason.data(), n, c.message);
  c.message[n] = '\0';
  c.flags = n < reason.size() ? (c.flags | kCompletionMessageCut) : (c.flags & ~kCompletionMessageCut);
}
static_assert(std::is_trivially_copyable_v<Completion> && std::is_standard_layout_v<Completion>);
static_assert(sizeof(Completion) == 128);
static_assert(offsetof(Completion, code) == 12);
static_assert(offsetof(Completion, version) == 16);
static_assert(offsetof(Completion, value) == 24);
static_assert(offsetof(Completion, flags) == 32);
static_assert(offsetof(Completion, message) == 64);

inline constexpr uint32_t kRejectCauses = 32;  // indexed by ErrorCode value

// Server-wide counters. Written by the server only (relaxed stores of
// monotonic or last-value numbers); readers get a racy snapshot.
// The server-wide counters, declared once: SHMPS_STATS_BLOCK_COUNTERS(X)
// expands X(name, kind, help) in StatsBlock's order (help as Prometheus
// shows it: a name ending in _micro holds millionths, exported divided by
// 1e6 under the name without the suffix, one ending in _pico 1e-12ths); shmps-inspect's view,
// its JSON names and Prometheus metrics (kind: counter, only ever grows;
// gauge, goes up and down) and the worker's reply (shmps/server_stats.hpp,
// source `block`) take them from here. A name ending in _bytes counts
// bytes: it passes 2^53 after days, so JSON carries it as a string; one
// ending in _ns counts nanoseconds: Prometheus gets seconds (_seconds), JSON
// a string. At most kStatsCounterSlots.
// clang-format off
// StatsBlock::scheduled_lr_pico when the schedule's lr is not finite (the
// server then refuses pushes: --lr-schedule), and when it is finite but
// past what the word holds (1.8e7 and more, applied as it is).
inline constexpr uint64_t kScheduledLrNotFinite = ~uint64_t{0};
inline constexpr uint64_t kScheduledLrSaturated = ~uint64_t{0} - 1;

#define SHMPS_STATS_BLOCK_COUNTERS(X) \
  X(version, gauge, "Updates applied to the weights (or the restored checkpoint's version).") \
  X(gradients_applied, counter, "Gradients applied.") \
  X(weights_pulled, counter, "Weight pulls served.") \
  X(avg_staleness_micro, gauge, "Mean staleness of the last 128 applied pushes, in versions.") \
  X(requests, counter, "Requests served.") \
  X(ring_depth, gauge, "Requests queued in all lanes now.") \
  X(ring_high_water, gauge, "Most requests ever queued at once.") \
  X(workers_attached, gauge, "Workers attached now.") \
  X(workers_died, counter, "Workers whose process died while attached.") \
  X(buffers_registered, gauge, "Buffers registered now.") \
  X(mappings_opened, counter, "Buffer mappings the server opened.") \
  X(mappings_closed, counter, "Buffer mappings the server closed.") \
  X(lanes_corrupt, counter, "Lanes whose indices were garbage.") \
  X(workers_evicted, counter, "Sessions the server ended (a process stopped too long, a corrupt lane).") \
  X(applied_bytes, counter, "Bytes of gradient applied (as pushed: 2 per element for f16 and bf16).") \
  X(pulls_waited, counter, "Pulls held back by --staleness-policy wait (until the slowest caught up, their wait ran out, their worker withdrew them, or their session ended).") \
  X(wait_ns, counter, "Time pulls were held back by --staleness-policy wait, in all.") \
  X(pushes_scaled, counter, "Pushes applied with a reduced lr by --staleness-policy scale.") \
  X(scale_factor_sum_micro, counter, "Sum of the lr factors of scaled pushes (mean factor: this / pushes_scaled).") \
  X(apply_threads, gauge, "Threads the last update of a tensor from 4 MiB ran on (host backend).") \
  X(fed_round, gauge, "Federation rounds this host completed (0: not federated).") \
  X(fed_members, gauge, "Hosts in the last federation round.") \
  X(fed_round_ns, gauge, "Time of the last federation round (headers, delta allreduce, outer step).") \
  X(fed_bytes, counter, "Bytes this host contributed to the federation's collectives.") \
  X(fed_drift, gauge, "Local updates not yet in a merged federation round.") \
  X(fed_anchor_hash, gauge, "Hash of the federation's anchor (equal on every host after a round).") \
  X(fed_failures, counter, "Federation rounds that failed (the engine's error; federation then ends, or an elastic group re-forms).") \
  X(fed_pushes_held, counter, "Times a push waited for a federation round's merge (drift cap, or no overlap).") \
  X(fed_epoch, gauge, "Membership epoch of the federation's group (rises as an elastic group re-forms; 0: static).") \
  X(fed_state, gauge, "The federation's state: 0 off, 1 forming a group, 2 in a group, 3 paused (no majority of the last group), 4 ended.") \
  X(scheduled_lr_pico, gauge, "The lr the next update gets by --lr-schedule (before --staleness-policy scale); +Inf: not finite.") \
  X(checkpoints_written, counter, "Checkpoints this server wrote (--checkpoint-dir).") \
  X(checkpoint_failures, counter, "Checkpoints that failed: the device's read or the write (the error is in the log).") \
  X(pulls_held, gauge, "Pulls held back now by --staleness-policy wait (their workers wait for the slowest).") \
  X(checkpoints_deferred, counter, "Checkpoints due that waited for a federation round to merge (its state does not match the weights until then), once per interval waited.") \
  X(ipc_handles_opened, counter, "CUDA IPC memory handles of workers' allocations the server opened (cudaIpcOpenMemHandle; CUDA backend).") \
  X(ipc_handles_closed, counter, "CUDA IPC memory handles the server closed (cudaIpcCloseMemHandle that succeeded; a failed close is logged, not counted).")
// clang-format on
#define SHMPS_STATS_COUNT(name, kind, help) +1
inline constexpr size_t kStatsBlockCounters = 0 SHMPS_STATS_BLOCK_COUNTERS(SHMPS_STATS_COUNT);
#undef SHMPS_STATS_COUNT
inline constexpr size_t kStatsCounterSlots = 48;
static_assert(kStatsBlockCounters <= kStatsCounterSlots);

// A histogram of log2 buckets, written by the server alone (relaxed
// stores; readers get a racy snapshot in which count may run a little
// ahead of or behind the buckets). buckets[0] counts the value 0,
// buckets[b] the values in [2^(b-1), 2^b), the last one everything from
// 2^(kHistogramBuckets-2) up. No allocation, a few instructions per value.
inline constexpr uint32_t kHistogramBuckets = 60;
struct Histogram {
  std::atomic<uint64_t> count;
  std::atomic<uint64_t> sum;  // of the values (saturating)
  std::atomic<uint64_t> max;
  uint64_t reserved;
  std::atomic<uint64_t> buckets[kHistogramBuckets];
};
static_assert(sizeof(Histogram) == 512);
// The bucket of `v`: 0 for 0, else 1 + floor(log2 v), capped at the last.
constexpr uint32_t histogram_bucket(uint64_t v) noexcept {
  const auto b = static_cast<uint32_t>(std::bit_width(v));
  return b < kHistogramBuckets ? b : kHistogramBuckets - 1;
}

// Adds v: what the histogram's single writer does (loads and relaxed
// stores, no locked instruction; readers see each word whole).
inline void record(Histogram& h, uint64_t v) noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;  // relaxed: statistics, one writer
  h.count.store(h.count.load(relaxed) + 1, relaxed);
  const uint64_t sum = h.sum.load(relaxed);
  h.sum.store(sum + v < sum ? ~uint64_t{0} : sum + v, relaxed);
  if (v > h.max.load(relaxed)) h.max.store(v, relaxed);
  std::atomic<uint64_t>& b = h.buckets[histogram_bucket(v)];
  b.store(b.load(relaxed) + 1, relaxed);
}

// counter += by, for a counter the server alone writes (the stats block,
// the entries' counters): a load and a store, no locked instruction;
// readers in other processes see each value whole, as with fetch_add.
inline void bump(std::atomic<uint64_t>& counter, uint64_t by = 1) noexcept {
  counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);  // relaxed: statistic
}

// The server's histograms, declared once: X(name, unit, help), in
// StatsBlock's order. unit ns: exported to Prometheus in seconds.
// apply_ns: a push's NaN/Inf check and optimizer update, from before the
// first tensor's check to after the last one's update (on the CUDA backend
// the kernels' launch: the device work is asynchronous); queue_ns: every
// request's time in its lane, from the worker's publish_ns stamp to the
// server taking it (as the server's clock last read it: at the top of its
// loop, at the end of the previous apply, or again for a request published
// after that read; so it reads low by at most the handling of the requests
// taken since that read); staleness: the
// version lag of each applied push.
// clang-format off
#define SHMPS_STATS_HISTOGRAMS(X) \
  X(apply_ns, ns, "Time to check and apply one push's gradient.") \
  X(queue_ns, ns, "Time a request waited in its lane, from the worker's publish to the server taking it.") \
  X(staleness, versions, "Versions the weights moved between a push's pull and its apply, for applied pushes.")
// clang-format on

struct StatsBlock {
#define SHMPS_STATS_FIELD(name, kind, help) std::atomic<uint64_t> name;
  SHMPS_STATS_BLOCK_COUNTERS(SHMPS_STATS_FIELD)
#undef SHMPS_STATS_FIELD
  uint64_t reserved0[kStatsCounterSlots - kStatsBlockCounters];
  std::atomic<uint64_t> rejected[kRejectCauses];  // by ErrorCode value
#define SHMPS_STATS_HISTOGRAM(name, unit, help) Histogram name;
  SHMPS_STATS_HISTOGRAMS(SHMPS_STATS_HISTOGRAM)
#undef SHMPS_STATS_HISTOGRAM
};
static_assert(std::is_standard_layout_v<StatsBlock>);
static_assert(sizeof(StatsBlock) == 2176);
static_assert(offsetof(StatsBlock, workers_evicted) == 104);
static_assert(offsetof(StatsBlock, applied_bytes) == 112);
static_assert(offsetof(StatsBlock, rejected) == 384);
static_assert(offsetof(StatsBlock, apply_ns) == 640);
static_assert(offsetof(StatsBlock, queue_ns) == 1152);
static_assert(offsetof(StatsBlock, staleness) == 1664);

}  // namespace shmps::shm
