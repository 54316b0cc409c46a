#include "shmps/shm/segment.hpp"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <boost/interprocess/shared_memory_object.hpp>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "shmps/shm/proc.hpp"

namespace bip = boost::interprocess;

namespace shmps::shm {
namespace {

constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// ShmObject::create's refusal of a fresh object another process locked
// first; Segment::create tries again on it.
constexpr std::string_view kLockedByAnother = "was locked by another process as it was created";

// What to do about EFBIG from sizing a shm object: the process's file
// size limit (RLIMIT_FSIZE) counts /dev/shm too. A process that does not
// ignore SIGXFSZ is ended by it instead (shmps-server ignores it).
constexpr const char* kFileSizeLimitFix =
    "; raise the process's file size limit (ulimit -f; LimitFSIZE= in a systemd unit), which /dev/shm counts too";

// Turns a Boost.Interprocess exception into a Status.
Status from_boost(const bip::interprocess_exception& e, const std::string& what) {
  const int err = e.get_native_error();
  if (err == EACCES || err == EPERM) return {ErrorCode::kPermission, what + ": " + errno_text(err)};
  if (err == ENOENT) return {ErrorCode::kIo, what + ": does not exist"};
  if (err == EEXIST) return {ErrorCode::kIo, what + ": already exists"};
  if (err == EFBIG) return {ErrorCode::kIo, what + ": " + errno_text(err) + kFileSizeLimitFix};
  return {ErrorCode::kIo, what + ": " + (err != 0 ? errno_text(err) : std::string(e.what()))};
}

bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// The login name of `uid`; empty when the user database has none.
std::string login_name(uid_t uid) {
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) return found->pw_name;
  return {};
}

std::string user_name(uid_t uid) {
  const std::string name = login_name(uid);
  return name.empty() ? "uid " + std::to_string(uid) : name;
}

std::string group_name(gid_t gid) {
  std::vector<char> buf(16384);
  struct group gr {};
  struct group* found = nullptr;
  if (::getgrgid_r(gid, &gr, buf.data(), buf.size(), &found) == 0 && found != nullptr) return found->gr_name;
  return "gid " + std::to_string(gid);
}

// Whether this process holds `gid` (effective or supplementary): what the
// kernel checks, not /etc/group, which a user added since login is in
// without holding it yet.
bool holds_group(gid_t gid) {
  if (::getegid() == gid) return true;
  const int n = ::getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  const int got = ::getgroups(n, groups.data());
  return got > 0 && std::find(groups.begin(), groups.begin() + got, gid) != groups.begin() + got;
}

}  // namespace

std::string owner_text(uid_t uid, gid_t gid) { return user_name(uid) + ":" + group_name(gid); }

std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 0777));
  return text;
}

namespace {

// "owner alice:staff, mode 0666": who holds an object, for every refusal.
std::string owner_and_mode(uid_t uid, gid_t gid, mode_t mode) {
  return "owner " + owner_text(uid, gid) + ", mode " + mode_text(mode);
}

// The error for EACCES/EPERM opening /dev/shm/<object_name>: the object's
// owner, group and mode (stat needs no access to the object), who this
// process is, and what would let it in. A segment is opened by its server's
// workers (and shmps-inspect), a worker's buffer by the server: in both
// cases the way in is the creator's group with a group-accessible mode
// (--group-access; buffers follow the segment's mode and group).
Status permission_denied(const std::string& object_name, bool read_only, int err) {
  const std::string path = "/dev/shm/" + object_name;
  std::string m = "open " + path + (read_only ? " read-only" : " read-write") + ": permission denied (errno " +
                  std::to_string(err) + ")";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {ErrorCode::kPermission, m};
  const unsigned mode = st.st_mode & 0777;
  const std::string group = group_name(st.st_gid), me = user_name(::geteuid());
  m += ": " + owner_and_mode(st.st_uid, st.st_gid, st.st_mode) + "; this process runs as " + me;
  const unsigned need = read_only ? 04 : 06;
  if (::geteuid() == st.st_uid)
    return {ErrorCode::kPermission, m + ", its owner, but the mode denies its owner that access"};
  const bool group_may = ((mode >> 3) & need) == need;
  const std::string only_owner = "the mode lets only its owner in: start the server with --group-access (mode 0660)";
  if (holds_group(st.st_gid))
    return {ErrorCode::kPermission, m + " in group " + group + (group_may ? "" : ", but " + only_owner)};
  // Root's group would hand workers root's group files too: a server run by
  // hand as root is better given a group of its own.
  const std::string join =
      st.st_gid == 0 ? "its group is root, which workers should not join: run the server under a group of "
                       "its own (the shmps@ unit runs it as shmps:shmps) and join that group, then log in again"
                     : "join group " + group + ": sudo adduser " + (login_name(::geteuid()).empty() ? "$USER" : me) +
                           " " + group + ", then log in again";
  return {ErrorCode::kPermission,
          m + ", not in group " + group + "; " + (group_may ? join : only_owner + " and " + join)};
}

}  // namespace

// ---------------------------------------------------------------- names

Status validate_name(const std::string& name) {
  // 32: "shmps.<name>.p<pid>.<n>" of a worker's buffer must fit kNameBytes.
  if (name.empty() || name.size() > 32)
    return {ErrorCode::kInvalidArgument, "name must be 1..32 characters, got " + std::to_string(name.size())};
  if (name[0] == '.') return {ErrorCode::kInvalidArgument, "name must not start with '.'"};
  for (char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) return {ErrorCode::kInvalidArgument, "name '" + name + "' may hold only [A-Za-z0-9._-]"};
  }
  // "<a>.p<digits>.<digits>" has the shape of one of server <a>'s worker
  // buffers ("shmps.<a>.p<pid>.<n>"): <a>'s server would remove such a
  // segment as a dead worker's buffer. Any digits, wider than
  // parse_buffer_object_name() reads (pid 0, past pid_t, n past 2^64): a
  // server of an older release sweeps those too.
  const size_t last = name.rfind('.');
  const size_t pid_dot = last == std::string::npos || last == 0 ? std::string::npos : name.rfind(".p", last - 1);
  const auto digits = [&name](size_t from, size_t to) {
    return to > from && name.find_first_not_of("0123456789", from) >= to;
  };
  if (pid_dot != std::string::npos && pid_dot > 0 && digits(pid_dot + 2, last) && digits(last + 1, name.size()))
    return {ErrorCode::kInvalidArgument, "name '" + name + "' ends in '" + name.substr(pid_dot) +
                                             "', the shape of a worker buffer's name (shmps.<name>.p<pid>.<n>)"};
  return Status::Ok();
}

std::string segment_object_name(const std::string& name) { return "shmps." + name; }

uint64_t element_count(const TensorSpec& t) {
  uint64_t n = 1;
  for (const uint64_t d : t.shape) n *= d;
  return n;
}

uint64_t total_elements(const std::vector<TensorSpec>& tensors) {
  uint64_t total = 0;
  for (const TensorSpec& t : tensors) total += element_count(t);
  return total;
}

std::string buffer_object_prefix(const std::string& name, pid_t pid) {
  return segment_object_name(name) + ".p" + std::to_string(pid) + ".";
}

std::string buffer_object_name(const std::string& name, pid_t pid, uint64_t n) {
  return buffer_object_prefix(name, pid) + std::to_string(n);
}

