#include "checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/crc.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/log.hpp"
#include "threads.hpp"

namespace shmps::server {
namespace {

struct CheckpointHeader {
  uint64_t magic;
  uint32_t format;
  uint32_t header_size;
  uint64_t version;
  uint32_t optimizer_kind;
  uint32_t state_arrays;
  uint32_t tensor_count;
  uint32_t flags;  // kCheckpoint* (from format 2; 0 in format 1)
  uint64_t total_elements;
  uint64_t reserved[2];
};
static_assert(sizeof(CheckpointHeader) == 64 && std::is_trivially_copyable_v<CheckpointHeader>);

struct CheckpointTensor {
  char name[shm::kNameBytes];
  uint32_t ndim;
  uint32_t reserved0;
  uint64_t shape[shm::kMaxDims];
  uint64_t step;
};
static_assert(sizeof(CheckpointTensor) == 112 && std::is_trivially_copyable_v<CheckpointTensor>);

// Heads the federation section (FederationState).
struct CheckpointFederationRecord {
  uint64_t round;
  uint32_t momentum_started;  // 0 or 1
  uint32_t host;              // FederationState::host + 1 (0: unknown; 0 before format 4)
  uint64_t unmerged_updates;
  uint64_t lineage;  // 0: unknown (written as reserved, 0, before it was recorded)
  // From format 5 (the record's first 32 bytes before it):
  uint64_t restore_base_updates;  // FederationState's; 0 without kCheckpointRestoreBase
  uint64_t reserved;              // 0
};
static_assert(sizeof(CheckpointFederationRecord) == 48 && std::is_trivially_copyable_v<CheckpointFederationRecord>);

// The record's bytes as `format` stores them.
uint64_t federation_record_bytes(uint32_t format) { return format >= 5 ? sizeof(CheckpointFederationRecord) : 32; }

// The float arrays of the federation section: the anchor, the momentum
// with kCheckpointOuterMomentum and the restore base with
// kCheckpointRestoreBase.
uint64_t federation_arrays(uint32_t flags) {
  if ((flags & kCheckpointFederation) == 0) return 0;
  return 1 + ((flags & kCheckpointOuterMomentum) != 0 ? 1 : 0) + ((flags & kCheckpointRestoreBase) != 0 ? 1 : 0);
}

// The header's flags a file of `format` may hold.
uint32_t known_flags(uint32_t format) {
  if (format == 1) return 0;
  return kCheckpointFederation | kCheckpointOuterMomentum | (format >= 5 ? kCheckpointRestoreBase : 0);
}

// A span of RoundGroups as format 3 stored it: without its members.
struct CheckpointSpan3 {
  uint64_t group;
  uint64_t first;
  uint64_t last;
};
using CheckpointRoundGroups3 = std::array<CheckpointSpan3, RoundGroups::kSpans>;
static_assert(sizeof(CheckpointRoundGroups3) == 192 && std::is_trivially_copyable_v<CheckpointRoundGroups3>);

// The federation section's RoundGroups: from format 3, with the members
// from format 4.
uint64_t round_groups_bytes(uint32_t format) {
  return format >= 4 ? sizeof(RoundGroups) : format == 3 ? sizeof(CheckpointRoundGroups3) : 0;
}

// The RoundGroups of a federation section's bytes as `format` stores
// them (round_groups_bytes(format) of them).
RoundGroups round_groups_from(const unsigned char* bytes, uint32_t format) {
  RoundGroups groups;
  if (format >= 4) {
    std::memcpy(&groups, bytes, sizeof groups);
  } else if (format == 3) {
    CheckpointRoundGroups3 spans;
    std::memcpy(&spans, bytes, sizeof spans);
    for (size_t k = 0; k < spans.size(); ++k)
      groups.spans[k] = {spans[k].group, spans[k].first, spans[k].last, RoundGroups::kMembersUnknown};
  }
  return groups;
}

std::string errno_text() { return std::strerror(errno); }

// What to do about a checkpoint write into `dir` that failed with `err`
// ("; ..." to follow the error).
std::string write_fix(int err, const std::string& dir) {
  if (err == ENOSPC || err == EDQUOT)
    return "; free space on the file system of " + dir +
           ", or lower --checkpoint-keep (a write needs room for one more checkpoint than it keeps)";
  if (err == EFBIG) return "; raise the server's file size limit (LimitFSIZE= in its unit, ulimit -f)";
  return "; check " + dir + " and its disk (dmesg), and free space there";
}

// What to do about a directory listing that failed with `err`.
std::string listing_fix(int err) {
  switch (err) {
    case EMFILE:
      return "raise the server's open-file limit (LimitNOFILE= in its unit, ulimit -n)";
    case ENFILE:
      return "the system's file table is full: close files elsewhere or raise fs.file-max";
    case ENOMEM:
      return "free memory";
    default:
      return "check the directory and its file system (dmesg)";
  }
}

// What to do about a checkpoint file that could not be opened or read
// with `err` ("; ..." to follow the error): the restore leaves it as it
// is and tries the previous one.
std::string read_fix(int err) {
  switch (err) {
    case EACCES:
    case EPERM:
      return "; left as it is: to have it restored, make it readable by the server's user (uid " +
             std::to_string(::geteuid()) + ") and restart the server";
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return "; left as it is: " + listing_fix(err) + ", and restart the server to have it restored";
    default:
      return "; left as it is: check the file and its disk (dmesg)";
  }
}

std::string file_name(uint64_t version) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%020llu.shmps", static_cast<unsigned long long>(version));
  return name;
}

bool is_checkpoint_name(const std::string& n) {
  return n.size() == 5 + 20 + 6 && n.rfind("ckpt-", 0) == 0 && n.compare(25, 6, ".shmps") == 0 &&
         n.find_first_not_of("0123456789", 5) == 25;
}

// ".ckpt-<20 digits>.shmps.tmp": what write_checkpoint() renames.
bool is_temp_name(const std::string& n) {
  return n.size() == 1 + 31 + 4 && n[0] == '.' && is_checkpoint_name(n.substr(1, 31)) && n.compare(32, 4, ".tmp") == 0;
}

// The version a checkpoint's file name gives, if it is one.
std::optional<uint64_t> version_in_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (!is_checkpoint_name(name)) return std::nullopt;
  return std::stoull(name.substr(5, 20));  // 20 digits can exceed 2^64: stoull throws, caught by the caller
}

