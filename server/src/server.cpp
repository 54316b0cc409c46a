// Server: creates the segment and the model, runs the consumer loop (the
// one thread that serves every lane), and shuts down. It hands whole jobs
// to collaborators that return results: Sessions (the worker table),
// RequestHandler (one request -> its answer), HeldCompletions (answers
// waiting for device work), CheckpointPolicy, apply_live() (reload),
// RejectionLog and WorkerLineLog (rate-limited lines). docs/design.md,
// "The server's files", maps them.
#include "shmps/server/server.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <system_error>
#include <thread>
#include <utility>

#include "backend.hpp"
#include "checkpoint_policy.hpp"
#include "federation_link.hpp"
#include "held_completions.hpp"
#include "model.hpp"
#include "orphan_sweeper.hpp"
#include "peer_guard.hpp"
#include "pull_gate.hpp"
#include "rate_log.hpp"
#include "reload.hpp"
#include "reload_parser.hpp"
#include "request_handler.hpp"
#include "service.hpp"
#include "sessions.hpp"
#include "shmps/server/log.hpp"
#include "shmps/server/options.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {

using shm::Completion;
using shm::Opcode;
using shm::Request;

namespace {

constexpr uint32_t kBatchPerLane = 32;            // requests served per lane before moving on
constexpr uint64_t kHousekeepingNs = 50'000'000;  // dead-worker scan and lane sweep
constexpr uint64_t kHeartbeatNs = 10'000'000;
constexpr uint32_t kWatchPolls = 64;                 // idle polls of watch_lanes() before the loop turns (a pause each)
constexpr uint64_t kWatchBudgetNs = 20'000;          // serving time after which watch_lanes() lets the loop turn
constexpr uint64_t kStatusNs = 2'000'000'000;        // STATUS= refresh, rejection counts
constexpr uint64_t kSegmentCheckNs = 1'000'000'000;  // is /dev/shm/shmps.<name> still ours?

uint64_t random_generation() {
  std::random_device rd;
  uint64_t g = (uint64_t{rd()} << 32) ^ rd() ^ shm::monotonic_ns();
  return g == 0 ? 1 : g;
}

// The configuration block of the header: what workers and shmps-inspect
// read of the running configuration.
shm::ConfigBlock config_block(const ServerConfig& config, shm::Backend backend) {
  shm::ConfigBlock cb{};
  const kernels::OptimizerConfig& o = config.optimizer;
  cb.optimizer_kind = static_cast<uint32_t>(o.kind);
  cb.flags = (o.nesterov ? shm::kConfigNesterov : 0) | (o.amsgrad ? shm::kConfigAmsgrad : 0) |
             (config.allow_nonfinite ? shm::kConfigAllowNonFinite : 0) |
             (config.group_access ? shm::kConfigGroupAccess : 0);
  cb.lr = o.lr;
  cb.momentum = o.momentum;
  cb.dampening = o.dampening;
  cb.weight_decay = o.weight_decay;
  cb.beta1 = o.beta1;
  cb.beta2 = o.beta2;
  cb.eps = o.eps;
  cb.backend = static_cast<uint32_t>(backend);
  cb.max_staleness = config.max_staleness;
  cb.staleness_policy = static_cast<uint32_t>(config.staleness_policy);
  return cb;
}

// The header's block for the weights' IPC export (CUDA backend), for
// workers that map them themselves; empty for a backend without one.
shm::WeightsExportBlock weights_export_block(const WeightsExport& ex, uint64_t total_elements) {
  shm::WeightsExportBlock w{};
  if (!ex.present) return w;
  w.flags = shm::kWeightsExportPresent;
  w.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
  w.allocation_bytes = ex.allocation_bytes;
  w.weights_bytes = total_elements * sizeof(float);
  std::memcpy(w.device_uuid, ex.device_uuid, sizeof w.device_uuid);
  std::memcpy(w.ipc_handle, ex.ipc_handle, sizeof w.ipc_handle);
  return w;
}

}  // namespace

class Server::Impl {
 public:
  Impl(const ServerConfig& c, std::unique_ptr<shm::Segment> seg, std::unique_ptr<Backend> b)
      : config(c),
        segment(std::move(seg)),
        backend(std::move(b)),
        sweeper(config.name),
        held(config.max_workers),
        sessions(config, *segment, held, worker_lines),
        gate(config, sessions, *segment),
        handler(config, model, *backend, sessions, gate, *segment, rejections),
        behind(config.max_workers, 0) {
    // Every worker may write the segment, and so shrink it: the guard
    // grows it back where the server would die of SIGBUS (repair_segment()).
    install_peer_guard();
    guard_segment(segment->object().data(), segment->object().size(), segment->object().descriptor());
    regrowths_repaired = segment_regrowths();  // the process's count: earlier ones were another server's
  }
  ~Impl() { unguard_segment(segment->object().data()); }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // ---- set by create(), constant after it (config: run() applies a
  // reload's live keys in place, on the consumer thread)
  ServerConfig config;
  std::unique_ptr<shm::Segment> segment;
  std::unique_ptr<Backend> backend;
  uint64_t created_ns = 0;

  // ---- its own thread (create() starts it, shutdown() ends it): dead
  // workers' buffer objects, off the consumer thread
  OrphanSweeper sweeper;

  // ---- the consumer thread's (create() before run())
  Model model;
  HeldCompletions held;
  RejectionLog rejections;
  WorkerLineLog worker_lines;
  Sessions sessions;
  PullGate gate;
  RequestHandler handler;
  std::vector<PullGate::Released> released;       // release_pulls()'s, kept for its capacity
  std::unique_ptr<CheckpointPolicy> checkpoints;  // none while config.checkpoint_dir is empty
  std::unique_ptr<FederationLink> federation;     // none while config.federation.kind is kNone
  bool pushes_held = false;                       // a lane waits for the federation's merge (push_waits_for_merge())
  std::vector<uint8_t> behind;                    // per lane: 1 while its completion queue was full (serve_lane())
  Status failure;                                 // why run() stops on its own (the device, the segment's name)
  bool removed = false;                           // the segment is gone (shutdown() ran)
  uint64_t loop_now = 0;                          // CLOCK_MONOTONIC ns at the start of this turn of the loop
  uint64_t clock_now = 0;  // the clock as last read: loop_now, the end of an apply, or a take (queue_ns)
  uint64_t last_heartbeat = 0;
  uint64_t last_housekeeping = 0;
  uint64_t last_segment_check = 0;
  uint64_t regrowths_repaired = 0;  // segment_regrowths() when repair_segment() last ran
  uint64_t segment_repairs = 0;     // repair_segment()'s runs
  uint64_t last_repair_log = 0;     // when repair_segment() last logged
  size_t watch_cursor = 0;          // where watch_lanes() resumes its round robin
  // The service manager (sd_notify) and the STATUS= line.
  RunOptions run_options;
  std::unique_ptr<ReloadParser> reload_parser;  // with run_options.reload, while run() runs
  ServiceNotifier notifier;
  uint64_t last_watchdog = 0;
  uint64_t last_status = 0;
  uint64_t applied_at_last_status = 0;
  double push_rate = 0.0;  // pushes/s over the last status interval

