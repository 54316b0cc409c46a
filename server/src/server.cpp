#include "shmps/server/server.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <random>

#include "backend.hpp"
#include "checkpoint.hpp"
#include "service.hpp"
#include "shmps/server/log.hpp"
#include "shmps/server/options.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/ring.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {

using shm::Completion;
using shm::Opcode;
using shm::Request;
using shm::WorkerState;

namespace {

constexpr uint32_t kBatchPerLane = 32;          // requests served per lane before moving on
constexpr uint64_t kHousekeepingNs = 50'000'000;  // dead-worker scan and lane sweep
constexpr uint64_t kHeartbeatNs = 10'000'000;
constexpr uint32_t kWatchPolls = 64;             // idle polls of watch_lanes() before the loop turns (a pause each)
constexpr uint64_t kWatchBudgetNs = 20'000;      // serving time after which watch_lanes() lets the loop turn
constexpr size_t kStalenessWindow = 128;
constexpr uint64_t kStatusNs = 2'000'000'000;     // STATUS= refresh, rejection counts
constexpr uint64_t kSegmentCheckNs = 1'000'000'000;  // is /dev/shm/shmps.<name> still ours?
constexpr uint64_t kRejectLogNs = 1'000'000'000;  // at most one rejection line per cause per second
constexpr uint32_t kWorkerLinesPerSecond = 20;    // attach/detach/death/eviction lines, then counted
constexpr uint64_t kFenceStallNs = 60'000'000'000;  // device work this late means the stream is stuck

const char* opcode_name(uint32_t opcode) {
  static constexpr const char* kNames[] = {"request", "attach", "detach", "register_buffer", "unregister_buffer",
                                           "push", "pull", "stats", "ping", "init"};
  return opcode <= shm::kOpcodeMax ? kNames[opcode] : "request";
}

std::string fixed1(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// The entries of config_entries() with repeated keys (tensor) joined, in order.
std::vector<std::pair<std::string, std::string>> grouped_entries(const ServerConfig& config) {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& [key, value] : config_entries(config)) {
    auto it = std::find_if(out.begin(), out.end(), [&key = key](const auto& e) { return e.first == key; });
    if (it == out.end()) out.emplace_back(key, value);
    else it->second += "," + value;
  }
  return out;
}

uint64_t random_generation() {
  std::random_device rd;
  uint64_t g = (uint64_t{rd()} << 32) ^ rd() ^ shm::monotonic_ns();
  return g == 0 ? 1 : g;
}

Result<std::vector<float>> initial_weights(const InitSpec& init, uint64_t total) {
  std::vector<float> w(total, 0.0f);
  switch (init.kind) {
    case InitSpec::Kind::kZero:
      break;
    case InitSpec::Kind::kNormal: {
      std::mt19937_64 rng(init.seed);
      std::normal_distribution<float> dist(0.0f, init.scale);
      for (float& x : w) x = dist(rng);
      break;
    }
    case InitSpec::Kind::kUniform: {
      std::mt19937_64 rng(init.seed);
      std::uniform_real_distribution<float> dist(-init.scale, init.scale);
      for (float& x : w) x = dist(rng);
      break;
    }
    case InitSpec::Kind::kFile:
      if (Status s = read_init_file(init.file, total, w.data()); !s.ok()) return s;
      break;
  }
  return w;
}

}  // namespace

// Server-private state of one worker-table entry.
// The server's own record is the authority: what the segment says is a
// claim to check against it, never a fact (a worker may overwrite its
// entry at any time).
struct WorkerSlot {
  shm::SpscConsumer<Request> lane;
  shm::SpscProducer<Completion> completions;
  // By buffer id. Shared: a request whose device work still runs holds its
  // buffer, so an unregister, detach or death closes the mapping only once
  // that work is done (the deleter counts mappings_closed then).
  std::vector<std::shared_ptr<PeerBuffer>> buffers;
  // Completions held back until the device work before them is done
  // (backend.hpp, "Completion"), in request order: once one is held, every
  // later completion of this worker queues behind it.
  struct Deferred {
    Completion completion;
    Fence fence = 0;                   // 0: ready as soon as those before it are
    std::shared_ptr<PeerBuffer> hold;  // the buffer its device work uses
    uint64_t since_ns = 0;             // when it was held back (CLOCK_MONOTONIC)
  };
  std::deque<Deferred> deferred;
  uint64_t owner = 0;           // the owner word we attached (pid, kAttached); 0: none
  uint64_t pid_start_time = 0;
  uint64_t lease = 0;
  uint64_t stopped_since_ns = 0;  // when we first saw its process stopped; 0: running
  uint64_t next_request_id = 0;   // the id after the last request taken; 0: unknown (new session)
  bool attached() const { return owner != 0; }
};

class Server::Impl {
 public:
  ServerConfig config;
  std::unique_ptr<shm::Segment> segment;
  std::unique_ptr<Backend> backend;
  std::vector<WorkerSlot> slots;
  std::vector<uint32_t> attached_lanes;     // indices of the attached slots, for watch_lanes()
  std::vector<uint64_t> attached_bits;      // the same as doorbell-word bitmaps
  size_t watch_cursor = 0;                  // where watch_lanes() resumes its round robin
  std::vector<shm::TensorDesc> tensors;     // private copy: never re-read from shm
  std::vector<uint64_t> steps;              // per tensor, PyTorch's step count
  shm::ConfigBlock shared_config{};
  std::string buffer_prefix;                // "shmps.<name>.p": buffers are "<prefix><pid>.<n>"
  uint64_t version = 0;
  std::string initialised_by;               // "worker 2 (pid 4711)" once a worker's init was accepted
  uint64_t total_elements = 0;
  std::array<uint64_t, kStalenessWindow> staleness_window{};
  uint64_t staleness_count = 0;
  uint64_t staleness_sum = 0;
  uint64_t lease_counter = 0;
  uint64_t high_water = 0;                  // mirror of stats().ring_high_water
  uint64_t last_heartbeat = 0;
  uint64_t last_housekeeping = 0;
  uint64_t loop_now = 0;                    // CLOCK_MONOTONIC ns at the start of this turn of the loop
  // Checkpoints (none while config.checkpoint_dir is empty).
  std::unique_ptr<CheckpointWriter> checkpoints;
  uint64_t last_checkpoint_version = 0;  // handed to the writer (or restored)
  uint64_t last_checkpoint_ns = 0;
  // The segment's name must keep pointing at our object (logind's
  // RemoveIPC, or an operator, may unlink it under us).
  uint64_t last_segment_check = 0;
  Status failure;
  // Device work of sessions that ended while it ran (a worker died or was
  // evicted mid-push): its buffers stay mapped until the fence is done.
  std::vector<WorkerSlot::Deferred> orphaned;
  uint64_t deferred_count = 0;             // sum of slots[*].deferred sizes
  // A push or pull that enqueued device work on this buffer (set before the
  // backend call, consumed by post()).
  std::shared_ptr<PeerBuffer> held;
  bool async_backend = false;               // backend->asynchronous(), read once
  std::atomic<bool> stop{false};
  std::atomic<bool> reload_requested{false};
  bool removed = false;

  // Service manager and log state; the consumer thread's only.
  RunOptions run_options;
  ServiceNotifier notifier;
  uint64_t created_ns = 0;
  uint64_t last_watchdog = 0;
  uint64_t last_status = 0;
  uint64_t applied_at_last_status = 0;
  double push_rate = 0.0;  // pushes/s over the last status interval
  struct RejectLog {
    uint64_t last_ns = 0;     // when the last line for this cause was written
    uint64_t unreported = 0;  // rejections since, not logged one by one
  };
  std::array<RejectLog, shm::kRejectCauses> reject_log{};
  // Worker lifecycle lines (attached, detached, died, evicted): at most
  // kWorkerLinesPerSecond per second, so a crash loop of thousands of
  // workers cannot flood the journal; the rest are counted.
  struct WorkerLog {
    uint64_t window_start = 0;
    uint32_t lines = 0;
    uint64_t suppressed = 0;
  } worker_log;

  shm::StatsBlock& stats() { return segment->stats(); }