// write(2) all of it; false with errno set on failure.
bool write_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// read(2) exactly `bytes`; false on an error (errno set) or early end (errno 0).
bool read_all(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = 0;
      return false;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// "'fc1.weight' of shape 128x784", as --tensor names a shape. The name is
// as the file holds it: the log escapes what is not printable.
std::string tensor_text(const std::string& name, const std::vector<uint64_t>& shape) {
  std::string text = "'" + name + "' of shape ";
  for (size_t d = 0; d < shape.size(); ++d) text += (d == 0 ? "" : "x") + std::to_string(shape[d]);
  return text;
}

// "a symbolic link", "a FIFO": what a file of `mode` is, for messages.
std::string file_kind(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return S_ISREG(mode) ? "a regular file" : "of an unknown kind";
}

// An open checkpoint file whose header and tensor records passed every
// check that needs no payload: open_checkpoint().
struct OpenedCheckpoint {
  UniqueFd file;
  CheckpointHeader header{};
  std::vector<CheckpointTensor> tensors;
  // Its header and tensor records name this model, whatever else failed
  // (a damaged payload or size): a write of ours may replace it.
  bool ours = false;
};

// Opens `entry` in the directory `dir_fd` (AT_FDCWD: `entry` is a path),
// the file messages call `path`, and checks it as read_checkpoint()
// documents, up to the payload: everything but the checksum and the
// steps. Reads the header and tensor records only (at most 64 + 4096 x 112
// bytes).
Status open_checkpoint(int dir_fd, const std::string& entry, const std::string& path, const CheckpointLayout& expect,
                       OpenedCheckpoint* out) {
  const auto corrupt = [&](const std::string& why) { return Status{ErrorCode::kLayoutMismatch, path + ": " + why}; };
  const auto misfit = [&](const std::string& why) {
    out->ours = false;
    return Status{ErrorCode::kLayoutMismatch, path + ": does not fit this configuration (" + why + ")"};
  };
  const auto read_failed = [&](const std::string& what) {
    const int err = errno;
    return err != 0 ? Status{ErrorCode::kIo, path + ": read: " + std::strerror(err) + read_fix(err)} : corrupt(what);
  };
  // In a directory (the restore, pruning, a write's check of the file it
  // would replace) the entry itself is judged before it is opened, never a
  // link's target: a link, FIFO, device or socket named like a checkpoint
  // is refused unopened (a FIFO's open would wait for a writer, a tty's
  // make it the server's controlling terminal, a device's act on the
  // device). A path given alone (read_checkpoint(path): a tool's, the
  // fuzzer's /proc/self/fd/N) is followed, as a path is. The open keeps to
  // what was judged: O_NOFOLLOW, and O_NONBLOCK and O_NOCTTY should the
  // entry be replaced in between, whose kind fstat() then checks again.
  const bool in_dir = dir_fd != AT_FDCWD;
  const auto failed = [&](const char* call) {
    const int err = errno;
    return Status{ErrorCode::kIo, path + ": " + call + ": " + std::strerror(err) + read_fix(err)};
  };
  const auto not_regular = [&](mode_t mode) {
    return Status{ErrorCode::kIo, path + ": not a regular file (" + file_kind(mode) +
                                      "): not read; a checkpoint is read from a file of its own, never through a "
                                      "link or from a device: move it away"};
  };
  struct stat st {};
  if (::fstatat(dir_fd, entry.c_str(), &st, in_dir ? AT_SYMLINK_NOFOLLOW : 0) != 0) return failed("stat");
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  out->file.fd =
      ::openat(dir_fd, entry.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | (in_dir ? O_NOFOLLOW : 0));
  if (out->file.fd < 0) return failed("open");
  if (::fstat(out->file.fd, &st) != 0) return failed("fstat");
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  // The server writes its checkpoints as its own user, mode 0600: a file
  // of another user's was put there by someone else, and is not trusted
  // with the model's state (nor replaced, nor pruned).
  if (st.st_uid != ::geteuid())
    return {ErrorCode::kPermission, path + ": owned by uid " + std::to_string(st.st_uid) +
                                        ", not by this server's user (uid " + std::to_string(::geteuid()) +
                                        "): not trusted; if it is a checkpoint of this model, chown it to uid " +
                                        std::to_string(::geteuid())};
  const auto size = static_cast<uint64_t>(st.st_size);
  CheckpointHeader& h = out->header;
  if (size < sizeof h + 4) return corrupt("truncated header");
  if (!read_all(out->file.fd, &h, sizeof h)) return read_failed("truncated header");
  if (h.magic != kCheckpointMagic) return corrupt("not a shmps checkpoint (bad magic)");
  if (h.format == 0 || h.format > kCheckpointFormat)
    return corrupt("checkpoint format " + std::to_string(h.format) + ", this build reads 1 to " +
                   std::to_string(kCheckpointFormat));
  // A momentum or a restore base only in a federation section.
  if (h.header_size != sizeof h || h.tensor_count == 0 || h.tensor_count > shm::kMaxTensorsLimit ||
      h.state_arrays > 3 || (h.flags & ~known_flags(h.format)) != 0 ||
      (h.flags != 0 && (h.flags & kCheckpointFederation) == 0))
    return corrupt("implausible header");
  // The writer zeroes every byte it reserves (write_in()): a file with
  // any of them set holds something this build does not know of, and is
  // neither restored nor pruned nor replaced.
  const auto unknown = [&](const std::string& what) {
    out->ours = false;
    return Status{ErrorCode::kLayoutMismatch, path + ": not a checkpoint of format " + std::to_string(h.format) +
                                                  " as this build reads it (" + what + " not zero)"};
  };
  if (h.reserved[0] != 0 || h.reserved[1] != 0) return unknown("the header's reserved bytes");
  if (h.version >= kMaxCheckpointVersion) return corrupt("implausible version " + std::to_string(h.version));
  try {
    if (const auto named = version_in_name(path); named && *named != h.version)
      return corrupt("named version " + std::to_string(*named) + " but holds version " + std::to_string(h.version));
  } catch (const std::out_of_range&) {
    return corrupt("named with a version over 2^64");
  }
  // The layout before the size, and both before any allocation the file's
  // counts would size.
  const uint64_t expect_total = shm::total_elements(expect.tensors);
  if (h.tensor_count != expect.tensors.size())
    return misfit(std::to_string(h.tensor_count) + " tensors, this server has " +
                  std::to_string(expect.tensors.size()));
  if (h.optimizer_kind != expect.optimizer_kind || h.state_arrays != expect.state_arrays) {
    // "adam with 2 state arrays": what the file holds and what this server keeps.
    const auto optimizer = [](uint32_t kind, uint32_t arrays) {
      const char* name =
          kind >= 1 && kind <= 3 ? kernels::optimizer_kind_name(static_cast<kernels::OptimizerKind>(kind)) : nullptr;
      return (name != nullptr ? std::string(name) : "optimizer " + std::to_string(kind)) + " with " +
             std::to_string(arrays) + " state array(s)";
    };
    return misfit(optimizer(h.optimizer_kind, h.state_arrays) + " in the file, " +
                  optimizer(expect.optimizer_kind, expect.state_arrays) +
                  " in this server (another optimizer, or its momentum/amsgrad setting)");
  }
  if (h.total_elements != expect_total)
    return misfit(std::to_string(h.total_elements) + " parameters, this server has " + std::to_string(expect_total));
  out->ours = true;  // until a tensor record says otherwise
  // expect_total <= 2^40 (shm::validate_tensors()): no overflow below.
  const uint64_t federation_bytes = (h.flags & kCheckpointFederation) != 0
                                        ? federation_record_bytes(h.format) + round_groups_bytes(h.format) +
                                              h.total_elements * federation_arrays(h.flags) * 4
                                        : 0;
  const uint64_t expected_size = sizeof h + uint64_t{h.tensor_count} * sizeof(CheckpointTensor) +
                                 h.total_elements * (1 + h.state_arrays) * 4 + federation_bytes + 4;
  if (expected_size != size) return corrupt("size " + std::to_string(size) + " does not match its header (truncated?)");
  out->tensors.resize(h.tensor_count);
  if (!read_all(out->file.fd, out->tensors.data(), out->tensors.size() * sizeof(CheckpointTensor)))
    return read_failed("truncated");
  for (size_t i = 0; i < out->tensors.size(); ++i) {
    const CheckpointTensor& t = out->tensors[i];
    const char* name_end = static_cast<const char*>(std::memchr(t.name, '\0', sizeof t.name));
    if (name_end == nullptr || t.ndim == 0 || t.ndim > shm::kMaxDims)
      return corrupt("bad tensor record " + std::to_string(i));
    if (t.reserved0 != 0 || std::any_of(name_end, t.name + sizeof t.name, [](char c) { return c != '\0'; }) ||
        std::any_of(t.shape + t.ndim, t.shape + shm::kMaxDims, [](uint64_t d) { return d != 0; }))
      return unknown("tensor record " + std::to_string(i) + "'s reserved bytes, name padding or dimensions past its " +
                     std::to_string(t.ndim));
    const shm::TensorSpec& want = expect.tensors[i];
    const std::vector<uint64_t> shape(t.shape, t.shape + t.ndim);
    if (want.name != t.name || want.shape != shape)
      return misfit("tensor " + std::to_string(i) + " is " + tensor_text(t.name, shape) + " in the file, " +
                    tensor_text(want.name, want.shape) + " in this server");
  }
  return Status::Ok();
}

// The last component of `path`.
std::string name_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// An O_DIRECTORY descriptor of `dir` (following a symbolic link, as a path
// would), or -1 with errno set.
UniqueFd open_dir(const std::string& dir) { return UniqueFd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)); }

