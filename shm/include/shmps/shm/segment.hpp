// Creating, opening, validating and removing shmps shared-memory objects:
// the control segment ("shmps.<name>") and the buffer objects workers
// register. The only place that knows Boost.Interprocess; its exceptions
// become Status here. A Segment/ShmObject is a mapping owned by one process;
// its methods are not synchronised (the bytes inside are, see layout.hpp).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shmps/shm/layout.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/status.hpp"

namespace shmps::shm {

// Checks a user-chosen name: 1..32 of [A-Za-z0-9._-], not starting with '.'
// (32: the names of worker buffer objects derive from it and must fit).
// Errors: kInvalidArgument naming the problem.
Status validate_name(const std::string& name);
// "shmps.<name>": the POSIX shm object of the control segment.
std::string segment_object_name(const std::string& name);
// "shmps.<name>.p<pid>.<n>": buffer `n` of the worker process `pid` of
// server `name` (the server opens only objects named so).
std::string buffer_object_name(const std::string& name, pid_t pid, uint64_t n);
// "shmps.<name>.p<pid>.": what the names of worker `pid`'s buffers start
// with (each is this and "<n>").
std::string buffer_object_prefix(const std::string& name, pid_t pid);
// What an object name of buffer_object_name()'s shape says: the server's
// name (any text before ".p<pid>.<n>", which a server's own name may
// contain), the worker's pid (1..pid_t's maximum) and n.
struct BufferObjectName {
  std::string server;
  pid_t pid;
  uint64_t n;
};
std::optional<BufferObjectName> parse_buffer_object_name(std::string_view object_name);
// A buffer object of server `name` left by a worker process that is gone:
// its object name, its pid, and its owner.
struct OrphanBuffer {
  std::string object_name;
  pid_t pid;
  uid_t owner;
};
// The buffer objects of server `name` in /dev/shm whose pid is `pid`, or,
// with pid 0, whose pid no process uses (pid_in_use(), asked once per pid).
std::vector<OrphanBuffer> orphan_buffers(const std::string& name, pid_t pid = 0);

// "alice:staff" (login and group names, "uid N"/"gid N" where the
// databases have none) and "0660": an object's owner and mode as every
// message about one shows them.
std::string owner_text(uid_t uid, gid_t gid);
std::string mode_text(mode_t mode);

// Who a worker trusts with its segment (docs/operations.md, "Who a worker
// trusts"), declared once for worker_lib and shmps-inspect.
// The uids that may own it: the process's effective user, root, and the
// server's user (`server_user`, a login name or a uid; empty: the packaged
// unit's "shmps", where that user exists). Errors: kInvalidArgument (a
// server_user that names no user).
Result<std::vector<uid_t>> trusted_owners(const std::string& server_user);
// The object at `path` (its owner and mode, from the descriptor mapped):
// owned by one of `trusted`, never world-writable. kPermission naming the
// owner, the mode and the fix.
Status check_owner_and_mode(const std::string& path, uid_t uid, gid_t gid, mode_t mode,
                            const std::vector<uid_t>& trusted);
// Its group bits only when its server asked for group access
// (kConfigGroupAccess in `config_flags`, read from the validated header).
Status check_group_access(const std::string& path, uid_t uid, gid_t gid, mode_t mode, uint32_t config_flags);

// A mapped POSIX shm object.
class ShmObject {
 public:
  // What the object's descriptor says of it (fstat) when it was opened.
  struct Identity {
    uint64_t device = 0;
    uint64_t inode = 0;
    uint64_t links = 0;  // its names (hard links) then
    uid_t uid = 0;
    gid_t gid = 0;
    mode_t mode = 0;  // permission bits
  };
  using Accept = std::function<Status(const Identity&)>;

