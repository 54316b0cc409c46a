// Checkpoints of the server's state: weights, optimizer state, per-tensor
// step counts and version, and the federation's state when federated, in
// one file per checkpoint, written atomically
// (temp file, fsync, rename, fsync of the directory) and checksummed. Used
// by the consumer thread (snapshot, restore) and one writer thread (write,
// prune); a CheckpointWriter serialises its own writes.
//
// File "ckpt-<version, 20 digits>.shmps", little-endian:
//   CheckpointHeader                      64 B
//   CheckpointTensor[tensor_count]       112 B each
//   weights      fp32[total_elements]
//   state        fp32[state_arrays * total_elements]
//   with kCheckpointFederation in the header's flags:
//     CheckpointFederationRecord           48 B (32 B before format 5:
//                                               without restore_base_updates
//                                               and its reserved word)
//     RoundGroups                         256 B (from format 4: 8 spans {group,
//                                               first, last, members}; format
//                                               3: 192 B, spans without members)
//     anchor     fp32[total_elements]
//     momentum   fp32[total_elements], with kCheckpointOuterMomentum
//     base       fp32[total_elements], with kCheckpointRestoreBase
//   crc32        uint32 of all bytes before it (Boost.CRC, CRC-32/ISO-HDLC)
// Reserved bytes (the header's, a tensor record's, the padding of its
// name and the dimensions past its ndim, the federation record's) are
// written as zeros, and a file with any of them set is refused: putting
// them to use is a change of these bytes.
// Bump kCheckpointFormat on any change to these bytes. A checkpoint without
// a federation section is written as format 1 (no flags), which older
// builds read too; formats 4 (no restore base), 3 (its spans' members read
// as unknown) and 2 (a federation section without the RoundGroups) are
// still read.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "round_groups.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"
#include "shmps/unique_fd.hpp"