// The names in the directory `dir_fd`, which messages call `dir`, that
// `wanted` takes, in no order. Listed through a descriptor of its own
// (openat "."): a readdir() offset is the open file's, and `dir_fd` is
// shared. Errors: kIo naming the directory, the failing call, its errno
// text and the fix: a listing cut short (no descriptor or memory left, a
// read error) is never taken for an empty directory.
Result<std::vector<std::string>> names_in(int dir_fd, const std::string& dir, bool (*wanted)(const std::string&)) {
  const auto failed = [&dir](const char* call) {
    const int err = errno;
    return Status{ErrorCode::kIo,
                  "cannot list " + dir + " (" + call + ": " + std::strerror(err) + "): " + listing_fix(err)};
  };
  const int fd = ::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return failed("open");
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    Status s = failed("fdopendir");
    ::close(fd);
    return s;
  }
  std::vector<std::string> names;
  while (true) {
    // readdir() returns null at the end and on an error: errno tells them apart.
    errno = 0;
    const dirent* e = ::readdir(d);
    if (e == nullptr) break;
    if (wanted(e->d_name)) names.emplace_back(e->d_name);
  }
  Status s = errno != 0 ? failed("readdir") : Status::Ok();
  ::closedir(d);  // closes fd
  if (!s.ok()) return s;
  return names;
}

