#include "inspect_source.hpp"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "shmps/unique_fd.hpp"

namespace shmps::inspect {
namespace {

// `cause`: the failure's ErrorCode; by default the one its exit code stands for.
Loaded failure(ExitCode exit, std::string error, std::optional<ErrorCode> cause = std::nullopt) {
  Loaded l;
  l.exit = exit;
  l.error = std::move(error);
  l.cause = cause                           ? *cause
            : exit == ExitCode::kBadSegment ? ErrorCode::kLayoutMismatch
            : exit == ExitCode::kError      ? ErrorCode::kIo
                                            : ErrorCode::kServerNotRunning;
  return l;
}

// Private, zero-filled memory for `bytes` (at least a header's worth): an
// anonymous mapping, page-aligned as a segment's mapping is (the layout's
// structs are alignas(64)); pages never written cost no memory.
std::shared_ptr<void> zeroed(size_t bytes) {
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t length = (std::max(bytes, sizeof(shm::SegmentHeader)) + page - 1) / page * page;
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return std::shared_ptr<void>(p, [length](void* q) { ::munmap(q, length); });
}

// Reads `bytes` at `offset` of a file whose size is known; false with
// *error set on an I/O error or a file shorter than that.
bool read_at(int fd, void* to, size_t bytes, size_t offset, const std::string& path, std::string* error) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, static_cast<char*>(to) + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *error = "read '" + path + "': " + errno_text(errno);
      return false;
    }
    if (n == 0) {
      *error = "'" + path + "' shrank while being read";
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

// The SIGBUS guard of the live copy: an object truncated by its owner
// faults on the pages past its new end, and a hole of a sparse object when
// tmpfs has no memory left for its page. The handler is installed only around the
// copy (the tool is single-threaded), so every SIGBUS it sees is the copy's;
// it jumps back out of the copy, which holds nothing to clean up.
sigjmp_buf g_copy_fault;
extern "C" void on_copy_sigbus(int) { siglongjmp(g_copy_fault, 1); }

// A live mapping is copied word by word in address order
// (shm::copy_shared): a word published with a release store (the layout
// version, a worker entry's owner, a ring's tail or head) orders the words
// copied after it, as the in-place reads of take_snapshot would.
using shm::copy_shared;

// A segment's counts, from the image's copy of its header (which
// shm::validate_header() passed): the geometry the copy follows. The image's
// header is copied once, first, and is not read again from the segment,
// so whatever a writer does to the live header, the copy follows the
// geometry the image shows.
struct Counts {
  uint32_t tensor_count = 0, max_workers = 0, max_buffers = 0, lane_capacity = 0;
  explicit Counts(const shm::SegmentHeader& h)
      : tensor_count(h.tensor_count),
        max_workers(h.max_workers),
        max_buffers(h.max_buffers),
        lane_capacity(h.lane_capacity) {}
  shm::Geometry geometry() const {
    return shm::compute_geometry(tensor_count, max_workers, max_buffers, lane_capacity);
  }
};

// A segment is copied into its image piece by piece: `copy(offset,
// bytes)` brings those bytes of the segment to the same offset of the
// image, and answers false when it could not (a file's read failed; a live
// copy's fault jumps out instead). The functions below run under the live
// copy's SIGBUS guard, which may jump out of any of them: they hold
// nothing with a destructor.

// Copies `count` slots of `slot_bytes` from ring index `first` on, each at
// index & (capacity - 1) after the ring's LaneHeader (the ring at `ring`):
// at most two runs.
template <typename Copy>
bool copy_slots(const Copy& copy, uint64_t ring, uint64_t first, uint64_t count, uint32_t capacity, size_t slot_bytes) {
  const uint64_t slots = ring + sizeof(shm::LaneHeader);
  const uint64_t start = first & (capacity - 1);
  const uint64_t run = std::min<uint64_t>(count, capacity - start);
  if (!copy(slots + start * slot_bytes, run * slot_bytes)) return false;
  return count <= run || copy(slots, (count - run) * slot_bytes);
}

// Each request lane and completion queue, copied in the order its live
// reader needs: the head, then the tail, then the rest of its LaneHeader,
// then the slots [head, tail) it holds (every slot below that tail was
// published before it, SYNC(slot_published) through copy_shared's
// acquire), so that the copy's tail is at least its head; of those, the
// first `rings.max_slots` only. Only those slots are read (take_snapshot
// decodes nothing else; a lane's publish stamps not at all): the rest of
// the ring stays zero in the image, and the holes of a sparse segment are
// never read, which would make tmpfs allocate them. A ring whose tail -
// head exceeds its capacity (corrupt, or reset in between) gets no slots;
// take_snapshot reports it corrupt. Nothing at all without `rings.read`.
template <typename Copy>
bool copy_rings(const char* image, const Counts& h, RingReading rings, const Copy& copy) {
  if (!rings.read) return true;
  const shm::Geometry g = h.geometry();
  constexpr size_t kTail = offsetof(shm::LaneHeader, tail);
  constexpr size_t kHead = offsetof(shm::LaneHeader, head);
  static_assert(kTail == 0 && kHead == 64);
  for (uint64_t w = 0; w < h.max_workers; ++w) {
    for (const uint64_t ring : {g.lanes_offset + w * g.lane_stride, g.completions_offset + w * g.completion_stride}) {
      const size_t slot_bytes = ring < g.completions_offset ? sizeof(shm::Request) : sizeof(shm::Completion);
      uint64_t head = 0;
      uint64_t tail = 0;
      // A few tries, as a live reader retries: preempted between the two
      // loads, the ring may have moved more than its capacity.
      for (int tries = 0; tries < 3; ++tries) {
        if (!copy(ring + kHead, 8) || !copy(ring + kTail, 8)) return false;
        std::memcpy(&head, image + ring + kHead, sizeof head);
        std::memcpy(&tail, image + ring + kTail, sizeof tail);
        if (tail - head <= h.lane_capacity) break;
      }
      if (!copy(ring + 8, kHead - 8) || !copy(ring + kHead + 8, sizeof(shm::LaneHeader) - kHead - 8)) return false;
      if (tail - head > h.lane_capacity) continue;
      const uint64_t count = std::min<uint64_t>(tail - head, rings.max_slots);
      if (!copy_slots(copy, ring, head, count, h.lane_capacity, slot_bytes)) return false;
    }
  }
  return true;
}

// The tensor table of a segment whose header is in the image (`h`: its
// counts): the part validate_segment() reads after the header.
template <typename Copy>
bool copy_tensor_table(const Counts& h, const Copy& copy) {
  return copy(h.geometry().tensor_table_offset, uint64_t{h.tensor_count} * sizeof(shm::TensorDesc));
}

// The rest of a segment of `size` bytes whose header and tensor table are
// in the image and validated: the worker table, the stats block to the
// end (in address order), then its rings as `rings` says. Only a segment
// that passed validation gets this far: a crafted object's (a sparse one
// of every count at its limit) worker table and rings are never read, so
// its holes are never allocated for it.
template <typename Copy>
bool copy_rest(const char* image, const Counts& h, size_t size, RingReading rings, const Copy& copy) {
  const shm::Geometry g = h.geometry();
  return copy(g.worker_table_offset, g.lanes_offset - g.worker_table_offset) &&
         copy(g.stats_offset, size - g.stats_offset) && copy_rings(image, h, rings, copy);
}

// Runs `pieces(copy)`, whose `copy(offset, bytes)` copies those bytes of
// the live mapping `from` to the same offset of the image `to`, under the
// SIGBUS guard. false: the mapping faulted during the copy: the object
// shrank, or tmpfs had no memory for a page read (a hole of a sparse
// object).
template <typename Pieces>
bool guarded_copy(void* to, const void* from, const Pieces& pieces) {
  auto* image = static_cast<char*>(to);
  const auto* live = static_cast<const char*>(from);
  const auto copy = [image, live](uint64_t offset, size_t n) {
    copy_shared(image + offset, live + offset, n);
    return true;
  };
  struct sigaction sa {
  }, previous{};
  sa.sa_handler = on_copy_sigbus;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, &previous);
  volatile bool copied = false;
  // savemask 1: the jump out of the handler unblocks SIGBUS again.
  if (sigsetjmp(g_copy_fault, 1) == 0) {
    pieces(copy);
    copied = true;
  }
  ::sigaction(SIGBUS, &previous, nullptr);
  return copied;
}

const shm::SegmentHeader& header_of(const void* image) { return *static_cast<const shm::SegmentHeader*>(image); }

using shm::largest_segment_size;

}  // namespace