std::optional<BufferObjectName> parse_buffer_object_name(std::string_view object_name) {
  constexpr std::string_view kSegmentPrefix = "shmps.";
  if (!object_name.starts_with(kSegmentPrefix)) return std::nullopt;
  // Read from the end: "<n>", then "<pid>", then ".p"; the rest is the server's.
  const auto number_before = [&](size_t end, uint64_t* value) -> size_t {
    size_t begin = end;
    while (begin > 0 && object_name[begin - 1] >= '0' && object_name[begin - 1] <= '9') --begin;
    if (begin == end || std::from_chars(object_name.data() + begin, object_name.data() + end, *value).ec != std::errc{})
      return std::string_view::npos;  // none, or past 2^64 - 1
    return begin;
  };
  uint64_t n = 0, pid = 0;
  const size_t n_at = number_before(object_name.size(), &n);
  if (n_at == std::string_view::npos || n_at < 1 || object_name[n_at - 1] != '.') return std::nullopt;
  const size_t pid_at = number_before(n_at - 1, &pid);
  if (pid_at == std::string_view::npos || pid_at < 2 || object_name.substr(pid_at - 2, 2) != ".p") return std::nullopt;
  if (pid == 0 || pid > static_cast<uint64_t>(std::numeric_limits<pid_t>::max())) return std::nullopt;
  if (pid_at - 2 <= kSegmentPrefix.size()) return std::nullopt;  // no server name
  return BufferObjectName{std::string(object_name.substr(kSegmentPrefix.size(), pid_at - 2 - kSegmentPrefix.size())),
                          static_cast<pid_t>(pid), n};
}

std::vector<OrphanBuffer> orphan_buffers(const std::string& name, pid_t pid) {
  std::vector<OrphanBuffer> out;
  // Each pid is looked at once (/proc/<pid>/stat), however many names
  // carry it: anyone may fill /dev/shm with names of one pid.
  std::unordered_map<pid_t, bool> in_use;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = e.path().filename().string();
    const auto parsed = parse_buffer_object_name(file);
    if (!parsed || parsed->server != name) continue;
    if (pid != 0 && parsed->pid != pid) continue;
    if (pid == 0) {
      const auto [at, fresh] = in_use.try_emplace(parsed->pid, false);
      if (fresh) at->second = pid_in_use(parsed->pid);
      if (at->second) continue;
    }
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    out.push_back({file, parsed->pid, st.st_uid});
  }
  return out;
}

// ---------------------------------------------------------------- ShmObject

// The object's mapping (MAP_SHARED), unmapped with the ShmObject, and the
// creator's descriptor, closed with it.
struct ShmObject::Region {
  void* address = nullptr;
  size_t size = 0;
  int fd = -1;
  Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() {
    if (address != nullptr) ::munmap(address, size);
    if (fd >= 0) ::close(fd);
  }
};

ShmObject::ShmObject() = default;
ShmObject::~ShmObject() = default;
int ShmObject::descriptor() const noexcept { return region_->fd; }
void* ShmObject::mapping() const noexcept { return region_->address; }
size_t ShmObject::mapping_size() const noexcept { return region_->size; }

namespace {

// Fills *identity from the descriptor and maps bytes [offset, offset +
// length) of the object (length 0: all of it), from the page that holds
// the first: *address and *size are the mapping's, *lead the window's
// distance into it. Anything but a regular file is refused before it is
// read: a FIFO or device placed at the name must not block or feed its
// reader. *empty: refused for its 0 bytes. `accept` (if set) may refuse the
// object by its identity before anything is mapped.
Status map_object(int fd, bool read_only, const std::string& name, uint64_t offset, uint64_t length,
                  ShmObject::Identity* identity, void** address, size_t* size, size_t* lead, bool* empty,
                  bool* too_large = nullptr, uint64_t max_bytes = ~uint64_t{0}, const ShmObject::Accept& accept = {}) {
  *empty = false;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {ErrorCode::kIo, "fstat '" + name + "': " + errno_text(errno)};
  identity->device = st.st_dev;
  identity->inode = st.st_ino;
  identity->links = st.st_nlink;
  identity->uid = st.st_uid;
  identity->gid = st.st_gid;
  identity->mode = st.st_mode & 0777;
  if (!S_ISREG(st.st_mode)) {
    const std::string path = "/dev/shm/" + name;
    const char* what = S_ISFIFO(st.st_mode)   ? "a FIFO, not a regular file"
                       : S_ISDIR(st.st_mode)  ? "a directory, not a regular file"
                       : S_ISSOCK(st.st_mode) ? "a socket, not a regular file"
                       : S_ISCHR(st.st_mode)  ? "a character device, not a regular file"
                       : S_ISBLK(st.st_mode)  ? "a block device, not a regular file"
                                              : "not a regular file";
    return {ErrorCode::kIo,
            path + " is " + what + " (" + owner_and_mode(st.st_uid, st.st_gid, st.st_mode) +
                "): not a shm object any shmps process makes; remove it: " + (st.st_uid == ::geteuid() ? "" : "sudo ") +
                (S_ISDIR(st.st_mode) ? "rmdir " : "rm ") + path};
  }
  if (st.st_size == 0) {
    *empty = true;
    return {ErrorCode::kIo,
            "shm object '" + name + "' is empty (" + owner_and_mode(st.st_uid, st.st_gid, st.st_mode) + ")"};
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    if (too_large != nullptr) *too_large = true;
    return {ErrorCode::kLayoutMismatch, "shm object '" + name + "' holds " + std::to_string(st.st_size) +
                                            " bytes, more than the " + std::to_string(max_bytes) + " it may (" +
                                            owner_and_mode(st.st_uid, st.st_gid, st.st_mode) + ")"};
  }
  if (accept)
    if (Status s = accept(*identity); !s.ok()) return s;
  const auto object_bytes = static_cast<uint64_t>(st.st_size);
  if (length == 0) length = object_bytes;
  if (offset > object_bytes || length > object_bytes - offset)
    return {ErrorCode::kBadRange, "offset " + std::to_string(offset) + " + length " + std::to_string(length) +
                                      " exceeds the " + std::to_string(object_bytes) + " bytes of shm object '" + name +
                                      "'"};
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t first_page = offset / page * page;
  const auto bytes = static_cast<size_t>(offset + length - first_page);
  void* mapped = ::mmap(nullptr, bytes, read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                        static_cast<off_t>(first_page));
  if (mapped == MAP_FAILED) return {ErrorCode::kIo, "mmap '" + name + "': " + errno_text(errno)};
  *address = mapped;
  *size = bytes;
  *lead = static_cast<size_t>(offset - first_page);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ShmObject>> ShmObject::create(const std::string& object_name, size_t bytes, mode_t mode,
                                                     gid_t group, bool keep_descriptor, bool* name_taken) {
  if (name_taken != nullptr) *name_taken = false;
  if (object_name.empty() || object_name.size() >= kNameBytes || object_name.find('/') != std::string::npos)
    return Status{ErrorCode::kInvalidArgument, "bad shm object name '" + object_name + "'"};
  if ((mode & 0002) != 0 || (mode & ~mode_t{0777}) != 0)
    return Status{ErrorCode::kInvalidArgument, "refusing to create '" + object_name + "' with mode 0" +
                                                   std::to_string(mode) + ": world-writable or not a permission mode"};
  if (bytes == 0) return Status{ErrorCode::kInvalidArgument, "shm object '" + object_name + "' of 0 bytes"};
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()))
    return Status{ErrorCode::kNoCapacity, "shm object '" + object_name + "' of " + std::to_string(bytes) +
                                              " bytes: larger than any file can be"};
  std::unique_ptr<ShmObject> obj(new ShmObject());
  obj->name_ = object_name;
  obj->region_ = std::make_unique<Region>();
  bool created = false;
  // An object given to another group (a worker's buffer, the segment's
  // group) is created with its owner's bits alone and gets the rest of
  // `mode` only after the fchown: created with them, it would be open to
  // the creator's primary group until then.
  const bool regroup = group != static_cast<gid_t>(-1);
  try {
    // Boost applies the mode with fchmod on the new descriptor: no umask.
    bip::shared_memory_object shm(bip::create_only, object_name.c_str(), bip::read_write,
                                  bip::permissions(static_cast<int>(regroup ? mode & 0700 : mode)));
    created = true;
    const int fd = shm.get_mapping_handle().handle;
    // The creator's lock, held with the kept descriptor for the object's
    // life. Busy on a fresh object: a starting server took it between our
    // create and here, found it unlocked, and removes it.
    if (keep_descriptor && ::flock(fd, LOCK_EX | LOCK_NB) != 0)
      return Status{ErrorCode::kIo, "shm object '" + object_name + "' " + std::string(kLockedByAnother)};
    if (regroup && ::fchown(fd, static_cast<uid_t>(-1), group) != 0) {
      const int err = errno;
      bip::shared_memory_object::remove(object_name.c_str());
      return Status{err == EPERM ? ErrorCode::kPermission : ErrorCode::kIo,
                    "giving '" + object_name + "' group " + std::to_string(group) + ": " + errno_text(err)};
    }
    if (regroup && (mode & 0077) != 0 && ::fchmod(fd, mode) != 0) {
      const int err = errno;
      bip::shared_memory_object::remove(object_name.c_str());
      return Status{ErrorCode::kIo, "giving '" + object_name + "' mode " + mode_text(mode) + ": " + errno_text(err)};
    }
    shm.truncate(static_cast<bip::offset_t>(bytes));
    // Reserve every page now: on a full /dev/shm, fail here, not with SIGBUS.
    if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
      struct statvfs vfs {};
      const uint64_t avail = ::fstatvfs(fd, &vfs) == 0 ? uint64_t{vfs.f_bavail} * vfs.f_frsize : 0;
      bip::shared_memory_object::remove(object_name.c_str());
      if (err == ENOSPC)
        return Status{ErrorCode::kNoCapacity, "/dev/shm too small for '" + object_name + "': need " +
                                                  std::to_string(bytes) + " bytes, " + std::to_string(avail) +
                                                  " available"};
      if (err == EFBIG)
        return Status{ErrorCode::kIo, "posix_fallocate '" + object_name + "': " + errno_text(err) + kFileSizeLimitFix};
      return Status{ErrorCode::kIo, "posix_fallocate '" + object_name + "': " + errno_text(err)};
    }
    bool empty = false;
    size_t lead = 0;
    if (Status s = map_object(fd, false, object_name, 0, 0, &obj->identity_, &obj->region_->address,
                              &obj->region_->size, &lead, &empty);
        !s.ok()) {
      bip::shared_memory_object::remove(object_name.c_str());
      return s;
    }
    // Boost closes its descriptor with `shm`; a creator that asks keeps one.
    if (keep_descriptor) obj->region_->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (keep_descriptor && obj->region_->fd < 0) {
      const int err = errno;
      bip::shared_memory_object::remove(object_name.c_str());
      return Status{ErrorCode::kIo, "keeping a descriptor of '" + object_name + "': " + errno_text(err)};
    }
  } catch (const bip::interprocess_exception& e) {
    if (created) bip::shared_memory_object::remove(object_name.c_str());  // made here: not left behind
    if (!created && name_taken != nullptr) *name_taken = e.get_native_error() == EEXIST;
    return from_boost(e, "create shm object '" + object_name + "'");
  }
  obj->data_ = obj->region_->address;
  obj->size_ = obj->region_->size;
  return obj;
}