// write_checkpoint() in the directory `dir_fd`, which messages call `dir`.
Status write_in(int dir_fd, const std::string& dir, const CheckpointData& data) {
  const std::string final_name = file_name(data.version), temp_name = "." + final_name + ".tmp";
  const std::string final_path = dir + "/" + final_name, temp_path = dir + "/" + temp_name;
  const uint64_t total = data.weights.size();
  if (data.state.size() != uint64_t{data.layout.state_arrays} * total ||
      data.steps.size() != data.layout.tensors.size() ||
      (data.federation && (data.federation->anchor.size() != total ||
                           (!data.federation->momentum.empty() && data.federation->momentum.size() != total) ||
                           (!data.federation->restore_base.empty() && data.federation->restore_base.size() != total) ||
                           (data.federation->restore_base.empty() && data.federation->restore_base_updates != 0)))) {
    std::string sizes = std::to_string(total) + " weights, " + std::to_string(data.state.size()) +
                        " optimizer state values for " + std::to_string(data.layout.state_arrays) + " array(s), " +
                        std::to_string(data.steps.size()) + " step counts for " +
                        std::to_string(data.layout.tensors.size()) + " tensor(s)";
    if (data.federation)
      sizes += ", a federation anchor of " + std::to_string(data.federation->anchor.size()) + ", momentum of " +
               std::to_string(data.federation->momentum.size()) + ", restore base of " +
               std::to_string(data.federation->restore_base.size()) + " holding " +
               std::to_string(data.federation->restore_base_updates) + " update(s)";
    return {ErrorCode::kInternal, "checkpoint: not writing " + final_path + ": the snapshot of version " +
                                      std::to_string(data.version) + " does not hold together (" + sizes +
                                      "); a bug in shmps: please report it with this line"};
  }
  CheckpointHeader h{};
  h.magic = kCheckpointMagic;
  h.format = data.federation ? kCheckpointFormat : 1;
  h.header_size = sizeof h;
  h.version = data.version;
  h.optimizer_kind = data.layout.optimizer_kind;
  h.state_arrays = data.layout.state_arrays;
  h.tensor_count = static_cast<uint32_t>(data.layout.tensors.size());
  h.total_elements = total;
  CheckpointFederationRecord fed{};
  if (data.federation) {
    h.flags = kCheckpointFederation | (data.federation->momentum.empty() ? 0 : kCheckpointOuterMomentum) |
              (data.federation->restore_base.empty() ? 0 : kCheckpointRestoreBase);
    fed.round = data.federation->round;
    fed.momentum_started = data.federation->momentum_started ? 1 : 0;
    fed.unmerged_updates = data.federation->unmerged_updates;
    fed.lineage = data.federation->lineage;
    fed.host = data.federation->host + 1;  // kUnknownFederationHost: 0
    fed.restore_base_updates = data.federation->restore_base_updates;
  }
  // The federation section's arrays (none without it).
  std::vector<std::span<const float>> fed_arrays;
  if (data.federation) {
    fed_arrays.emplace_back(data.federation->anchor);
    if (!data.federation->momentum.empty()) fed_arrays.emplace_back(data.federation->momentum);
    if (!data.federation->restore_base.empty()) fed_arrays.emplace_back(data.federation->restore_base);
  }
  std::vector<CheckpointTensor> tensors(data.layout.tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    CheckpointTensor& t = tensors[i];
    std::memset(&t, 0, sizeof t);
    std::snprintf(t.name, sizeof t.name, "%s", data.layout.tensors[i].name.c_str());
    t.ndim = static_cast<uint32_t>(data.layout.tensors[i].shape.size());
    std::copy(data.layout.tensors[i].shape.begin(), data.layout.tensors[i].shape.end(), t.shape);
    t.step = data.steps[i];
  }
  boost::crc_32_type crc;
  crc.process_bytes(&h, sizeof h);
  crc.process_bytes(tensors.data(), tensors.size() * sizeof(CheckpointTensor));
  crc.process_bytes(data.weights.data(), data.weights.size() * sizeof(float));
  crc.process_bytes(data.state.data(), data.state.size() * sizeof(float));
  if (data.federation) {
    crc.process_bytes(&fed, sizeof fed);
    crc.process_bytes(&data.federation->history, sizeof(RoundGroups));
  }
  for (std::span<const float> a : fed_arrays) crc.process_bytes(a.data(), a.size_bytes());
  const uint32_t checksum = crc.checksum();

  // Never over another model's checkpoint (a server started with the wrong
  // options on this directory), nor over something that is not a file.
  // One of ours, even damaged, may go: this write replaces it.
  // An empty file holds nothing to lose (a crash before its first byte, or
  // a file made by hand).
  if (struct stat st{}; ::fstatat(dir_fd, final_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                        !(S_ISREG(st.st_mode) && st.st_size == 0)) {
    const auto not_replacing = [&](const std::string& why) {
      return Status{ErrorCode::kLayoutMismatch, "checkpoint: not replacing " + final_path + ": " + why +
                                                    "; move it away or use another --checkpoint-dir"};
    };
    if (!S_ISREG(st.st_mode)) return not_replacing("not a regular file (" + file_kind(st.st_mode) + ")");
    OpenedCheckpoint existing;
    if (Status fits = open_checkpoint(dir_fd, final_name, final_path, data.layout, &existing); !existing.ours) {
      // Its messages start with the path, named above already.
      std::string why = fits.message();
      if (why.rfind(final_path + ": ", 0) == 0) why.erase(0, final_path.size() + 2);
      return not_replacing(why);
    }
  }
  // A file of our own making: whatever is at the temp name goes first (a
  // FIFO there would block the open, and with it every later checkpoint
  // and the stop), and O_EXCL refuses what could not go.
  if (::unlinkat(dir_fd, temp_name.c_str(), 0) != 0 && errno != ENOENT)
    return {ErrorCode::kIo, errno == EROFS ? "checkpoint: cannot write in " + dir + ": " + errno_text()
                                           : "checkpoint: cannot remove " + temp_path + ": " + errno_text()};
  const int fd = ::openat(dir_fd, temp_name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    const int err = errno;
    return {ErrorCode::kIo,
            "checkpoint: open " + temp_path + " (for " + final_path + "): " + std::strerror(err) + write_fix(err, dir)};
  }
  bool ok = write_all(fd, &h, sizeof h) && write_all(fd, tensors.data(), tensors.size() * sizeof(CheckpointTensor)) &&
            write_all(fd, data.weights.data(), data.weights.size() * sizeof(float)) &&
            write_all(fd, data.state.data(), data.state.size() * sizeof(float)) &&
            (!data.federation ||
             (write_all(fd, &fed, sizeof fed) && write_all(fd, &data.federation->history, sizeof(RoundGroups))));
  for (std::span<const float> a : fed_arrays) ok = ok && write_all(fd, a.data(), a.size_bytes());
  ok = ok && write_all(fd, &checksum, sizeof checksum) && ::fsync(fd) == 0;
  const int write_errno = ok ? 0 : errno;
  ::close(fd);
  if (!ok) {
    ::unlinkat(dir_fd, temp_name.c_str(), 0);
    return {ErrorCode::kIo, "checkpoint: write " + temp_path + " (for " + final_path +
                                "): " + std::strerror(write_errno) + write_fix(write_errno, dir)};
  }
  if (::renameat(dir_fd, temp_name.c_str(), dir_fd, final_name.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlinkat(dir_fd, temp_name.c_str(), 0);
    return {ErrorCode::kIo, "checkpoint: rename to " + final_path + ": " + err};
  }
  // The rename is durable only once the directory is.
  if (::fsync(dir_fd) != 0) return {ErrorCode::kIo, "checkpoint: fsync " + dir + ": " + errno_text()};
  return Status::Ok();
}

// read_checkpoint() of `name` in `dir_fd` (open_checkpoint()) on `f`,
// which it opens.
Result<CheckpointData> read_opened(int dir_fd, const std::string& name, const std::string& path,
                                   const CheckpointLayout& expect, OpenedCheckpoint& f) {
  if (Status s = open_checkpoint(dir_fd, name, path, expect, &f); !s.ok()) return s;
  const auto corrupt = [&](const std::string& why) { return Status{ErrorCode::kLayoutMismatch, path + ": " + why}; };
  const CheckpointHeader& h = f.header;
  CheckpointData data;
  data.version = h.version;
  data.layout = expect;
  // Sized by this server's own model (open_checkpoint() matched it).
  data.weights.resize(h.total_elements);
  data.state.resize(h.total_elements * h.state_arrays);
  CheckpointFederationRecord fed{};
  if ((h.flags & kCheckpointFederation) != 0) {
    data.federation.emplace();
    data.federation->anchor.resize(h.total_elements);
    if ((h.flags & kCheckpointOuterMomentum) != 0) data.federation->momentum.resize(h.total_elements);
    if ((h.flags & kCheckpointRestoreBase) != 0) data.federation->restore_base.resize(h.total_elements);
  }
  const auto read_floats = [&](std::vector<float>& v) { return read_all(f.file.fd, v.data(), v.size() * 4); };
  uint32_t stored = 0;
  bool ok = read_floats(data.weights) && read_floats(data.state);
  // The record of groups as the file holds it (its format's bytes).
  std::array<unsigned char, sizeof(RoundGroups)> groups{};
  const uint64_t groups_bytes = round_groups_bytes(h.format);
  const uint64_t record_bytes = federation_record_bytes(h.format);  // the rest of `fed` stays 0
  if (data.federation)
    ok = ok && read_all(f.file.fd, &fed, record_bytes) && read_all(f.file.fd, groups.data(), groups_bytes) &&
         read_floats(data.federation->anchor) && read_floats(data.federation->momentum) &&
         read_floats(data.federation->restore_base);
  if (!ok || !read_all(f.file.fd, &stored, 4)) {
    const int err = errno;
    return err != 0 ? Status{ErrorCode::kIo, path + ": read: " + std::strerror(err) + read_fix(err)}
                    : corrupt("truncated");
  }
  boost::crc_32_type crc;
  crc.process_bytes(&h, sizeof h);
  crc.process_bytes(f.tensors.data(), f.tensors.size() * sizeof(CheckpointTensor));
  crc.process_bytes(data.weights.data(), data.weights.size() * 4);
  crc.process_bytes(data.state.data(), data.state.size() * 4);
  if (data.federation) {
    crc.process_bytes(&fed, record_bytes);
    crc.process_bytes(groups.data(), groups_bytes);
    crc.process_bytes(data.federation->anchor.data(), data.federation->anchor.size() * 4);
    crc.process_bytes(data.federation->momentum.data(), data.federation->momentum.size() * 4);
    crc.process_bytes(data.federation->restore_base.data(), data.federation->restore_base.size() * 4);
  }
  if (crc.checksum() != stored) return corrupt("checksum mismatch");
  if (data.federation) {
    // The round is a count like the version: a damaged one must not wrap.
    // A restore base's updates are some of the unmerged ones.
    const bool has_base = !data.federation->restore_base.empty();
    if (fed.momentum_started > 1 || fed.round >= kMaxCheckpointVersion ||
        fed.unmerged_updates >= kMaxCheckpointVersion || fed.restore_base_updates > fed.unmerged_updates ||
        (!has_base && fed.restore_base_updates != 0) || fed.reserved != 0)
      return corrupt("implausible federation record (round " + std::to_string(fed.round) + ", " +
                     std::to_string(fed.unmerged_updates) + " unmerged updates, " +
                     std::to_string(fed.restore_base_updates) + " of them in the restore base)");
    data.federation->history = round_groups_from(groups.data(), h.format);
    if (!data.federation->history.plausible(fed.round))
      return corrupt("implausible record of the rounds' groups for round " + std::to_string(fed.round));
    data.federation->round = fed.round;
    data.federation->unmerged_updates = fed.unmerged_updates;
    data.federation->lineage = fed.lineage;
    data.federation->host = h.format >= 4 ? fed.host - 1 : kUnknownFederationHost;  // 0 - 1: unknown
    data.federation->momentum_started = fed.momentum_started != 0;
    data.federation->restore_base_updates = fed.restore_base_updates;
  }
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    // Not <= the version: a push steps its tensors before a buffer found
    // damaged after the apply rejects it unversioned.
    if (f.tensors[i].step >= kMaxCheckpointVersion)
      return corrupt("tensor " + std::to_string(i) + " has an implausible step " + std::to_string(f.tensors[i].step));
    data.steps.push_back(f.tensors[i].step);
  }
  return data;
}

// read_checkpoint() of `name` in `dir_fd`.
Result<CheckpointData> read_in(int dir_fd, const std::string& name, const std::string& path,
                               const CheckpointLayout& expect, bool* damaged) {
  OpenedCheckpoint f;
  Result<CheckpointData> read = read_opened(dir_fd, name, path, expect, f);
  if (damaged != nullptr) *damaged = !read.ok() && f.ours && read.status().code() == ErrorCode::kLayoutMismatch;
  return read;
}

// list_checkpoints() of `dir_fd`, which the paths call `dir`.
Result<std::vector<std::string>> list_in(int dir_fd, const std::string& dir) {
  Result<std::vector<std::string>> names = names_in(dir_fd, dir, is_checkpoint_name);
  if (!names.ok()) return names;
  // Fixed-width versions: name order is version order.
  std::sort(names->rbegin(), names->rend());
  for (std::string& n : *names) n = dir + "/" + n;
  return names;
}

// prune_checkpoints() in `dir_fd`, which messages call `dir`.
void prune_in(int dir_fd, const std::string& dir, uint32_t keep, uint64_t newest, const CheckpointLayout& layout) {
  const Result<std::vector<std::string>> paths = list_in(dir_fd, dir);
  if (!paths.ok()) {
    log::warn("checkpoint: not pruning this time: " + paths.status().message() +
              "; the older checkpoints stay until a later write prunes them");
    return;
  }
  uint32_t kept = 0;
  for (const std::string& path : *paths) {
    try {
      if (version_in_name(path).value() > newest) continue;
    } catch (const std::out_of_range&) {
      continue;  // a name over 2^64: not one of ours
    }
    const std::string name = name_of(path);
    OpenedCheckpoint f;
    // Another model's, or unreadable: not ours to delete.
    if (!open_checkpoint(dir_fd, name, path, layout, &f).ok()) continue;
    if (kept < std::max<uint32_t>(keep, 1)) {
      ++kept;
      continue;
    }
    ::unlinkat(dir_fd, name.c_str(), 0);
  }
}

void remove_temps_in(int dir_fd, const std::string& dir) {
  const Result<std::vector<std::string>> temps = names_in(dir_fd, dir, is_temp_name);
  if (!temps.ok()) {
    log::warn("checkpoint: the temp files of a writer killed mid-write are not removed: " + temps.status().message());
    return;
  }
  for (const std::string& t : *temps) ::unlinkat(dir_fd, t.c_str(), 0);
}

}  // namespace