Loaded load_segment(const std::string& name, bool wait_for_start, RingReading rings, const shm::FlockTable* flocks) {
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  if (shm::validate_name(name).ok())
    if (auto left = shm::never_written(name, flocks)) {
      Loaded never = failure(ExitCode::kUnpublished, *left);
      never.dead_start = true;
      return never;
    }
  Loaded l;
  size_t live_size = 0;  // of the object last copied
  const auto copy = [&](std::unique_ptr<shm::ShmObject>& live) -> Status {
    const Status shrank{ErrorCode::kLayoutMismatch,
                        path + ": the segment shrank while being read, or /dev/shm had no memory for a page read"};
    // No larger than largest_segment_size(): open_segment_object refused
    // a larger object before mapping it.
    const size_t size = live->size();
    live_size = size;
    l.image.copy = zeroed(size);
    if (!l.image.copy) return {ErrorCode::kIo, "cannot allocate " + std::to_string(size) + " bytes"};
    auto* image = static_cast<char*>(l.image.copy.get());
    // The header first, as for --file: an object that is not a published
    // segment of its size (a worker's buffer, a server still starting, a
    // crafted sparse object) is judged from its header alone; then the
    // tensor table, validated before anything after it is read.
    const size_t header_bytes = std::min<size_t>(size, sizeof(shm::SegmentHeader));
    if (!guarded_copy(image, live->data(), [header_bytes](const auto& piece) { piece(0, header_bytes); }))
      return shrank;
    if (Status s = shm::validate_header(header_of(image), size); !s.ok()) return {s.code(), path + ": " + s.message()};
    const Counts counts(header_of(image));
    if (!guarded_copy(image, live->data(), [&counts](const auto& piece) { copy_tensor_table(counts, piece); }))
      return shrank;
    if (Status s = shm::validate_segment(image, size); !s.ok()) return {s.code(), path + ": " + s.message()};
    if (!guarded_copy(image, live->data(), [image, &counts, size, rings](const auto& piece) {
          copy_rest(image, counts, size, rings, piece);
        }))
      return shrank;
    l.image.source = path;
    // Every object of the name lies in /dev/shm's file system.
    struct stat dir {};
    const uint64_t device = ::stat("/dev/shm", &dir) == 0 ? static_cast<uint64_t>(dir.st_dev) : 0;
    l.image.owner =
        ImageOwner{live->owner_uid(), live->owner_gid(), live->mode(), /*live=*/true, device, live->inode()};
    l.image.data = l.image.copy.get();
    l.image.size = size;
    return Status::Ok();
  };
  const Status s =
      shm::open_segment_object(name, /*read_only=*/true, copy, {},
                               wait_for_start ? shm::kSegmentStartWait : std::chrono::milliseconds(0), flocks);
  if (s.ok()) return l;
  if (s.code() == ErrorCode::kServerNotRunning) {
    // Both "no such object" and "not published yet": the object's
    // existence tells them apart.
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return failure(ExitCode::kNoSegment, s.message(), s.code());
    Loaded unpublished = failure(ExitCode::kUnpublished, s.message(), s.code());
    // The last header copied, if any (an empty object leaves none).
    unpublished.dead_start = l.image.copy && live_size >= sizeof(shm::SegmentHeader) &&
                             shm::dead_server_of_unpublished(l.image.copy.get(), sizeof(shm::SegmentHeader));
    return unpublished;
  }
  if (s.code() == ErrorCode::kPermission) {
    // shm's message says how a worker gets in (the group, --group-access);
    // a reader may also be the segment's owner, unless it is that owner
    // already and the mode keeps it out.
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && st.st_uid != ::geteuid()) {
      const std::string owner = shm::owner_text(st.st_uid, st.st_gid);
      const std::string user = owner.substr(0, owner.find(':'));
      const std::string sudo = st.st_uid == 0               ? "sudo"
                               : user.rfind("uid ", 0) == 0 ? "sudo -u '#" + std::to_string(st.st_uid) + "'"
                                                            : "sudo -u " + user;
      return failure(ExitCode::kError,
                     s.message() + "; or run shmps-inspect as the segment's owner: " + sudo + " shmps-inspect " + name,
                     s.code());
    }
  }
  return failure(exit_code_for(s), s.message(), s.code());
}

