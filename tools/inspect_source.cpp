#include "inspect_source.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace

Loaded load_segment(const std::string& name) {
  const std::string object_path = "/dev/shm/" + shm::segment_object_name(name);
  auto opened = shm::Segment::open(name, /*read_only=*/true);
  if (!opened.ok()) {
    const Status& s = opened.status();
    switch (s.code()) {
      case ErrorCode::kLayoutMismatch:
        return failure(ExitCode::kBadSegment, s.message());
      case ErrorCode::kServerNotRunning: {
        // Segment::open says kServerNotRunning both for "no such object" and
        // for "not published yet"; the object's existence tells them apart.
        std::error_code ec;
        const bool exists = std::filesystem::exists(object_path, ec);
        return failure(exists ? ExitCode::kUnpublished : ExitCode::kNoSegment, s.message());
      }
      default:
        return failure(ExitCode::kError, s.message());
    }
  }
  Loaded l;
  l.image.source = object_path;
  l.image.segment = std::move(opened).value();
  l.image.data = l.image.segment->object().data();
  l.image.size = l.image.segment->object().size();
  return l;
}

Loaded load_file(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) {
    const int err = errno;
    if (err == ENOENT) return failure(ExitCode::kNoSegment, "no such file '" + path + "'");
    return failure(ExitCode::kError, "open '" + path + "': " + errno_text(err));
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) return failure(ExitCode::kError, "fstat '" + path + "': " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) return failure(ExitCode::kError, "'" + path + "' is not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  const shm::Geometry largest =
      shm::compute_geometry(shm::kMaxTensorsLimit, shm::kMaxWorkersLimit, shm::kMaxBuffersLimit, shm::kMaxLaneCapacity);
  if (size > largest.segment_size)
    return failure(ExitCode::kBadSegment, "'" + path + "' holds " + std::to_string(size) +
                                              " bytes, more than any shmps segment (" +
                                              std::to_string(largest.segment_size) + ")");
  // 64-byte aligned like a mapping: the layout's structs are alignas(64).
  const size_t alloc = (size + 63) / 64 * 64 + 64;
  void* mem = std::aligned_alloc(64, alloc);
  if (mem == nullptr) return failure(ExitCode::kError, "cannot allocate " + std::to_string(alloc) + " bytes");
  Loaded l;
  l.image.copy.reset(mem);
  std::memset(mem, 0, alloc);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(f.fd, static_cast<char*>(mem) + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return failure(ExitCode::kError, "read '" + path + "': " + errno_text(errno));
    if (n == 0) return failure(ExitCode::kError, "'" + path + "' shrank while being read");
    done += static_cast<size_t>(n);
  }
  l.image.source = path;
  l.image.data = mem;
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