Status write_checkpoint(const std::string& dir, const CheckpointData& data) {
  const UniqueFd d = open_dir(dir);
  if (d.fd < 0) return {ErrorCode::kIo, "checkpoint: open " + dir + ": " + errno_text()};
  return write_in(d.fd, dir, data);
}

Status write_checkpoint(const CheckpointDirLock& lock, const CheckpointData& data) {
  return write_in(lock.dir_fd(), lock.dir(), data);
}

Result<CheckpointData> read_checkpoint(const std::string& path, const CheckpointLayout& expect, bool* damaged) {
  return read_in(AT_FDCWD, path, path, expect, damaged);
}

Result<CheckpointData> read_checkpoint(const CheckpointDirLock& lock, const std::string& path,
                                       const CheckpointLayout& expect, bool* damaged) {
  return read_in(lock.dir_fd(), name_of(path), path, expect, damaged);
}

Result<std::string> set_aside_damaged_checkpoint(const CheckpointDirLock& lock, const std::string& path) {
  const std::string name = name_of(path);
  const int d = lock.dir_fd();
  for (uint32_t n = 0; n <= kMostDamagedCopies; ++n) {
    const std::string suffix = n == 0 ? ".damaged" : ".damaged." + std::to_string(n);
    const std::string to = name + suffix;
    // RENAME_NOREPLACE: a file set aside before is the operator's, never
    // replaced. A file system without it (EINVAL), or a kernel or seccomp
    // filter without renameat2 (ENOSYS, EPERM), gets a hard link and an
    // unlink, which refuse an existing name as well.
    if (::renameat2(d, name.c_str(), d, to.c_str(), RENAME_NOREPLACE) == 0) return path + suffix;
    const char* call = "rename";
    if (errno == EINVAL || errno == ENOSYS || errno == EPERM) {
      call = "link";
      if (::linkat(d, name.c_str(), d, to.c_str(), 0) == 0) {
        if (::unlinkat(d, name.c_str(), 0) != 0)
          return Status{ErrorCode::kIo, "remove " + path + " (linked to " + path + suffix + "): " + errno_text()};
        return path + suffix;
      }
    }
    if (errno != EEXIST)
      return Status{ErrorCode::kIo, std::string(call) + " " + path + " to " + path + suffix + ": " + errno_text()};
  }
  return Status{ErrorCode::kIo, "not renaming " + path + ": " + path + ".damaged and .damaged.1 to .damaged." +
                                    std::to_string(kMostDamagedCopies) +
                                    " are all taken; remove those no longer needed"};
}

