#include "inspect_source.hpp"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace shmps::inspect {
namespace {

Loaded failure(ExitCode exit, std::string error) {
  Loaded l;
  l.exit = exit;
  l.error = std::move(error);
  return l;
}

// Closes a descriptor at scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

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

// The SIGBUS guard of copy_live(): an object truncated by its owner faults
// on the pages past its new end. The handler is installed only around the
// copy (the tool is single-threaded), so every SIGBUS it sees is the copy's;
// it jumps back out of the copy, which holds nothing to clean up.
sigjmp_buf g_copy_fault;
extern "C" void on_copy_sigbus(int) { siglongjmp(g_copy_fault, 1); }

// A live mapping is copied word by word in address order
// (shm::copy_shared): a word published with a release store (the layout
// version, a worker entry's owner, a ring's tail or head) orders the words
// copied after it, as the in-place reads of take_snapshot would.
using shm::copy_shared;

// Each request lane and completion queue copied again in the order its
// live reader needs: the head, then the tail, then the rest (the slots),
// so that the copy's tail is at least its head and every slot below the
// tail was published before it was copied. The copy in address order reads
// a ring's tail (offset 0) before its head (offset 64), and a consumer
// that moved between the two made the ring look corrupt (head past tail).
void copy_rings(void* to, const void* from, const shm::SegmentHeader& h) {
  const shm::Geometry g = shm::compute_geometry(h.tensor_count, h.max_workers, h.max_buffers, h.lane_capacity);
  constexpr size_t kTail = offsetof(shm::LaneHeader, tail);
  constexpr size_t kHead = offsetof(shm::LaneHeader, head);
  static_assert(kTail == 0 && kHead == 64);
  for (uint64_t w = 0; w < h.max_workers; ++w) {
    for (const uint64_t ring : {g.lanes_offset + w * g.lane_stride, g.completions_offset + w * g.completion_stride}) {
      const uint64_t stride = ring < g.completions_offset ? g.lane_stride : g.completion_stride;
      auto* out = static_cast<char*>(to) + ring;
      const auto* in = static_cast<const char*>(from) + ring;
      // A few tries, as a live reader retries: preempted between the two
      // loads, the ring may have moved more than its capacity.
      for (int tries = 0; tries < 3; ++tries) {
        copy_shared(out + kHead, in + kHead, 8);
        copy_shared(out + kTail, in + kTail, 8);
        uint64_t head = 0;
        uint64_t tail = 0;
        std::memcpy(&head, out + kHead, sizeof head);
        std::memcpy(&tail, out + kTail, sizeof tail);
        if (tail - head <= h.lane_capacity) break;
      }
      copy_shared(out + 8, in + 8, kHead - 8);
      copy_shared(out + kHead + 8, in + kHead + 8, stride - kHead - 8);
    }
  }
}

// false: the mapping faulted (the object shrank) during the copy. With
// `rings` (a validated header's), the rings are copied again as
// copy_rings() says.
bool guarded_copy(void* to, const void* from, size_t bytes, const shm::SegmentHeader* rings = nullptr) {
  struct sigaction sa {
  }, previous{};
  sa.sa_handler = on_copy_sigbus;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, &previous);
  volatile bool copied = false;
  // savemask 1: the jump out of the handler unblocks SIGBUS again.
  if (sigsetjmp(g_copy_fault, 1) == 0) {
    if (rings != nullptr) {
      copy_rings(to, from, *rings);
    } else {
      copy_shared(to, from, bytes);
    }
    copied = true;
  }
  ::sigaction(SIGBUS, &previous, nullptr);
  return copied;
}

// Whether the header at `copy` is a published segment's of exactly `size`
// bytes (magic, layout version, its size and the size its counts give):
// only then is the rest worth reading. validate_segment says what is wrong
// with one that is not, from the header alone.
bool header_fits(const void* copy, uint64_t size) {
  if (size < sizeof(shm::SegmentHeader)) return false;
  const auto& h = *static_cast<const shm::SegmentHeader*>(copy);
  // relaxed: a private copy.
  return h.magic == shm::kMagic && h.layout_version.load(std::memory_order_relaxed) == shm::kLayoutVersion &&
         h.segment_size == size &&
         shm::compute_geometry(h.tensor_count, h.max_workers, h.max_buffers, h.lane_capacity).segment_size == size;
}

