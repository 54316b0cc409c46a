// Where shmps-inspect's bytes come from: the live control segment, mapped
// read-only (PROT_READ, so a stray write faults instead of changing it) and
// copied out under a SIGBUS guard, or a segment saved in a regular file.
// Either way the image is a private, page-aligned copy, validated by
// take_snapshot(); loading only copies or reads it.
// An Image is owned by one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "shmps/shm/proc.hpp"
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

// Who owns the object or file the image was copied from.
struct ImageOwner {
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0;                 // permission bits
  bool live = false;               // the live segment's object (not a --file copy)
  uint64_t device = 0, inode = 0;  // the live object's (/proc/locks names it so); 0 for a --file copy
};

struct Image {
  std::string source;  // "/dev/shm/shmps.<name>" or the file's path
  ImageOwner owner;
  const void* data = nullptr;
  size_t size = 0;             // bytes
  std::shared_ptr<void> copy;  // owns the private copy `data` points to
};

// What a load copies of each ring (request lane, completion queue) and a
// snapshot decodes; everything outside the rings is always read. A ring
// holds up to 65536 slots and a segment 512 rings, gigabytes in all, which
// a planted or stuck segment may claim are all pending: the copy, the
// decoded snapshot and the output are bounded by `max_slots` instead.
// Text and JSON show each ring's first kSlotsShown pending slots (from its
// head, the next to be served or read) and how many more it holds;
// --list and Prometheus show no ring, and read none (kNoRings).
inline constexpr uint32_t kSlotsShown = 32;
struct RingReading {
  bool read = true;                  // false: neither a ring's indices nor its slots
  uint32_t max_slots = kSlotsShown;  // per ring
};
inline constexpr RingReading kNoRings{false, 0};

struct Loaded {
  Image image;  // valid when exit == kOk
  ExitCode exit = ExitCode::kOk;
  std::string error;                 // what went wrong, when exit != kOk
  ErrorCode cause = ErrorCode::kOk;  // its code: kPermission tells no access from the other kError failures
  // kUnpublished by what no start will finish: a header that names a dead
  // server, or an object never_written() judges so (empty or unwritten,
  // unlocked, unchanged for longer than a start's wait). A server that is
  // down, not a read that failed.
  bool dead_start = false;
};

// Copies "shmps.<name>" and validates the copy (shm::open_segment_object,
// as Segment::open does with its mapping: with `wait_for_start`, up to 2 s
// for a segment still being sized or published; without, one look, and
// such a segment is kUnpublished at once; one whose header names a dead
// server is at once, dead_start). An object that is empty or whose
// header is all zero (magic 0), that no process holds a flock on (a
// starting server holds its own from before sizing it) and whose ctime is
// older than that wait is no start in progress: kUnpublished at once,
// naming its owner and the command that removes it (dead_start). An
// object larger than any segment is kBadSegment before it is mapped. A
// segment that shrinks while being copied, or whose hole tmpfs has no
// memory for (a SIGBUS on the mapping), is kBadSegment, "the segment
// shrank while being read, or /dev/shm had no memory for a page read".
// Of a segment, only what the snapshot decodes is read, and each part
// only once what comes before it is valid: the header
// (shm::validate_header), then the tensor table (validate_segment), then
// the rest outside the rings, and of each ring what `rings` says (its
// live slots up to the cap, never its holes). `flocks`: the flocks to
// judge an unwritten object by (never_written()), for a caller that loads
// many; by default /proc/locks is read for it.
Loaded load_segment(const std::string& name, bool wait_for_start = true, RingReading rings = {},
                    const shm::FlockTable* flocks = nullptr);
// Reads a regular file as load_segment() reads a segment (anything else is
// refused without being opened for long: a FIFO does not block). A file
// larger than the largest possible segment is refused (kBadSegment)
// without being read; so is one whose header is not a segment's or
// disagrees with the file's size, after reading the header alone, and one
// whose tensor table is not valid, after reading the header and the table.
Loaded load_file(const std::string& path, RingReading rings = {});

// The exit code for a take_snapshot() failure.
ExitCode exit_code_for(const Status& status);

}  // namespace shmps::inspect