  // ---- any thread, signal handlers included
  std::atomic<bool> stop{false};
  std::atomic<bool> reload_requested{false};

  shm::StatsBlock& stats() { return segment->stats(); }

  // ------------------------------------------------------------ loop
  Status run(const RunOptions& options) {
    run_options = options;
    // The parser's thread wakes the consumer once a result can be taken.
    // Without the thread (a task limit reached) the server serves on, and
    // reloads are refused as without a source.
    if (run_options.reload) {
      try {
        reload_parser = std::make_unique<ReloadParser>(run_options.reload,
                                                       [wake = &segment->header().server_wake] { shm::notify(*wake); });
      } catch (const std::system_error& e) {
        log::error(std::string("reloads are off: their thread cannot start: ") + e.what());
      }
    }
    notifier = options.notify_service_manager ? ServiceNotifier::from_environment() : ServiceNotifier{};
    const auto spin_ns = uint64_t{config.idle_spin_us} * 1000;
    uint64_t idle_since = 0;
    last_watchdog = last_status = shm::monotonic_ns();
    applied_at_last_status = stats().gradients_applied.load(std::memory_order_relaxed);  // relaxed: our own counter
    if (federation) federation->start(model.version);
    publish_lr();
    if (notifier.enabled()) {
      log::info(notifier.watchdog_ns() == 0 ? std::string("notifying systemd; no watchdog")
                                            : "notifying systemd; watchdog keep-alive every " +
                                                  std::to_string(notifier.watchdog_ns() / 2'000'000) + " ms");
      // The segment is published and the weights are loaded (create()).
      notifier.ready(status_text());
    }
    while (!stop.load(std::memory_order_acquire)) {  // SYNC(stop): pairs with request_stop()
      const uint64_t now = shm::monotonic_ns();
      loop_now = clock_now = now;
      if (now - last_heartbeat >= kHeartbeatNs) {
        // relaxed: a liveness hint; readers compare it against their clock only.
        segment->header().heartbeat_ns.store(now, std::memory_order_relaxed);
        last_heartbeat = now;
        periodic(now);
      }
      bool worked = drain_held();
      if (federation) worked |= poll_federation();
      if (gate.any_parked()) worked |= release_pulls(now);
      worked |= serve_doorbells();
      if (now - last_housekeeping >= kHousekeepingNs) {
        last_housekeeping = now;
        worked |= housekeeping();
      }
      if (worked) {
        idle_since = 0;
        continue;
      }
      if (!held.idle()) {
        shm::cpu_relax();  // device work in flight: poll its fences, never sleep
        continue;
      }
      if (idle_since == 0) idle_since = now;
      if (now - idle_since < spin_ns) {
        // After an empty watch, a worker waiting for this CPU gets it now,
        // not after our spin (docs/design.md, "Sleeping").
        if (watch_lanes())
          idle_since = 0;
        else
          shm::yield_cpu();
        continue;
      }
      sleep_until_doorbell();
    }
    reload_parser.reset();  // a parse in progress is waited for, and dropped
    shutdown();
    return failure;
  }

  // The federation's snapshot or merge, when its thread asks (between two
  // requests). After a merge, or a round abandoned, the lanes whose next
  // push waited for it are served (they rang no doorbell meanwhile). A
  // backend failure is the device's: fatal.
  bool poll_federation() {
    Result<FederationLink::Polled> r = federation->poll(*backend, model.version);
    if (!r.ok()) {
      fatal(r.status());
      return false;
    }
    // A join's snapshot (or a round's) makes an init too late; a join
    // abandoned before any merge leaves the weights this host's until the
    // next join's snapshot, and so does federation ended before any merge
    // (the host serves alone).
    if (*r == FederationLink::Polled::kSnapshot) model.federation_joining = true;
    if (model.federation_joining && model.rounds_merged == 0 &&
        (*r == FederationLink::Polled::kDiscard || federation->off()))
      model.federation_joining = false;
    if (*r == FederationLink::Polled::kNothing || *r == FederationLink::Polled::kSnapshot)
      return *r == FederationLink::Polled::kSnapshot;
    if (*r == FederationLink::Polled::kMerge) model.merged(1);
    if (pushes_held) {
      pushes_held = false;
      housekeeping();  // every living lane, served
    }
    return true;
  }

  // Whether lane i's next request is a push that must wait for the
  // federation's merge (FederationLink::holding_pushes()); then the lane
  // waits, and poll_federation() serves it after the merge. The request
  // is read where try_pop() would take it from, and only its opcode: a
  // garbage one is not a push, and is refused once taken.
  bool push_waits_for_merge(WorkerSlot& slot) {
    if (!federation || !federation->holding_pushes(model.version)) return false;
    const Request* next = slot.lane.seq_published(slot.next_request_id) ? slot.lane.peek_published() : slot.lane.peek();
    if (next == nullptr) return false;
    uint32_t opcode;
    std::memcpy(&opcode, reinterpret_cast<const char*>(next) + offsetof(Request, opcode), sizeof opcode);
    if (opcode != static_cast<uint32_t>(Opcode::kPush)) return false;
    pushes_held = true;
    // Counted once per push: the idle loop's watch looks at the lane again.
    if (slot.held_push_at != slot.lane.next_index() + 1) {
      slot.held_push_at = slot.lane.next_index() + 1;
      shm::bump(stats().fed_pushes_held);
    }
    return true;
  }

  // The lr the next update gets (--lr-schedule at this version), in
  // 1e-12ths, for readers of the stats block: a finite lr past what the
  // word holds (1.8e7) saturates (shm::kScheduledLrSaturated), one that is
  // not finite is shm::kScheduledLrNotFinite.
  void publish_lr() {
    const float lr = next_lr(config, model.version);
    const double pico = static_cast<double>(lr) * 1e12 + 0.5;
    const uint64_t value = !std::isfinite(lr)                                       ? shm::kScheduledLrNotFinite
                           : pico < static_cast<double>(shm::kScheduledLrSaturated) ? static_cast<uint64_t>(pico)
                                                                                    : shm::kScheduledLrSaturated;
    stats().scheduled_lr_pico.store(value, std::memory_order_relaxed);  // relaxed: statistic
  }