Result<std::vector<std::string>> list_checkpoints(const std::string& dir) {
  const UniqueFd d = open_dir(dir);
  if (d.fd < 0) return Status{ErrorCode::kIo, "cannot open " + dir + ": " + errno_text()};
  return list_in(d.fd, dir);
}

Result<std::vector<std::string>> list_checkpoints(const CheckpointDirLock& lock) {
  return list_in(lock.dir_fd(), lock.dir());
}

void prune_checkpoints(const std::string& dir, uint32_t keep, uint64_t newest, const CheckpointLayout& layout) {
  if (const UniqueFd d = open_dir(dir); d.fd >= 0) prune_in(d.fd, dir, keep, newest, layout);
}

void prune_checkpoints(const CheckpointDirLock& lock, uint32_t keep, uint64_t newest, const CheckpointLayout& layout) {
  prune_in(lock.dir_fd(), lock.dir(), keep, newest, layout);
}

// Whether the start could use `dir` for checkpoints: a directory this
// process may create files in, or a path the first existing ancestor of
// which is a directory it may create entries in, with no symbolic link to
// nothing or to a loop on the way (the start could not create the path
// through it).
Status check_checkpoint_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path at = fs::absolute(dir, ec);
  // "d/" would be followed where d is a link: the link itself is judged.
  if (!at.has_filename() && at.has_relative_path()) at = at.parent_path();
  const fs::path whole = at;
  const auto fail = [&dir](const std::string& why) {
    return Status{ErrorCode::kIo, "--checkpoint-dir " + dir + ": " + why};
  };
  // The kernel's own file systems: access() lets root in, but no file can
  // be created there (checked before access(), so that every user reads
  // the same reason).
  const auto on_kernel_fs = [](const fs::path& p) {
    struct statfs fsinfo {};
    if (::statfs(p.c_str(), &fsinfo) != 0) return false;
    const auto type = static_cast<unsigned long>(fsinfo.f_type);
    return type == PROC_SUPER_MAGIC || type == SYSFS_MAGIC || type == CGROUP_SUPER_MAGIC ||
           type == CGROUP2_SUPER_MAGIC || type == DEBUGFS_MAGIC;
  };
  constexpr const char* kKernelFs =
      "on a kernel file system (procfs, sysfs, cgroup or debugfs), where no file can be created";
  if (fs::exists(at, ec)) {
    if (!fs::is_directory(at, ec)) return fail(std::strerror(ENOTDIR));
    if (on_kernel_fs(at)) return fail(kKernelFs);
    if (::access(at.c_str(), W_OK | X_OK) != 0)
      return fail("cannot write checkpoints in it: " + std::string(std::strerror(errno)));
    return Status::Ok();
  }
  // Up to the first ancestor that exists. A symbolic link to nothing on
  // the way, the path itself or a directory above it, is refused: the
  // start's mkdir of the link fails (EEXIST), and so does that of the
  // directory below it (ENOENT).
  while (true) {
    if (fs::is_symlink(fs::symlink_status(at, ec))) {
      // To nothing, or to a loop of links (ELOOP), which the start's mkdir
      // cannot follow either.
      std::error_code follow;
      const bool to_nothing = fs::status(at, follow).type() == fs::file_type::not_found;
      const std::string link =
          "a symbolic link to " + fs::read_symlink(at, ec).string() +
          (to_nothing ? ", which does not exist" : ", which cannot be followed: " + follow.message());
      return fail(at == whole ? link : at.string() + " is " + link);
    }
    if (!at.has_parent_path() || at == at.parent_path()) break;
    at = at.parent_path();
    if (fs::exists(at, ec)) break;
  }
  if (!fs::is_directory(at, ec)) return fail(at.string() + ": " + std::strerror(ENOTDIR));
  if (on_kernel_fs(at)) return fail(kKernelFs);
  if (::access(at.c_str(), W_OK | X_OK) != 0)
    return fail("cannot create it in " + at.string() + ": " + std::strerror(errno));
  return Status::Ok();
}

