// Checkpoints of the server's state: weights, optimizer state, per-tensor
// step counts and version, in one file per checkpoint, written atomically
// (temp file, fsync, rename, fsync of the directory) and checksummed. Used
// by the consumer thread (snapshot, restore) and one writer thread (write,
// prune); a CheckpointWriter serialises its own writes.
//
// File "ckpt-<version, 20 digits>.shmps", little-endian:
//   CheckpointHeader                      64 B
//   CheckpointTensor[tensor_count]       112 B each
//   weights      fp32[total_elements]
//   state        fp32[state_arrays * total_elements]
//   crc32        uint32 of all bytes before it (Boost.CRC, CRC-32/ISO-HDLC)
// Bump kCheckpointFormat on any change to these bytes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shmps/shm/layout.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

inline constexpr uint64_t kCheckpointMagic = 0x314b4353504d4853ull;  // "SHMPSCK1" little-endian
inline constexpr uint32_t kCheckpointFormat = 1;

// Everything a checkpoint holds, in host memory.
struct CheckpointData {
  uint64_t version = 0;
  uint32_t optimizer_kind = 0;
  uint32_t state_arrays = 0;
  std::vector<shm::TensorSpec> tensors;
  std::vector<uint64_t> steps;       // per tensor
  std::vector<float> weights;        // total elements
  std::vector<float> state;          // state_arrays * total elements
};

// Writes `data` as dir/ckpt-<version>.shmps atomically. Errors: kIo with
// the failing call and errno text.
Status write_checkpoint(const std::string& dir, const CheckpointData& data);

// Reads and fully validates one file: magic, format, sizes, checksum.
// Errors: kIo (unreadable), kLayoutMismatch (corrupt or truncated: the
// message says which check failed).
Result<CheckpointData> read_checkpoint(const std::string& path);

// The checkpoint files in dir, newest (highest version) first.
std::vector<std::string> list_checkpoints(const std::string& dir);

// Deletes all but the newest `keep` checkpoint files (and stray temp files).
void prune_checkpoints(const std::string& dir, uint32_t keep);

// A background writer: submit() hands a snapshot over and returns at once;
// one write at a time (a submit while one is in flight is refused, so the
// consumer never waits for a disk).
class CheckpointWriter {
 public:
  CheckpointWriter(std::string dir, uint32_t keep);
  ~CheckpointWriter();  // finishes the write in flight
  // False when a write is still in flight (nothing taken).
  bool submit(CheckpointData data);
  // Waits for the write in flight; returns its status (ok if none).
  Status drain();
  // Status of the last finished write, and clears it.
  Status take_result();
  bool busy() const;

 private:
  void loop();
  std::string dir_;
  uint32_t keep_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool has_job_ = false;
  bool writing_ = false;
  bool quit_ = false;
  CheckpointData job_;
  Status result_;
  std::thread thread_;
};

}  // namespace shmps::server