Loaded load_file(const std::string& path, RingReading rings) {
  UniqueFd f;
  // O_NONBLOCK: opening a FIFO would wait for a writer; a regular file
  // ignores the flag.
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd < 0) {
    const int err = errno;
    if (err == ENOENT) return failure(ExitCode::kNoSegment, "no such file '" + path + "'");
    return failure(ExitCode::kError, "open '" + path + "': " + errno_text(err),
                   err == EACCES || err == EPERM ? ErrorCode::kPermission : ErrorCode::kIo);
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) return failure(ExitCode::kError, "fstat '" + path + "': " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) return failure(ExitCode::kError, "'" + path + "' is not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > largest_segment_size())
    return failure(ExitCode::kBadSegment, "'" + path + "' holds " + std::to_string(size) +
                                              " bytes, more than any shmps segment (" +
                                              std::to_string(largest_segment_size()) + ")");
  Loaded l;
  l.image.copy = zeroed(size);
  if (!l.image.copy) return failure(ExitCode::kError, "cannot allocate " + std::to_string(size) + " bytes");
  auto* image = static_cast<char*>(l.image.copy.get());
  std::string error;
  // The header first. One that is not a segment's (magic, layout version),
  // or whose size or offsets disagree with the file's size and its counts,
  // is refused from the header alone; then the tensor table, validated
  // before the rest is read.
  if (!read_at(f.fd, image, std::min<uint64_t>(size, sizeof(shm::SegmentHeader)), 0, path, &error))
    return failure(ExitCode::kError, error);
  if (Status s = shm::validate_header(header_of(image), size); !s.ok()) {
    // A copy is never published later: say whose start it was copied from.
    if (const auto dead = shm::dead_server_of_unpublished(image, size)) {
      Loaded unpublished =
          failure(exit_code_for(s),
                  path + ": segment not published: the shmps-server that made it (pid " + std::to_string(*dead) +
                      ") had not published it when this copy was made, and is not running on this "
                      "host (a start that died, or a copy from another host)",
                  s.code());
      unpublished.dead_start = true;
      return unpublished;
    }
    return failure(exit_code_for(s), path + ": " + s.message(), s.code());
  }
  // By the counts of the header read (not read again).
  const Counts counts(header_of(image));
  const auto copy = [&f, image, &path, &error](uint64_t offset, size_t bytes) {
    return read_at(f.fd, image + offset, bytes, offset, path, &error);
  };
  if (!copy_tensor_table(counts, copy)) return failure(ExitCode::kError, error);
  if (Status s = shm::validate_segment(image, size); !s.ok())
    return failure(exit_code_for(s), path + ": " + s.message(), s.code());
  if (!copy_rest(image, counts, size, rings, copy)) return failure(ExitCode::kError, error);
  l.image.source = path;
  l.image.owner = ImageOwner{st.st_uid, st.st_gid, st.st_mode & 0777, /*live=*/false};
  l.image.data = image;
  l.image.size = size;
  return l;
}

ExitCode exit_code_for(const Status& status) {
  switch (status.code()) {
    case ErrorCode::kOk:
      return ExitCode::kOk;
    case ErrorCode::kLayoutMismatch:
      return ExitCode::kBadSegment;
    case ErrorCode::kServerNotRunning:
      return ExitCode::kUnpublished;
    default:
      return ExitCode::kError;
  }
}

}  // namespace shmps::inspect