Result<std::unique_ptr<ShmObject>> ShmObject::open(const std::string& object_name, bool read_only, OpenFailure* failure,
                                                   uint64_t max_bytes) {
  return open_mapped(object_name, read_only, Window{}, failure, max_bytes);
}

Result<std::unique_ptr<ShmObject>> ShmObject::open_window(const std::string& object_name, bool read_only,
                                                          uint64_t offset, uint64_t length, OpenFailure* failure,
                                                          const Accept& accept) {
  if (failure != nullptr) *failure = OpenFailure::kOther;
  if (length == 0)
    return Status{ErrorCode::kInvalidArgument, "a window of 0 bytes of shm object '" + object_name + "'"};
  return open_mapped(object_name, read_only, Window{offset, length}, failure, ~uint64_t{0}, accept);
}

Result<std::unique_ptr<ShmObject>> ShmObject::open_mapped(const std::string& object_name, bool read_only, Window window,
                                                          OpenFailure* failure, uint64_t max_bytes,
                                                          const Accept& accept) {
  OpenFailure unused = OpenFailure::kOther;
  OpenFailure& why = failure != nullptr ? *failure : unused;
  why = OpenFailure::kOther;
  if (object_name.empty() || object_name.size() >= kNameBytes || object_name.find('/') != std::string::npos)
    return Status{ErrorCode::kInvalidArgument, "bad shm object name '" + object_name + "'"};
  std::unique_ptr<ShmObject> obj(new ShmObject());
  obj->name_ = object_name;
  obj->region_ = std::make_unique<Region>();
  // O_NONBLOCK: a FIFO at the name would block the open itself (map_object
  // refuses it once open); a regular file ignores the flag.
  const int fd = ::shm_open(object_name.c_str(), (read_only ? O_RDONLY : O_RDWR) | O_NONBLOCK, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM) return permission_denied(object_name, read_only, err);
    // shm_open does not follow a symbolic link (O_NOFOLLOW): ELOOP.
    if (err == ELOOP) {
      const std::string path = "/dev/shm/" + object_name;
      struct stat st {};
      if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
        std::vector<char> target(4096);
        const ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
        return Status{ErrorCode::kIo,
                      path + " is a symbolic link" +
                          (n > 0 ? " (to " + std::string(target.data(), static_cast<size_t>(n)) + ")" : std::string()) +
                          ", not a shm object any shmps process makes (none follows a link); remove it: " +
                          (st.st_uid == ::geteuid() ? "rm " : "sudo rm ") + path};
      }
    }
    const std::string what = "open shm object '" + object_name + "': ";
    if (err == ENOENT) why = OpenFailure::kNoObject;
    return Status{ErrorCode::kIo, what + (err == ENOENT ? std::string("does not exist") : errno_text(err))};
  }
  bool empty = false;
  bool too_large = false;
  size_t lead = 0;
  const Status mapped =
      map_object(fd, read_only, object_name, window.offset, window.length, &obj->identity_, &obj->region_->address,
                 &obj->region_->size, &lead, &empty, &too_large, max_bytes, accept);
  ::close(fd);  // the mapping stays
  if (empty) why = OpenFailure::kEmpty;
  if (too_large) why = OpenFailure::kTooLarge;
  if (!mapped.ok()) return mapped;
  obj->data_ = static_cast<char*>(obj->region_->address) + lead;
  obj->size_ = obj->region_->size - lead;
  return obj;
}

int ShmObject::remove(const std::string& object_name) {
  return ::shm_unlink(object_name.c_str()) == 0 || errno == ENOENT ? 0 : errno;
}

// ---------------------------------------------------------------- geometry

uint64_t largest_segment_size() noexcept {
  return compute_geometry(kMaxTensorsLimit, kMaxWorkersLimit, kMaxBuffersLimit, kMaxLaneCapacity).segment_size;
}