namespace shmps::server {

inline constexpr uint64_t kCheckpointMagic = 0x314b4353504d4853ull;  // "SHMPSCK1" little-endian
inline constexpr uint32_t kCheckpointFormat = 5;
// The header's flags (from format 2).
inline constexpr uint32_t kCheckpointFederation = 1u << 0;     // a federation section follows the state
inline constexpr uint32_t kCheckpointOuterMomentum = 1u << 1;  // it holds the outer momentum
inline constexpr uint32_t kCheckpointRestoreBase = 1u << 2;    // it holds a restore base (from format 5)

// What a checkpoint must match for a server to restore it, prune it or
// write over it: the model's tensors (names and shapes, in order), the
// optimizer and how many state arrays it keeps (0..3).
struct CheckpointLayout {
  std::vector<shm::TensorSpec> tensors;
  uint32_t optimizer_kind = 0;
  uint32_t state_arrays = 0;
};

// The federation's state as of the weights it is stored with
// (Federator): the anchor every host agreed on at `round`, and the outer
// optimizer's momentum (Nesterov outer step; empty otherwise). A restart
// resumes the rounds from it (Federator::restore()).
inline constexpr uint32_t kUnknownFederationHost = ~uint32_t{0};

struct FederationState {
  uint64_t round = 0;
  bool momentum_started = false;  // PyTorch's SGD: the momentum buffer holds a step
  std::vector<float> anchor;      // total elements
  std::vector<float> momentum;    // total elements, or empty
  // Local updates in W - anchor (none merged yet): the weight of this
  // host's delta in the next round after a restart that keeps the drift.
  uint64_t unmerged_updates = 0;
  // Of the rounds up to `round` (none in a format-2 file; the members
  // unknown in a format-3 one).
  RoundGroups history;
  // The lineage of the anchor (Federator::lineage()); 0: unknown (a file
  // written before it was recorded).
  uint64_t lineage = 0;
  // The id of the host that wrote it (Membership::host): the record of
  // groups tells whether *this* id was a member of the rounds since.
  // kUnknownFederationHost in a file before format 4, and for a state
  // that never joined.
  uint32_t host = kUnknownFederationHost;
  // A state restored and not joined since (Federator::restore()): the
  // weights of the checkpoint first restored, W_base, and how many of
  // `unmerged_updates` W_base - anchor holds. The updates applied since,
  // W - W_base, are in no round yet: a join keeps them whichever rule it
  // takes for the checkpoint's drift, also after further restarts from
  // checkpoints written before it. Empty and 0 otherwise (and in a file
  // before format 5).
  std::vector<float> restore_base = {};
  uint64_t restore_base_updates = 0;
};

// Everything a checkpoint holds, in host memory.
struct CheckpointData {
  uint64_t version = 0;
  CheckpointLayout layout;
  std::vector<uint64_t> steps;  // per tensor
  std::vector<float> weights;   // total elements
  std::vector<float> state;     // state_arrays * total elements
  std::optional<FederationState> federation;
};

// The bound on a checkpoint's version and per-tensor steps: a push adds 1
// to them, and a damaged file must not make the next push wrap to 0.
inline constexpr uint64_t kMaxCheckpointVersion = uint64_t{1} << 62;

class CheckpointDirLock;

// Writes `data` as dir/ckpt-<version>.shmps atomically. A file of that
// name is replaced only when its header and tensor records are of
// data.layout (one of ours, even damaged): never another model's, nor one
// it cannot identify. Errors: kIo with the failing call and errno text;
// kLayoutMismatch for such a file. The directory is opened once, and
// every file in it reached through that descriptor (as with a lock
// below).
Status write_checkpoint(const std::string& dir, const CheckpointData& data);
// The same in the directory `lock` holds (the server's writes): every
// file is created, written, renamed and checked relative to the
// directory's descriptor, and that descriptor is what is fsync'ed, so the
// write lands in the directory the lock guards whatever its path leads to
// by now (a directory moved away and another put at its path, perhaps
// locked by another server, between a CheckpointDirLock::still_held()
// check and the write). Messages name the directory by its path.
Status write_checkpoint(const CheckpointDirLock& lock, const CheckpointData& data);

// Reads and fully validates one file for a server of layout `expect`.
// Checked in this order, so that nothing is allocated from the file's word
// before its header matches `expect`: a regular file (a FIFO or device is
// refused before it is opened; `path` is followed where it is a link),
// magic, format, reserved bytes zero
// (the header's, each tensor record's, its name's padding and dimensions
// past its ndim), a version below
// kMaxCheckpointVersion and equal to the one in its name (when named
// ckpt-<20 digits>.shmps), the layout, the size; then the checksum and
// every per-tensor step below kMaxCheckpointVersion (Adam's next step must
// not wrap to 0). Weights are not judged: NaN or Inf the server wrote is
// restored as it was. Errors: kIo (cannot open, not a regular file, read
// failed), kPermission (owned by another user than the server's),
// kLayoutMismatch (corrupt, truncated, another model, or failed a
// check above: the message says which). `damaged`, when given, tells
// whether a refused file is one of this model's (its header and tensor
// records name it) that failed a later check (its size, checksum, steps
// or federation section): a file of ours, damaged, not a read error nor
// another model's.
Result<CheckpointData> read_checkpoint(const std::string& path, const CheckpointLayout& expect,
                                       bool* damaged = nullptr);
// The same for a file list_checkpoints(lock) named: its name opened in the
// directory `lock` holds, never followed (a symbolic link named like a
// checkpoint is refused, as a FIFO or device is).
Result<CheckpointData> read_checkpoint(const CheckpointDirLock& lock, const std::string& path,
                                       const CheckpointLayout& expect, bool* damaged = nullptr);

// Renames a damaged checkpoint of this model (read_checkpoint()'s
// `damaged`), one list_checkpoints(lock) named, to "<path>.damaged" in the
// directory `lock` holds: no checkpoint's name, so that neither a later
// restore reads it again nor pruning counts it among the newest
// --checkpoint-keep (it would keep the damaged file and delete valid
// ones), and kept for the operator to look at. Never over a file set aside
// before: where that name is taken, "<path>.damaged.1", ".2", ... up to
// kMostDamagedCopies. The new path, or kIo.
inline constexpr uint32_t kMostDamagedCopies = 1000;
Result<std::string> set_aside_damaged_checkpoint(const CheckpointDirLock& lock, const std::string& path);

// The checkpoint files in dir (as paths dir/<name>), newest (highest
// version) first. Errors: kIo when the directory cannot be opened or read
// to its end (no descriptor or memory left, a read error), naming it, the
// failing call and the fix: a listing cut short is never taken for an
// empty directory (a restore would start from scratch, and its writes
// replace the checkpoints there one by one).
Result<std::vector<std::string>> list_checkpoints(const std::string& dir);
// The same in the directory `lock` holds (named by its path).
Result<std::vector<std::string>> list_checkpoints(const CheckpointDirLock& lock);

// After a checkpoint of version `newest` was written: deletes all but the
// newest `keep` files of `layout` at or below `newest`. A file above it
// (newer than anything this server wrote: a restart skipped it as damaged
// or foreign), or not of `layout` (another model's, or unreadable), is left
// alone. Only headers are read. Lists, reads and deletes through one
// descriptor of the directory. A directory it cannot list is not pruned
// this time (logged as a warning).
void prune_checkpoints(const std::string& dir, uint32_t keep, uint64_t newest, const CheckpointLayout& layout);
// The same in the directory `lock` holds (the server's pruning; see
// write_checkpoint(lock, data)).
void prune_checkpoints(const CheckpointDirLock& lock, uint32_t keep, uint64_t newest, const CheckpointLayout& layout);

// Deletes the temp files (.ckpt-<version>.shmps.tmp) a writer killed in
// mid-write left. At server start, before its writer runs, with the
// directory's lock held (the overload on the lock): a checkpoint directory
// serves one server. A directory it cannot list is left as it is (logged
// as a warning).
void remove_temp_files(const std::string& dir);
void remove_temp_files(const CheckpointDirLock& lock);

// The name of a checkpoint directory's lock file (CheckpointDirLock): no
// checkpoint's or temp file's name, so the restore, pruning and the temp
// files' removal never take it for one.
inline constexpr const char* kCheckpointLockName = ".lock";

// One server's hold of its checkpoint directory: two servers on one
// directory would write over and prune each other's checkpoints, and a
// restart would restore the other's weights. An exclusive flock(2) on
// <dir>/.lock (created 0600, as the checkpoints), held while the object
// lives, released by the kernel however the process ends (no stale lock
// after a crash). The file holds the holder's pid ("pid 4242"), for the
// message of the server refused. The lock keeps a descriptor of the
// directory it locked, opened once at acquire(), and the functions above
// that take the lock reach every file through it: the server touches no
// other directory, whatever happens to the path. One owner; move-only.
class CheckpointDirLock {
 public:
  // Takes the lock of the existing directory `dir` without waiting.
  // Errors: kInvalidArgument when another process holds it (the message
  // names the directory and the holder's pid), kIo (the directory or the
  // lock file cannot be opened, the lock file locked, or it is not a
  // regular file).
  static Result<CheckpointDirLock> acquire(const std::string& dir);
  // Whether acquire(dir) would take the lock now, creating nothing: the
  // lock is taken without waiting and released at once (a missing
  // directory or lock file is free, and so is a lock file this user may
  // not open: the start, as its owner, checks it). --check-config's question, so that
  // it fails as the start would, with acquire()'s errors and messages.
  // `holder`, when given, gets the pid the holder wrote (0: free, or not
  // named). For that instant a server starting on `dir` is refused as if
  // another held it.
  static Status probe(const std::string& dir, uint32_t* holder = nullptr);
  // Whether the lock file at the directory's path is still the one this
  // lock holds. Not when the directory was moved or replaced (mv D D.old;
  // mkdir D) or its lock file removed while the server ran: another server
  // may then lock the path and write there, and the two would prune each
  // other's checkpoints; and the checkpoints written in the moved
  // directory would be invisible to a restart. Checked before each write;
  // kIo naming the cause and the fix. (Between the check and the write the
  // writes go through dir_fd() all the same.)
  Status still_held() const;
  // The locked directory: its descriptor (O_DIRECTORY), and its path as
  // given to acquire(), for messages.
  int dir_fd() const { return dir_fd_.fd; }
  const std::string& dir() const { return dir_; }