  // ------------------------------------------------------------ loop
  Status run(const RunOptions& options) {
    run_options = options;
    notifier = options.notify_service_manager ? ServiceNotifier::from_environment() : ServiceNotifier{};
    const auto spin_ns = uint64_t{config.idle_spin_us} * 1000;
    uint64_t idle_since = 0;
    last_watchdog = last_status = shm::monotonic_ns();
    applied_at_last_status = stats().gradients_applied.load(std::memory_order_relaxed);  // relaxed: our own counter
    if (notifier.enabled()) {
      log::info(notifier.watchdog_ns() == 0
                    ? std::string("notifying systemd; no watchdog")
                    : "notifying systemd; watchdog keep-alive every " + std::to_string(notifier.watchdog_ns() / 2'000'000) + " ms");
      // The segment is published and the weights are loaded (create()).
      notifier.ready(status_text());
    }
    while (!stop.load(std::memory_order_acquire)) {  // SYNC(stop): pairs with request_stop()
      const uint64_t now = shm::monotonic_ns();
      loop_now = now;
      if (now - last_heartbeat >= kHeartbeatNs) {
        // relaxed: a liveness hint; readers compare it against their clock only.
        segment->header().heartbeat_ns.store(now, std::memory_order_relaxed);
        last_heartbeat = now;
        periodic(now);
      }
      bool worked = drain_deferred();
      worked |= serve_doorbells();
      if (now - last_housekeeping >= kHousekeepingNs) {
        last_housekeeping = now;
        worked |= housekeeping();
      }
      if (worked) {
        idle_since = 0;
        continue;
      }
      if (deferred_count != 0 || !orphaned.empty()) {
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
    shutdown();
    return failure;
  }

  // Every kHeartbeatNs, from the loop and only there: a consumer stuck in a
  // request stops the watchdog keep-alives, and systemd restarts it.
  void periodic(uint64_t now) {
    update_depth();  // for readers of the stats block (shmps-inspect)
    if (now - last_segment_check >= kSegmentCheckNs) {
      last_segment_check = now;
      check_segment_name();
    }
    if (checkpoints) maybe_checkpoint(now);
    // The relaxed load keeps the locked exchange off the common path (a
    // stale false only delays the reload to the next tick). SYNC(reload):
    // the acquire pairs with request_reload()'s release, so what the
    // requester wrote for RunOptions::reload to read is visible.
    if (reload_requested.load(std::memory_order_relaxed) && reload_requested.exchange(false, std::memory_order_acquire))
      reload(now);
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
      flush_rejection_counts(now);
    }
    flush_worker_lines(now);
  }

  // "shmps 0.1.0 'job1': 2 workers attached, 850.0 pushes/s, version 1234"
  std::string status_text() {
    // relaxed: our own counter.
    const uint64_t workers = stats().workers_attached.load(std::memory_order_relaxed);
    return std::string("shmps ") + version_text() + " '" + config.name + "': " + std::to_string(workers) +
           " workers attached, " + fixed1(push_rate) + " pushes/s, version " + std::to_string(version);
  }

  // ------------------------------------------------------------ reload
  void reload(uint64_t now) {
    notifier.reloading(now);
    if (!run_options.reload) {
      log::warn("reload requested, but this server has no configuration source; nothing changed");
    } else if (Result<ServerConfig> next = run_options.reload(); !next.ok()) {
      log::error("reload failed, keeping the running configuration: " + next.status().message());
      notifier.ready("reload failed (see the log); " + status_text());
      return;
    } else {
      apply_live(*next);
    }
    notifier.ready(status_text());
  }

  // Applies what may change while workers run and logs each change; other
  // differences wait for a restart. The segment's config block follows, so
  // shmps-inspect shows the values in force.
  void apply_live(const ServerConfig& next) {
    const auto before = grouped_entries(config);
    const auto after = grouped_entries(next);
    std::vector<std::string> keys;
    for (const auto* side : {&after, &before})
      for (const auto& e : *side)
        if (std::find(keys.begin(), keys.end(), e.first) == keys.end()) keys.push_back(e.first);
    const auto value_of = [](const auto& entries, const std::string& key) {
      for (const auto& e : entries)
        if (e.first == key) return e.second;
      return std::string("(unset)");
    };
    int applied = 0, pending = 0;
    shm::ConfigBlock& shared = segment->header().config;
    for (const std::string& key : keys) {
      const std::string old_value = value_of(before, key), new_value = value_of(after, key);
      if (old_value == new_value) continue;
      const std::string change = "reload: " + key + " " + old_value + " -> " + new_value;
      if (key == "lr") {
        kernels::OptimizerConfig candidate = config.optimizer;
        candidate.lr = next.optimizer.lr;
        if (std::string err = kernels::validate(candidate); !err.empty()) {
          log::error("reload: lr " + new_value + " refused, keeping " + old_value + ": " + err);
          continue;
        }
        config.optimizer.lr = next.optimizer.lr;
        // relaxed: a display value for shmps-inspect (an aligned 4-byte
        // store, never torn); the server reads its own copy.
        std::atomic_ref<float>(shared.lr).store(config.optimizer.lr, std::memory_order_relaxed);
        log::info(change);
      } else if (key == "max-staleness") {
        config.max_staleness = next.max_staleness;
        // relaxed: as lr above.
        std::atomic_ref<uint64_t>(shared.max_staleness).store(config.max_staleness, std::memory_order_relaxed);
        log::info(change);
      } else if (key == "log-level") {
        // Written under whichever of the two levels is more verbose, so the
        // change itself is always seen.
        const bool more_verbose = static_cast<int>(next.log_level) > static_cast<int>(config.log_level);
        if (more_verbose) log::set_level(next.log_level);
        log::info(change);
        if (!more_verbose) log::set_level(next.log_level);
        config.log_level = next.log_level;
      } else {
        log::warn(change + " needs a restart; still " + old_value);
        ++pending;
        continue;
      }
      ++applied;
    }
    log::info("reloaded the configuration: " + std::to_string(applied) + " change(s) applied" +
              (pending > 0 ? ", " + std::to_string(pending) + " need a restart" : std::string()));
  }

  void log_worker(LogLevel level, const std::string& line) {
    if (!log::enabled(level)) return;
    const uint64_t now = shm::monotonic_ns();
    flush_worker_lines(now);
    if (worker_log.lines >= kWorkerLinesPerSecond) {
      ++worker_log.suppressed;
      return;
    }
    ++worker_log.lines;
    log::write(level, line);
  }

  // Starts a new one-second window of worker lines, reporting what the
  // last one suppressed (with `all`: now, at shutdown).
  void flush_worker_lines(uint64_t now, bool all = false) {
    if (!all && now - worker_log.window_start < kRejectLogNs) return;
    if (worker_log.suppressed > 0)
      log::warn(std::to_string(worker_log.suppressed) + " more worker attach/detach/death/eviction lines in the last " +
                fixed1(static_cast<double>(now - worker_log.window_start) / 1e9) +
                " s not logged (more than " + std::to_string(kWorkerLinesPerSecond) + " per second)");
    worker_log = WorkerLog{now, 0, 0};
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
    if (!doorbells_pending() && !stop.load(std::memory_order_acquire))
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
      const size_t n = attached_lanes.size();
      for (size_t k = 0; k < n; ++k) {
        const size_t pos = (watch_cursor + k) % n;  // round robin: no lane waits behind a busy one
        const uint32_t i = attached_lanes[pos];
        shm::SpscConsumer<Request>& lane = slots[i].lane;
        lane.prefetch_next();
        if (!lane.tail_moved_hint()) continue;
        watch_cursor = pos + 1;
        // May change attached_lanes: rescan from the cursor. A lane that
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
        if ((segment->header().doorbell[w].load(std::memory_order_relaxed) & ~attached_bits[w]) != 0) return true;
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
    // release: relevant only to ourselves; no data published here.
    segment->header().doorbell[i / 64].fetch_or(uint64_t{1} << (i % 64), std::memory_order_release);
  }

  // Serves up to kBatchPerLane requests of lane i. True when any was served.
  bool serve_lane(uint32_t i) {
    WorkerSlot& slot = slots[i];
    if (!sync_entry(i)) return false;
    slot.lane.prefetch_next();  // the request's line travels while we check the entry
    shm::WorkerEntry& entry = segment->worker(i);
    uint32_t served = 0;
    bool drained = false;  // the batch ended on an empty lane
    while (served < kBatchPerLane) {
      if (!slot.completions.has_space()) break;  // worker is behind; it will catch up
      if (slot.deferred.size() >= config.lane_capacity) break;  // its device work is behind
      if (!failure.ok()) break;  // the device failed: nothing more is taken (shutdown fails the rest)
      // This lane alone is a lower bound of the total; update_depth() sums
      // all lanes every heartbeat and for a stats request.
      note_depth(slot.lane.depth_estimate());
      // A request whose id is the one after the last is taken from its slot
      // (ring.hpp, seq_published()) even if its tail has not arrived yet.
      Request req;
      const shm::RingResult r = slot.lane.try_pop(&req, slot.next_request_id);
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
      bump(stats().requests);
      Completion c = handle(i, req);
      if (c.opcode == static_cast<uint32_t>(Opcode::kDetach) && c.code == 0) {
        // Its held-back answers go first (detaches are rare: wait for the device).
        if (!slot.deferred.empty()) {
          if (Status s = backend->synchronize(); !s.ok()) fatal(s);
          drain_deferred();
        }
        // kDetached before the answer: the worker, once it reads the
        // answer, sees it may reset and free the entry.
        mark_detached(i);
        post(i, c);
        finish_detach(i);
        return true;
      }
      post(i, c);
      if (!slot.attached() || entry.owner.load(std::memory_order_relaxed) != slot.owner)  // relaxed: re-checked by sync_entry
        return true;  // evicted while handling, or the entry changed
    }
    if (served > 0) shm::notify(slot.lane.header()->space_ready);
    if (!drained && slot.lane.refresh() == shm::RingResult::kOk) ring_doorbell(i);  // more left: come back
    return served > 0;
  }

  // Answers request `c` of worker i: now, or once the device work the
  // request enqueued (held) and every completion held before it are done.
  void post(uint32_t i, const Completion& c) {
    WorkerSlot& slot = slots[i];
    const Fence fence = held ? backend->fence() : 0;
    if (fence != 0 || !slot.deferred.empty()) {
      slot.deferred.push_back({c, fence, std::move(held), shm::monotonic_ns()});
      ++deferred_count;
      held.reset();
      return;
    }
    held.reset();
    post_now(i, c);
  }

  void post_now(uint32_t i, const Completion& c) {
    WorkerSlot& slot = slots[i];
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

  // Posts the held-back completions whose device work is done, in request
  // order per worker, and lets go of orphaned work that finished. A fence
  // that reports an error fails its request with the CUDA error; a lost
  // context stops the server (fatal()).
  bool drain_deferred() {
    // The common case, and the only one of the host backend: nothing held
    // back, nothing to poll (a device failing meanwhile is seen by the next
    // call that uses it).
    if (deferred_count == 0 && orphaned.empty()) return false;
    bool worked = false;
    if (deferred_count != 0) {
      for (uint32_t i = 0; i < config.max_workers; ++i) {
        WorkerSlot& slot = slots[i];
        while (!slot.deferred.empty()) {
          WorkerSlot::Deferred& d = slot.deferred.front();
          if (d.fence != 0) {
            Result<bool> done = backend->fence_done(d.fence);
            if (done.ok() && !*done) {
              // A stream waiting on the event of a worker killed before its
              // own stream reached the record may wait forever: everything
              // queued behind it would stall with it, so give up loudly.
              if (shm::monotonic_ns() - d.since_ns > kFenceStallNs)
                fatal(Status{ErrorCode::kCuda, "device work of worker " + std::to_string(i) + " has not finished in " +
                                                   std::to_string(kFenceStallNs / 1'000'000'000) +
                                                   " s (a dead worker's event never recorded?)"});
              break;
            }
            if (!done.ok()) {
              d.completion.code = static_cast<uint32_t>(done.status().code());
              std::snprintf(d.completion.message, sizeof d.completion.message, "%s", done.status().message().c_str());
            }
          }
          if (!slot.completions.has_space()) break;  // the worker is behind; it will catch up
          const Completion c = d.completion;
          slot.deferred.pop_front();
          --deferred_count;
          post_now(i, c);
          worked = true;
          if (!slot.attached()) break;  // evicted by post_now
        }
      }
    }
    std::erase_if(orphaned, [&](const WorkerSlot::Deferred& d) {
      Result<bool> done = backend->fence_done(d.fence);
      return !done.ok() || *done;
    });
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

  void update_depth() {
    uint64_t depth = 0;
    for (uint32_t i = 0; i < config.max_workers; ++i)
      if (slots[i].attached()) depth += slots[i].lane.depth_estimate();
    // relaxed: statistics for readers of the stats block.
    stats().ring_depth.store(depth, std::memory_order_relaxed);
    note_depth(depth);
  }

  // counter += by for counters only this thread writes (the stats block,
  // the entries' counters): a load and a store, no locked instruction;
  // readers in other processes see each value whole (relaxed atomics), as
  // with fetch_add.
  static void bump(std::atomic<uint64_t>& counter, uint64_t by = 1) {
    counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);  // relaxed: statistic
  }

  void note_depth(uint64_t depth) {
    if (depth <= high_water) return;
    high_water = depth;
    stats().ring_high_water.store(depth, std::memory_order_relaxed);  // relaxed: statistic
  }

  // ------------------------------------------------------------ requests
  static Completion answer(const Request& req, ErrorCode code, std::string_view message) {
    Completion c{};
    c.request_id = req.request_id;
    c.opcode = req.opcode;
    c.code = static_cast<uint32_t>(code);
    // Most completions are successes without a message, and c is zeroed:
    // skip the formatting (about 230 of the ~1.8K instructions a push costs
    // the protocol, by callgrind).
    if (!message.empty())
      std::snprintf(c.message, sizeof c.message, "%.*s", static_cast<int>(message.size()), message.data());
    return c;
  }

  Completion reject(uint32_t i, const Request& req, ErrorCode code, const std::string& message) {
    // relaxed: statistics counters.
    stats().rejected[static_cast<uint32_t>(code) % shm::kRejectCauses].fetch_add(1, std::memory_order_relaxed);
    if (req.opcode == static_cast<uint32_t>(Opcode::kPush))
      segment->worker(i).pushes_rejected.fetch_add(1, std::memory_order_relaxed);
    log_rejection(i, req, code, message);
    Completion c = answer(req, code, message);
    c.version = version;
    return c;
  }

  // Stale pushes are routine in asynchronous training (info); anything else
  // is a bug or an attack on the worker side (warn). At most one line per
  // cause per kRejectLogNs; the ones in between are counted and reported
  // with the next line, or by flush_rejection_counts().
  static LogLevel rejection_level(uint32_t cause) {
    return cause == static_cast<uint32_t>(ErrorCode::kStale) || cause == static_cast<uint32_t>(ErrorCode::kInitRefused)
               ? LogLevel::kInfo
               : LogLevel::kWarn;
  }

  void log_rejection(uint32_t i, const Request& req, ErrorCode code, const std::string& message) {
    const uint32_t cause = static_cast<uint32_t>(code) % shm::kRejectCauses;
    if (!log::enabled(rejection_level(cause))) return;
    RejectLog& r = reject_log[cause];
    const uint64_t now = shm::monotonic_ns();
    if (r.last_ns != 0 && now - r.last_ns < kRejectLogNs) {
      ++r.unreported;
      return;
    }
    // relaxed: re-read of the entry's owner for the pid in the message.
    const uint32_t pid = shm::owner_pid(segment->worker(i).owner.load(std::memory_order_relaxed));
    std::string line = "rejected " + std::string(opcode_name(req.opcode)) + " from worker " + std::to_string(i) +
                       " (pid " + std::to_string(pid) + "): " + std::string(error_code_name(code)) + ": " + message;
    if (r.unreported > 0)
      line += " (+" + std::to_string(r.unreported) + " more '" + std::string(error_code_name(code)) + "' since the last report)";
    log::write(rejection_level(cause), line);
    r.last_ns = now;
    r.unreported = 0;
  }

  // Reports the rejections not logged one by one, once their cause's line
  // is kRejectLogNs old (or now, with `all`: at shutdown).
  void flush_rejection_counts(uint64_t now, bool all = false) {
    for (uint32_t cause = 0; cause < shm::kRejectCauses; ++cause) {
      RejectLog& r = reject_log[cause];
      if (r.unreported == 0 || (!all && now - r.last_ns < kRejectLogNs)) continue;
      log::write(rejection_level(cause), std::to_string(r.unreported) + " more '" +
                                             std::string(error_code_name(static_cast<ErrorCode>(cause))) +
                                             "' rejections in the last " + fixed1(static_cast<double>(now - r.last_ns) / 1e9) + " s");
      r.unreported = 0;
      r.last_ns = now;
    }
  }

  Completion handle(uint32_t i, const Request& req) {
    shm::WorkerEntry& entry = segment->worker(i);
    if (req.worker_id != i)
      return reject(i, req, ErrorCode::kBadRequest, "worker_id " + std::to_string(req.worker_id) + " on lane " + std::to_string(i));
    if (req.opcode == 0 || req.opcode > shm::kOpcodeMax)
      return reject(i, req, ErrorCode::kBadRequest, "unknown opcode " + std::to_string(req.opcode));
    if (req.flags != 0) return reject(i, req, ErrorCode::kBadRequest, "flags must be 0");
    if (req.opcode == static_cast<uint32_t>(Opcode::kAttach))
      return reject(i, req, ErrorCode::kBadRequest, "attach is a handshake in the worker entry, not a request");
    // Our copy of the lease: the one in the entry is the worker's to overwrite.
    if (req.lease != slots[i].lease) return reject(i, req, ErrorCode::kBadRequest, "stale or forged lease");
    // relaxed: a statistic. The time of this turn of the loop (a clock read
    // per request cost 20-30 ns of the round trip).
    entry.last_request_ns.store(loop_now, std::memory_order_relaxed);
    switch (static_cast<Opcode>(req.opcode)) {
      case Opcode::kDetach: return answer(req, ErrorCode::kOk, "");
      case Opcode::kRegisterBuffer: return register_buffer(i, req);
      case Opcode::kUnregisterBuffer: return unregister_buffer(i, req);
      case Opcode::kPush: return push(i, req);
      case Opcode::kPull: return pull(i, req);
      case Opcode::kStats: return stats_request(i, req);
      case Opcode::kInit: return init(i, req);
      case Opcode::kPing: {
        Completion c = answer(req, ErrorCode::kOk, "");
        c.version = version;
        return c;
      }
      case Opcode::kAttach: break;
    }
    return reject(i, req, ErrorCode::kBadRequest, "unknown opcode");
  }

  // Reconciles our record of entry i with its owner word. True when its
  // lane may be served: attached by us and unchanged. A Claimed entry gets
  // the attach handshake; an entry that changed under an attached session
  // (freed, re-claimed or overwritten by its process) ends that session.
  bool sync_entry(uint32_t i) {
    WorkerSlot& slot = slots[i];
    // acquire: SYNC(worker_claim) pairs with the claiming CAS, so the
    // claimer's pid_start_time is visible.
    const uint64_t owner = segment->worker(i).owner.load(std::memory_order_acquire);
    if (slot.attached()) {
      if (owner == slot.owner) return true;
      end_session(i, "its entry was freed or overwritten by its process without a detach");
    }
    if (shm::owner_state(owner) == static_cast<uint32_t>(WorkerState::kClaimed)) attach(i, owner);
    return false;
  }

  // The attach handshake: a worker claims a free entry (CAS to (pid,
  // kClaimed)), writes its start time and rings its doorbell. We check the
  // process, reset the lane and queue indices (whatever earlier owners left
  // there), issue a lease and move the owner word to (pid, kAttached) with a
  // CAS; the worker waits for exactly that word (SYNC(worker_attached)).
  void attach(uint32_t i, uint64_t claimed) {
    shm::WorkerEntry& entry = segment->worker(i);
    const pid_t pid = static_cast<pid_t>(shm::owner_pid(claimed));
    const uint64_t start = entry.pid_start_time;
    if (pid <= 0 || start == 0 || !shm::process_alive(pid, start)) return;  // not ready yet, or reaped soon
    WorkerSlot& slot = slots[i];
    reset_lanes(i);
    uint64_t lease = (++lease_counter << 16) ^ (segment->header().generation & 0xFFFF) ^ (uint64_t{i} << 56);
    if (lease == 0) lease = 1;
    entry.lease = lease;
    // relaxed: published by the release CAS below.
    entry.pushes_applied.store(0, std::memory_order_relaxed);
    entry.pushes_rejected.store(0, std::memory_order_relaxed);
    entry.pulls.store(0, std::memory_order_relaxed);
    const uint64_t attached = shm::make_owner(static_cast<uint32_t>(pid), WorkerState::kAttached);
    uint64_t expected = claimed;
    // acq_rel: SYNC(worker_attached) the release publishes the reset
    // indices and the lease to the worker that sees kAttached; fails if the
    // entry changed since we read it (then nothing is attached).
    if (!entry.owner.compare_exchange_strong(expected, attached, std::memory_order_acq_rel, std::memory_order_relaxed))
      return;
    slot.owner = attached;
    slot.lease = lease;
    attached_lanes.push_back(i);
    attached_bits[i / 64] |= uint64_t{1} << (i % 64);
    slot.pid_start_time = start;
    slot.buffers.clear();
    slot.buffers.resize(config.max_buffers);
    stats().workers_attached.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
    shm::notify(segment->completions(i).data_ready);
    log_worker(LogLevel::kInfo, "worker " + std::to_string(i) + " attached (pid " + std::to_string(pid) + ")");
  }

  // Drops our side of an attached session (buffers, counts); the entry's
  // words are left as they are.
  void end_session(uint32_t i, const std::string& why) {
    WorkerSlot& slot = slots[i];
    if (!slot.attached()) return;
    if (!why.empty())
      log_worker(LogLevel::kWarn, "worker " + std::to_string(i) + " (pid " + std::to_string(shm::owner_pid(slot.owner)) + "): " + why);
    for (auto& d : slot.deferred)
      if (d.fence != 0) orphaned.push_back({Completion{}, d.fence, std::move(d.hold)});
    deferred_count -= slot.deferred.size();
    slot.deferred.clear();
    for (uint32_t b = 0; b < slot.buffers.size(); ++b) close_buffer(slot, b);
    slot.buffers.clear();
    slot.owner = 0;
    slot.lease = 0;
    slot.stopped_since_ns = 0;
    std::erase(attached_lanes, i);
    attached_bits[i / 64] &= ~(uint64_t{1} << (i % 64));
    stats().workers_attached.fetch_sub(1, std::memory_order_relaxed);  // relaxed: statistic
  }

  Completion register_buffer(uint32_t i, const Request& req) {
    WorkerSlot& slot = slots[i];
    if (req.buffer_id >= config.max_buffers)
      return reject(i, req, ErrorCode::kUnknownBuffer, "buffer id " + std::to_string(req.buffer_id) + " >= max_buffers " + std::to_string(config.max_buffers));
    if (slot.buffers[req.buffer_id]) return reject(i, req, ErrorCode::kBadRequest, "buffer id already registered");
    // Copy the descriptor out of shared memory before validating it.
    shm::BufferDesc desc;
    std::memcpy(&desc, &segment->buffer(i, req.buffer_id), sizeof desc);
    if (desc.kind == static_cast<uint32_t>(shm::BufferKind::kHostShm) &&
        std::memchr(desc.handle, '\0', sizeof desc.handle) == nullptr)
      return reject(i, req, ErrorCode::kBadRequest, "buffer handle is not a terminated name");
    if (desc.length == 0) return reject(i, req, ErrorCode::kBadRange, "buffer length 0");
    // Only objects named for this worker's pid: never the control segment
    // or another worker's buffer.
    const uint32_t pid = shm::owner_pid(slot.owner);
    auto peer = backend->open_peer_of(desc, buffer_prefix + std::to_string(pid) + ".", pid);
    if (!peer.ok()) {
      if (Status s = backend->healthy(); !s.ok()) fatal(s);
      return reject(i, req, peer.status().code(), peer.status().message());
    }
    // The deleter runs when the last holder lets go: at close_buffer(), or
    // later when device work still used it.
    shm::StatsBlock* st = &stats();
    slot.buffers[req.buffer_id] = std::shared_ptr<PeerBuffer>(peer->release(), [st](PeerBuffer* p) {
      delete p;
      st->mappings_closed.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
    });
    if (log::enabled(LogLevel::kDebug))
      log::debug("worker " + std::to_string(i) + " registered buffer " + std::to_string(req.buffer_id) + " (" +
                 std::to_string(desc.length) + " bytes)");
    // relaxed: statistics.
    stats().buffers_registered.fetch_add(1, std::memory_order_relaxed);
    stats().mappings_opened.fetch_add(1, std::memory_order_relaxed);
    return answer(req, ErrorCode::kOk, "");
  }

  void close_buffer(WorkerSlot& slot, uint32_t b) {
    if (!slot.buffers[b]) return;
    slot.buffers[b].reset();  // the deleter counts mappings_closed once nothing holds it
    stats().buffers_registered.fetch_sub(1, std::memory_order_relaxed);  // relaxed: statistic
  }

  // Rejects `req` and forgets its buffer, whose memory vanished under us.
  Completion drop_buffer(uint32_t i, const Request& req, const Status& why) {
    log::warn("worker " + std::to_string(i) + ": buffer " + std::to_string(req.buffer_id) + ": " + why.message());
    close_buffer(slots[i], req.buffer_id);
    return reject(i, req, why.code(), why.message());
  }

  Completion unregister_buffer(uint32_t i, const Request& req) {
    WorkerSlot& slot = slots[i];
    if (req.buffer_id >= config.max_buffers || !slot.buffers[req.buffer_id])
      return reject(i, req, ErrorCode::kUnknownBuffer, "buffer " + std::to_string(req.buffer_id) + " is not registered");
    close_buffer(slot, req.buffer_id);
    return answer(req, ErrorCode::kOk, "");
  }

  // Resolves tensor_id and the byte range of a push or pull: the tensor
  // range [first, last) and its element count, and the registered buffer.
  struct Target {
    uint32_t first = 0, last = 0;
    uint64_t elements = 0;
    PeerBuffer* buffer = nullptr;
  };
  Result<Target> resolve(uint32_t i, const Request& req, uint64_t element_size, const char* dtype_name) {
    Target t;
    if (req.tensor_id == shm::kAllTensors) {
      t.first = 0;
      t.last = static_cast<uint32_t>(tensors.size());
      t.elements = total_elements;
    } else if (req.tensor_id < tensors.size()) {
      t.first = req.tensor_id;
      t.last = req.tensor_id + 1;
      t.elements = tensors[req.tensor_id].element_count;
    } else {
      return Status{ErrorCode::kUnknownTensor, "tensor id " + std::to_string(req.tensor_id) + " >= " + std::to_string(tensors.size()) + " tensors"};
    }
    if (req.buffer_id >= config.max_buffers || !slots[i].buffers[req.buffer_id])
      return Status{ErrorCode::kUnknownBuffer, "buffer " + std::to_string(req.buffer_id) + " is not registered"};
    t.buffer = slots[i].buffers[req.buffer_id].get();
    const uint64_t need = t.elements * element_size;
    if (req.byte_length != need) {
      const std::string what = req.tensor_id == shm::kAllTensors ? std::string("all tensors") : std::string(tensors[t.first].name);
      return Status{ErrorCode::kBadLength, std::to_string(req.byte_length) + " B, " + what + " needs " + std::to_string(need) + " (" + dtype_name + ")"};
    }
    const uint64_t len = t.buffer->length();
    if (req.byte_offset > len || need > len - req.byte_offset)
      return Status{ErrorCode::kBadRange, "offset " + std::to_string(req.byte_offset) + " + " + std::to_string(need) + " > buffer " + std::to_string(len)};
    return t;
  }

  Completion push(uint32_t i, const Request& req) {
    static constexpr const char* kDtypeNames[] = {"?", "f32", "f16", "bf16"};
    if (req.dtype == 0 || req.dtype > shm::kDtypeMax)
      return reject(i, req, ErrorCode::kBadDtype, "gradient dtype " + std::to_string(req.dtype) + " unknown");
    const auto dtype = static_cast<kernels::GradDtype>(req.dtype);
    auto target = resolve(i, req, kernels::dtype_size(dtype), kDtypeNames[req.dtype]);
    if (!target.ok()) return reject(i, req, target.status().code(), target.status().message());
    if (req.worker_version > version)
      return reject(i, req, ErrorCode::kBadRequest, "worker_version " + std::to_string(req.worker_version) + " ahead of version " + std::to_string(version));
    const uint64_t staleness = version - req.worker_version;
    if (staleness > config.max_staleness)
      return reject(i, req, ErrorCode::kStale, "staleness " + std::to_string(staleness) + " > max_staleness " + std::to_string(config.max_staleness) + " (v" + std::to_string(req.worker_version) + " vs v" + std::to_string(version) + ")");
    if (!config.allow_nonfinite) {
      const Result<bool> finite = backend->all_finite(*target->buffer, req.byte_offset, target->elements, dtype);
      // The check pass reads the whole gradient first: a buffer truncated
      // under us is found here, before anything is applied.
      if (Status s = backend->peer_intact(*target->buffer); !s.ok()) return drop_buffer(i, req, s);
      if (!finite.ok()) {
        // The check could not run (a CUDA error): a lost device stops us.
        if (Status h = backend->healthy(); !h.ok()) fatal(h);
        return reject(i, req, finite.status().code(), finite.status().message());
      }
      if (!*finite) return reject(i, req, ErrorCode::kNonFinite, "NaN or Inf in the gradient");
    }
    uint64_t byte_offset = req.byte_offset;
    const uint64_t esize = kernels::dtype_size(dtype);
    // Its completion (even a failure) waits for the applies. A shared_ptr
    // copy (two locked instructions) only where there is something to wait for.
    if (async_backend) held = slots[i].buffers[req.buffer_id];
    for (uint32_t t = target->first; t < target->last; ++t) {
      if (Status s = backend->apply(config.optimizer, t, ++steps[t], *target->buffer, byte_offset, dtype); !s.ok()) {
        if (Status h = backend->healthy(); !h.ok()) fatal(h);
        return reject(i, req, s.code(), s.message());
      }
      byte_offset += tensors[t].element_count * esize;
    }
    // Only with --allow-nonfinite (no check pass) or a worker truncating
    // during the apply: zeros were read for the missing pages.
    if (Status s = backend->peer_intact(*target->buffer); !s.ok())
      return drop_buffer(i, req, Status{s.code(), s.message() + "; the update was applied with zeros for the lost pages"});
    ++version;
    record_staleness(staleness);
    if (checkpoints && config.checkpoint_every != 0 && version - last_checkpoint_version >= config.checkpoint_every)
      maybe_checkpoint(shm::monotonic_ns());
    // relaxed: statistics; the completion's release publishes them to the pusher.
    stats().version.store(version, std::memory_order_relaxed);
    bump(stats().gradients_applied);
    bump(segment->worker(i).pushes_applied);
    Completion c = answer(req, ErrorCode::kOk, "");
    c.version = version;
    c.value = staleness;
    return c;
  }

  void record_staleness(uint64_t s) {
    const size_t pos = staleness_count % kStalenessWindow;
    if (staleness_count >= kStalenessWindow) staleness_sum -= staleness_window[pos];
    staleness_window[pos] = s;
    staleness_sum += s;
    ++staleness_count;
    // relaxed: statistic. A constant divisor once the window is full (a
    // multiply, not a 64-bit division, on every push).
    const uint64_t micro = staleness_count >= kStalenessWindow ? staleness_sum * 1'000'000 / kStalenessWindow
                                                               : staleness_sum * 1'000'000 / staleness_count;
    stats().avg_staleness_micro.store(micro, std::memory_order_relaxed);
  }

  Completion pull(uint32_t i, const Request& req) {
    auto target = resolve(i, req, sizeof(float), "f32");
    if (!target.ok()) return reject(i, req, target.status().code(), target.status().message());
    const uint64_t first = tensors[target->first].element_offset;
    if (async_backend) held = slots[i].buffers[req.buffer_id];  // completed once the copy is done
    if (Status s = backend->copy_out(first, target->elements, *target->buffer, req.byte_offset); !s.ok()) {
      if (Status h = backend->healthy(); !h.ok()) fatal(h);
      return reject(i, req, s.code(), s.message());
    }
    if (Status s = backend->peer_intact(*target->buffer); !s.ok()) return drop_buffer(i, req, s);
    // relaxed: statistics.
    bump(stats().weights_pulled);
    bump(segment->worker(i).pulls);
    Completion c = answer(req, ErrorCode::kOk, "");
    c.version = version;
    return c;
  }

  // A worker sets the weights at version 0 (ps-lite's and KVStore's init:
  // the framework initialises the model, not the server): all tensors as
  // fp32 from its buffer, accepted once and only while no push has been
  // applied; the first of concurrent initialisers wins. The optimizer state
  // is still zero then, so only the weights change.
  Completion init(uint32_t i, const Request& req) {
    if (req.tensor_id != shm::kAllTensors)
      return reject(i, req, ErrorCode::kBadRequest, "init sets all tensors at once (tensor id kAllTensors)");
    auto target = resolve(i, req, sizeof(float), "f32");
    if (!target.ok()) return reject(i, req, target.status().code(), target.status().message());
    if (!initialised_by.empty())
      return reject(i, req, ErrorCode::kInitRefused, "already initialised by " + initialised_by);
    if (version != 0)
      return reject(i, req, ErrorCode::kInitRefused, "version is " + std::to_string(version) + ": pushes applied");
    if (!config.allow_nonfinite) {
      const Result<bool> finite = backend->all_finite(*target->buffer, req.byte_offset, target->elements, kernels::GradDtype::kF32);
      if (Status s = backend->peer_intact(*target->buffer); !s.ok()) return drop_buffer(i, req, s);
      if (!finite.ok()) {
        if (Status h = backend->healthy(); !h.ok()) fatal(h);
        return reject(i, req, finite.status().code(), finite.status().message());
      }
      if (!*finite) return reject(i, req, ErrorCode::kNonFinite, "NaN or Inf in the initial weights");
    }
    if (async_backend) held = slots[i].buffers[req.buffer_id];  // completed once the copy is done
    if (Status s = backend->copy_in(0, total_elements, *target->buffer, req.byte_offset); !s.ok()) {
      if (Status h = backend->healthy(); !h.ok()) fatal(h);
      return reject(i, req, s.code(), s.message());
    }
    if (Status s = backend->peer_intact(*target->buffer); !s.ok()) return drop_buffer(i, req, s);
    initialised_by = "worker " + std::to_string(i) + " (pid " + std::to_string(shm::owner_pid(slots[i].owner)) + ")";
    log::info("weights initialised by " + initialised_by);
    Completion c = answer(req, ErrorCode::kOk, "");
    c.version = version;
    return c;
  }

  Completion stats_request(uint32_t i, const Request& req) {
    update_depth();  // what is queued right now
    shm::StatsReply& r = segment->worker(i).stats_reply;
    auto& s = stats();
    // relaxed loads of our own counters; the completion's release publishes r.
    r.version = version;
    r.gradients_applied = s.gradients_applied.load(std::memory_order_relaxed);
    r.weights_pulled = s.weights_pulled.load(std::memory_order_relaxed);
    r.avg_staleness_micro = s.avg_staleness_micro.load(std::memory_order_relaxed);
    r.rejected_stale = s.rejected[static_cast<uint32_t>(ErrorCode::kStale)].load(std::memory_order_relaxed);
    r.rejected_nonfinite = s.rejected[static_cast<uint32_t>(ErrorCode::kNonFinite)].load(std::memory_order_relaxed);
    uint64_t invalid = 0;
    for (uint32_t c = 0; c < shm::kRejectCauses; ++c)
      if (c != static_cast<uint32_t>(ErrorCode::kStale) && c != static_cast<uint32_t>(ErrorCode::kNonFinite))
        invalid += s.rejected[c].load(std::memory_order_relaxed);
    r.rejected_invalid = invalid;
    r.ring_depth = s.ring_depth.load(std::memory_order_relaxed);
    r.ring_high_water = s.ring_high_water.load(std::memory_order_relaxed);
    r.workers_attached = s.workers_attached.load(std::memory_order_relaxed);
    r.workers_died = s.workers_died.load(std::memory_order_relaxed);
    r.workers_evicted = s.workers_evicted.load(std::memory_order_relaxed);
    const shm::WorkerEntry& e = segment->worker(i);
    r.my_pushes_applied = e.pushes_applied.load(std::memory_order_relaxed);
    r.my_pushes_rejected = e.pushes_rejected.load(std::memory_order_relaxed);
    r.my_pulls = e.pulls.load(std::memory_order_relaxed);
    Completion c = answer(req, ErrorCode::kOk, "");
    c.version = version;
    return c;
  }

  // ------------------------------------------------------------ lifecycle of entries
  // Returns entry i, whose owner process is dead, to kFree: a CAS from the
  // owner word we judged, so a claimer never loses its claim.
  // SYNC(worker_release).
  void release_entry(uint32_t i, uint64_t dead_owner) {
    end_session(i, "");
    shm::WorkerEntry& entry = segment->worker(i);
    entry.lease = 0;
    entry.pid_start_time = 0;
    std::memset(segment->buffer_table_bytes(i), 0, config.max_buffers * sizeof(shm::BufferDesc));
    uint64_t expected = dead_owner;
    entry.owner.compare_exchange_strong(expected, 0, std::memory_order_release, std::memory_order_relaxed);
  }

  // Unlinks the buffer objects "shmps.<name>.p<pid>.<n>" of a worker that
  // died (worker_lib unlinks them itself at unregister and detach). With
  // pid 0: those of every dead pid (at start, after a crash of the
  // previous server).
  void unlink_orphan_buffers(uint32_t dead_pid) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string file = e.path().filename().string();
      if (file.rfind(buffer_prefix, 0) != 0) continue;
      // After the prefix: "<pid>.<n>".
      const size_t dot = file.find('.', buffer_prefix.size());
      if (dot == std::string::npos) continue;
      const std::string pid_text = file.substr(buffer_prefix.size(), dot - buffer_prefix.size());
      if (pid_text.empty() || pid_text.size() > 10 || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
      const auto pid = static_cast<uint32_t>(std::stoul(pid_text));
      if (dead_pid != 0 ? pid != dead_pid : shm::process_alive(static_cast<pid_t>(pid), 0)) continue;
      shm::ShmObject::remove(file);
      log::info("removed orphaned buffer object /dev/shm/" + file);
    }
  }

  void reset_lanes(uint32_t i) {
    // relaxed: published by the owner store that follows (release).
    segment->lane(i).tail.store(0, std::memory_order_relaxed);
    segment->lane(i).head.store(0, std::memory_order_relaxed);
    segment->completions(i).tail.store(0, std::memory_order_relaxed);
    segment->completions(i).head.store(0, std::memory_order_relaxed);
    // Both ends take slots by request id (ring.hpp, seq_published()): no
    // id of an earlier session may be left in them (a new Worker counts
    // from 1 again).
    Completion* answers = segment->completion_slots(i);
    Request* requests = segment->lane_slots(i);
    for (uint32_t k = 0; k < config.lane_capacity; ++k) {
      std::atomic_ref<uint64_t>(answers[k].request_id).store(0, std::memory_order_relaxed);  // relaxed: as above
      std::atomic_ref<uint64_t>(requests[k].request_id).store(0, std::memory_order_relaxed);  // relaxed: as above
    }
    slots[i].lane = shm::SpscConsumer<Request>(&segment->lane(i), segment->lane_slots(i), config.lane_capacity);
    slots[i].next_request_id = 0;
    slots[i].completions = shm::SpscProducer<Completion>(&segment->completions(i), segment->completion_slots(i), config.lane_capacity);
  }

  // (pid, kAttached) -> (pid, kDetached), by CAS: an entry that changed
  // under us is left alone (sync_entry notices it).
  void mark_detached(uint32_t i) {
    uint64_t expected = slots[i].owner;
    // SYNC(worker_detached): release pairs with the worker's acquire load of
    // owner after it reads the detach completion (published after this).
    segment->worker(i).owner.compare_exchange_strong(
        expected, shm::make_owner(shm::owner_pid(slots[i].owner), WorkerState::kDetached), std::memory_order_release,
        std::memory_order_relaxed);
  }

  // After a successful detach: the worker frees the entry once it has read
  // the answer; we only drop our side.
  void finish_detach(uint32_t i) {
    log_worker(LogLevel::kInfo, "worker " + std::to_string(i) + " detached (pid " + std::to_string(shm::owner_pid(slots[i].owner)) + ")");
    end_session(i, "");
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
    if (!slots[i].deferred.empty() && !corrupt) {
      if (Status s = backend->synchronize(); !s.ok()) fatal(s);
      drain_deferred();
    }
    mark_detached(i);
    // Counted after the entry says Detached, so a reader that sees the
    // count sees the entry released (test_stopped reads them in that order;
    // counting first, with the log line's write in between, was a race).
    // relaxed: statistics.
    if (corrupt) stats().lanes_corrupt.fetch_add(1, std::memory_order_relaxed);
    stats().workers_evicted.fetch_add(1, std::memory_order_relaxed);
    log_worker(LogLevel::kWarn, "evicting worker " + std::to_string(i) + " (pid " + std::to_string(shm::owner_pid(slots[i].owner)) + "): " + why);
    end_session(i, "");
  }

  // Tracks how long attached worker i's process has been stopped and
  // evicts it past --stopped-worker-timeout-ms. A stopped worker blocks
  // nobody else (each has its own lane), but it holds its entry, its
  // buffer mappings and, in training, a version it will push late.
  void watch_stopped(uint32_t i, shm::ProcessState state, uint64_t now) {
    WorkerSlot& slot = slots[i];
    if (state != shm::ProcessState::kStopped) {
      slot.stopped_since_ns = 0;
      return;
    }
    if (slot.stopped_since_ns == 0) slot.stopped_since_ns = now;
    const uint64_t timeout_ns = uint64_t{config.stopped_worker_timeout_ms} * 1'000'000;
    if (timeout_ns == 0 || now - slot.stopped_since_ns < timeout_ns) return;
    const uint64_t queued = slot.lane.depth_estimate();
    evict(i, "its process has been stopped (SIGSTOP, Ctrl-Z or a debugger) for " +
                 std::to_string((now - slot.stopped_since_ns) / 1'000'000) + " ms (--stopped-worker-timeout-ms " +
                 std::to_string(config.stopped_worker_timeout_ms) + "); " + std::to_string(queued) +
                 " queued request(s) dropped unanswered",
          /*corrupt=*/false);
  }

  // Reclaims entries whose owner died, and sweeps lanes whose doorbell may
  // have been lost (a producer killed between publishing and ringing).
  bool housekeeping() {
    bool worked = false;
    const uint64_t now = shm::monotonic_ns();
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      shm::WorkerEntry& entry = segment->worker(i);
      const uint64_t owner = entry.owner.load(std::memory_order_acquire);  // SYNC(worker_claim)
      if (owner == 0) {
        if (slots[i].attached()) end_session(i, "its entry was freed without a detach");
        continue;
      }
      const pid_t pid = static_cast<pid_t>(shm::owner_pid(owner));
      const uint64_t start = owner == slots[i].owner ? slots[i].pid_start_time : entry.pid_start_time;
      const shm::ProcessState state = shm::process_state(pid, start);
      if (state == shm::ProcessState::kGone) {
        const bool was_attached = owner == slots[i].owner;
        log_worker(was_attached ? LogLevel::kWarn : LogLevel::kInfo,
                   "worker " + std::to_string(i) + " (pid " + std::to_string(pid) + ") died" +
                       (was_attached ? "" : " before attaching") + "; releasing its entry");
        if (was_attached) stats().workers_died.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
        release_entry(i, owner);
        // Only when no process of that pid exists: the owner word (and the
        // start time we judged by) may be a forgery naming a living worker.
        if (!shm::process_alive(pid, 0)) unlink_orphan_buffers(static_cast<uint32_t>(pid));
        worked = true;
        continue;
      }
      if (owner == slots[i].owner) watch_stopped(i, state, now);
      worked |= serve_lane(i);
    }
    return worked;
  }

  // ------------------------------------------------------------ checkpoints
  CheckpointLayout checkpoint_layout() const {
    CheckpointLayout l;
    l.tensors = config.tensors;
    l.optimizer_kind = static_cast<uint32_t>(config.optimizer.kind);
    l.state_arrays = static_cast<uint32_t>(kernels::state_arrays(config.optimizer));
    return l;
  }

  CheckpointData snapshot() const {
    CheckpointData d;
    d.version = version;
    d.layout = checkpoint_layout();
    d.steps = steps;
    d.weights = backend->read_weights();
    d.state = backend->read_state();
    return d;
  }

  // On the consumer thread (after a push that reaches checkpoint_every, and
  // every tick for the time trigger): takes a snapshot (a copy of weights
  // and state in memory) and hands it to the writer thread; never waits
  // for the disk. A trigger that finds the writer busy fires again on the
  // next push or tick, so under load a checkpoint may land a few versions
  // after the multiple of checkpoint_every.
  void maybe_checkpoint(uint64_t now) {
    if (Status s = checkpoints->take_result(); !s.ok()) log::error(s.message());
    if (version == last_checkpoint_version) return;
    const bool by_count = config.checkpoint_every != 0 && version - last_checkpoint_version >= config.checkpoint_every;
    const bool by_time = config.checkpoint_interval_s != 0 &&
                         now - last_checkpoint_ns >= uint64_t{config.checkpoint_interval_s} * 1'000'000'000;
    if (!by_count && !by_time) return;
    if (checkpoints->busy()) return;
    checkpoints->submit(snapshot());
    log::info("checkpoint of version " + std::to_string(version) + " handed to the writer");
    last_checkpoint_version = version;
    last_checkpoint_ns = now;
  }

  // At stop: the current version on disk, unless a checkpoint of it is
  // there already (restored, or written by the writer: a periodic write
  // that failed does not count). Errors: the write's; the server then
  // exits with it, so that an operator learns the state was not saved.
  Status final_checkpoint() {
    if (!checkpoints) return Status::Ok();
    if (Status s = checkpoints->drain(); !s.ok()) log::error(s.message());
    if (version == checkpoints->last_written()) return Status::Ok();
    if (Status s = write_checkpoint(config.checkpoint_dir, snapshot()); !s.ok())
      return Status{s.code(), "final " + s.message()};
    prune_checkpoints(config.checkpoint_dir, config.checkpoint_keep, version, checkpoint_layout());
    last_checkpoint_version = version;
    log::info("final checkpoint written: version " + std::to_string(version) + " in " + config.checkpoint_dir);
    return Status::Ok();
  }

  // Restores the newest valid checkpoint of the directory, if any, after
  // removing the temp files of a writer killed mid-write. A file that is
  // corrupt, truncated or of another model (read_checkpoint()) is reported
  // and the previous one tried; with none valid, the configured initial
  // values stay. Returns the restored version (none: nothing restored).
  Result<std::optional<uint64_t>> restore() {
    remove_temp_files(config.checkpoint_dir);
    const CheckpointLayout layout = checkpoint_layout();
    for (const std::string& path : list_checkpoints(config.checkpoint_dir)) {
      auto data = read_checkpoint(path, layout);
      if (!data.ok()) {
        log::error("checkpoint " + data.status().message() + "; trying the previous one");
        continue;
      }
      if (Status s = backend->load(data->weights, data->state); !s.ok()) return s;
      steps = data->steps;
      version = data->version;
      last_checkpoint_version = version;
      // relaxed: published with the segment (publish() is a release store).
      stats().version.store(version, std::memory_order_relaxed);
      log::info("restored checkpoint " + path + ": version " + std::to_string(version));
      return std::optional<uint64_t>(version);
    }
    log::info("no valid checkpoint in " + config.checkpoint_dir + "; starting from the configured initial values");
    return std::optional<uint64_t>();
  }

  // True while /dev/shm/shmps.<name> is the object we created.
  bool segment_is_ours() const {
    struct stat st{};
    const std::string path = "/dev/shm/" + shm::segment_object_name(config.name);
    return ::stat(path.c_str(), &st) == 0 && st.st_ino == segment->object().inode();
  }

  void check_segment_name() {
    if (segment_is_ours()) return;
    failure = Status{ErrorCode::kIo, "/dev/shm/" + shm::segment_object_name(config.name) +
                                         " was removed or replaced under the running server (systemd-logind's "
                                         "RemoveIPC=yes removes a user's POSIX shm at logout: run shmps as a system "
                                         "user); stopping so a restart gives workers a fresh segment"};
    log::error(failure.message());
    stop.store(true, std::memory_order_release);  // SYNC(stop)
  }

  void shutdown() {
    notifier.stopping("stopping: failing queued requests; " + status_text());
    auto& h = segment->header();
    h.server_state.store(static_cast<uint32_t>(shm::ServerState::kStopping), std::memory_order_release);
    // Device work in flight: completed when the device is healthy, failed
    // (weights may be half-written) when it is not.
    const Status device = backend->healthy().ok() ? backend->synchronize() : backend->healthy();
    if (!device.ok()) fatal(device);
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      WorkerSlot& slot = slots[i];
      while (!slot.deferred.empty() && slot.attached() && slot.completions.has_space()) {
        Completion c = slot.deferred.front().completion;
        if (!device.ok()) {
          c.code = static_cast<uint32_t>(device.code());
          std::snprintf(c.message, sizeof c.message, "%s", "device failed; weights may be half-written");
        }
        slot.deferred.pop_front();
        post_now(i, c);
      }
      slot.deferred.clear();
    }
    deferred_count = 0;
    orphaned.clear();
    // Fail what is queued: nothing more is applied.
    uint64_t failed = 0;
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      WorkerSlot& slot = slots[i];
      if (!slot.attached()) continue;
      Request req;
      while (slot.completions.has_space() && slot.lane.try_pop(&req) == shm::RingResult::kOk) {
        Completion c = answer(req, ErrorCode::kShuttingDown, "server is shutting down");
        c.version = version;
        post(i, c);
        ++failed;
      }
    }
    // SYNC(server_stopped): release pairs with the workers' acquire load of
    // the state; every completion above is visible before kStopped.
    h.server_state.store(static_cast<uint32_t>(shm::ServerState::kStopped), std::memory_order_release);
    for (uint32_t i = 0; i < config.max_workers; ++i) {
      shm::notify(segment->completions(i).data_ready);
      shm::notify(segment->lane(i).space_ready);
    }
    flush_rejection_counts(shm::monotonic_ns(), /*all=*/true);
    flush_worker_lines(shm::monotonic_ns(), /*all=*/true);
    // relaxed: our own counters.
    const auto& st = stats();
    const auto count = [](const std::atomic<uint64_t>& a) { return std::to_string(a.load(std::memory_order_relaxed)); };
    uint64_t rejected = 0;
    for (const auto& r : st.rejected) rejected += r.load(std::memory_order_relaxed);
    log::info("stopped: version " + std::to_string(version) + ", gradients applied " + count(st.gradients_applied) +
              ", weights pulled " + count(st.weights_pulled) + ", rejected " + std::to_string(rejected) + " (stale " +
              count(st.rejected[static_cast<uint32_t>(ErrorCode::kStale)]) + ", non-finite " +
              count(st.rejected[static_cast<uint32_t>(ErrorCode::kNonFinite)]) + "), workers attached " +
              count(st.workers_attached) + ", died " + count(st.workers_died) + ", evicted " + count(st.workers_evicted) + ", queued requests failed " +
              std::to_string(failed) + ", up " + fixed1(static_cast<double>(shm::monotonic_ns() - created_ns) / 1e9) + " s");
    if (failure.ok() || failure.code() != ErrorCode::kCuda) {
      if (Status s = final_checkpoint(); !s.ok()) {
        log::error(s.message());
        if (failure.ok()) failure = s;
      }
    }
    // Buffers of workers that died since the last sweep (e.g. killed just
    // before this stop) would otherwise outlive us in /dev/shm.
    unlink_orphan_buffers(0);
    // Only our own object: the name may have been taken over meanwhile.
    if (segment_is_ours()) shm::Segment::remove(config.name);
    removed = true;
  }
};