  // Creates `object_name` exclusively with `mode` (set on the descriptor,
  // not subject to the umask; never world-writable: o+w is refused), sizes
  // it to `bytes` and reserves the memory up front (posix_fallocate), so a
  // full /dev/shm fails here ("need X bytes, Y available", kNoCapacity)
  // rather than with SIGBUS later. With `group` != -1 the object is given
  // that group (fchown; the caller must belong to it), so a server running
  // as another user of the group can map it. Errors: kInvalidArgument,
  // kPermission, kNoCapacity, kIo (EEXIST included).
  // With `keep_descriptor`, descriptor() stays open with the mapping and
  // holds an exclusive flock on the object until it closes: a server's
  // lock, which tells another server starting under the name that this
  // one lives (two more kIo: no descriptor left, or another process locked
  // the fresh object first).
  // `name_taken`: set when the failure is an object already at the name.
  static Result<std::unique_ptr<ShmObject>> create(const std::string& object_name, size_t bytes, mode_t mode,
                                                   gid_t group = static_cast<gid_t>(-1), bool keep_descriptor = false,
                                                   bool* name_taken = nullptr);
  // Why open() failed, where a caller treats the case apart (a server that
  // is not there yet): no object at the name, or one of 0 bytes, which its
  // creator has not sized yet. kOther: any other failure.
  // kTooLarge: more bytes than the caller's max_bytes.
  enum class OpenFailure : uint8_t { kOther, kNoObject, kEmpty, kTooLarge };
  // Maps an existing object whole. Errors: kIo ("does not exist" for
  // ENOENT, "is empty" with its owner and mode for 0 bytes: *failure says
  // which); kPermission naming the object's path, owner user:group and
  // mode, this process's user, and what would let it in (the group to
  // join, --group-access); kIo. An object of more than `max_bytes` is
  // refused before it is mapped (kLayoutMismatch, *failure kTooLarge): a
  // mapping of terabytes fails (ENOMEM) or reserves address space for
  // nothing.
  static Result<std::unique_ptr<ShmObject>> open(const std::string& object_name, bool read_only,
                                                 OpenFailure* failure = nullptr, uint64_t max_bytes = ~uint64_t{0});
  // Maps bytes [offset, offset + length) of an existing object, and only
  // the pages that hold them: an object of terabytes (a sparse file costs
  // its maker nothing) costs the mapper the window it names, not its size.
  // data() is the window's first byte and size() its length; mapping()
  // and mapping_size() give the range mapped, from the page boundary at or
  // before data() to the window's end. Errors as open()'s, and kBadRange
  // (the window does not lie inside the object, with both numbers),
  // kInvalidArgument (length 0); nothing is mapped then.
  // `accept`, when given, sees the object's identity before anything is
  // mapped; an error it returns is open_window()'s, and nothing is mapped:
  // a caller that must not map some objects (a server: its own control
  // segment, another worker's buffer, behind a hard link) refuses them there.
  static Result<std::unique_ptr<ShmObject>> open_window(const std::string& object_name, bool read_only, uint64_t offset,
                                                        uint64_t length, OpenFailure* failure = nullptr,
                                                        const Accept& accept = {});
  // shm_unlink; nothing happens when it is already gone. Returns 0, or
  // the errno of a failed unlink (EPERM: another user's object in the
  // sticky /dev/shm).
  static int remove(const std::string& object_name);

  ~ShmObject();
  // The bytes opened: the whole object, or open_window()'s window.
  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  // The mapping that holds them, from a page boundary (what a SIGBUS guard
  // covers, or cudaHostRegister page-locks); data() and size() for a whole
  // object.
  void* mapping() const noexcept;
  size_t mapping_size() const noexcept;
  const std::string& name() const noexcept { return name_; }
  // Identity of the object mapped (device, inode): a recreated name has a
  // new inode, which handle caches use to detect recycling.
  const Identity& identity() const noexcept { return identity_; }
  uint64_t device() const noexcept { return identity_.device; }
  uint64_t inode() const noexcept { return identity_.inode; }
  uid_t owner_uid() const noexcept { return identity_.uid; }
  gid_t owner_gid() const noexcept { return identity_.gid; }
  mode_t mode() const noexcept { return identity_.mode; }
  // The creator's descriptor, kept open with the mapping when create() was
  // asked to (else -1): the server grows its control segment back through it
  // when another process shrinks the object (server/src/peer_guard.hpp).
  int descriptor() const noexcept;

