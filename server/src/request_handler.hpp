// What the server does with one request of an attached worker: checks it
// against the worker's session (lease, buffers) and the model (tensors,
// lengths, dtype, version, staleness), runs it on the backend and returns
// the answer, with what the server must do about it: hold the completion
// behind device work, park a pull that --staleness-policy wait holds back
// (PullGate), or stop (the device is lost). Rejections are counted
// in the stats block and logged, rate-limited. Consumer thread only.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>

#include "backend.hpp"
#include "model.hpp"
#include "pull_gate.hpp"
#include "rate_log.hpp"
#include "sessions.hpp"
#include "shmps/server/config.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {

// The staleness from which --staleness-policy scale reduces the lr: past
// max(1, max_staleness).
inline uint64_t scale_bound(uint64_t max_staleness) { return max_staleness > 1 ? max_staleness : 1; }
// The lr --staleness-policy scale applies a push `staleness` versions old
// with: lr up to the bound b = scale_bound(max_staleness), lr * b /
// staleness past it (so with max_staleness 0 or 1, Zhang et al.'s
// lr / staleness), in fp32 as written here (what tests compare bitwise
// against the kernels run with that lr).
inline float scaled_lr(float lr, uint64_t staleness, uint64_t max_staleness) {
  const uint64_t b = scale_bound(max_staleness);
  if (staleness <= b) return lr;
  const float scaled = lr * static_cast<float>(b) / static_cast<float>(staleness);
  // lr * b alone may pass the float range where the result does not.
  return std::isfinite(scaled) || !std::isfinite(lr)
             ? scaled
             : static_cast<float>(static_cast<double>(lr) * static_cast<double>(b) / static_cast<double>(staleness));
}

// The lr of the update after `updates` (the version): --lr-schedule's, from
// --lr.
inline float next_lr(const ServerConfig& config, uint64_t updates) {
  return static_cast<float>(kernels::scheduled_lr(config.lr_schedule, config.optimizer.lr, updates));
}

struct Answer {
  shm::Completion completion;
  // The buffer the request's device work uses (asynchronous backends): the
  // completion is posted once that work is done, and the buffer stays
  // mapped until then.
  std::shared_ptr<PeerBuffer> hold;
  bool applied = false;           // a push advanced the version
  bool held_back = false;         // a pull --staleness-policy wait holds: park it (PullGate), no answer yet
  uint64_t applied_until_ns = 0;  // an applied push: the clock read after its apply (0: none read)
  Status device;                  // not ok: the device context is lost; the server must stop
};

class RequestHandler {
 public:
  // `config` is the running configuration (a reload changes lr and
  // max_staleness in place).
  RequestHandler(const ServerConfig& config, Model& model, Backend& backend, Sessions& sessions, PullGate& gate,
                 shm::Segment& segment, RejectionLog& log);

  // Request `req` taken from worker i's lane at `now` (monotonic ns, this
  // turn of the loop's).
  Answer handle(uint32_t i, const shm::Request& req, uint64_t now);

  // A completion of `req` with `code` and `message` (cut to fit).
  static shm::Completion answer(const shm::Request& req, ErrorCode code, std::string_view message);

  // Refuses `req` of worker i: counted by cause, logged (rate-limited).
  // `subject`, when not empty, is what the log line names before the
  // message (the buffer a drop closes): the completion's message is cut
  // at 63 bytes, the line is not.
  Answer reject(uint32_t i, const shm::Request& req, ErrorCode code, const std::string& message,
                std::string_view subject = {});

 private:
  // The tensor range [first, last) of a push or pull, its element count,
  // and the registered buffer.
  struct Target {
    uint32_t first = 0, last = 0;
    uint64_t elements = 0;
    PeerBuffer* buffer = nullptr;
  };
  Result<Target> resolve(uint32_t i, const shm::Request& req, uint64_t element_size, const char* dtype_name) const;
  // Whether a tensor of `t` is long enough for its update to be split
  // over threads (kernels::kCpuSplitMinElements).
  bool splits(const Target& t) const;

  // Rejects `req` and forgets its buffer, whose memory vanished under us;
  // the rejection's line (rate-limited, as every rejection's) names the
  // buffer.
  Answer drop_buffer(uint32_t i, const shm::Request& req, const Status& why);
  // Rejects `req` with a backend error; a lost device is reported to the server.
  Answer backend_failed(uint32_t i, const shm::Request& req, const Status& error);

  Answer register_buffer(uint32_t i, const shm::Request& req);
  Answer unregister_buffer(uint32_t i, const shm::Request& req);
  Answer push(uint32_t i, const shm::Request& req);
  Answer pull(uint32_t i, const shm::Request& req);
  Answer init(uint32_t i, const shm::Request& req);
  Answer stats(uint32_t i, const shm::Request& req);

  const ServerConfig& config_;
  Model& model_;
  Backend& backend_;
  Sessions& sessions_;
  PullGate& gate_;
  shm::Segment& segment_;
  RejectionLog& log_;
  const bool async_;  // backend_.asynchronous(): completions may wait for device work
  uint64_t now_ = 0;
};

}  // namespace shmps::server