  // Every kHeartbeatNs, from the loop and only there: a consumer stuck in a
  // request stops the watchdog keep-alives, and systemd restarts it.
  void periodic(uint64_t now) {
    sessions.publish_depth();  // for readers of the stats block (shmps-inspect)
    stats().pulls_held.store(gate.parked_count(), std::memory_order_relaxed);  // relaxed: a gauge for readers
    publish_lr();
    for (uint32_t i = 0; i < config.max_workers; ++i)
      if (std::exchange(behind[i], 0) != 0) ring_doorbell(i);  // its completion queue was full: try again
    if (federation) federation->publish_drift(model.version);
    if (const uint64_t regrown = segment_regrowths(); regrown != regrowths_repaired) {
      regrowths_repaired = regrown;
      repair_segment("was shrunk");
    }
    if (now - last_segment_check >= kSegmentCheckNs) {
      last_segment_check = now;
      check_segment();
    }
    sweeper.tick(now);  // a sweep here only where its thread could not start
    if (checkpoints) checkpoints->tick(now);
    // A parse done: applied here, between two requests.
    if (reload_parser)
      if (std::optional<Result<ServerConfig>> parsed = reload_parser->take()) finish_reload(std::move(*parsed));
    // The relaxed load keeps the locked exchange off the common path (a
    // stale false only delays the reload to the next tick); a reload asked
    // for during a parse starts after it. SYNC(reload): the acquire pairs
    // with request_reload()'s release, so what the requester wrote for
    // RunOptions::reload to read is visible (to the parser's thread too:
    // start() locks after it).
    if (reload_requested.load(std::memory_order_relaxed) && !(reload_parser && reload_parser->busy()) &&
        reload_requested.exchange(false, std::memory_order_acquire))
      begin_reload(now);
    if (notifier.watchdog_ns() != 0 && now - last_watchdog >= notifier.watchdog_ns() / 2) {
      notifier.watchdog();
      last_watchdog = now;
    }
    if (now - last_status >= kStatusNs) {
      const uint64_t applied = stats().gradients_applied.load(std::memory_order_relaxed);  // relaxed: our own counter
      push_rate = static_cast<double>(applied - applied_at_last_status) * 1e9 / static_cast<double>(now - last_status);
      applied_at_last_status = applied;
      last_status = now;
      if (notifier.enabled()) notifier.status(status_text());
      rejections.flush(now);
    }
    worker_lines.flush(now);
  }

  // "shmps 0.1.0 'job1': 2 workers attached, 850.0 pushes/s, version 1234"
  std::string status_text() {
    // relaxed: our own counter.
    const uint64_t workers = stats().workers_attached.load(std::memory_order_relaxed);
    return std::string("shmps ") + version_text() + " '" + config.name + "': " + std::to_string(workers) +
           " workers attached, " + fixed1(push_rate) + " pushes/s, version " + std::to_string(model.version);
  }

  // A reload: its parse goes to the parser's thread (ReloadParser), and
  // finish_reload() applies the result once taken.
  void begin_reload(uint64_t now) {
    notifier.reloading(now);
    if (!reload_parser) {
      log::warn("reload requested, but this server has no configuration source; nothing changed");
      notifier.ready(status_text());
      return;
    }
    reload_parser->start();
  }

  void finish_reload(Result<ServerConfig> next) {
    if (!next.ok()) {
      log::error("reload failed, keeping the running configuration: " + next.status().message());
      notifier.ready("reload failed (see the log); " + status_text());
      return;
    }
    // The running name and checkpoint directory carry the rank.
    if (federation) apply_rank_in_name(*next, federation->membership().host);
    apply_live(config, *next, segment->header().config);
    notifier.ready(status_text());
  }

  bool doorbells_pending() {
    const uint32_t words = (config.max_workers + 63) / 64;
    for (uint32_t w = 0; w < words; ++w)
      // seq_cst: part of the Dekker pattern with producers' doorbell fetch_or (futex.hpp).
      if (segment->header().doorbell[w].load(std::memory_order_seq_cst) != 0) return true;
    return false;
  }

  void sleep_until_doorbell() {
    auto& wake = segment->header().server_wake;
    wake.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seq = wake.seq.load(std::memory_order_seq_cst);  // SYNC(wait_word)
    // The federation thread notifies the word after asking for a snapshot
    // or a merge (FederationLink::set_phase()).
    if (!doorbells_pending() && !stop.load(std::memory_order_acquire) &&  // SYNC(stop)
        !(federation && federation->wants_consumer()))
      shm::wait_once(wake, seq, std::chrono::nanoseconds(kHeartbeatNs));
    wake.waiters.fetch_sub(1, std::memory_order_relaxed);  // relaxed: only a hint to notifiers
  }

  // The idle spin between two turns of the loop: watches the attached lanes'
  // tails and the doorbell words with plain loads and serves a lane the
  // moment its tail moves, before its doorbell arrives: a request then
  // reaches us in one cache-line transfer (its tail; the slot was prefetched
  // alongside) instead of three (the doorbell, then the tail, then the
  // slot). While requests keep coming it stays here, so the loop's
  // bookkeeping (clock, heartbeat, doorbell sweep) runs between bursts
  // rather than between two requests of a round-trip-bound worker, but it
  // returns at least every kWatchBudgetNs of serving, and after kWatchPolls
  // polls (a pause each) without a request. The doorbell bits of attached
  // lanes are left for the next serve_doorbells() (we poll those lanes
  // anyway); any other bit (an attach) ends the watch at once. The doorbell
  // stays the only signal for a sleeping server and for attaches. True
  // when it served a lane or saw such a doorbell.
  bool watch_lanes() {
    const uint32_t words = (config.max_workers + 63) / 64;
    bool worked = false;
    uint32_t idle_polls = 0;
    while (idle_polls < kWatchPolls) {
      bool served = false;
      const std::vector<uint32_t>& lanes = sessions.attached_lanes();
      const size_t n = lanes.size();
      for (size_t k = 0; k < n; ++k) {
        const size_t pos = (watch_cursor + k) % n;  // round robin: no lane waits behind a busy one
        const uint32_t i = lanes[pos];
        shm::SpscConsumer<Request>& lane = sessions[i].lane;
        lane.prefetch_next();
        if (!lane.tail_moved_hint()) continue;
        watch_cursor = pos + 1;
        // May change the attached lanes: rescan from the cursor. A lane that
        // gave nothing (its tail lags the slots taken by id, or its entry
        // changed) is not work: the watch, and then the loop, stay idle, so
        // such a lane cannot keep the server from sleeping.
        served = serve_lane(i);
        break;
      }
      if (served) {
        worked = true;
        idle_polls = 0;
        if (shm::monotonic_ns() - loop_now >= kWatchBudgetNs) return true;
        continue;
      }
      for (uint32_t w = 0; w < words; ++w)
        // relaxed: a hint; serve_doorbells() takes the bits with acq_rel.
        if ((segment->header().doorbell[w].load(std::memory_order_relaxed) & ~sessions.attached_bits(w)) != 0)
          return true;
      shm::cpu_relax();
      ++idle_polls;
    }
    return worked;
  }