void remove_temp_files(const std::string& dir) {
  if (const UniqueFd d = open_dir(dir); d.fd >= 0) remove_temps_in(d.fd, dir);
}

void remove_temp_files(const CheckpointDirLock& lock) { remove_temps_in(lock.dir_fd(), lock.dir()); }

Result<CheckpointDirLock> CheckpointDirLock::take(const std::string& dir, bool create, uint32_t* holder) {
  const std::string path = dir + "/" + kCheckpointLockName;
  // The directory once (following a symbolic link, as the path does), and
  // the lock file in it: both are then the ones this lock holds, whatever
  // the path leads to later. O_NONBLOCK: a FIFO planted there must not
  // block the start; O_NOFOLLOW: nor a link lead the pid's write elsewhere.
  CheckpointDirLock lock;
  lock.dir_fd_ = open_dir(dir);
  if (lock.dir_fd_.fd < 0 && !create && errno == ENOENT) return lock;
  if (lock.dir_fd_.fd < 0)
    return Status{ErrorCode::kIo, "--checkpoint-dir " + dir + ": cannot open it: " + errno_text()};
  // Read-only for a probe (flock needs no write access), which passes a
  // lock file it may not open (the service user's, mode 0600, checked by
  // another user): the start checks it then.
  lock.fd_.fd = ::openat(lock.dir_fd_.fd, kCheckpointLockName,
                         (create ? O_RDWR | O_CREAT : O_RDONLY) | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock.fd_.fd < 0 && !create && (errno == ENOENT || errno == EACCES)) return lock;
  if (lock.fd_.fd < 0)
    return Status{ErrorCode::kIo, "--checkpoint-dir " + dir + ": open " + path + ": " + errno_text()};
  struct stat st {};
  if (::fstat(lock.fd_.fd, &st) != 0 || !S_ISREG(st.st_mode))
    return Status{ErrorCode::kIo, "--checkpoint-dir " + dir + ": " + path + " is not a regular file"};
  if (::flock(lock.fd_.fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK)
      return Status{ErrorCode::kIo, "--checkpoint-dir " + dir + ": flock " + path + ": " + errno_text()};
    // The holder wrote its pid once it held the lock.
    char text[32] = {};
    const ssize_t n = ::pread(lock.fd_.fd, text, sizeof text - 1, 0);
    unsigned long pid = 0;
    const bool named = n > 0 && std::sscanf(text, "pid %lu", &pid) == 1 && pid != 0 && pid <= UINT32_MAX;
    if (holder != nullptr) *holder = named ? static_cast<uint32_t>(pid) : 0;
    return Status{ErrorCode::kInvalidArgument,
                  "--checkpoint-dir " + dir + " is in use by another shmps-server" +
                      (named ? " (pid " + std::to_string(pid) + ")" : std::string()) + ", which holds " + path +
                      ": a checkpoint directory serves one server (each would write over and prune the other's "
                      "checkpoints); give each server a directory of its own (federated hosts on one machine: "
                      "--fed-rank-in-name), or stop the other first"};
  }
  lock.dir_ = dir;
  lock.path_ = path;
  return lock;
}

