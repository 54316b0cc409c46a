// Where shmps-inspect's bytes come from: the live control segment mapped
// read-only (PROT_READ, so a stray write faults instead of changing it), or
// a private, 64-byte aligned copy of a segment saved in a regular file. The
// image is validated by take_snapshot(); loading only maps or reads it.
// An Image is owned by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>

#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"

namespace shmps::inspect {

// shmps-inspect's exit codes (docs/inspect.md).
enum class ExitCode : int {
  kOk = 0,
  kError = 1,        // bad command line, permission, I/O
  kNoSegment = 2,    // no such segment (or file)
  kBadSegment = 3,   // corrupt, foreign, or of another layout version
  kUnpublished = 4,  // the segment exists but its server has not published it
};

struct Image {
  std::string source;  // "/dev/shm/shmps.<name>" or the file's path
  const void* data = nullptr;
  size_t size = 0;                        // bytes
  std::unique_ptr<shm::Segment> segment;  // live: owns the read-only mapping
  struct Free {
    void operator()(void* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<void, Free> copy;  // file: owns the copy
};

struct Loaded {
  Image image;  // valid when exit == kOk
  ExitCode exit = ExitCode::kOk;
  std::string error;  // what went wrong, when exit != kOk
};

// Opens "shmps.<name>" read-only with Segment::open (which validates it and
// waits up to 2 s for a segment still being published).
Loaded load_segment(const std::string& name);
// Reads a whole regular file into memory. A file larger than the largest
// possible segment is refused (kBadSegment) without being read.
Loaded load_file(const std::string& path);

// The exit code for a take_snapshot() failure.
ExitCode exit_code_for(const Status& status);

}  // namespace shmps::inspect