  bool serve_doorbells() {
    bool worked = false;
    const uint32_t words = (config.max_workers + 63) / 64;
    for (uint32_t w = 0; w < words; ++w) {
      // SYNC(doorbell): acquire pairs with the producer's fetch_or; the lane
      // tail it published before ringing is then visible (and re-checked
      // with its own acquire in try_pop anyway).
      uint64_t bits = segment->header().doorbell[w].exchange(0, std::memory_order_acq_rel);
      while (bits != 0) {
        const uint32_t bit = static_cast<uint32_t>(__builtin_ctzll(bits));
        bits &= bits - 1;
        const uint32_t i = w * 64 + bit;
        if (i >= config.max_workers) continue;  // garbage bit from a buggy producer
        worked |= serve_lane(i);
      }
    }
    return worked;
  }

  void ring_doorbell(uint32_t i) {
    // release: relevant only to ourselves; no data published here. SYNC(doorbell)
    segment->header().doorbell[i / 64].fetch_or(uint64_t{1} << (i % 64), std::memory_order_release);
  }

  // Serves up to kBatchPerLane requests of lane i. True when any was served.
  bool serve_lane(uint32_t i) {
    WorkerSlot& slot = sessions[i];
    if (!sessions.sync(i)) return false;
    // Its pull goes first (release_pulls()); one its worker cancelled, in
    // the loop's next turn.
    if (gate.parked(i)) return gate.cancelled(i);
    slot.lane.prefetch_next();  // the request's line travels while we check the entry
    shm::WorkerEntry& entry = segment->worker(i);
    uint32_t served = 0;
    bool drained = false;         // the batch ended on an empty lane
    bool held_for_merge = false;  // the batch ended on a push that waits for the federation's merge
    bool queue_full = false;      // the batch ended on a full completion queue
    while (served < kBatchPerLane) {
      // A request is taken only with a slot of the completion queue for
      // its answer beside one for each answer held behind device work, so
      // that every held answer can be posted once its work is done
      // (otherwise the loop polls their fences without ever sleeping,
      // until the worker reads).
      if (!slot.completions.has_space_for(held.held(i) + 1)) {
        if (slot.completions.head_impossible()) {
          evict(i, "its completion queue indices are corrupt");
          return true;
        }
        // The worker has not read its answers: more than a lane's capacity
        // in flight, which worker_lib never has. Looked at again each
        // heartbeat (periodic()), not at once: the lane must not keep the
        // server from sleeping.
        queue_full = true;
        behind[i] = 1;
        break;
      }
      if (!failure.ok()) break;  // the device failed: nothing more is taken (shutdown fails the rest)
      if (push_waits_for_merge(slot)) {
        held_for_merge = true;
        break;
      }
      // This lane alone is a lower bound of the total; publish_depth() sums
      // all lanes every heartbeat and for a stats request.
      sessions.note_depth(slot.lane.depth_estimate());
      // A request whose id is the one after the last is taken from its slot
      // (ring.hpp, seq_published()) even if its tail has not arrived yet.
      // Its publish stamp is read before the slot is released: after it,
      // the worker may publish the next request of that slot, and its stamp.
      Request req;
      uint64_t published = 0;
      const shm::RingResult r = slot.lane.try_pop(&req, slot.next_request_id, [&](uint64_t index) {
        // relaxed: the worker wrote it before the release we took the slot
        // with; a worker's garbage only makes this one sample wrong.
        published = std::atomic_ref<uint64_t>(const_cast<uint64_t&>(slot.stamps[index & (config.lane_capacity - 1)]))
                        .load(std::memory_order_relaxed);
      });
      if (r == shm::RingResult::kEmpty) {
        drained = true;
        break;
      }
      if (r == shm::RingResult::kCorrupt) {
        evict(i, "its request lane indices are corrupt");
        return true;
      }
      ++served;
      // A worker's ids count up by one (0 after a wrap: unknown). One that
      // reuses an id gets no slot taken by id at or below the highest
      // taken (ring.hpp, seq_published()): its stale slots are not served again.
      slot.next_request_id = req.request_id + 1;
      shm::bump(stats().requests);
      // Published after the clock was last read (the loop watches lanes
      // between reads): read it now, so a wait is never counted as 0.
      if (published > clock_now) clock_now = shm::monotonic_ns();
      shm::record(stats().queue_ns, clock_now > published ? clock_now - published : 0);
      Answer a = handler.handle(i, req, loop_now);
      if (a.held_back) {
        // Its wait counts from its publish (a stamp the worker wrote:
        // never later than now), as the worker's deadline does.
        gate.park(i, req, std::min(published, clock_now));
        break;  // the rest of the lane waits behind the pull
      }
      if (a.applied) gate.pushed(i);
      if (a.applied_until_ns != 0) clock_now = a.applied_until_ns;
      if (!a.device.ok()) fatal(a.device);
      if (a.applied && checkpoints) checkpoints->after_push(loop_now);
      if (a.applied && gate.any_parked()) release_pulls(clock_now);
      if (a.completion.opcode == static_cast<uint32_t>(Opcode::kDetach) && a.completion.code == 0) {
        // Its held-back answers go first (detaches are rare: wait for the device).
        if (held.held(i) != 0) {
          if (Status s = backend->synchronize(); !s.ok()) fatal(s);
          drain_held();
        }
        // kDetached (its buffers closed first) before the answer: the worker, once it reads the
        // answer, sees it may reset and free the entry.
        sessions.mark_detached(i);
        post(i, a);
        sessions.finish_detach(i);
        return true;
      }
      post(i, a);
      if (!slot.attached() ||
          entry.owner.load(std::memory_order_relaxed) != slot.owner)  // relaxed: re-checked by sync()
        return true;                                                  // evicted while handling, or the entry changed
    }
    if (served > 0) shm::notify(slot.lane.header()->space_ready);
    // More left: come back (but for a push that waits for the merge).
    if (!drained && !held_for_merge && !queue_full && slot.lane.refresh() == shm::RingResult::kOk) ring_doorbell(i);
    return served > 0;
  }

