#include "request_handler.hpp"

#include <cmath>

#include <cstring>
#include <string>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/log.hpp"
#include "shmps/shm/proc.hpp"

namespace shmps::server {

using shm::Completion;
using shm::Opcode;
using shm::Request;

namespace {

// The kernels' mirrors of the wire vocabulary (kernels/ depends on nothing of ours).
static_assert(static_cast<uint32_t>(kernels::GradDtype::kF32) == static_cast<uint32_t>(shm::Dtype::kF32) &&
              static_cast<uint32_t>(kernels::GradDtype::kF16) == static_cast<uint32_t>(shm::Dtype::kF16) &&
              static_cast<uint32_t>(kernels::GradDtype::kBF16) == static_cast<uint32_t>(shm::Dtype::kBF16));
static_assert(static_cast<uint32_t>(kernels::OptimizerKind::kSgd) == static_cast<uint32_t>(shm::OptimizerKind::kSgd) &&
              static_cast<uint32_t>(kernels::OptimizerKind::kAdam) ==
                  static_cast<uint32_t>(shm::OptimizerKind::kAdam) &&
              static_cast<uint32_t>(kernels::OptimizerKind::kAdamW) ==
                  static_cast<uint32_t>(shm::OptimizerKind::kAdamW));

const char* opcode_name(uint32_t opcode) {
  const char* name = shm::opcode_name(opcode);
  return name != nullptr ? name : "request";
}

Answer ok(const Request& req, uint64_t version) {
  Answer a;
  a.completion = RequestHandler::answer(req, ErrorCode::kOk, "");
  a.completion.version = version;
  return a;
}

}  // namespace

RequestHandler::RequestHandler(const ServerConfig& config, Model& model, Backend& backend, Sessions& sessions,
                               PullGate& gate, shm::Segment& segment, RejectionLog& log)
    : config_(config),
      model_(model),
      backend_(backend),
      sessions_(sessions),
      gate_(gate),
      segment_(segment),
      log_(log),
      async_(backend.asynchronous()) {}

Completion RequestHandler::answer(const Request& req, ErrorCode code, std::string_view message) {
  Completion c{};
  c.request_id = req.request_id;
  c.opcode = req.opcode;
  c.code = static_cast<uint32_t>(code);
  // Most completions are successes without a message, and c is zeroed:
  // skip the formatting (about 230 of the ~1.8K instructions a push costs
  // the protocol, by callgrind).
  if (!message.empty()) shm::set_message(c, message);
  return c;
}

Answer RequestHandler::handle(uint32_t i, const Request& req, uint64_t now) {
  now_ = now;
  shm::WorkerEntry& entry = segment_.worker(i);
  if (req.worker_id != i)
    return reject(i, req, ErrorCode::kBadRequest,
                  "worker_id " + std::to_string(req.worker_id) + " on lane " + std::to_string(i));
  if (req.opcode == 0 || req.opcode > shm::kOpcodeMax)
    return reject(i, req, ErrorCode::kBadRequest, "unknown opcode " + std::to_string(req.opcode));
  if (req.flags != 0) return reject(i, req, ErrorCode::kBadRequest, "flags must be 0");
  if (req.opcode == static_cast<uint32_t>(Opcode::kAttach))
    return reject(i, req, ErrorCode::kBadRequest, "attach is a handshake in the worker entry, not a request");
  // Our copy of the lease: the one in the entry is the worker's to overwrite.
  if (req.lease != sessions_[i].lease) return reject(i, req, ErrorCode::kBadRequest, "stale or forged lease");
  // relaxed: a statistic. The time of this turn of the loop (a clock read
  // per request cost 20-30 ns of the round trip).
  entry.last_request_ns.store(now, std::memory_order_relaxed);
  switch (static_cast<Opcode>(req.opcode)) {
    case Opcode::kDetach:
      return ok(req, model_.version);
    case Opcode::kRegisterBuffer:
      return register_buffer(i, req);
    case Opcode::kUnregisterBuffer:
      return unregister_buffer(i, req);
    case Opcode::kPush:
      return push(i, req);
    case Opcode::kPull:
      return pull(i, req);
    case Opcode::kStats:
      return stats(i, req);
    case Opcode::kInit:
      return init(i, req);
    case Opcode::kPing:
      return ok(req, model_.version);
    case Opcode::kAttach:
      break;
  }
  return reject(i, req, ErrorCode::kBadRequest, "unknown opcode");
}

Answer RequestHandler::reject(uint32_t i, const Request& req, ErrorCode code, const std::string& message,
                              std::string_view subject) {
  shm::StatsBlock& st = segment_.stats();
  // relaxed: statistics counters.
  st.rejected[static_cast<uint32_t>(code) % shm::kRejectCauses].fetch_add(1, std::memory_order_relaxed);
  if (req.opcode == static_cast<uint32_t>(Opcode::kPush))
    segment_.worker(i).pushes_rejected.fetch_add(1, std::memory_order_relaxed);
  log_.note(code, shm::monotonic_ns(), [&] {
    // relaxed: re-read of the entry's owner for the pid in the message.
    const uint32_t pid = shm::owner_pid(segment_.worker(i).owner.load(std::memory_order_relaxed));
    return "rejected " + std::string(opcode_name(req.opcode)) + " from worker " + std::to_string(i) + " (pid " +
           std::to_string(pid) + "): " + std::string(error_code_name(code)) + ": " +
           (subject.empty() ? std::string() : std::string(subject) + ": ") + message;
  });
  Answer a;
  a.completion = answer(req, code, message);
  a.completion.version = model_.version;
  return a;
}

Answer RequestHandler::drop_buffer(uint32_t i, const Request& req, const Status& why) {
  sessions_.close_buffer(i, req.buffer_id);
  return reject(i, req, why.code(), why.message(), "buffer " + std::to_string(req.buffer_id));
}

Answer RequestHandler::backend_failed(uint32_t i, const Request& req, const Status& error) {
  Answer a = reject(i, req, error.code(), error.message());
  a.device = backend_.healthy();
  return a;
}

Answer RequestHandler::register_buffer(uint32_t i, const Request& req) {
  WorkerSlot& slot = sessions_[i];
  if (req.buffer_id >= config_.max_buffers)
    return reject(
        i, req, ErrorCode::kUnknownBuffer,
        "buffer id " + std::to_string(req.buffer_id) + " >= max_buffers " + std::to_string(config_.max_buffers));
  // Copy the descriptor out of shared memory before validating it.
  shm::BufferDesc desc;
  std::memcpy(&desc, &segment_.buffer(i, req.buffer_id), sizeof desc);
  // A descriptor that names its registration (worker_lib's) belongs to
  // that request only: one that timed out and comes after the worker
  // wrote the id anew registers nothing. And a worker that writes an id
  // anew holds it free (its registration there timed out, and was served
  // after all): the old registration goes.
  const bool stamped = desc.request_id != 0;
  if (stamped && desc.request_id != req.request_id)
    return reject(i, req, ErrorCode::kBadRequest,
                  "buffer " + std::to_string(req.buffer_id) + "'s descriptor was written for " +
                      (desc.request_id == ~uint64_t{0} ? std::string("a request not yet sent")
                                                       : "request " + std::to_string(desc.request_id)) +
                      ", not this one (" + std::to_string(req.request_id) +
                      "): a registration that timed out, overtaken by a later one; nothing registered");
  if (slot.buffers[req.buffer_id]) {
    if (!stamped) return reject(i, req, ErrorCode::kBadRequest, "buffer id already registered");
    sessions_.close_buffer(i, req.buffer_id);
  }
  if (desc.kind == static_cast<uint32_t>(shm::BufferKind::kHostShm) &&
      std::memchr(desc.handle, '\0', sizeof desc.handle) == nullptr)
    return reject(i, req, ErrorCode::kBadRequest, "buffer handle is not a terminated name");
  if (desc.length == 0) return reject(i, req, ErrorCode::kBadRange, "buffer length 0");
  // The server maps each window a descriptor names, and a shm object of
  // terabytes costs its maker nothing (ftruncate alone): a worker's windows
  // stay within its budget, so that no few workers can fill the server's
  // address space and leave none for the others' buffers.
  const uint64_t budget = worker_buffer_budget(config_);
  uint64_t registered = 0;  // at most the budget: each registration kept it so
  for (const auto& b : slot.buffers)
    if (b) registered += b->length();
  if (desc.length > budget || registered > budget - desc.length)
    return reject(i, req, ErrorCode::kNoCapacity,
                  "past --max-worker-buffer-bytes " + std::to_string(budget) + ": " + std::to_string(registered) +
                      " B registered + " + std::to_string(desc.length) +
                      " B; nothing registered (unregister a buffer, or raise the option)");
  // Only objects named for this worker's pid, with that one name, and
  // neither the control segment nor another worker's buffer.
  const uint32_t pid = slot.pid();
  PeerObjectRule rule;
  rule.prefix = shm::buffer_object_prefix(config_.name, static_cast<pid_t>(pid));
  rule.taken_as = [this, i](const shm::ShmObject::Identity& id) { return sessions_.taken_as(id, i); };
  auto peer = backend_.open_peer_of(desc, rule, pid);
  if (!peer.ok()) return backend_failed(i, req, peer.status());
  sessions_.add_buffer(i, req.buffer_id, std::move(peer).value());
  if (log::enabled(LogLevel::kDebug))
    log::debug("worker " + std::to_string(i) + " registered buffer " + std::to_string(req.buffer_id) + " (" +
               std::to_string(desc.length) + " bytes)");
  return ok(req, model_.version);
}

Answer RequestHandler::unregister_buffer(uint32_t i, const Request& req) {
  if (sessions_[i].buffer(req.buffer_id) == nullptr)
    return reject(i, req, ErrorCode::kUnknownBuffer, "buffer " + std::to_string(req.buffer_id) + " is not registered");
  sessions_.close_buffer(i, req.buffer_id);
  return ok(req, model_.version);
}

Result<RequestHandler::Target> RequestHandler::resolve(uint32_t i, const Request& req, uint64_t element_size,
                                                       const char* dtype_name) const {
  Target t;
  if (req.tensor_id == shm::kAllTensors) {
    t.first = 0;
    t.last = static_cast<uint32_t>(model_.tensors.size());
    t.elements = model_.total_elements;
  } else if (req.tensor_id < model_.tensors.size()) {
    t.first = req.tensor_id;
    t.last = req.tensor_id + 1;
    t.elements = model_.tensors[req.tensor_id].element_count;
  } else {
    return Status{ErrorCode::kUnknownTensor, "tensor id " + std::to_string(req.tensor_id) +
                                                 " >= " + std::to_string(model_.tensors.size()) + " tensors"};
  }
  t.buffer = sessions_[i].buffer(req.buffer_id);
  if (t.buffer == nullptr)
    return Status{ErrorCode::kUnknownBuffer, "buffer " + std::to_string(req.buffer_id) + " is not registered"};
  const uint64_t need = t.elements * element_size;
  if (req.byte_length != need) {
    const std::string what =
        req.tensor_id == shm::kAllTensors ? std::string("all tensors") : std::string(model_.tensors[t.first].name);
    return Status{ErrorCode::kBadLength, std::to_string(req.byte_length) + " B, " + what + " needs " +
                                             std::to_string(need) + " (" + dtype_name + ")"};
  }
  const uint64_t len = t.buffer->length();
  if (req.byte_offset > len || need > len - req.byte_offset)
    return Status{ErrorCode::kBadRange, "offset " + std::to_string(req.byte_offset) + " + " + std::to_string(need) +
                                            " > buffer " + std::to_string(len)};
  return t;
}

bool RequestHandler::splits(const Target& t) const {
  for (uint32_t k = t.first; k < t.last; ++k)
    if (model_.tensors[k].element_count >= kernels::kCpuSplitMinElements) return true;
  return false;
}

Answer RequestHandler::push(uint32_t i, const Request& req) {
  if (shm::dtype_name(req.dtype) == nullptr)
    return reject(i, req, ErrorCode::kBadDtype, "gradient dtype " + std::to_string(req.dtype) + " unknown");
  const auto dtype = static_cast<kernels::GradDtype>(req.dtype);
  auto target = resolve(i, req, shm::dtype_size(req.dtype), shm::dtype_name(req.dtype));
  if (!target.ok()) return reject(i, req, target.status().code(), target.status().message());
  const uint64_t version = model_.version;
  if (req.worker_version > version)
    return reject(
        i, req, ErrorCode::kBadRequest,
        "worker_version " + std::to_string(req.worker_version) + " ahead of version " + std::to_string(version));
  const uint64_t staleness = version - req.worker_version;
  const shm::StalenessPolicy policy = config_.staleness_policy;
  if (policy == shm::StalenessPolicy::kReject && staleness > config_.max_staleness)
    return reject(i, req, ErrorCode::kStale,
                  "staleness " + std::to_string(staleness) + " > max_staleness " +
                      std::to_string(config_.max_staleness) + " (v" + std::to_string(req.worker_version) + " vs v" +
                      std::to_string(version) + ")");
  // The lr of this update: the schedule's at this version; under scale,
  // what reject would throw away is applied with that lr * b / staleness
  // (scaled_lr()). The step count and the moments advance as for any push.
  const bool scaled = policy == shm::StalenessPolicy::kScale && staleness > scale_bound(config_.max_staleness);
  const bool scheduled = !config_.lr_schedule.constant();
  kernels::OptimizerConfig stepped;
  if (scaled || scheduled) {
    stepped = config_.optimizer;
    if (scheduled) stepped.lr = next_lr(config_, version);
    if (scaled) stepped.lr = scaled_lr(stepped.lr, staleness, config_.max_staleness);
    // A schedule that grows past the float range (exponential:GAMMA with
    // GAMMA > 1, as torch's), or makes Adam's step size pass it, would
    // write Inf or NaN into every weight. (scale only lowers the lr.)
    if (Status s = kernels::validate_update(stepped); !s.ok())
      return reject(i, req, ErrorCode::kNonFinite,
                    "--lr-schedule gives update " + std::to_string(version + 1) +
                        (std::isfinite(stepped.lr) ? " a learning rate that is out of range (" + s.message() + ")"
                                                   : std::string(" a learning rate past the float range")) +
                        "; nothing applied: fix the schedule (and reload)");
  }
  const kernels::OptimizerConfig& optimizer = scaled || scheduled ? stepped : config_.optimizer;
  shm::StatsBlock& st = segment_.stats();
  if (target->elements >= kernels::kCpuSplitMinElements && splits(*target)) {
    const uint32_t threads =
        backend_.set_apply_threads(sessions_.apply_threads(i, [this](uint32_t w) { return gate_.holds_pull_of(w); }));
    st.apply_threads.store(threads, std::memory_order_relaxed);  // relaxed: statistic
  }
  const uint64_t apply_start = shm::monotonic_ns();  // apply_ns: the check and the update
  if (!config_.allow_nonfinite) {
    const Result<bool> finite = backend_.all_finite(*target->buffer, req.byte_offset, target->elements, dtype);
    // The check pass reads the whole gradient first: a buffer truncated
    // under us is found here, before anything is applied.
    if (Status s = backend_.peer_intact(*target->buffer); !s.ok()) return drop_buffer(i, req, s);
    if (!finite.ok()) return backend_failed(i, req, finite.status());  // the check could not run (a CUDA error)
    if (!*finite) return reject(i, req, ErrorCode::kNonFinite, "NaN or Inf in the gradient");
  }
  uint64_t byte_offset = req.byte_offset;
  const uint64_t esize = shm::dtype_size(req.dtype);
  // Its completion (even a failure) waits for the applies. A shared_ptr
  // copy (two locked instructions) only where there is something to wait for.
  std::shared_ptr<PeerBuffer> hold = async_ ? sessions_[i].buffers[req.buffer_id] : nullptr;
  for (uint32_t t = target->first; t < target->last; ++t) {
    if (Status s = backend_.apply(optimizer, t, ++model_.steps[t], *target->buffer, byte_offset, dtype); !s.ok()) {
      ++model_.unversioned_changes;  // the tensors before t were updated, and their steps
      Answer a = backend_failed(i, req, s);
      a.hold = std::move(hold);
      return a;
    }
    byte_offset += model_.tensors[t].element_count * esize;
  }
  // Only with --allow-nonfinite (no check pass) or a worker truncating
  // during the apply: zeros were read for the missing pages.
  if (Status s = backend_.peer_intact(*target->buffer); !s.ok()) {
    ++model_.unversioned_changes;
    Answer a =
        drop_buffer(i, req, Status{s.code(), s.message() + "; the update was applied with zeros for the lost pages"});
    a.hold = std::move(hold);
    return a;
  }
  ++model_.version;
  if (scaled) {
    // b < staleness: a factor below 1, in millionths (doubles: b may be huge).
    const auto factor_micro = static_cast<uint64_t>(1e6 * static_cast<double>(scale_bound(config_.max_staleness)) /
                                                    static_cast<double>(staleness));
    shm::bump(st.pushes_scaled);
    shm::bump(st.scale_factor_sum_micro, factor_micro);
    shm::bump(segment_.worker(i).pushes_scaled);
    shm::bump(segment_.worker(i).scale_factor_sum_micro, factor_micro);
  }
  // relaxed: statistics; the completion's release publishes them to the pusher.
  st.avg_staleness_micro.store(model_.staleness.record(staleness), std::memory_order_relaxed);
  st.version.store(model_.version, std::memory_order_relaxed);
  shm::bump(st.gradients_applied);
  shm::bump(st.applied_bytes, req.byte_length);
  shm::bump(segment_.worker(i).pushes_applied);
  shm::bump(segment_.worker(i).applied_bytes, req.byte_length);
  const uint64_t apply_end = shm::monotonic_ns();
  shm::record(st.apply_ns, apply_end - apply_start);
  shm::record(st.staleness, staleness);
  Answer a = ok(req, model_.version);
  a.applied_until_ns = apply_end;
  a.completion.value = staleness;
  a.hold = std::move(hold);
  a.applied = true;
  return a;
}

Answer RequestHandler::pull(uint32_t i, const Request& req) {
  auto target = resolve(i, req, sizeof(float), "f32");
  if (!target.ok()) return reject(i, req, target.status().code(), target.status().message());
  // Only a pull that would be served is held (released, it is handled
  // again from the top).
  if (gate_.must_wait(i)) {
    if (req.wait_ns == 0) return reject(i, req, ErrorCode::kTimeout, "held by --staleness-policy wait; wait_ns 0");
    Answer held{};  // no completion: the server parks the request
    held.held_back = true;
    return held;
  }
  const uint64_t first = model_.tensors[target->first].element_offset;
  // Completed once the copy is done.
  std::shared_ptr<PeerBuffer> hold = async_ ? sessions_[i].buffers[req.buffer_id] : nullptr;
  Answer a;
  if (Status s = backend_.copy_out(first, target->elements, *target->buffer, req.byte_offset); !s.ok()) {
    a = backend_failed(i, req, s);
  } else if (Status intact = backend_.peer_intact(*target->buffer); !intact.ok()) {
    a = drop_buffer(i, req, intact);
  } else {
    // relaxed: statistics.
    shm::bump(segment_.stats().weights_pulled);
    shm::bump(segment_.worker(i).pulls);
    a = ok(req, model_.version);
  }
  a.hold = std::move(hold);
  return a;
}

// A worker sets the weights at version 0 (ps-lite's and KVStore's init: the
// framework initialises the model, not the server): all tensors as fp32
// from its buffer, accepted once and only while no push has been applied;
// the first of concurrent initialisers wins. The optimizer state is still
// zero then, so only the weights change.
Answer RequestHandler::init(uint32_t i, const Request& req) {
  if (req.tensor_id != shm::kAllTensors)
    return reject(i, req, ErrorCode::kBadRequest, "init sets all tensors at once (tensor id kAllTensors)");
  auto target = resolve(i, req, sizeof(float), "f32");
  if (!target.ok()) return reject(i, req, target.status().code(), target.status().message());
  if (!model_.initialised_by.empty())
    return reject(i, req, ErrorCode::kInitRefused, "already initialised by " + model_.initialised_by);
  if (model_.version != 0)
    return reject(i, req, ErrorCode::kInitRefused, "version is " + std::to_string(model_.version) + ": pushes applied");
  // The next round would average it into every host's weights.
  if (model_.rounds_merged != 0)
    return reject(i, req, ErrorCode::kInitRefused,
                  "the weights are the federation's (" + std::to_string(model_.rounds_merged) +
                      " rounds merged): initialise before its group forms");
  // The join is under way: its snapshot was taken, and its merge makes
  // rank 0's weights (or the group's anchor) this host's.
  if (model_.federation_joining)
    return reject(i, req, ErrorCode::kInitRefused,
                  "the federation's join is under way (its snapshot taken): the weights become the group's; "
                  "initialise before its group forms");
  if (!config_.allow_nonfinite) {
    const Result<bool> finite =
        backend_.all_finite(*target->buffer, req.byte_offset, target->elements, kernels::GradDtype::kF32);
    if (Status s = backend_.peer_intact(*target->buffer); !s.ok()) return drop_buffer(i, req, s);
    if (!finite.ok()) return backend_failed(i, req, finite.status());
    if (!*finite) return reject(i, req, ErrorCode::kNonFinite, "NaN or Inf in the initial weights");
  }
  // Completed once the copy is done.
  std::shared_ptr<PeerBuffer> hold = async_ ? sessions_[i].buffers[req.buffer_id] : nullptr;
  Answer a;
  const Status copied = backend_.copy_in(0, model_.total_elements, *target->buffer, req.byte_offset);
  ++model_.unversioned_changes;  // the weights, whole or in part, even when the copy failed
  if (!copied.ok()) {
    a = backend_failed(i, req, copied);
  } else if (Status intact = backend_.peer_intact(*target->buffer); !intact.ok()) {
    a = drop_buffer(i, req, intact);
  } else {
    model_.initialised_by = "worker " + std::to_string(i) + " (pid " + std::to_string(sessions_[i].pid()) + ")";
    log::info("weights initialised by " + model_.initialised_by);
    a = ok(req, model_.version);
  }
  a.hold = std::move(hold);
  return a;
}

Answer RequestHandler::stats(uint32_t i, const Request& req) {
  sessions_.publish_depth();  // what is queued right now
  shm::StatsReply& r = segment_.worker(i).stats_reply;
  const shm::StatsBlock& s = segment_.stats();
  const shm::WorkerEntry& e = segment_.worker(i);
  // relaxed loads of our own counters; the completion's release publishes r.
  const auto cause = [&s](ErrorCode code) {
    return s.rejected[static_cast<uint32_t>(code)].load(std::memory_order_relaxed);
  };
  const uint64_t rejected_stale = cause(ErrorCode::kStale), rejected_nonfinite = cause(ErrorCode::kNonFinite),
                 rejected_timeout = cause(ErrorCode::kTimeout);
  uint64_t rejected_invalid = 0;
  for (uint32_t c = 0; c < shm::kRejectCauses; ++c) rejected_invalid += s.rejected[c].load(std::memory_order_relaxed);
  rejected_invalid -= rejected_stale + rejected_nonfinite + rejected_timeout;
#define SHMPS_STATS_FROM_block(from) s.from.load(std::memory_order_relaxed)
#define SHMPS_STATS_FROM_entry(from) e.from.load(std::memory_order_relaxed)
#define SHMPS_STATS_FROM_rejected(from) rejected_##from
#define SHMPS_STATS_FILL(name, source, from) r.name = SHMPS_STATS_FROM_##source(from);
  SHMPS_SERVER_STATS(SHMPS_STATS_FILL)
#undef SHMPS_STATS_FILL
#undef SHMPS_STATS_FROM_rejected
#undef SHMPS_STATS_FROM_entry
#undef SHMPS_STATS_FROM_block
  return ok(req, model_.version);
}

}  // namespace shmps::server