using shm::largest_segment_size;

}  // namespace

Loaded load_segment(const std::string& name, bool wait_for_start) {
  const std::string path = "/dev/shm/" + shm::segment_object_name(name);
  Loaded l;
  const auto copy = [&](std::unique_ptr<shm::ShmObject>& live) -> Status {
    const Status shrank{ErrorCode::kLayoutMismatch, path + ": the segment shrank while being read"};
    // No larger than largest_segment_size(): open_segment_object refused
    // a larger object before mapping it.
    const size_t size = live->size();
    l.image.copy = zeroed(size);
    if (!l.image.copy) return {ErrorCode::kIo, "cannot allocate " + std::to_string(size) + " bytes"};
    // The header first, as for --file: an object that is not a published
    // segment of its size (a worker's buffer, a server still starting) is
    // judged from its header and never copied whole.
    if (!guarded_copy(l.image.copy.get(), live->data(), std::min<size_t>(size, sizeof(shm::SegmentHeader))))
      return shrank;
    const bool fits = header_fits(l.image.copy.get(), size);
    if (fits && !guarded_copy(l.image.copy.get(), live->data(), size)) return shrank;
    Status s = shm::validate_segment(l.image.copy.get(), size);
    if (!s.ok()) return {s.code(), path + ": " + s.message()};
    if (!fits) return {ErrorCode::kLayoutMismatch, path + ": the header does not describe this object"};
    // The rings again, by the copy's geometry (validated), not the live header's.
    if (!guarded_copy(l.image.copy.get(), live->data(), size,
                      static_cast<const shm::SegmentHeader*>(l.image.copy.get())))
      return shrank;
    l.image.source = path;
    l.image.owner = ImageOwner{live->owner_uid(), live->owner_gid(), live->mode(), /*live=*/true};
    l.image.data = l.image.copy.get();
    l.image.size = size;
    return Status::Ok();
  };
  const Status s = shm::open_segment_object(name, /*read_only=*/true, copy, {},
                                            wait_for_start ? shm::kSegmentStartWait : std::chrono::milliseconds(0));
  if (s.ok()) return l;
  if (s.code() == ErrorCode::kServerNotRunning) {
    // Both "no such object" and "not published yet": the object's
    // existence tells them apart.
    std::error_code ec;
    return failure(std::filesystem::exists(path, ec) ? ExitCode::kUnpublished : ExitCode::kNoSegment, s.message());
  }
  return failure(exit_code_for(s), s.message());
}

Loaded load_file(const std::string& path) {
  Fd f;
  // O_NONBLOCK: opening a FIFO would wait for a writer; a regular file
  // ignores the flag.
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd < 0) {
    const int err = errno;
    if (err == ENOENT) return failure(ExitCode::kNoSegment, "no such file '" + path + "'");
    return failure(ExitCode::kError, "open '" + path + "': " + errno_text(err));
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
  std::string error;
  // The header first. One that is not a segment's (magic, layout version),
  // or whose size disagrees with the file's, fails validate_segment, which
  // then reads only the header and zero pages that cost nothing.
  const size_t head = std::min<uint64_t>(size, sizeof(shm::SegmentHeader));
  if (!read_at(f.fd, l.image.copy.get(), head, 0, path, &error)) return failure(ExitCode::kError, error);
  if (!header_fits(l.image.copy.get(), size)) {
    if (Status s = shm::validate_segment(l.image.copy.get(), size); !s.ok())
      return failure(exit_code_for(s), path + ": " + s.message());
  }
  if (!read_at(f.fd, static_cast<char*>(l.image.copy.get()) + head, size - head, head, path, &error))
    return failure(ExitCode::kError, error);
  l.image.source = path;
  l.image.owner = ImageOwner{st.st_uid, st.st_gid, st.st_mode & 0777, /*live=*/false};
  l.image.data = l.image.copy.get();
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