Geometry compute_geometry(uint32_t tensor_count, uint32_t max_workers, uint32_t max_buffers,
                          uint32_t lane_capacity) noexcept {
  Geometry g{};
  g.tensor_table_offset = sizeof(SegmentHeader);
  g.worker_table_offset = align_up(g.tensor_table_offset + uint64_t{tensor_count} * sizeof(TensorDesc), kCacheLine);
  g.worker_entry_size = sizeof(WorkerEntry) + uint64_t{max_buffers} * sizeof(BufferDesc);
  g.lanes_offset = align_up(g.worker_table_offset + uint64_t{max_workers} * g.worker_entry_size, kCacheLine);
  // Requests, then their publish_ns stamps; whole cache lines for every
  // capacity (2 and 4 slots of stamps are 16 and 32 bytes).
  g.lane_stride =
      align_up(sizeof(LaneHeader) + uint64_t{lane_capacity} * (sizeof(Request) + sizeof(uint64_t)), kCacheLine);
  g.completions_offset = g.lanes_offset + uint64_t{max_workers} * g.lane_stride;
  g.completion_stride = sizeof(LaneHeader) + uint64_t{lane_capacity} * sizeof(Completion);
  g.stats_offset = g.completions_offset + uint64_t{max_workers} * g.completion_stride;
  g.segment_size = align_up(g.stats_offset + sizeof(StatsBlock), 4096);
  return g;
}

// ---------------------------------------------------------------- validation

Status check_counts(uint64_t tensor_count, uint64_t max_workers, uint64_t max_buffers, uint64_t lane_capacity) {
  if (tensor_count == 0 || tensor_count > kMaxTensorsLimit)
    return {ErrorCode::kLayoutMismatch,
            "tensor_count " + std::to_string(tensor_count) + " outside 1.." + std::to_string(kMaxTensorsLimit)};
  if (max_workers == 0 || max_workers > kMaxWorkersLimit)
    return {ErrorCode::kLayoutMismatch,
            "max_workers " + std::to_string(max_workers) + " outside 1.." + std::to_string(kMaxWorkersLimit)};
  if (max_buffers == 0 || max_buffers > kMaxBuffersLimit)
    return {ErrorCode::kLayoutMismatch,
            "max_buffers " + std::to_string(max_buffers) + " outside 1.." + std::to_string(kMaxBuffersLimit)};
  if (lane_capacity < 2 || lane_capacity > kMaxLaneCapacity || !is_power_of_two(lane_capacity))
    return {ErrorCode::kLayoutMismatch,
            "lane_capacity " + std::to_string(lane_capacity) + " is not a power of two in 2..65536"};
  return Status::Ok();
}

namespace {

Status smaller_than_a_header(size_t size) {
  return {ErrorCode::kLayoutMismatch,
          "object of " + std::to_string(size) + " bytes is smaller than a shmps header (4096 bytes)"};
}

}  // namespace

Status validate_header(const SegmentHeader& h, size_t size) {
  if (size < sizeof(SegmentHeader)) return smaller_than_a_header(size);
  // A fresh object is zero-filled: magic 0 means the server is still
  // initialising it (or died doing so), not a foreign file.
  if (h.magic == 0)
    return {ErrorCode::kServerNotRunning, "segment not initialised yet (server starting, or it died while starting)"};
  if (h.magic != kMagic) {
    return {ErrorCode::kLayoutMismatch, "not a shmps segment: magic " + hex64(h.magic) + ", expected " + hex64(kMagic)};
  }
  // relaxed: a private copy; its maker's copy of the live segment was the
  // acquire side (shm::copy_shared).
  const uint32_t version = h.layout_version.load(std::memory_order_relaxed);
  if (version == 0) return {ErrorCode::kServerNotRunning, "segment not published yet (server starting)"};
  if (version != kLayoutVersion)
    return {ErrorCode::kLayoutMismatch, "segment has layout version " + std::to_string(version) +
                                            ", this build understands " + std::to_string(kLayoutVersion)};
  if (h.header_size != sizeof(SegmentHeader))
    return {ErrorCode::kLayoutMismatch, "header_size " + std::to_string(h.header_size) + " != 4096"};
  if (Status s = check_counts(h.tensor_count, h.max_workers, h.max_buffers, h.lane_capacity); !s.ok()) return s;
  if (h.tensor_desc_size != sizeof(TensorDesc))
    return {ErrorCode::kLayoutMismatch, "tensor_desc_size " + std::to_string(h.tensor_desc_size)};
  const Geometry g = compute_geometry(h.tensor_count, h.max_workers, h.max_buffers, h.lane_capacity);
  if (h.segment_size != size || g.segment_size != size)
    return {ErrorCode::kLayoutMismatch, "segment_size " + std::to_string(h.segment_size) + ", mapped " +
                                            std::to_string(size) + ", expected " + std::to_string(g.segment_size)};
  if (h.tensor_table_offset != g.tensor_table_offset || h.worker_table_offset != g.worker_table_offset ||
      h.worker_entry_size != g.worker_entry_size || h.lanes_offset != g.lanes_offset ||
      h.lane_stride != g.lane_stride || h.completions_offset != g.completions_offset ||
      h.completion_stride != g.completion_stride || h.stats_offset != g.stats_offset)
    return {ErrorCode::kLayoutMismatch, "section offsets do not match the counts in the header"};
  if (h.config.optimizer_kind < 1 || h.config.optimizer_kind > 3)
    return {ErrorCode::kLayoutMismatch, "config.optimizer_kind " + std::to_string(h.config.optimizer_kind)};
  if (h.config.backend < 1 || h.config.backend > 2)
    return {ErrorCode::kLayoutMismatch, "config.backend " + std::to_string(h.config.backend)};
  return Status::Ok();
}

Status validate_segment(const void* base, size_t size) {
  if (size < sizeof(SegmentHeader)) return smaller_than_a_header(size);  // before a byte is read
  const auto& h = *static_cast<const SegmentHeader*>(base);
  if (Status s = validate_header(h, size); !s.ok()) return s;
  const Geometry g = compute_geometry(h.tensor_count, h.max_workers, h.max_buffers, h.lane_capacity);
  const auto* tensors = reinterpret_cast<const TensorDesc*>(static_cast<const char*>(base) + g.tensor_table_offset);
  uint64_t next_offset = 0;
  std::set<std::string> names;
  for (uint32_t i = 0; i < h.tensor_count; ++i) {
    const TensorDesc& t = tensors[i];
    const std::string where = "tensor " + std::to_string(i);
    const void* nul = std::memchr(t.name, '\0', kNameBytes);
    if (nul == nullptr || t.name[0] == '\0') return {ErrorCode::kLayoutMismatch, where + ": bad name"};
    if (!names.insert(t.name).second) return {ErrorCode::kLayoutMismatch, where + ": duplicate name"};
    if (t.dtype != static_cast<uint32_t>(Dtype::kF32))
      return {ErrorCode::kLayoutMismatch, where + ": dtype " + std::to_string(t.dtype)};
    if (t.ndim == 0 || t.ndim > kMaxDims)
      return {ErrorCode::kLayoutMismatch, where + ": ndim " + std::to_string(t.ndim)};
    uint64_t count = 1;
    for (uint32_t d = 0; d < kMaxDims; ++d) {
      if (d < t.ndim) {
        if (t.shape[d] == 0 || __builtin_mul_overflow(count, t.shape[d], &count))
          return {ErrorCode::kLayoutMismatch, where + ": bad shape"};
      } else if (t.shape[d] != 0) {
        return {ErrorCode::kLayoutMismatch, where + ": shape beyond ndim"};
      }
    }
    if (count != t.element_count || t.element_offset != next_offset)
      return {ErrorCode::kLayoutMismatch, where + ": element_count/offset inconsistent"};
    if (__builtin_add_overflow(next_offset, count, &next_offset))
      return {ErrorCode::kLayoutMismatch, where + ": total overflows"};
  }
  if (next_offset != h.total_elements)
    return {ErrorCode::kLayoutMismatch,
            "total_elements " + std::to_string(h.total_elements) + " != sum of tensors " + std::to_string(next_offset)};
  return Status::Ok();
}