  // Answers the parked pulls (--staleness-policy wait) that may go on at
  // `now`: served, or refused when their wait ran out. Their lanes are
  // served again from the next turn. Counts those dropped with their
  // session. True when any was answered or dropped.
  bool release_pulls(uint64_t now) {
    released.clear();
    gate.release(now, &released);
    for (PullGate::Released& r : released) answer_parked(r);
    return !released.empty();
  }

  void answer_parked(PullGate::Released& r) {
    const uint32_t i = r.worker;
    shm::bump(stats().pulls_waited);
    shm::bump(stats().wait_ns, r.waited_ns);
    if (r.ended) return;  // entry i is no longer its worker's
    shm::bump(segment->worker(i).pulls_waited);
    shm::bump(segment->worker(i).wait_ns, r.waited_ns);
    Answer a;
    if (r.cancelled) {  // withdrawn by its worker: answered, not counted as a rejection
      a.completion = RequestHandler::answer(r.request, ErrorCode::kInterrupted,
                                            "withdrawn by its worker (interrupted wait or detach)");
      a.completion.version = model.version;
    } else {
      if (r.timed_out) shm::bump(segment->worker(i).pulls_timed_out);
      a = r.timed_out ? handler.reject(i, r.request, ErrorCode::kTimeout, r.why)
                      : handler.handle(i, r.request, shm::monotonic_ns());
    }
    if (!a.device.ok()) fatal(a.device);
    post(i, a);
    ring_doorbell(i);  // the rest of its lane
  }

  // Answers worker i's request: now, or once the device work the request
  // enqueued (a.hold) and every completion of i held before it are done.
  void post(uint32_t i, Answer& a) {
    const Fence fence = a.hold ? backend->fence() : 0;
    if (held.must_hold(i, fence)) {
      held.hold(i, a.completion, fence, std::move(a.hold), shm::monotonic_ns());
      return;
    }
    post_now(i, a.completion);
  }

  void post_now(uint32_t i, const Completion& c) {
    WorkerSlot& slot = sessions[i];
    // Space was checked before popping the request; a worker that moved its
    // head backwards gets evicted instead of overwriting unread answers.
    // A success writes only the completion's first line (layout.hpp, Completion).
    const size_t bytes = c.code == 0 ? offsetof(Completion, message) : sizeof c;
    if (slot.completions.try_push(c, bytes) != shm::RingResult::kOk) {
      evict(i, "its completion queue indices are corrupt");
      return;
    }
    shm::notify(slot.completions.header()->data_ready);
  }

  // Posts the held completions whose device work is done, in request order
  // per worker, and lets go of orphaned work that finished. A fence that
  // reports an error fails its request with the CUDA error; a lost context,
  // or work stalled for HeldCompletions::kStallNs (held or orphaned), stops
  // the server.
  bool drain_held() {
    // The common case, and the only one of the host backend: nothing held,
    // nothing to poll (a device failing meanwhile is seen by the next call
    // that uses it).
    if (held.idle()) return false;
    bool worked = false;
    const uint64_t now = shm::monotonic_ns();
    for (uint32_t i = 0; i < config.max_workers && held.any_held(); ++i) {
      WorkerSlot& slot = sessions[i];
      while (held.held(i) != 0 && slot.completions.has_space()) {  // a worker that is behind will catch up
        auto ready = held.pop_ready(i, *backend, now);
        if (!ready.ok()) {
          fatal(ready.status());
          break;
        }
        if (!*ready) break;  // its device work still runs
        post_now(i, **ready);
        worked = true;
        if (!slot.attached()) break;  // evicted by post_now
      }
    }
    if (Status s = held.release_finished(*backend, now); !s.ok()) fatal(s);
    if (Status s = backend->healthy(); !s.ok()) fatal(s);
    return worked;
  }

  // The device context is lost: stop taking requests; shutdown() fails what
  // is in flight, and run() returns the error (the process exits non-zero,
  // systemd restarts it). No checkpoint of weights a failed kernel may have
  // half-written is taken.
  void fatal(const Status& why) {
    if (!failure.ok()) return;
    failure = Status{why.code(), why.message() + "; the weights may be half-written: stopping without a checkpoint"};
    log::error(failure.message());
    stop.store(true, std::memory_order_release);  // SYNC(stop)
  }

  // Stops serving a misbehaving or stopped but living worker: its requests
  // still queued are dropped unanswered (never applied), its buffers
  // unmapped, and kDetached tells its library, which frees the entry (and
  // re-attaches, with reconnect) when it runs again. Until the process
  // frees the entry or dies, the entry is not reused: a producer that
  // resumes in the middle of writing its lane only writes its own,
  // abandoned lane, which nobody reads.
  void evict(uint32_t i, const std::string& why, bool corrupt = true) {
    // Answers held back for device work belong to pushes already applied:
    // post what fits before letting go, so they are not reported lost
    // (device backends only; the host backend never holds any back).
    if (held.held(i) != 0 && !corrupt) {
      if (Status s = backend->synchronize(); !s.ok()) fatal(s);
      drain_held();
    }
    // Said before the session ends, which drops the pull.
    const std::string held_pull = gate.parked(i) ? "; its pull held by --staleness-policy wait dropped unanswered" : "";
    sessions.mark_detached(i);  // its buffers closed first, as for a detach
    // Counted after the entry says Detached, so a reader that sees the
    // count sees the entry released (test_stopped reads them in that order).
    // relaxed: statistics.
    if (corrupt) stats().lanes_corrupt.fetch_add(1, std::memory_order_relaxed);
    stats().workers_evicted.fetch_add(1, std::memory_order_relaxed);
    sessions.log(LogLevel::kWarn, "evicting worker " + std::to_string(i) + " (pid " +
                                      std::to_string(sessions[i].pid()) + "): " + why + held_pull);
    sessions.end(i, "");
  }