 private:
  // acquire() without the pid written. With `create` false, a missing
  // directory or lock file is no error: the lock comes back holding
  // nothing. `holder`, when given and another process holds the lock,
  // gets the pid it wrote (0: none).
  static Result<CheckpointDirLock> take(const std::string& dir, bool create, uint32_t* holder);

  UniqueFd dir_fd_;
  UniqueFd fd_;  // the lock file's; its close releases the flock
  std::string dir_;
  std::string path_;  // dir_/kCheckpointLockName
};

// Whether a server could keep its checkpoints in `dir`: a directory this
// process may create files in, or a path whose first existing ancestor is
// a directory it may create entries in (not a symbolic link to nothing),
// not on a kernel file system (procfs, sysfs, cgroup, debugfs). The start
// and --check-config refuse the same. Errors: kIo,
// "--checkpoint-dir <dir>: <why>".
Status check_checkpoint_dir(const std::string& dir);

// A background writer: submit() hands a snapshot over and returns at once;
// one write at a time (a submit while one is in flight is refused, so the
// consumer never waits for a disk).
class CheckpointWriter {
 public:
  // Writes and prunes (keeping `keep`) in the directory `lock` holds
  // (which outlives the writer), through its descriptor. `on_disk`: the
  // version of a checkpoint already there (the one the server restored),
  // which last_written() reports until a write succeeds (with no
  // unversioned change: holds()). Each write first
  // checks that `lock` is still the directory's
  // (CheckpointDirLock::still_held()). `after_check`, when set, runs on
  // the writer thread after each check that passed, before the write
  // (tests inject one that moves the directory away there, to make that
  // window deterministic).
  CheckpointWriter(uint32_t keep, std::optional<uint64_t> on_disk, const CheckpointDirLock& lock,
                   std::function<void()> after_check = {});
  ~CheckpointWriter();  // finishes the write in flight
  // `unversioned_changes`: the model's Model::unversioned_changes as of
  // the snapshot, which holds() compares once the write succeeded. False
  // when a write is still in flight (nothing taken).
  bool submit(CheckpointData data, uint64_t unversioned_changes);
  // Waits for the write in flight; returns its status (ok if none).
  Status drain();
  // Status of the last finished write, and clears it.
  Status take_result();
  bool busy() const;
  // The version of the last write that succeeded, else `on_disk`.
  std::optional<uint64_t> last_written() const;
  // Whether the last write that succeeded, else the checkpoint `on_disk`
  // (at 0 unversioned changes), holds the model at `version` and
  // `unversioned_changes`: a write handed over and failed, or one still
  // in flight, does not count.
  bool holds(uint64_t version, uint64_t unversioned_changes) const;
  // The writes that succeeded, and those that failed.
  uint64_t written() const;
  uint64_t failed() const;

 private:
  void loop();
  const uint32_t keep_;
  const CheckpointDirLock& lock_;
  const std::function<void()> after_check_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool has_job_ = false;
  bool writing_ = false;
  bool quit_ = false;
  CheckpointData job_;
  uint64_t job_unversioned_ = 0;  // submit()'s unversioned_changes of job_
  Status result_;
  std::optional<uint64_t> last_written_;
  uint64_t last_written_unversioned_ = 0;  // submit()'s, of the write last_written_ names
  uint64_t written_ = 0;
  uint64_t failed_ = 0;
  std::thread thread_;
};

}  // namespace shmps::server