namespace {

// The server a header names when it lives: its magic, and both its pid
// and start time (a pid without its start time, a header half written,
// would take any process that reused the pid for the server), that
// process alive. Whatever the layout version: a server of another
// release, or one still starting, serves the name all the same.
std::optional<uint32_t> live_server_named(const SegmentHeader& h) noexcept {
  if (h.magic != kMagic || h.server_pid == 0 || h.server_start_time == 0) return std::nullopt;
  // A pid above INT_MAX turns negative, which process_alive rejects.
  if (!process_alive(static_cast<pid_t>(h.server_pid), h.server_start_time)) return std::nullopt;
  return h.server_pid;
}

}  // namespace

std::optional<uint32_t> dead_server_of_unpublished(const void* header, size_t size) noexcept {
  if (size < sizeof(SegmentHeader)) return std::nullopt;
  const auto& h = *static_cast<const SegmentHeader*>(header);
  // relaxed: a private copy.
  if (h.magic != kMagic || h.layout_version.load(std::memory_order_relaxed) != 0) return std::nullopt;
  // Both words: a pid without its start time (a header half written)
  // would take any process that reused the pid for the server.
  if (h.server_pid == 0 || h.server_start_time == 0) return std::nullopt;
  // A pid above INT_MAX turns negative, which process_alive rejects: no
  // process, as garbage should be.
  if (process_alive(static_cast<pid_t>(h.server_pid), h.server_start_time)) return std::nullopt;
  return h.server_pid;
}

// ---------------------------------------------------------------- Segment

void copy_shared(void* to, const void* from, size_t bytes) noexcept {
  auto* out = static_cast<uint64_t*>(to);
  const auto* in = static_cast<const uint64_t*>(from);
  // acquire (the GCC builtins: std::atomic_ref<const T> is not in C++20),
  // each word: SYNC(segment_published) for an opener's copy of the header;
  // for shmps-inspect's copy of a whole segment, every pair of
  // docs/design.md's table whose release word it copies.
  for (size_t i = 0; i < bytes / 8; ++i) out[i] = __atomic_load_n(in + i, __ATOMIC_ACQUIRE);
  // SYNC(segment_published): the tail, byte by byte, as the words above.
  for (size_t i = bytes / 8 * 8; i < bytes; ++i)
    static_cast<unsigned char*>(to)[i] = __atomic_load_n(static_cast<const unsigned char*>(from) + i, __ATOMIC_ACQUIRE);
}

namespace {

// The layout of a validated header and its tensor table (an opener's copy).
SegmentLayout layout_of(const SegmentHeader& h, const TensorDesc* table) {
  SegmentLayout l;
  l.tensor_count = h.tensor_count;
  l.max_workers = h.max_workers;
  l.max_buffers = h.max_buffers;
  l.lane_capacity = h.lane_capacity;
  l.total_elements = h.total_elements;
  l.generation = h.generation;
  l.server_pid = h.server_pid;
  l.server_start_time = h.server_start_time;
  l.config_flags = h.config.flags;
  l.geometry = compute_geometry(h.tensor_count, h.max_workers, h.max_buffers, h.lane_capacity);
  l.tensors.assign(table, table + h.tensor_count);
  return l;
}

// Private memory for a copy of a segment's header and tensor table,
// aligned as the header is.
struct alignas(kCacheLine) CacheLine {
  unsigned char bytes[kCacheLine];
};
static_assert(sizeof(SegmentHeader) % kCacheLine == 0 && sizeof(TensorDesc) % kCacheLine == 0);

// Copies the header and the tensor table of the mapping `obj` into *copy
// and validates the copy (validate_segment() reads nothing else): what was
// checked is what the layout is made of, however the mapping changes
// meanwhile. The table is copied for the copied header's tensor_count when
// that is within the limit (validation refuses it otherwise); a mapping
// too small for it fails validation's size check before the table is read.
Status copy_and_validate(const ShmObject& obj, std::vector<CacheLine>* copy) {
  const size_t size = obj.size();
  if (size < sizeof(SegmentHeader)) return validate_segment(obj.data(), size);  // names the size, reads nothing
  const auto& live = *static_cast<const SegmentHeader*>(obj.data());
  copy->assign(sizeof(SegmentHeader) / kCacheLine, CacheLine{});
  // SYNC(segment_published): copy_shared's acquire of the layout version,
  // the header's second word, orders the rest of the copy after publish().
  copy_shared(copy->data(), &live, sizeof(SegmentHeader));
  const uint32_t count = reinterpret_cast<const SegmentHeader*>(copy->data())->tensor_count;
  if (count <= kMaxTensorsLimit) {
    const size_t table = uint64_t{count} * sizeof(TensorDesc);
    copy->resize((sizeof(SegmentHeader) + table) / kCacheLine, CacheLine{});
    copy_shared(reinterpret_cast<char*>(copy->data()) + sizeof(SegmentHeader),
                static_cast<const char*>(obj.data()) + sizeof(SegmentHeader),
                std::min(table, size - sizeof(SegmentHeader)));
  }
  return validate_segment(copy->data(), size);
}

}  // namespace

Status validate_tensors(const std::vector<TensorSpec>& tensors) {
  if (tensors.empty() || tensors.size() > kMaxTensorsLimit)
    return {ErrorCode::kInvalidArgument,
            "a model needs 1.." + std::to_string(kMaxTensorsLimit) + " tensors, got " + std::to_string(tensors.size())};
  std::set<std::string> names;
  uint64_t total = 0;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty() || t.name.size() >= kNameBytes)
      return {ErrorCode::kInvalidArgument, "tensor name '" + t.name + "' must be 1..63 bytes"};
    for (char c : t.name)
      if (c <= ' ' || c > '~' || c == ':')
        return {ErrorCode::kInvalidArgument,
                "tensor name '" + t.name + "' has a blank, ':' or non-printable character"};
    if (!names.insert(t.name).second) return {ErrorCode::kInvalidArgument, "tensor name '" + t.name + "' given twice"};
    if (t.shape.empty() || t.shape.size() > kMaxDims)
      return {ErrorCode::kInvalidArgument, "tensor '" + t.name + "' must have 1..4 dimensions"};
    uint64_t count = 1;
    for (uint64_t d : t.shape)
      if (d == 0 || d > kMaxTotalElements || __builtin_mul_overflow(count, d, &count) || count > kMaxTotalElements)
        return {ErrorCode::kInvalidArgument, "tensor '" + t.name + "' has a dimension of 0, or over 2^40 elements"};
    total += count;  // both terms <= 2^40: no overflow
    if (total > kMaxTotalElements)
      return {ErrorCode::kInvalidArgument, "the tensors hold over 2^40 elements in total (at '" + t.name + "')"};
  }
  return Status::Ok();
}

namespace {

Status validate_spec(const SegmentSpec& spec) {
  if (Status s = validate_name(spec.name); !s.ok()) return s;
  if (Status s = check_counts(spec.tensors.size(), spec.max_workers, spec.max_buffers, spec.lane_capacity); !s.ok())
    return {ErrorCode::kInvalidArgument, s.message()};
  return validate_tensors(spec.tensors);
}

}  // namespace