  // Reclaims entries whose owner died, evicts workers stopped too long, and
  // sweeps every living entry's lane (a doorbell may have been lost: a
  // producer killed between publishing and ringing).
  bool housekeeping() {
    bool worked = false;
    const uint64_t now = shm::monotonic_ns();
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      std::string why;
      switch (sessions.reap(i, now, &why)) {
        case Sessions::Owner::kNone:
          break;
        case Sessions::Owner::kReaped:
          sweeper.sweep_soon();  // its buffer objects, once no process holds its pid
          worked = true;
          break;
        case Sessions::Owner::kStopped:
          evict(i, why, /*corrupt=*/false);
          worked |= serve_lane(i);
          break;
        case Sessions::Owner::kLiving:
          worked |= serve_lane(i);
          break;
      }
    }
    return worked;
  }

  // True while /dev/shm/shmps.<name> is the object we created.
  bool segment_is_ours() const {
    struct stat st {};
    const std::string path = "/dev/shm/" + shm::segment_object_name(config.name);
    return ::stat(path.c_str(), &st) == 0 && st.st_ino == segment->object().inode();
  }

  // What the segment's header says, as the server wrote it.
  shm::ConfigBlock header_config() const { return config_block(config, backend->kind()); }
  shm::WeightsExportBlock header_export() const {
    return weights_export_block(backend->weights_export(), model.total_elements);
  }

  // Every kSegmentCheckNs: the object at the segment's name is still ours
  // (or the server stops), whole, and its header and tensor table still
  // say what the server wrote (or they are repaired). Catches what the
  // SIGBUS guard cannot: a shrink the server has not touched, one undone
  // before it did (the lost pages zeros), a part of a page lost, words
  // written over.
  void check_segment() {
    if (!segment_is_ours()) {
      failure = Status{ErrorCode::kIo, "/dev/shm/" + shm::segment_object_name(config.name) +
                                           " was removed or replaced under the running server (systemd-logind's "
                                           "RemoveIPC=yes removes a user's POSIX shm at logout: run shmps as a "
                                           "system user); stopping so a restart gives workers a fresh segment"};
      log::error(failure.message());
      stop.store(true, std::memory_order_release);  // SYNC(stop)
      return;
    }
    const shm::ShmObject& object = segment->object();
    const auto bytes = static_cast<off_t>(object.size());
    struct stat st {};
    if (::fstat(object.descriptor(), &st) == 0 && st.st_size != bytes) {
      // Shrunk: the lost pages come back as zeros. Grown: every opener
      // checks the object's size against the header's (a worker's attach
      // would fail until a restart); no one maps past `bytes`, so the
      // excess goes.
      const char* what = st.st_size < bytes ? "shrunk" : "grown";
      if (::ftruncate(object.descriptor(), bytes) != 0) {
        log::error("/dev/shm/" + object.name() + " was " + what + " under the running server; truncating it back to " +
                   std::to_string(bytes) + " bytes failed: " + std::strerror(errno));
        return;
      }
      repair_segment(st.st_size < bytes ? "was shrunk" : "was grown");
    } else if (!segment->header_intact(header_config(), shm::ServerState::kRunning, header_export())) {
      repair_segment("had its header or tensor table written over");
    }
  }

  // Another process that may write the segment shrank it (and the SIGBUS
  // guard or check_segment() grew it back: the lost pages read as zeros),
  // or wrote over its header. The header and the tensor table are written
  // again, so workers can attach; a worker whose entry, lane or queue was
  // lost meets the checks any garbage there meets (its lane is stopped,
  // its session ends); the stats block's counters restart from what is
  // left. At most one log line a second: a process that does it again and
  // again cannot flood the journal.
  void repair_segment(const char* what) {
    const shm::ShmObject& object = segment->object();
    const int reserve = ::posix_fallocate(object.descriptor(), 0, static_cast<off_t>(object.size()));
    segment->write_header(header_config(), shm::ServerState::kRunning, header_export());
    // Only the consumer waits on the word, and it is not waiting now.
    segment->header().server_wake.waiters.store(0, std::memory_order_relaxed);  // relaxed: a hint to notifiers
    segment->publish();
    // The gauges the server knows for itself; counters restart from what is left.
    uint64_t buffers = 0;
    for (uint32_t i = 0; i < config.max_workers; ++i)
      for (const auto& b : sessions[i].buffers) buffers += b != nullptr ? 1 : 0;
    shm::StatsBlock& st = stats();
    constexpr auto relaxed = std::memory_order_relaxed;  // relaxed: statistics, as every store to the block
    st.version.store(model.version, relaxed);
    st.workers_attached.store(sessions.attached_lanes().size(), relaxed);
    st.buffers_registered.store(buffers, relaxed);
    applied_at_last_status = st.gradients_applied.load(relaxed);
    ++segment_repairs;
    const uint64_t now = shm::monotonic_ns();
    if (segment_repairs > 1 && now - last_repair_log < kSegmentCheckNs) return;
    last_repair_log = now;
    log::error(
        "/dev/shm/" + object.name() + " " + what + " under the running server by a process that may write it (" +
        "owner " + shm::owner_text(object.owner_uid(), object.owner_gid()) + ", mode " + shm::mode_text(object.mode()) +
        "); repaired (" + std::to_string(segment_repairs) +
        " repairs so far): the header and tensor table rewritten, the weights kept, lost pages as zeros; "
        "workers whose entries or lanes were lost are stopped by the usual checks" +
        (reserve == 0 ? std::string() : "; reserving its pages again failed: " + std::string(std::strerror(reserve))));
  }

  void shutdown() {
    notifier.stopping("stopping: failing queued requests; " + status_text());
    auto& h = segment->header();
    // SYNC(server_stopped): workers that see kStopping take no new session.
    h.server_state.store(static_cast<uint32_t>(shm::ServerState::kStopping), std::memory_order_release);
    // Device work in flight: completed when the device is healthy, failed
    // (weights may be half-written) when it is not.
    const Status device = backend->healthy().ok() ? backend->synchronize() : backend->healthy();
    if (!device.ok()) fatal(device);
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      WorkerSlot& slot = sessions[i];
      while (held.held(i) != 0 && slot.attached() && slot.completions.has_space()) {
        Completion c = *held.pop_any(i);
        if (!device.ok()) {
          c.code = static_cast<uint32_t>(device.code());
          shm::set_message(c, "device failed; weights may be half-written");
        }
        post_now(i, c);
      }
    }
    held.clear();
    // Parked pulls go first (each is older than its lane's queue).
    released.clear();
    gate.release_all(shm::monotonic_ns(), &released);
    for (const PullGate::Released& r : released) {
      if (r.ended || !sessions[r.worker].completions.has_space()) continue;
      Completion c = RequestHandler::answer(r.request, ErrorCode::kShuttingDown, "server is shutting down");
      c.version = model.version;
      post_now(r.worker, c);
    }
    // Fail what is queued: nothing more is applied. At most a lane's
    // capacity each (a client that keeps publishing cannot hold the
    // shutdown), and only while the lane is still attached (post_now()
    // may evict).
    uint64_t failed = 0;
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      WorkerSlot& slot = sessions[i];
      Request req;
      for (uint32_t n = 0; n < config.lane_capacity && slot.attached() && slot.completions.has_space() &&
                           slot.lane.try_pop(&req) == shm::RingResult::kOk;
           ++n) {
        Completion c = RequestHandler::answer(req, ErrorCode::kShuttingDown, "server is shutting down");
        c.version = model.version;
        post_now(i, c);
        ++failed;
      }
    }
    // Then the federation leaves, the workers answered (its stop waits up
    // to the engine's timeout for a host that hangs): its last collective
    // pairs with the others' next round, and a round in flight is merged.
    // A thread stuck in a collective stays behind with its engine, never
    // finalised: the launcher then sees this process end without
    // MPI_Finalize.
    uint64_t merged = 0;
    // Under systemd, the stop may take that long before the final
    // checkpoint's own allowance: past TimeoutStopSec= (30 s) where the
    // engine's timeout or the period is long.
    if (federation) notifier.extend_timeout(federation->stop_bound() + std::chrono::seconds(5));
    if (federation && !federation->stop(*backend, model.version, &merged)) static_cast<void>(federation.release());
    model.merged(merged);  // the final checkpoint writes what a merge at stop changed
    // SYNC(server_stopped): release pairs with the workers' acquire load of
    // the state; every completion above is visible before kStopped.
    h.server_state.store(static_cast<uint32_t>(shm::ServerState::kStopped), std::memory_order_release);
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      shm::notify(segment->completions(i).data_ready);
      shm::notify(segment->lane(i).space_ready);
    }
    rejections.flush(shm::monotonic_ns(), /*all=*/true);
    worker_lines.flush(shm::monotonic_ns(), /*all=*/true);
    // relaxed: our own counters.
    const auto& st = stats();
    const auto count = [](const std::atomic<uint64_t>& a) { return std::to_string(a.load(std::memory_order_relaxed)); };
    uint64_t rejected = 0;
    for (const auto& r : st.rejected) rejected += r.load(std::memory_order_relaxed);
    log::info("stopped: version " + std::to_string(model.version) + ", gradients applied " +
              count(st.gradients_applied) + ", weights pulled " + count(st.weights_pulled) + ", rejected " +
              std::to_string(rejected) + " (stale " + count(st.rejected[static_cast<uint32_t>(ErrorCode::kStale)]) +
              ", non-finite " + count(st.rejected[static_cast<uint32_t>(ErrorCode::kNonFinite)]) +
              "), workers attached " + count(st.workers_attached) + ", died " + count(st.workers_died) + ", evicted " +
              count(st.workers_evicted) + ", queued requests failed " + std::to_string(failed) + ", up " +
              fixed1(static_cast<double>(shm::monotonic_ns() - created_ns) / 1e9) + " s");
    if (checkpoints && (failure.ok() || failure.code() != ErrorCode::kCuda)) {
      // A periodic write in flight is drained first, then the final one.
      notifier.extend_timeout(checkpoint_io_allowance(model.total_elements, 2));
      // run() returns the failure for its caller to report (shmps-server's
      // main logs it): logged here only when another failure goes first.
      if (Status s = checkpoints->write_final(); !s.ok()) {
        if (failure.ok())
          failure = s;
        else
          log::error(s.message());
      }
    }
    // Buffers of workers that died since the last sweep (e.g. killed just
    // before this stop) would otherwise outlive us in /dev/shm.
    sweeper.stop();
    sweeper.sweep_now();
    // Only our own object: the name may have been taken over meanwhile.
    if (segment_is_ours()) shm::Segment::remove(config.name);
    removed = true;
  }
};