 private:
  struct Region;  // the mapping and the creator's descriptor (segment.cpp)
  // Bytes [offset, offset + length) of an object; length 0: all of it.
  struct Window {
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  ShmObject();
  static Result<std::unique_ptr<ShmObject>> open_mapped(const std::string& object_name, bool read_only, Window window,
                                                        OpenFailure* failure, uint64_t max_bytes,
                                                        const Accept& accept = {});
  std::unique_ptr<Region> region_;
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  Identity identity_;
};

struct TensorSpec {
  std::string name;             // 1..63 bytes, printable, unique
  std::vector<uint64_t> shape;  // 1..4 dims, each >= 1
};

// Most elements a tensor, and all tensors together, may hold: 2^40 (4 TiB
// of fp32). Checkpoint files are read against the same bound.
inline constexpr uint64_t kMaxTotalElements = uint64_t{1} << 40;

// The elements of one tensor, and of all (their shapes' products; at most
// kMaxTotalElements once validate_tensors() passed them).
uint64_t element_count(const TensorSpec& t);
uint64_t total_elements(const std::vector<TensorSpec>& tensors);

// Checks a model's tensor list: 1..kMaxTensorsLimit tensors, each named
// 1..63 printable bytes without blanks or ':', names unique, 1..4
// dimensions of 1..2^40, at most kMaxTotalElements elements in all.
// Errors: kInvalidArgument naming the tensor and the rule. Pure.
Status validate_tensors(const std::vector<TensorSpec>& tensors);

struct SegmentSpec {
  std::string name;  // as given to --name
  std::vector<TensorSpec> tensors;
  uint32_t max_workers = 16;    // 1..256
  uint32_t max_buffers = 16;    // per worker, 1..64
  uint32_t lane_capacity = 64;  // power of two, 2..65536
  ConfigBlock config{};
  mode_t mode = 0600;
};

// Where each section lies for given counts (bytes).
struct Geometry {
  uint64_t tensor_table_offset, worker_table_offset, worker_entry_size;
  uint64_t lanes_offset, lane_stride, completions_offset, completion_stride;
  uint64_t stats_offset, segment_size;
};
// The size of the largest segment any counts allow (kMax*Limit,
// kMaxLaneCapacity): an object larger than this is no shmps segment.
uint64_t largest_segment_size() noexcept;

Geometry compute_geometry(uint32_t tensor_count, uint32_t max_workers, uint32_t max_buffers,
                          uint32_t lane_capacity) noexcept;

// Validates a segment image of `size` bytes (a copy of a live mapping, or of
// a file): magic, layout version, every size and offset, every tensor
// descriptor, the config enums. Reads only the header and the tensor table,
// so a copy of those two (SegmentHeader, then tensor_count TensorDescs)
// with the mapping's size validates a segment without reading it twice.
// Returns kLayoutMismatch (foreign object, other version: both numbers in
// the message), kServerNotRunning when the version is not published yet,
// or kOk.
Status validate_segment(const void* base, size_t size);

// validate_segment()'s checks of the header alone, every one but the
// tensor table's: the size, magic, layout version, header and descriptor
// sizes, counts, the segment size and every section offset the counts
// give, the config enums. For a reader that copies a segment piece by
// piece (shmps-inspect): nothing after a header is read before it passes.
// The same errors as validate_segment().
Status validate_header(const SegmentHeader& h, size_t size);

// A header's counts within their limits (1..kMaxTensorsLimit tensors,
// 1..kMaxWorkersLimit workers, 1..kMaxBuffersLimit buffers, a lane
// capacity that is a power of two in 2..kMaxLaneCapacity): the part of
// validate_segment that compute_geometry() needs. kLayoutMismatch naming
// the count, or kOk.
Status check_counts(uint64_t tensor_count, uint64_t max_workers, uint64_t max_buffers, uint64_t lane_capacity);

// The pid of the server an unpublished segment's header names, when that
// process is dead (process_alive(): gone, a zombie, or the pid reused):
// what a server start that died before publishing left. `header`: a
// private copy of `size` bytes (at least a SegmentHeader) with the magic
// and layout version 0. Empty for any other header, for one that names
// no server yet (its pid or its start time not written: a header half
// written), and for one whose server lives (starting, or stopped).
std::optional<uint32_t> dead_server_of_unpublished(const void* header, size_t size) noexcept;

// The pid of the live server that segment "shmps.<name>" names (its
// header's magic, server pid and start time, that process alive), whatever
// the layout version: the server that Segment::create() refuses to replace
// ("a live shmps-server (pid N) already serves ..."). Empty when there is
// no such object, this process cannot read it, or it names no live server.
// Reads the header once, with pread (no mapping).
std::optional<uint32_t> live_server_of(const std::string& name);

// Copies `bytes` of shared memory that other processes may be writing:
// word by word (8 bytes, then the rest byte by byte) with acquire loads in
// address order, so no word is torn and what a word published with a
// release store orders is visible in the words copied after it. `from`
// is 8-byte aligned.
void copy_shared(void* to, const void* from, size_t bytes) noexcept;

// What a segment's header said when it was validated (or created), kept in
// private memory: every accessor of Segment computes its addresses from
// this copy and never from the header's words, which any process that may
// write the segment could change after the check.
struct SegmentLayout {
  uint32_t tensor_count = 0, max_workers = 0, max_buffers = 0, lane_capacity = 0;
  uint64_t total_elements = 0;
  uint64_t generation = 0;
  uint32_t server_pid = 0;
  uint64_t server_start_time = 0;
  uint32_t config_flags = 0;  // ConfigBlock::flags (kConfigGroupAccess): fixed for a server's life
  Geometry geometry{};
  std::vector<TensorDesc> tensors;  // tensor_count descriptors, validated
};

// What the object at segment "shmps.<name>" says when no start will
// finish it, as far as the object tells: empty, or its magic zero (as
// validate_segment() judges a header not yet written), no process holding
// a flock on it (a starting server holds its own from the create on; an
// unreadable /proc/locks leaves the age alone to judge) and its ctime
// (its creation or sizing; a server writes its header through a mapping
// right after) older than a start's wait (kSegmentStartWait). A start
// that died before sizing or writing it left it, or a process that is no
// shmps server made it. The message names the object, its owner, mode and
// age, and the command that removes it. Empty for any other object, or
// one that cannot be read. The header is read with pread on a descriptor
// of its own: a hole reads as zeros without being allocated, and an
// object truncated meanwhile makes a short read, not a SIGBUS. The flocks
// are `flocks`' when given (a reader that asks about many objects reads
// /proc/locks once); else /proc/locks is read here.
std::optional<std::string> never_written(const std::string& name, const FlockTable* flocks = nullptr);

// Opens the object of segment "shmps.<name>" (read-only or not) and hands
// it to `accept`, which judges it (the mapping itself, or a copy of it) and
// takes it when it is good. Retried for up to 2 s while the object is empty
// (a server that has not sized it yet) or accept() answers
// kServerNotRunning (one that has not written or published it yet); the
// last answer then. Not retried, kServerNotRunning at once, for what a
// dead start left: an object never_written() judges so at the first look,
// or one whose header names a server that is dead
// (dead_server_of_unpublished(): the message names that pid and how to
// remove it). No such object: kServerNotRunning, "no shmps server named
// ...".
// `on_empty`, when given, judges an empty object by its owner and mode
// before it is waited for (a worker waits only for a server it trusts).
// `wait`: how long to retry (0: one look, for a reader that reports what
// is there rather than riding out a start, e.g. shmps-inspect --list).
// `flocks`: never_written()'s.
// An object larger than largest_segment_size() is kLayoutMismatch before
// it is mapped. Other errors as ShmObject::open's.
inline constexpr std::chrono::milliseconds kSegmentStartWait{2000};
Status open_segment_object(const std::string& name, bool read_only,
                           const std::function<Status(std::unique_ptr<ShmObject>&)>& accept,
                           const std::function<Status(uid_t, gid_t, mode_t)>& on_empty = {},
                           std::chrono::milliseconds wait = kSegmentStartWait, const FlockTable* flocks = nullptr);

class Segment {
 public:
  // Server: creates and initialises the control segment, leaving it
  // unpublished (layout_version 0) and in state kStarting. An existing
  // segment of that name is replaced only when it is ours and its server
  // is dead; a live server is never clobbered (kInvalidArgument naming its
  // pid), a foreign object is never adopted (kLayoutMismatch).
  static Result<std::unique_ptr<Segment>> create(const SegmentSpec& spec, uint64_t generation);
  // Worker: opens and validates "shmps.<name>" (open_segment_object()).
  // Waits up to `wait` (2 s; 0: one look, for a caller that looks again
  // itself, within a deadline of its own) for a segment still being
  // initialised, but not for a dead start's. With `trusted_owners` (a
  // worker), the object is checked before a byte of it is read: owned by
  // one of those uids, not world-writable, and its group bits only as the
  // server's kConfigGroupAccess says. Errors: kServerNotRunning (no such
  // segment: the message names it), kLayoutMismatch, kPermission (naming
  // the owner, the mode and the fix).
  static Result<std::unique_ptr<Segment>> open(const std::string& name, bool read_only,
                                               const std::vector<uid_t>* trusted_owners = nullptr,
                                               std::chrono::milliseconds wait = kSegmentStartWait);
  static void remove(const std::string& name);
  // Removes segment "shmps.<name>" when the server its header names is the
  // dead process (server_pid, server_start_time): what that server left
  // when it was killed, for the process that started it to clean up. Any
  // other object stays: a live server's, one whose header names another
  // process or none (not written yet), one another server locked (it is
  // taking the name over), another user's. Returns whether it removed one.
  static bool remove_if_left_by(const std::string& name, pid_t server_pid, uint64_t server_start_time);