namespace {

// Something holds the segment's name. A server holds an exclusive flock on
// its segment from creating it to its exit (ShmObject::create with
// keep_descriptor), so an object of ours that nobody has locked is what a
// server that died left, at whatever step it died: empty, its header not
// written yet, or a whole segment. Removes such an object, holding its lock
// meanwhile (a removal happens only under the lock: two servers starting
// cannot both judge one object dead); refuses one locked by a live process
// (a server starting or serving under the name), a segment whose header
// names a live server (a build that took no lock), and, naming its owner
// and mode, anything that is not ours. With `left_by`, only a segment
// whose header names that server (pid and start time) is removed: any
// other object is kInvalidArgument. `removed`, when given, says whether
// the object went.
struct ServerIdentity {
  uint32_t pid;
  uint64_t start_time;
};
Status clear_stale_object(const std::string& object_name, const std::string& name,
                          const ServerIdentity* left_by = nullptr, bool* removed = nullptr) {
  const std::string path = "/dev/shm/" + object_name;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    return errno == ENOENT ? Status::Ok() : Status{ErrorCode::kIo, "stat " + path + ": " + errno_text(errno)};
  const std::string who = " (" + owner_and_mode(st.st_uid, st.st_gid, st.st_mode) + ")";
  if (st.st_uid != ::geteuid())
    return {ErrorCode::kPermission,
            path + who + " belongs to another user, not to " + user_name(::geteuid()) +
                ": not adopting it; if it is stale, its owner or root must remove it (sudo rm " + path + ")"};
  if (!S_ISREG(st.st_mode)) return {ErrorCode::kLayoutMismatch, path + who + " is not a shm object; remove it by hand"};
  // O_NONBLOCK: a FIFO put there since the lstat must not block the open.
  const int fd = ::shm_open(object_name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) return errno == ENOENT ? Status::Ok() : Status{ErrorCode::kIo, "open " + path + ": " + errno_text(errno)};
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // releases the lock, after the removal
  } closer{fd};
  struct stat held {};
  if (::fstat(fd, &held) != 0) return {ErrorCode::kIo, "fstat " + path + ": " + errno_text(errno)};
  const std::string held_who = " (" + owner_and_mode(held.st_uid, held.st_gid, held.st_mode) + ")";
  // The descriptor's owner and type, not the name's a moment ago.
  if (held.st_uid != ::geteuid())
    return {ErrorCode::kPermission, path + held_who + " belongs to another user: not adopting it"};
  if (!S_ISREG(held.st_mode))
    return {ErrorCode::kLayoutMismatch, path + held_who + " is not a shm object; remove it by hand"};
  SegmentHeader h{};  // zero: an object too small to hold one names no server
  if (held.st_size > 0) {
    if (static_cast<uint64_t>(held.st_size) < sizeof(SegmentHeader))
      return {ErrorCode::kLayoutMismatch,
              path + held_who + " is " + std::to_string(held.st_size) +
                  " bytes, too small for a shmps segment; remove it by hand if it is stale"};
    // pread, not a mapping: a process that may write the object can
    // truncate it meanwhile, and a read of a mapped page past the end is
    // a SIGBUS; a short read (truncated since the fstat) names no server.
    if (::pread(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h))
      std::memset(static_cast<void*>(&h), 0, sizeof h);
    if (h.magic != kMagic && h.magic != 0)
      return {ErrorCode::kLayoutMismatch,
              path + held_who + " exists and is not a shmps segment; remove it by hand if it is stale"};
  }
  if (left_by != nullptr &&
      (h.magic != kMagic || h.server_pid != left_by->pid || h.server_start_time != left_by->start_time))
    return {ErrorCode::kInvalidArgument,
            path + " is not the segment of shmps-server pid " + std::to_string(left_by->pid) + ": not removing it"};
  if (live_server_named(h))
    return {ErrorCode::kInvalidArgument,
            "a live shmps-server (pid " + std::to_string(h.server_pid) + ") already serves '" + name + "'"};
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return {ErrorCode::kIo, "flock " + path + ": " + errno_text(errno)};
    return {ErrorCode::kInvalidArgument, "another shmps-server is starting under '" + name + "': " + path + held_who +
                                             " is locked by a live process; not replacing it"};
  }
  // Still the object at the name (only a holder of its lock removes it):
  // the one whose lock we hold goes.
  struct stat now {};
  if (::lstat(path.c_str(), &now) == 0 && now.st_ino == held.st_ino && now.st_dev == held.st_dev) {
    ShmObject::remove(object_name);
    if (removed != nullptr) *removed = true;
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Segment>> Segment::create(const SegmentSpec& spec, uint64_t generation) {
  if (Status s = validate_spec(spec); !s.ok()) return s;
  const std::string object_name = segment_object_name(spec.name);
  const Geometry g = compute_geometry(static_cast<uint32_t>(spec.tensors.size()), spec.max_workers, spec.max_buffers,
                                      spec.lane_capacity);
  // The descriptor stays, locked: the server grows the object back through
  // it (server/src/peer_guard.hpp), and its lock tells another starting
  // server that this one lives (clear_stale_object()).
  const std::string path = "/dev/shm/" + object_name;
  Result<std::unique_ptr<ShmObject>> created = Status{ErrorCode::kInternal, "not created"};
  // Another server starting under the name may remove an object of ours
  // that it opened before we locked it, as a dead start's: then we meet its
  // own object at the next try, and stop there.
  bool taken = false;
  for (int attempt = 0; attempt < 8; ++attempt) {
    created = ShmObject::create(object_name, g.segment_size, spec.mode, static_cast<gid_t>(-1),
                                /*keep_descriptor=*/true, &taken);
    if (!created.ok()) {
      const std::string& why = created.status().message();
      if (why.find(kLockedByAnother) != std::string::npos) continue;
      if (!taken) return created.status();
      if (Status s = clear_stale_object(object_name, spec.name); !s.ok()) return s;
      continue;
    }
    // Removed before our lock took (the other server's check and removal
    // fitting between our create and lock): not ours to serve.
    struct stat now {};
    if (::lstat(path.c_str(), &now) == 0 && now.st_ino == (*created)->inode()) break;
    created = Status{
        ErrorCode::kInvalidArgument,
        path + " was removed as this server created it, by another shmps-server starting under '" + spec.name + "'"};
  }
  if (!created.ok()) {
    const std::string& why = created.status().message();
    if (why.find(kLockedByAnother) == std::string::npos && !taken) return created.status();
    // Every try met an object that came back, or stayed locked: another
    // server starts under the name again and again (a crash loop).
    return Status{created.status().code(), "gave up creating " + path + " after 8 tries, each meeting an object " +
                                               "another process made there (is another shmps-server starting "
                                               "under '" +
                                               spec.name + "' in a loop?): " + why};
  }

  // The layout first, in private memory: the server's accessors use it,
  // and the header and table are written from it (the object may be
  // written by others from the moment it exists).
  SegmentLayout l;
  l.tensor_count = static_cast<uint32_t>(spec.tensors.size());
  l.max_workers = spec.max_workers;
  l.max_buffers = spec.max_buffers;
  l.lane_capacity = spec.lane_capacity;
  l.generation = generation;
  l.server_pid = static_cast<uint32_t>(::getpid());
  l.server_start_time = process_start_time(::getpid());
  l.config_flags = spec.config.flags;
  l.geometry = g;
  for (const TensorSpec& ts : spec.tensors) {
    TensorDesc t{};  // zeroed: the name NUL-padded, the shape 0 past ndim
    std::memcpy(t.name, ts.name.data(), ts.name.size());
    t.dtype = static_cast<uint32_t>(Dtype::kF32);
    t.ndim = static_cast<uint32_t>(ts.shape.size());
    uint64_t count = 1;  // validate_spec(): no overflow, at most 2^40 in all
    for (size_t d = 0; d < ts.shape.size(); ++d) {
      t.shape[d] = ts.shape[d];
      count *= ts.shape[d];
    }
    t.element_offset = l.total_elements;
    t.element_count = count;
    l.total_elements += count;
    l.tensors.push_back(t);
  }
  std::unique_ptr<Segment> seg(new Segment(spec.name, std::move(created).value(), std::move(l)));
  // The object is fresh and zero-filled: the header's other words are 0.
  seg->write_header(spec.config, ServerState::kStarting, WeightsExportBlock{});
  return seg;
}

namespace {

// The words of a header that say what the server made (all but the
// layout version, the heartbeat and the words workers write), and the
// tensor table, from `layout`: into the live header or a private image.
void fill_header(SegmentHeader& h, TensorDesc* table, const SegmentLayout& layout, const ConfigBlock& config,
                 ServerState state, const WeightsExportBlock& exported) noexcept {
  const Geometry& g = layout.geometry;
  h.magic = kMagic;
  h.header_size = sizeof(SegmentHeader);
  h.segment_size = g.segment_size;
  h.generation = layout.generation;
  h.server_pid = layout.server_pid;
  h.server_start_time = layout.server_start_time;
  h.server_state.store(static_cast<uint32_t>(state), std::memory_order_relaxed);  // relaxed: published by publish()
  h.tensor_table_offset = g.tensor_table_offset;
  h.tensor_count = layout.tensor_count;
  h.tensor_desc_size = sizeof(TensorDesc);
  h.worker_table_offset = g.worker_table_offset;
  h.max_workers = layout.max_workers;
  h.worker_entry_size = static_cast<uint32_t>(g.worker_entry_size);
  h.max_buffers = layout.max_buffers;
  h.lane_capacity = layout.lane_capacity;
  h.lanes_offset = g.lanes_offset;
  h.lane_stride = g.lane_stride;
  h.completions_offset = g.completions_offset;
  h.completion_stride = g.completion_stride;
  h.stats_offset = g.stats_offset;
  h.config = config;
  h.total_elements = layout.total_elements;
  h.weights_export = exported;
  std::memcpy(table, layout.tensors.data(), layout.tensors.size() * sizeof(TensorDesc));
}

}  // namespace

void Segment::write_header(const ConfigBlock& config, ServerState state, const WeightsExportBlock& exported) noexcept {
  SegmentHeader& h = header();
  fill_header(h, &tensor(0), layout_, config, state, exported);
  h.heartbeat_ns.store(monotonic_ns(), std::memory_order_relaxed);  // relaxed: published by publish()
}

bool Segment::header_intact(const ConfigBlock& config, ServerState state, const WeightsExportBlock& exported) const {
  // The table follows the header (compute_geometry()).
  const size_t bytes = sizeof(SegmentHeader) + layout_.tensors.size() * sizeof(TensorDesc);
  std::vector<CacheLine> seen(bytes / kCacheLine);
  copy_shared(seen.data(), &header(), bytes);
  // The image as the server would write it over what is there: equal
  // exactly when every word the server wrote still holds its value.
  std::vector<CacheLine> expected = seen;
  auto& h = *reinterpret_cast<SegmentHeader*>(expected.data());
  fill_header(h, reinterpret_cast<TensorDesc*>(&h + 1), layout_, config, state, exported);
  h.layout_version.store(kLayoutVersion, std::memory_order_relaxed);  // relaxed: private memory
  return std::memcmp(seen.data(), expected.data(), bytes) == 0;
}

void Segment::publish() noexcept {
  // SYNC(segment_published): release pairs with the acquire loads of an
  // opener's copy of the header (copy_and_validate(), shm::copy_shared);
  // everything written by create() is visible to an opener that sees the
  // version.
  header().layout_version.store(kLayoutVersion, std::memory_order_release);
}

// The uids a worker trusts to own its segment: its own effective user,
// root, and the server's user (WorkerOptions::server_user; by default the
// packaged unit's "shmps", where that user exists).
Result<std::vector<uid_t>> trusted_owners(const std::string& server_user) {
  std::vector<uid_t> uids{::geteuid()};
  if (uids[0] != 0) uids.push_back(0);
  if (server_user.find('\0') != std::string::npos)
    return Status{ErrorCode::kInvalidArgument, "WorkerOptions::server_user holds a NUL byte"};
  const std::string user = server_user.empty() ? "shmps" : server_user;
  uid_t uid = 0;
  uint64_t number = 0;
  const auto [end, err] = std::from_chars(user.data(), user.data() + user.size(), number);
  if (err == std::errc() && end == user.data() + user.size()) {
    // (uid_t)-1 means "no user" to chown and setreuid: never an owner.
    if (number >= uint64_t{static_cast<uid_t>(-1)})
      return Status{ErrorCode::kInvalidArgument, "WorkerOptions::server_user '" + server_user + "': not a uid"};
    uid = static_cast<uid_t>(number);
  } else {
    std::vector<char> buf(16384);
    struct passwd pw {};
    struct passwd* found = nullptr;
    if (::getpwnam_r(user.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
      if (server_user.empty()) return uids;  // no packaged user here: nothing more to trust
      return Status{ErrorCode::kInvalidArgument,
                    "WorkerOptions::server_user '" + server_user + "': no such user (give a login name or a uid)"};
    }
    uid = found->pw_uid;
  }
  if (std::find(uids.begin(), uids.end(), uid) == uids.end()) uids.push_back(uid);
  return uids;
}

Status check_owner_and_mode(const std::string& path, uid_t uid, gid_t gid, mode_t mode,
                            const std::vector<uid_t>& trusted) {
  const std::string who = " (" + owner_and_mode(uid, gid, mode) + ")";
  if (std::find(trusted.begin(), trusted.end(), uid) == trusted.end()) {
    std::string names;
    for (size_t i = 0; i < trusted.size(); ++i)
      names += (i == 0 ? "" : i + 1 == trusted.size() ? " or " : ", ") + user_name(trusted[i]);
    return {ErrorCode::kPermission,
            path + who + " is not owned by a user this worker trusts (" + names +
                "): not attaching to it. If that user runs your server, name it in WorkerOptions::server_user; "
                "otherwise it is not your server's segment: remove it (sudo rm " +
                path + ") and restart the server"};
  }
  if ((mode & 0002) != 0)
    return {ErrorCode::kPermission, path + who +
                                        " is world-writable, so any local user may have written it; a shmps-server "
                                        "never creates that mode: not attaching to it. Remove it (sudo rm " +
                                        path + ") and restart the server"};
  return Status::Ok();
}

Status check_group_access(const std::string& path, uid_t uid, gid_t gid, mode_t mode, uint32_t config_flags) {
  if ((mode & 0070) != 0 && (config_flags & kConfigGroupAccess) == 0)
    return Status{ErrorCode::kPermission, path + " (" + owner_and_mode(uid, gid, mode) +
                                              ") gives its group access, but its server was not started with "
                                              "--group-access: not attaching to it. Remove it (sudo rm " +
                                              path + ") and restart the server"};
  return Status::Ok();
}

namespace {

// kServerNotRunning naming the dead server and the way out, when the
// object at `object_name` is an unpublished segment whose server is dead
// (dead_server_of_unpublished()); else Ok. Its header is read with pread
// on a descriptor of its own, not through a mapping: an object its owner
// truncates meanwhile makes a short read, not a SIGBUS, and a hole reads
// as zeros without being allocated.
Status left_by_dead_start(const std::string& object_name, const std::string& name) {
  const int fd = ::shm_open(object_name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) return Status::Ok();  // gone or refused since: the caller's answer stands
  SegmentHeader h{};
  struct stat st {};
  const bool read =
      ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
  ::close(fd);
  const auto pid = read ? dead_server_of_unpublished(&h, sizeof h) : std::nullopt;
  if (!pid) return Status::Ok();
  const std::string path = "/dev/shm/" + object_name;
  return {ErrorCode::kServerNotRunning,
          path + " (" + owner_and_mode(st.st_uid, st.st_gid, st.st_mode) +
              ") is not published, and the shmps-server that made it (pid " + std::to_string(*pid) +
              ") is dead: a server start that died before publishing it left it; the next start of server '" + name +
              "' by its owner replaces it, or remove it: " + (st.st_uid == ::geteuid() ? "rm " : "sudo rm ") + path};
}

}  // namespace

std::optional<std::string> never_written(const std::string& name, const FlockTable* flocks) {
  const std::string object_name = segment_object_name(name);
  const std::string path = "/dev/shm/" + object_name;
  const int fd = ::shm_open(object_name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  uint64_t magic = 1;
  const bool readable =
      ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
      (st.st_size == 0 || (static_cast<uint64_t>(st.st_size) >= sizeof(SegmentHeader) &&
                           static_cast<uint64_t>(st.st_size) <= largest_segment_size() &&
                           ::pread(fd, &magic, sizeof magic, 0) == static_cast<ssize_t>(sizeof magic)));
  ::close(fd);
  const bool empty = readable && st.st_size == 0;
  if (!readable || (!empty && magic != 0)) return std::nullopt;
  const auto age = std::chrono::system_clock::now() -
                   std::chrono::system_clock::time_point(std::chrono::seconds(st.st_ctim.tv_sec) +
                                                         std::chrono::nanoseconds(st.st_ctim.tv_nsec));
  if (age <= kSegmentStartWait) return std::nullopt;
  const std::optional<bool> locked = flocks != nullptr ? flocks->holds(std::nullopt, st.st_dev, st.st_ino)
                                                       : holds_flock(std::nullopt, st.st_dev, st.st_ino);
  if (locked.value_or(false)) return std::nullopt;
  return path + " (" + owner_and_mode(st.st_uid, st.st_gid, st.st_mode) + ") " +
         (empty ? "is empty" : "is not initialised (no header: its magic is zero)") + ", unchanged for " +
         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(age).count()) + " s" +
         (locked.has_value() ? ", and no process holds its lock" : "") + ": a server start that died before " +
         (empty ? "sizing" : "writing") +
         " it left it, or a process that is no shmps server made it; the next start of server '" + name +
         "' by its owner replaces it, or remove it: " + (st.st_uid == ::geteuid() ? "rm " : "sudo rm ") + path;
}

std::optional<uint32_t> live_server_of(const std::string& name) {
  if (!validate_name(name).ok()) return std::nullopt;
  // pread on a descriptor of its own, as left_by_dead_start(): no SIGBUS
  // from an object truncated meanwhile.
  const std::string object_name = segment_object_name(name);
  const int fd = ::shm_open(object_name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  SegmentHeader h{};
  struct stat st {};
  const bool read =
      ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
  ::close(fd);
  return read ? live_server_named(h) : std::nullopt;
}

Status open_segment_object(const std::string& name, bool read_only,
                           const std::function<Status(std::unique_ptr<ShmObject>&)>& accept,
                           const std::function<Status(uid_t, gid_t, mode_t)>& on_empty, std::chrono::milliseconds wait,
                           const FlockTable* flocks) {
  if (Status s = validate_name(name); !s.ok()) return s;
  const std::string object_name = segment_object_name(name);
  const std::string path = "/dev/shm/" + object_name;
  // A server that is creating the segment may not have sized it (empty
  // object) or written it (zero header) yet: retry those for `wait`.
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (bool first_look = true;; first_look = false) {
    ShmObject::OpenFailure failure = ShmObject::OpenFailure::kOther;
    auto opened = ShmObject::open(object_name, read_only, &failure, largest_segment_size());
    Status s;
    if (!opened.ok()) {
      if (failure == ShmObject::OpenFailure::kNoObject)
        return Status{ErrorCode::kServerNotRunning,
                      "no shmps server named '" + name + "': " + path + " does not exist"};
      if (failure == ShmObject::OpenFailure::kTooLarge)
        return Status{ErrorCode::kLayoutMismatch, path + " holds more than any shmps segment (" +
                                                      std::to_string(largest_segment_size()) +
                                                      " bytes): " + opened.status().message()};
      if (failure != ShmObject::OpenFailure::kEmpty) return opened.status();
      struct stat st {};
      if (on_empty && ::lstat(path.c_str(), &st) == 0)
        if (Status t = on_empty(st.st_uid, st.st_gid, st.st_mode); !t.ok()) return t;
      // A starting server sizes the object right after creating it, under
      // its lock: one empty for longer at the first look, unlocked, is a
      // dead start's.
      if (first_look)
        if (auto left = never_written(name, flocks)) return Status{ErrorCode::kServerNotRunning, *left};
      s = Status{ErrorCode::kServerNotRunning, path + ": segment not sized yet (server starting)"};
    } else {
      s = accept(*opened);
      if (s.ok()) return s;
      // Not written or not published: by a server still starting, worth
      // the wait, or by one that died doing so, not worth it.
      if (s.code() == ErrorCode::kServerNotRunning) {
        if (Status dead = left_by_dead_start(object_name, name); !dead.ok()) return dead;
        if (first_look)
          if (auto left = never_written(name, flocks)) return Status{ErrorCode::kServerNotRunning, *left};
      }
    }
    if (s.code() != ErrorCode::kServerNotRunning || std::chrono::steady_clock::now() >= deadline) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<std::unique_ptr<Segment>> Segment::open(const std::string& name, bool read_only,
                                               const std::vector<uid_t>* trusted_owners,
                                               std::chrono::milliseconds wait) {
  const std::string path = "/dev/shm/" + segment_object_name(name);
  std::unique_ptr<Segment> segment;
  const auto accept = [&](std::unique_ptr<ShmObject>& obj) -> Status {
    if (trusted_owners != nullptr) {
      if (Status t = check_owner_and_mode(path, obj->owner_uid(), obj->owner_gid(), obj->mode(), *trusted_owners);
          !t.ok())
        return t;
    }
    std::vector<CacheLine> copy;
    if (Status s = copy_and_validate(*obj, &copy); !s.ok()) return Status{s.code(), path + ": " + s.message()};
    const auto& h = *reinterpret_cast<const SegmentHeader*>(copy.data());
    if (trusted_owners != nullptr) {
      if (Status g = check_group_access(path, obj->owner_uid(), obj->owner_gid(), obj->mode(), h.config.flags); !g.ok())
        return g;
    }
    const auto* table = reinterpret_cast<const TensorDesc*>(reinterpret_cast<const char*>(copy.data()) + sizeof h);
    segment.reset(new Segment(name, std::move(obj), layout_of(h, table)));
    return Status::Ok();
  };
  // An empty object is not worth waiting for unless its owner is trusted.
  const auto trust_empty = [&](uid_t uid, gid_t gid, mode_t mode) {
    return check_owner_and_mode(path, uid, gid, mode, *trusted_owners);
  };
  Status s = trusted_owners != nullptr ? open_segment_object(name, read_only, accept, trust_empty, wait)
                                       : open_segment_object(name, read_only, accept, {}, wait);
  if (!s.ok()) return s;
  return segment;
}

void Segment::remove(const std::string& name) { ShmObject::remove(segment_object_name(name)); }

bool Segment::remove_if_left_by(const std::string& name, pid_t server_pid, uint64_t server_start_time) {
  if (server_pid <= 0 || server_start_time == 0) return false;  // names no process
  const ServerIdentity left_by{static_cast<uint32_t>(server_pid), server_start_time};
  bool removed = false;
  return clear_stale_object(segment_object_name(name), name, &left_by, &removed).ok() && removed;
}

}  // namespace shmps::shm