// ------------------------------------------------------------ Server

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  if (impl_ && !impl_->removed) shm::Segment::remove(impl_->config.name);
}

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& config) { return create(config, nullptr); }

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& config, FailureKind& kind) {
  kind = FailureKind::kOther;
  return create(config, nullptr, nullptr, &kind);
}

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& config, std::unique_ptr<Backend> backend) {
  return create(config, std::move(backend), nullptr);
}

Result<std::unique_ptr<Server>> Server::create_federated(const ServerConfig& config,
                                                         std::unique_ptr<FederationEngine> engine) {
  return create(config, nullptr, std::move(engine));
}

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& requested, std::unique_ptr<Backend> backend,
                                               std::unique_ptr<FederationEngine> engine, FailureKind* kind) {
  if (Status s = validate(requested); !s.ok()) return s;
  // The engine first: with --fed-rank-in-name its rank names the segment.
  ServerConfig config = requested;
  if (!engine && config.federation.kind != FederationKind::kNone) {
    auto made = make_federation_engine(config.federation);
    if (!made.ok()) return made.status();
    engine = std::move(made).value();
  }
  if (engine) apply_rank_in_name(config, engine->membership().host);
  // The weights and optimizer state are the server's big allocations; one
  // that fails is a clear error (and no segment is left behind).
  try {
    return create_unguarded(config, std::move(backend), std::move(engine), kind);
  } catch (const std::bad_alloc&) {
    shm::Segment::remove(config.name);
    uint64_t params = 0;
    for (const auto& t : config.tensors) {
      uint64_t n = 1;
      for (uint64_t d : t.shape) n = __builtin_mul_overflow(n, d, &n) ? UINT64_MAX : n;
      params = __builtin_add_overflow(params, n, &params) ? UINT64_MAX : params;
    }
    const uint64_t per_param = 4 * (1 + kernels::state_arrays(config.optimizer));
    const uint64_t bytes = params > UINT64_MAX / per_param ? UINT64_MAX : params * per_param;
    return Status{ErrorCode::kNoCapacity, "cannot allocate the weights and optimizer state: " + std::to_string(params) +
                                              " parameters need " + std::to_string(bytes) + " bytes"};
  }
}

