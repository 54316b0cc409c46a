// libFuzzer target: any bytes as a checkpoint file in the server's
// checkpoint directory, read for a fixed model (Adam on a:2x2, b:3) the
// way a restarting server reads it. read_checkpoint() must never fault,
// hang on the file, or allocate from the file's counts (libFuzzer's
// -rss_limit_mb catches that); a file it accepts must hold exactly the
// model's sizes (its federation section's too, and its record of epochs
// fits its round; a restore base's count is within the unmerged updates). The file is written to a memfd and read
// through /proc/self/fd, as from a path. The first reserved byte of the header (offset 48) is the harness's switch,
// zeroed in the file it reads (a reader refuses a file with a reserved byte set): while it is 0, the harness rewrites
// the trailing CRC-32 over the bytes before it, so that mutations reach the checks past the checksum (steps, sizes);
// the fuzzer can set it to try wrong checksums too. Single-threaded.
#include <sys/mman.h>
#include <unistd.h>

#include <boost/crc.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.hpp"

namespace {

const shmps::server::CheckpointLayout& layout() {
  static const shmps::server::CheckpointLayout l = [] {
    shmps::server::CheckpointLayout x;
    x.tensors = {{"a", {2, 2}}, {"b", {3}}};
    x.optimizer_kind = 2;  // Adam: two state arrays
    x.state_arrays = 2;
    return x;
  }();
  return l;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);
  constexpr size_t kCrcSwitchAt = 48;  // CheckpointHeader::reserved[0]
  if (bytes.size() >= 64 + 4 && std::exchange(bytes[kCrcSwitchAt], 0) == 0) {
    boost::crc_32_type crc;
    crc.process_bytes(bytes.data(), bytes.size() - 4);
    const uint32_t sum = crc.checksum();
    std::memcpy(bytes.data() + bytes.size() - 4, &sum, 4);
  }
  const int fd = ::memfd_create("fuzz_checkpoint", MFD_CLOEXEC);
  if (fd < 0) __builtin_trap();
  if (!bytes.empty() && ::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) __builtin_trap();
  const auto read = shmps::server::read_checkpoint("/proc/self/fd/" + std::to_string(fd), layout());
  ::close(fd);
  if (read.ok() && (read->weights.size() != 7 || read->state.size() != 14 || read->steps.size() != 2 ||
                    read->version >= shmps::server::kMaxCheckpointVersion))
    __builtin_trap();
  // A federation section, when accepted, is of the model's size too.
  if (read.ok() && read->federation &&
      (read->federation->anchor.size() != 7 ||
       (read->federation->momentum.size() != 0 && read->federation->momentum.size() != 7) ||
       (read->federation->restore_base.size() != 0 && read->federation->restore_base.size() != 7) ||
       read->federation->restore_base_updates > read->federation->unmerged_updates ||
       read->federation->round >= shmps::server::kMaxCheckpointVersion ||
       !read->federation->history.plausible(read->federation->round)))
    __builtin_trap();
  return 0;
}