// ------------------------------------------------------------ Server

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  if (impl_ && impl_->segment && !impl_->removed) shm::Segment::remove(impl_->config.name);
}

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& config) {
  // The weights and optimizer state are the server's big allocations; one
  // that fails is a clear error (and no segment is left behind).
  try {
    return create_unguarded(config);
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

Result<std::unique_ptr<Server>> Server::create_unguarded(const ServerConfig& config) {
  if (Status s = validate(config); !s.ok()) return s;

  log::set_level(config.log_level);
  std::string effective;
  for (const auto& [key, value] : config_entries(config))
    effective += " " + key + "=" + (value.find(' ') == std::string::npos ? value : "'" + value + "'");
  log::info(std::string("starting shmps-server ") + version_text() + " (pid " + std::to_string(::getpid()) + "):" + effective);

  auto impl = std::make_unique<Server::Impl>();
  impl->config = config;
  impl->created_ns = shm::monotonic_ns();
  auto backend = select_backend(config.backend, config.device);
  if (!backend.ok()) return backend.status();
  impl->backend = std::move(backend).value();
  impl->async_backend = impl->backend->asynchronous();

  shm::SegmentSpec spec;
  spec.name = config.name;
  spec.tensors = config.tensors;
  spec.max_workers = config.max_workers;
  spec.max_buffers = config.max_buffers;
  spec.lane_capacity = config.lane_capacity;
  spec.mode = config.group_access ? 0660 : 0600;
  shm::ConfigBlock& cb = spec.config;
  const kernels::OptimizerConfig& o = config.optimizer;
  cb.optimizer_kind = static_cast<uint32_t>(o.kind);
  cb.flags = (o.nesterov ? shm::kConfigNesterov : 0) | (o.amsgrad ? shm::kConfigAmsgrad : 0) |
             (config.allow_nonfinite ? shm::kConfigAllowNonFinite : 0);
  cb.lr = o.lr;
  cb.momentum = o.momentum;
  cb.dampening = o.dampening;
  cb.weight_decay = o.weight_decay;
  cb.beta1 = o.beta1;
  cb.beta2 = o.beta2;
  cb.eps = o.eps;
  cb.backend = static_cast<uint32_t>(std::string(impl->backend->name()) == "cuda" ? shm::Backend::kCuda : shm::Backend::kHost);
  cb.max_staleness = config.max_staleness;

  auto segment = shm::Segment::create(spec, random_generation());
  if (!segment.ok()) return segment.status();
  impl->segment = std::move(segment).value();
  shm::Segment& seg = *impl->segment;

  std::vector<TensorExtent> extents;
  for (uint32_t t = 0; t < seg.header().tensor_count; ++t) {
    impl->tensors.push_back(seg.tensor(t));
    extents.push_back({seg.tensor(t).element_offset, seg.tensor(t).element_count});
  }
  impl->steps.assign(extents.size(), 0);
  impl->total_elements = seg.header().total_elements;
  impl->buffer_prefix = shm::segment_object_name(config.name) + ".p";
  impl->unlink_orphan_buffers(0);  // left by workers of a crashed predecessor

  auto init = initial_weights(config.init, impl->total_elements);
  if (!init.ok()) {
    shm::Segment::remove(config.name);
    return init.status();
  }
  if (Status s = impl->backend->allocate(extents, kernels::state_arrays(config.optimizer), std::move(init).value()); !s.ok()) {
    shm::Segment::remove(config.name);
    return s;
  }
  // The weights' IPC export (CUDA backend), for workers that map them
  // themselves; published with the segment below.
  if (const WeightsExport ex = impl->backend->weights_export(); ex.present) {
    shm::WeightsExportBlock& w = seg.header().weights_export;
    w.flags = shm::kWeightsExportPresent;
    w.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    w.allocation_bytes = ex.allocation_bytes;
    w.weights_bytes = impl->total_elements * sizeof(float);
    std::memcpy(w.device_uuid, ex.device_uuid, sizeof w.device_uuid);
    std::memcpy(w.ipc_handle, ex.ipc_handle, sizeof w.ipc_handle);
  }
  if (!config.checkpoint_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(config.checkpoint_dir, ec);
    if (ec) {
      shm::Segment::remove(config.name);
      return Status{ErrorCode::kIo, "--checkpoint-dir " + config.checkpoint_dir + ": " + ec.message()};
    }
    auto restored = impl->restore();
    if (!restored.ok()) {
      shm::Segment::remove(config.name);
      return restored.status();
    }
    impl->checkpoints = std::make_unique<CheckpointWriter>(config.checkpoint_dir, config.checkpoint_keep, *restored);
    impl->last_checkpoint_ns = shm::monotonic_ns();
  }
  impl->slots.resize(config.max_workers);
  impl->attached_bits.assign((config.max_workers + 63) / 64, 0);
  for (uint32_t i = 0; i < config.max_workers; ++i) impl->reset_lanes(i);

  seg.header().server_state.store(static_cast<uint32_t>(shm::ServerState::kRunning), std::memory_order_relaxed);  // relaxed: published next
  seg.publish();
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(spec.mode));
  log::info("serving /dev/shm/" + shm::segment_object_name(config.name) + " (mode " + mode + ", " +
            std::to_string(seg.header().segment_size / 1024) + " KiB): " + std::to_string(impl->tensors.size()) +
            " tensors, " + std::to_string(impl->total_elements) + " parameters, optimizer " +
            kernels::optimizer_kind_name(o.kind) + ", backend " + impl->backend->name());
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Status Server::run(const RunOptions& options) { return impl_->run(options); }

void Server::poll_once() {
  impl_->loop_now = shm::monotonic_ns();
  impl_->drain_deferred();
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

std::vector<float> Server::weights() const { return impl_->backend->read_weights(); }
uint64_t Server::version() const noexcept { return impl_->version; }

// ------------------------------------------------------------ run_server

namespace {
std::atomic<Server*> g_server{nullptr};
extern "C" void on_stop_signal(int) {
  if (Server* s = g_server.load(std::memory_order_acquire)) s->request_stop();
}
extern "C" void on_reload_signal(int) {
  if (Server* s = g_server.load(std::memory_order_acquire)) s->request_reload();
}

void handle(int signo, void (*handler)(int)) {
  struct sigaction sa{};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  ::sigaction(signo, &sa, nullptr);
}
}  // namespace

Status run_server(const ServerConfig& config, const std::vector<std::string>& argv) {
  // A SIGHUP during start-up must not kill the daemon (its default action);
  // the configuration it would re-read was read just now anyway. SIGINT and
  // SIGTERM are held back (blocked, so pending) while the server is created:
  // one that arrives after the segment is published but before the handlers
  // are in place would otherwise kill the process without its shutdown
  // (a stop right after start-up, as systemd may send). Unblocked once the
  // handlers are installed, a pending one stops run() at once, cleanly.
  // Threads started meanwhile (checkpoint writer, OpenMP) keep them
  // blocked, so they are delivered to this thread.
  handle(SIGHUP, SIG_IGN);
  sigset_t stop_signals, previous;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, &previous);
  auto server = Server::create(config);
  if (!server.ok()) {
    ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    return server.status();
  }
  g_server.store(server->get(), std::memory_order_release);
  handle(SIGINT, on_stop_signal);
  handle(SIGTERM, on_stop_signal);
  handle(SIGHUP, on_reload_signal);
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  RunOptions options;
  options.notify_service_manager = true;
  if (!argv.empty()) {
    options.reload = [argv]() -> Result<ServerConfig> {
      std::vector<const char*> args;
      for (const std::string& a : argv) args.push_back(a.c_str());
      auto parsed = parse_options(static_cast<int>(args.size()), args.data());
      if (!parsed.ok()) return parsed.status();
      if (parsed->help || parsed->version || parsed->check)
        return Status{ErrorCode::kInvalidArgument, "the command line asks for --help, --version or --check-config"};
      return std::move(parsed).value().config;
    };
  }
  Status s = (*server)->run(options);
  g_server.store(nullptr, std::memory_order_release);
  return s;
}

}  // namespace shmps::server