Status CheckpointDirLock::probe(const std::string& dir, uint32_t* holder) {
  if (holder != nullptr) *holder = 0;
  // Released as `taken` goes out of scope.
  const Result<CheckpointDirLock> taken = take(dir, /*create=*/false, holder);
  return taken.ok() ? Status::Ok() : taken.status();
}

Result<CheckpointDirLock> CheckpointDirLock::acquire(const std::string& dir) {
  Result<CheckpointDirLock> taken = take(dir, /*create=*/true, nullptr);
  if (!taken.ok()) return taken.status();
  CheckpointDirLock lock = std::move(taken).value();
  const std::string mine = "pid " + std::to_string(::getpid()) + "\n";
  // The pid only names the holder in another server's message: a write
  // that fails leaves the lock held all the same.
  if (::ftruncate(lock.fd_.fd, 0) == 0) static_cast<void>(::pwrite(lock.fd_.fd, mine.data(), mine.size(), 0));
  return lock;
}

Status CheckpointDirLock::still_held() const {
  struct stat held {
  }, at_path{};
  if (::fstat(fd_.fd, &held) == 0 && ::lstat(path_.c_str(), &at_path) == 0 && held.st_dev == at_path.st_dev &&
      held.st_ino == at_path.st_ino)
    return Status::Ok();
  return {ErrorCode::kIo, "checkpoint: not writing in " + dir_ + ": its lock file " + path_ +
                              " is not the one this server locked at start (the directory was moved or replaced, or "
                              "the lock file removed, while the server ran), so another server may be writing there; "
                              "put the directory back, or restart this server to take the lock again"};
}

CheckpointWriter::CheckpointWriter(uint32_t keep, std::optional<uint64_t> on_disk, const CheckpointDirLock& lock,
                                   std::function<void()> after_check)
    : keep_(keep),
      lock_(lock),
      after_check_(std::move(after_check)),
      last_written_(on_disk),
      thread_(start_helper_thread([this] { loop(); })) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard lock(mutex_);
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool CheckpointWriter::submit(CheckpointData data, uint64_t unversioned_changes) {
  {
    std::lock_guard lock(mutex_);
    if (has_job_ || writing_) return false;
    job_ = std::move(data);
    job_unversioned_ = unversioned_changes;
    has_job_ = true;
  }
  cv_.notify_all();
  return true;
}

Status CheckpointWriter::drain() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !has_job_ && !writing_; });
  Status s = result_;
  result_ = Status::Ok();
  return s;
}

Status CheckpointWriter::take_result() {
  std::lock_guard lock(mutex_);
  Status s = result_;
  result_ = Status::Ok();
  return s;
}

std::optional<uint64_t> CheckpointWriter::last_written() const {
  std::lock_guard lock(mutex_);
  return last_written_;
}

bool CheckpointWriter::holds(uint64_t version, uint64_t unversioned_changes) const {
  std::lock_guard lock(mutex_);
  return last_written_ == version && last_written_unversioned_ == unversioned_changes;
}

uint64_t CheckpointWriter::written() const {
  std::lock_guard lock(mutex_);
  return written_;
}

uint64_t CheckpointWriter::failed() const {
  std::lock_guard lock(mutex_);
  return failed_;
}

bool CheckpointWriter::busy() const {
  std::lock_guard lock(mutex_);
  return has_job_ || writing_;
}

void CheckpointWriter::loop() {
  name_this_thread("shmps-ckpt");
  std::unique_lock lock(mutex_);
  while (true) {
    cv_.wait(lock, [&] { return quit_ || has_job_; });
    if (!has_job_) return;  // quit with nothing pending
    CheckpointData job = std::move(job_);
    const uint64_t unversioned = job_unversioned_;
    has_job_ = false;
    writing_ = true;
    lock.unlock();
    // Through the lock's descriptor: a directory put at the path since the
    // check is not touched.
    Status s = lock_.still_held();
    if (s.ok() && after_check_) after_check_();
    if (s.ok()) s = write_checkpoint(lock_, job);
    if (s.ok()) prune_checkpoints(lock_, keep_, job.version, job.layout);
    lock.lock();
    writing_ = false;
    if (s.ok()) {
      last_written_ = job.version;
      last_written_unversioned_ = unversioned;
      ++written_;
    } else {
      result_ = s;  // the newest failure's message; failed_ counts them all
      ++failed_;
    }
    cv_.notify_all();
  }
}

}  // namespace shmps::server