  // Server: release-stores the layout version; openers may use it from now.
  void publish() noexcept;
  // Server: writes the header's words that describe the layout (magic,
  // sizes, counts, offsets, identity), `config`, `state`, the weights'
  // export, the heartbeat and the tensor table, all but the last three
  // from layout(). create() does it once (no export yet), the server
  // again after another process wrote over them or the object lost pages
  // (server/src/peer_guard.hpp), then publish()es.
  void write_header(const ConfigBlock& config, ServerState state, const WeightsExportBlock& exported) noexcept;
  // Server: whether the header says what write_header() wrote (given the
  // same arguments; the heartbeat and the words workers write aside), the
  // tensor table too, and the layout version is published. Reads a
  // private copy of the live words; the caller guards the mapping against
  // SIGBUS (peer_guard) or knows the object whole.
  bool header_intact(const ConfigBlock& config, ServerState state, const WeightsExportBlock& exported) const;

  // The live header: read its live words (state, heartbeat, doorbells,
  // the weights' export); its counts and offsets are layout()'s.
  SegmentHeader& header() const noexcept { return *static_cast<SegmentHeader*>(object_->data()); }
  const SegmentLayout& layout() const noexcept { return layout_; }
  // i < layout().max_workers, and so on: the callers' bounds are the layout's.
  WorkerEntry& worker(uint32_t i) const noexcept {
    return at<WorkerEntry>(g().worker_table_offset + i * g().worker_entry_size);
  }
  BufferDesc& buffer(uint32_t worker, uint32_t i) const noexcept {
    return at<BufferDesc>(g().worker_table_offset + worker * g().worker_entry_size + sizeof(WorkerEntry) +
                          i * sizeof(BufferDesc));
  }
  void* buffer_table_bytes(uint32_t worker) const noexcept { return &buffer(worker, 0); }
  LaneHeader& lane(uint32_t i) const noexcept { return at<LaneHeader>(g().lanes_offset + i * g().lane_stride); }
  Request* lane_slots(uint32_t i) const noexcept {
    return &at<Request>(g().lanes_offset + i * g().lane_stride + sizeof(LaneHeader));
  }
  // Lane i's publish_ns[lane_capacity]: the CLOCK_MONOTONIC time the worker
  // published the request in the slot of the same index (written before
  // its release of the tail, read by the server after copying the request
  // out and before releasing its slot, so never the next request's; both
  // relaxed through atomic_ref; a garbage stamp makes one wrong
  // queue_ns sample, nothing else).
  uint64_t* lane_stamps(uint32_t i) const noexcept {
    return &at<uint64_t>(g().lanes_offset + i * g().lane_stride + sizeof(LaneHeader) +
                         uint64_t{layout_.lane_capacity} * sizeof(Request));
  }
  LaneHeader& completions(uint32_t i) const noexcept {
    return at<LaneHeader>(g().completions_offset + i * g().completion_stride);
  }
  Completion* completion_slots(uint32_t i) const noexcept {
    return &at<Completion>(g().completions_offset + i * g().completion_stride + sizeof(LaneHeader));
  }
  StatsBlock& stats() const noexcept { return at<StatsBlock>(g().stats_offset); }
  const ShmObject& object() const noexcept { return *object_; }
  const std::string& name() const noexcept { return name_; }

 private:
  Segment(std::string name, std::unique_ptr<ShmObject> object, SegmentLayout layout)
      : name_(std::move(name)), object_(std::move(object)), layout_(std::move(layout)) {}
  const Geometry& g() const noexcept { return layout_.geometry; }
  // The live descriptor, written once by create(); everyone reads layout().tensors.
  TensorDesc& tensor(uint32_t i) const noexcept {
    return at<TensorDesc>(g().tensor_table_offset + i * sizeof(TensorDesc));
  }
  template <typename T>
  T& at(uint64_t offset) const noexcept {
    return *reinterpret_cast<T*>(static_cast<char*>(object_->data()) + offset);
  }
  std::string name_;
  std::unique_ptr<ShmObject> object_;
  SegmentLayout layout_;
};

}  // namespace shmps::shm