Result<std::unique_ptr<Server>> Server::create_unguarded(const ServerConfig& config, std::unique_ptr<Backend> backend,
                                                         std::unique_ptr<FederationEngine> engine, FailureKind* kind) {
  log::set_level(config.log_level);
  std::string effective;
  for (const auto& [key, value] : config_entries(config))
    effective += " " + key + "=" + (value.find(' ') == std::string::npos ? value : "'" + value + "'");
  log::info(std::string("starting shmps-server ") + version_text() + " (pid " + std::to_string(::getpid()) +
            "):" + effective);
  const uint64_t created_ns = shm::monotonic_ns();
  if (!backend) {
    auto selected = select_backend(config.backend, config.device);
    if (!selected.ok()) return selected.status();
    backend = std::move(selected).value();
  }

  shm::SegmentSpec spec;
  spec.name = config.name;
  spec.tensors = config.tensors;
  spec.max_workers = config.max_workers;
  spec.max_buffers = config.max_buffers;
  spec.lane_capacity = config.lane_capacity;
  spec.mode = config.group_access ? 0660 : 0600;
  spec.config = config_block(config, backend->kind());

  auto segment = shm::Segment::create(spec, random_generation());
  if (!segment.ok()) return segment.status();
  // From here until publish(), a failure removes the segment it made.
  auto impl = std::make_unique<Server::Impl>(config, std::move(segment).value(), std::move(backend));
  impl->created_ns = created_ns;
  const auto fail = [&impl](Status s) {
    shm::Segment::remove(impl->config.name);
    impl->removed = true;
    return s;
  };
  shm::Segment& seg = *impl->segment;
  impl->backend->set_stats(&seg.stats());
  Model& model = impl->model;
  std::vector<TensorExtent> extents;
  for (const shm::TensorDesc& t : seg.layout().tensors) {
    model.tensors.push_back(t);
    extents.push_back({t.element_offset, t.element_count});
  }
  model.steps.assign(extents.size(), 0);
  model.total_elements = seg.layout().total_elements;
  // Left by workers of a crashed predecessor; from here on, the sweeper's
  // thread sweeps every second.
  impl->sweeper.sweep_now();
  impl->sweeper.start();

  Backend& backend_ref = *impl->backend;
  if (Status s = backend_ref.allocate(extents, kernels::state_arrays(config.optimizer), model.total_elements); !s.ok())
    return fail(s);
  // A restored checkpoint replaces the initial weights: an --init-file
  // that cannot be read then stops nothing (a restart after the file was
  // cleaned up).
  const Status initialised =
      initial_weights(config.init, model.total_elements, [&backend_ref](uint64_t first, std::span<const float> values) {
        return backend_ref.write_weights(first, values);
      });
  if (!initialised.ok() && config.checkpoint_dir.empty()) return fail(initialised);
  // Published with the segment below.
  seg.header().weights_export = weights_export_block(impl->backend->weights_export(), model.total_elements);
  if (!config.checkpoint_dir.empty()) {
    impl->checkpoints = std::make_unique<CheckpointPolicy>(impl->config, model, *impl->backend, seg.stats());
    if (Status s = impl->checkpoints->start(shm::monotonic_ns(), kind); !s.ok()) return fail(s);
    if (!initialised.ok() && !impl->checkpoints->restored()) return fail(initialised);
    if (!initialised.ok())
      log::warn(initialised.message() + "; not needed: the weights and state are the restored checkpoint's");
  }
  if (engine) {
    const Membership m = engine->membership();
    log::info(std::string("federation over ") + engine->name() + ": host " + std::to_string(m.host) +
              (engine->elastic() ? " (the group forms at its first round)"
                                 : ", rank " + std::to_string(m.rank) + " of " + std::to_string(m.size)) +
              "; the join agrees on the anchor (docs/federation.md)");
    impl->federation = std::make_unique<FederationLink>(config.federation, std::move(engine), model_fingerprint(config),
                                                        seg.stats(), seg.header().server_wake);
    if (impl->checkpoints) {
      if (std::optional<FederationState> state = impl->checkpoints->take_restored_federation()) {
        const uint64_t round = state->round;
        if (Status s = impl->federation->restore(std::move(*state), impl->checkpoints->take_restored_weights());
            !s.ok())
          return fail(s);
        // The weights are the federation's already (a checkpoint of version
        // 0 holds merged rounds too): an init would make the join keep
        // init - W_ckpt as local updates.
        model.initialised_by = "the federation state of checkpoint " + impl->checkpoints->restored_path();
        log::info("federation: resuming from the checkpoint's anchor of round " + std::to_string(round));
      } else if (impl->checkpoints->restored()) {
        impl->federation->restored_without_state(impl->checkpoints->restored_path());
      }
      // The checkpoints carry the federation's state; once a link left
      // behind at stop is released there is none to be had (and no
      // checkpoint is written without it: CheckpointPolicy::write_final()).
      impl->checkpoints->set_federation_source([fed = &impl->federation, &model](std::optional<FederationState>* out) {
        return *fed && (*fed)->checkpoint_state(model.version, out);
      });
    }
  } else if (impl->checkpoints) {
    // Without federation, a restored federation state and the copy of the
    // weights kept for it are of no use: not held for the server's life.
    static_cast<void>(impl->checkpoints->take_restored_federation());
    static_cast<void>(impl->checkpoints->take_restored_weights());
  }

  seg.header().server_state.store(static_cast<uint32_t>(shm::ServerState::kRunning),
                                  std::memory_order_relaxed);  // relaxed: published next
  seg.publish();
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(spec.mode));
  log::info("serving /dev/shm/" + shm::segment_object_name(config.name) + " (mode " + mode + ", " +
            std::to_string(seg.layout().geometry.segment_size / 1024) +
            " KiB): " + std::to_string(model.tensors.size()) + " tensors, " + std::to_string(model.total_elements) +
            " parameters, optimizer " + kernels::optimizer_kind_name(config.optimizer.kind) + ", backend " +
            impl->backend->name() + ", buffers of up to " + std::to_string(worker_buffer_budget(config)) +
            " bytes per worker");
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Status Server::run(const RunOptions& options) { return impl_->run(options); }

void Server::poll_once() {
  impl_->loop_now = shm::monotonic_ns();
  impl_->drain_held();
  if (impl_->gate.any_parked()) impl_->release_pulls(impl_->loop_now);
  impl_->serve_doorbells();
  impl_->housekeeping();
}

void Server::request_stop() noexcept {
  impl_->stop.store(true, std::memory_order_release);  // SYNC(stop)
  shm::notify(impl_->segment->header().server_wake);
}

void Server::request_reload() noexcept {
  impl_->reload_requested.store(true, std::memory_order_release);  // SYNC(reload)
  shm::notify(impl_->segment->header().server_wake);
}

Result<std::vector<float>> Server::weights() const { return impl_->backend->read_weights(); }
uint64_t Server::version() const noexcept { return impl_->model.version; }

}  // namespace shmps::server
