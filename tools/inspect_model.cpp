#include "inspect_model.hpp"

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::inspect {

namespace {

// a + b, saturating at 2^64 - 1 (garbage buckets can sum past it).
uint64_t add_saturating(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? ~uint64_t{0} : sum;
}

}  // namespace

std::optional<uint64_t> HistogramView::quantile(double q) const {
  uint64_t total = 0;
  for (uint64_t b : buckets) total = add_saturating(total, b);
  if (total == 0) return std::nullopt;
  // The rank of the quantile, 1-based: the smallest count c with c >= q *
  // total; 2^64 (a saturated total, rounded) is out of uint64_t's range.
  const double wanted = std::ceil(q * static_cast<double>(total));
  const uint64_t rank = wanted >= 0x1p64 ? total : std::max<uint64_t>(1, static_cast<uint64_t>(wanted));
  uint64_t seen = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    seen = add_saturating(seen, buckets[b]);
    if (seen >= rank) {
      const uint64_t upper = b == 0 ? 0 : b >= 64 ? ~uint64_t{0} : (uint64_t{1} << b) - 1;
      return std::min(upper, max);
    }
  }
  return max;
}

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

using nlohmann::json;

std::string unknown(uint32_t value) { return "unknown(" + std::to_string(value) + ")"; }

// "812 ns", "35.2 us", "3.10 ms", "1.20 s".
std::string duration_text(uint64_t ns) {
  char buf[32];
  const auto d = static_cast<double>(ns);
  if (ns < 1000)
    std::snprintf(buf, sizeof buf, "%llu ns", static_cast<unsigned long long>(ns));
  else if (ns < 1'000'000)
    std::snprintf(buf, sizeof buf, "%.1f us", d / 1e3);
  else if (ns < 1'000'000'000)
    std::snprintf(buf, sizeof buf, "%.2f ms", d / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.2f s", d / 1e9);
  return buf;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Seconds as num() gives them, but whole from 10^6 on (an uptime past 11.6
// days), which %g would give as 1.23457e+06.
std::string seconds_text(double s) {
  if (!std::isfinite(s) || s < 1e6) return num(s);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f", s);
  return buf;
}

// A float as the double of its shortest decimal form, so JSON shows 0.001
// rather than 0.0010000000474974513.
double json_float(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  if (r.ec != std::errc{}) return v;
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}

bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Milliseconds from `then` to `now` (CLOCK_MONOTONIC ns); empty when `then`
// is 0 (never) or lies in the future (a garbage or foreign-boot value).
std::optional<uint64_t> age_ms(uint64_t now, uint64_t then) {
  if (then == 0 || then > now) return std::nullopt;
  return (now - then) / 1'000'000;
}

std::string age_text(const std::optional<uint64_t>& age, uint64_t raw) {
  if (age) return std::to_string(*age) + " ms ago";
  return raw == 0 ? std::string("never") : std::string("in the future (") + std::to_string(raw) + " ns)";
}

// Geometry recomputed from counts read once from the image. validate_segment
// has checked the image, but a live segment can change under us (a buggy or
// hostile peer), so the decoder never re-reads an offset: it derives them
// from these counts, re-checked here against the image's size.
struct Bounds {
  uint32_t tensor_count = 0, max_workers = 0, max_buffers = 0, lane_capacity = 0;
  shm::Geometry g{};
};

Status read_bounds(const shm::SegmentHeader& h, size_t size, Bounds* b) {
  b->tensor_count = h.tensor_count;
  b->max_workers = h.max_workers;
  b->max_buffers = h.max_buffers;
  b->lane_capacity = h.lane_capacity;
  if (b->tensor_count == 0 || b->tensor_count > shm::kMaxTensorsLimit || b->max_workers == 0 ||
      b->max_workers > shm::kMaxWorkersLimit || b->max_buffers == 0 || b->max_buffers > shm::kMaxBuffersLimit ||
      b->lane_capacity < 2 || b->lane_capacity > shm::kMaxLaneCapacity || !is_power_of_two(b->lane_capacity))
    return {ErrorCode::kLayoutMismatch, "segment changed while being read: counts out of range"};
  b->g = shm::compute_geometry(b->tensor_count, b->max_workers, b->max_buffers, b->lane_capacity);
  if (b->g.segment_size > size)
    return {ErrorCode::kLayoutMismatch, "segment changed while being read: counts need " +
                                            std::to_string(b->g.segment_size) + " bytes, image has " +
                                            std::to_string(size)};
  return Status::Ok();
}

template <typename T>
const T& at(const void* base, uint64_t offset) {
  return *reinterpret_cast<const T*>(static_cast<const char*>(base) + offset);
}

template <typename T>
T copy_at(const void* base, uint64_t offset) {
  T out;
  std::memcpy(&out, static_cast<const char*>(base) + offset, sizeof out);
  return out;
}

// Reads a ring's indices: head first, then tail, so that (both being
// monotonic) tail >= head unless the ring is garbage or was reset between
// the two loads; a reset is transient, so an impossible pair is re-read a
// few times before it is reported as corrupt.
template <typename Slot>
QueueView<Slot> read_queue(const void* base, uint64_t header_offset, uint32_t capacity, uint32_t worker,
                           uint32_t max_slots) {
  const auto& lane = at<shm::LaneHeader>(base, header_offset);
  QueueView<Slot> q;
  q.worker = worker;
  for (int attempt = 0; attempt < 3; ++attempt) {
    // SYNC(slot_released): acquire pairs with the consumer's release store of
    // head, so the tail it had read before is no newer than the one we load next.
    q.head = lane.head.load(std::memory_order_acquire);
    // SYNC(slot_published): acquire pairs with the producer's release store;
    // the slots before tail are written.
    q.tail = lane.tail.load(std::memory_order_acquire);
    q.depth = q.tail - q.head;  // unsigned: correct across wrap
    q.corrupt = q.depth > capacity;
    if (!q.corrupt) break;
  }
  if (q.corrupt) return q;
  // The first max_slots only (RingReading): a garbage or stuck ring may
  // claim all of its capacity, 65536 slots.
  const uint64_t shown = std::min<uint64_t>(q.depth, max_slots);
  q.not_shown = q.depth - shown;
  const uint64_t slots = header_offset + sizeof(shm::LaneHeader);
  q.indices.reserve(shown);
  q.slots.reserve(shown);
  for (uint64_t index = q.head; index != q.head + shown; ++index) {
    q.indices.push_back(index);
    q.slots.push_back(copy_at<Slot>(base, slots + (index & (capacity - 1)) * sizeof(Slot)));
  }
  return q;
}

std::string hex_bytes(const uint8_t* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += kDigits[bytes[i] >> 4];
    out += kDigits[bytes[i] & 15];
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------- names

namespace {
// A name from layout.hpp's tables, or the number for a value outside them.
std::string named(const char* name, uint32_t value) { return name != nullptr ? std::string(name) : unknown(value); }
}  // namespace

std::string opcode_name(uint32_t opcode) { return named(shm::opcode_name(opcode), opcode); }
std::string server_state_name(uint32_t state) { return named(shm::server_state_name(state), state); }
std::string worker_state_name(uint32_t state) { return named(shm::worker_state_name(state), state); }
std::string optimizer_name(uint32_t kind) { return named(shm::optimizer_kind_name(kind), kind); }
std::string backend_name(uint32_t backend) { return named(shm::backend_name(backend), backend); }
std::string staleness_policy_text(uint32_t policy) { return named(shm::staleness_policy_name(policy), policy); }
std::string dtype_name(uint32_t dtype) { return named(shm::dtype_name(dtype), dtype); }
std::string buffer_kind_name(uint32_t kind) { return named(shm::buffer_kind_name(kind), kind); }

std::string error_name(uint32_t code) {
  const std::string_view name = error_code_name(static_cast<ErrorCode>(code));
  // error_code_name says "unknown" for every value outside the enum.
  if (name == "unknown") return unknown(code);
  return std::string(name);
}

std::string config_flags_text(uint32_t flags) {
  std::string out;
  auto add = [&out](const std::string& s) { out += (out.empty() ? "" : ",") + s; };
  if (flags & shm::kConfigNesterov) add("nesterov");
  if (flags & shm::kConfigAmsgrad) add("amsgrad");
  if (flags & shm::kConfigAllowNonFinite) add("allow_nonfinite");
  if (flags & shm::kConfigGroupAccess) add("group_access");
  const uint32_t rest =
      flags & ~(shm::kConfigNesterov | shm::kConfigAmsgrad | shm::kConfigAllowNonFinite | shm::kConfigGroupAccess);
  if (rest != 0) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%x", rest);
    add(buf);
  }
  return out.empty() ? "none" : out;
}

std::string printable_text(std::string_view text, bool keep_high) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c != 0x7f && (c < 0x80 || keep_high) && c != '\\' && c != '"') {
      out += ch;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

namespace {

constexpr std::string_view kUnterminated = " (unterminated)";

// `name` (printable_name()'s) in the text's double quotes, its
// " (unterminated)", when `unterminated`, after the closing quote: the
// note is no part of the name.
std::string quoted(const std::string& name, bool unterminated) {
  if (!unterminated) return "\"" + name + "\"";
  return "\"" + name.substr(0, name.size() - kUnterminated.size()) + "\"" + std::string(kUnterminated);
}

bool has_nul(const void* bytes, size_t n) { return std::memchr(bytes, '\0', n) != nullptr; }

}  // namespace

std::string printable_name(const void* bytes, size_t n) {
  const auto* p = static_cast<const char*>(bytes);
  const void* nul = std::memchr(p, '\0', n);
  const size_t len = nul != nullptr ? static_cast<size_t>(static_cast<const char*>(nul) - p) : n;
  std::string out = printable_text(std::string_view(p, len));
  if (nul == nullptr) out += kUnterminated;
  return out;
}

ObjectView judge_object(const std::string& path, uint32_t uid, uint32_t gid, uint32_t mode, uint32_t config_flags,
                        bool live) {
  ObjectView v;
  v.uid = uid;
  v.gid = gid;
  v.owner = shm::owner_text(uid, gid);
  v.mode = shm::mode_text(mode);
  if (!live) return v;
  // The default server user never fails (no "shmps" user: not trusted).
  const auto trusted = shm::trusted_owners("");
  Status s = trusted.ok() ? shm::check_owner_and_mode(path, uid, gid, mode, *trusted) : trusted.status();
  if (s.ok()) s = shm::check_group_access(path, uid, gid, mode, config_flags);
  v.trusted = s.ok();
  if (!s.ok()) v.trust_problem = s.message();
  return v;
}

void judge_server_lock(Snapshot* snapshot, uint64_t device, uint64_t inode, const shm::FlockTable* flocks) {
  HeaderView& h = snapshot->header;
  const auto holds = [&](std::optional<pid_t> pid) {
    return flocks != nullptr ? flocks->holds(pid, device, inode) : shm::holds_flock(pid, device, inode);
  };
  if (!h.server_alive) {
    const std::optional<bool> held = holds(std::nullopt);
    h.server_unseen = held && *held;
    return;
  }
  // A pid above INT_MAX made server_alive false above.
  h.server_holds_object = holds(static_cast<pid_t>(h.server_pid));
  if (h.server_holds_object && !*h.server_holds_object) {
    h.server_alive = false;
    h.server_stopped = false;
    h.server_uptime_s.reset();
  }
}

// ---------------------------------------------------------------- snapshot

Result<Snapshot> take_snapshot(const void* base, size_t size, const std::string& source, RingReading rings) {
  if (Status s = shm::validate_segment(base, size); !s.ok()) return s;
  const auto& h = at<shm::SegmentHeader>(base, 0);
  Bounds b;
  if (Status s = read_bounds(h, size, &b); !s.ok()) return s;

  Snapshot snap;
  snap.source = source;
  snap.rings = rings;
  snap.taken_ns = shm::monotonic_ns();
  const uint64_t now = snap.taken_ns;

  // Header. The identity and geometry fields are written before the
  // version's publication (validate_segment's acquire load orders them).
  HeaderView& hv = snap.header;
  hv.magic = h.magic;
  hv.layout_version = h.layout_version.load(std::memory_order_acquire);  // SYNC(segment_published)
  hv.header_size = h.header_size;
  hv.segment_size = h.segment_size;
  hv.generation = h.generation;
  hv.server_pid = h.server_pid;
  hv.server_start_time = h.server_start_time;
  // A pid above INT_MAX turns negative here, which process_state rejects;
  // a start time of 0 (a server always writes its own) names no process.
  const shm::ProcessState server = shm::process_state(static_cast<pid_t>(hv.server_pid), hv.server_start_time);
  hv.server_alive = server != shm::ProcessState::kGone;
  hv.server_stopped = server == shm::ProcessState::kStopped;
  if (hv.server_alive) {
    // starttime counts clock ticks since boot (proc(5)), as CLOCK_BOOTTIME does.
    struct timespec boot {};
    const long ticks = ::sysconf(_SC_CLK_TCK);
    if (::clock_gettime(CLOCK_BOOTTIME, &boot) == 0 && ticks > 0) {
      const double since_boot = static_cast<double>(boot.tv_sec) + static_cast<double>(boot.tv_nsec) / 1e9;
      const double started = static_cast<double>(hv.server_start_time) / static_cast<double>(ticks);
      if (since_boot >= started) hv.server_uptime_s = since_boot - started;
    }
  }
  // acquire: SYNC(server_stopped) as the workers read it; a display value only.
  hv.server_state = h.server_state.load(std::memory_order_acquire);
  hv.heartbeat_ns = h.heartbeat_ns.load(std::memory_order_relaxed);  // relaxed: a liveness hint
  hv.heartbeat_age_ms = age_ms(now, hv.heartbeat_ns);
  hv.tensor_count = b.tensor_count;
  hv.max_workers = b.max_workers;
  hv.max_buffers = b.max_buffers;
  hv.lane_capacity = b.lane_capacity;
  hv.total_elements = h.total_elements;
  for (const auto& word : h.doorbell)
    hv.doorbell.push_back(word.load(std::memory_order_relaxed));  // relaxed: a display value only

  if (h.weights_export.flags & shm::kWeightsExportPresent) {
    const shm::WeightsExportBlock& w = h.weights_export;
    const uint8_t* u = w.device_uuid;
    char uuid[48];
    std::snprintf(uuid, sizeof uuid, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                  u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    snap.weights_export = WeightsExportView{uuid, w.allocation_bytes, w.weights_bytes};
  }

  const shm::ConfigBlock cfg = h.config;
  ConfigView& cv = snap.config;
  cv.optimizer_kind = cfg.optimizer_kind;
  cv.flags = cfg.flags;
  cv.lr = cfg.lr;
  cv.momentum = cfg.momentum;
  cv.dampening = cfg.dampening;
  cv.weight_decay = cfg.weight_decay;
  cv.beta1 = cfg.beta1;
  cv.beta2 = cfg.beta2;
  cv.eps = cfg.eps;
  cv.backend = cfg.backend;
  cv.max_staleness = cfg.max_staleness;
  cv.staleness_policy = cfg.staleness_policy;

  for (uint32_t i = 0; i < b.tensor_count; ++i) {
    const auto t = copy_at<shm::TensorDesc>(base, b.g.tensor_table_offset + uint64_t{i} * sizeof(shm::TensorDesc));
    TensorView tv;
    tv.id = i;
    tv.name = printable_name(t.name, sizeof t.name);
    tv.dtype = t.dtype;
    tv.ndim = t.ndim;
    tv.shape.assign(t.shape, t.shape + std::min<uint32_t>(t.ndim, shm::kMaxDims));
    tv.element_offset = t.element_offset;
    tv.element_count = t.element_count;
    snap.tensors.push_back(std::move(tv));
  }

  for (uint32_t i = 0; i < b.max_workers; ++i) {
    const uint64_t entry_offset = b.g.worker_table_offset + uint64_t{i} * b.g.worker_entry_size;
    const auto& e = at<shm::WorkerEntry>(base, entry_offset);
    // acquire: SYNC(worker_claim) with a worker's claiming CAS and
    // SYNC(worker_attached) with the server's store of kAttached: the
    // pid_start_time and the lease written before them are visible.
    const uint64_t owner = e.owner.load(std::memory_order_acquire);
    const auto queue_of = [&](uint64_t offset) {
      return read_queue<shm::Completion>(base, offset, b.lane_capacity, i, rings.max_slots);
    };
    const uint64_t completions = b.g.completions_offset + uint64_t{i} * b.g.completion_stride;
    if (owner == 0) {
      // A free entry: its queues are reset; list them only if they are not.
      if (rings.read) {
        auto cq = queue_of(completions);
        if (cq.head != 0 || cq.tail != 0) snap.completions.push_back(std::move(cq));
      }
    } else {
      WorkerView w;
      w.id = i;
      w.pid = shm::owner_pid(owner);
      w.state = shm::owner_state(owner);
      w.pid_start_time = e.pid_start_time;
      // As the server judges it (server/src/sessions.cpp, reap): an entry
      // without a start time (claimed, its worker yet to write it), or
      // being given back (kReleasing: its start time is being cleared), by
      // whatever process holds the pid.
      const auto pid = static_cast<pid_t>(w.pid);
      const bool by_pid = w.pid_start_time == 0 || w.state == static_cast<uint32_t>(shm::WorkerState::kReleasing);
      const shm::ProcessState ps = by_pid ? shm::pid_state(pid) : shm::process_state(pid, w.pid_start_time);
      w.pid_alive = ps != shm::ProcessState::kGone;
      w.pid_stopped = ps == shm::ProcessState::kStopped;
      w.lease = e.lease;
      // relaxed: monotonic statistics; a racy snapshot is all we promise.
      w.pushes_applied = e.pushes_applied.load(std::memory_order_relaxed);
      w.applied_bytes = e.applied_bytes.load(std::memory_order_relaxed);
      w.pushes_rejected = e.pushes_rejected.load(std::memory_order_relaxed);
      w.pulls = e.pulls.load(std::memory_order_relaxed);
      w.pulls_waited = e.pulls_waited.load(std::memory_order_relaxed);
      w.wait_ns = e.wait_ns.load(std::memory_order_relaxed);
      w.pulls_timed_out = e.pulls_timed_out.load(std::memory_order_relaxed);
      w.pushes_scaled = e.pushes_scaled.load(std::memory_order_relaxed);
      w.scale_factor_sum_micro = e.scale_factor_sum_micro.load(std::memory_order_relaxed);
      w.last_request_ns = e.last_request_ns.load(std::memory_order_relaxed);
      w.last_request_age_ms = age_ms(now, w.last_request_ns);
      for (uint32_t k = 0; k < b.max_buffers; ++k) {
        const auto d = copy_at<shm::BufferDesc>(
            base, entry_offset + sizeof(shm::WorkerEntry) + uint64_t{k} * sizeof(shm::BufferDesc));
        if (d.kind == static_cast<uint32_t>(shm::BufferKind::kEmpty)) continue;
        BufferView bv;
        bv.id = k;
        bv.kind = d.kind;
        bv.flags = d.flags;
        bv.length = d.length;
        bv.offset = d.offset;
        if (d.kind == static_cast<uint32_t>(shm::BufferKind::kCudaIpc))
          bv.device_uuid = hex_bytes(d.device_uuid, sizeof d.device_uuid);
        else {
          bv.name = printable_name(d.handle, sizeof d.handle);
          bv.name_unterminated = !has_nul(d.handle, sizeof d.handle);
        }
        w.buffers.push_back(std::move(bv));
      }
      snap.workers.push_back(std::move(w));
      if (rings.read) snap.completions.push_back(queue_of(completions));
    }
    if (!rings.read) continue;
    auto lane = read_queue<shm::Request>(base, b.g.lanes_offset + uint64_t{i} * b.g.lane_stride, b.lane_capacity, i,
                                         rings.max_slots);
    if (lane.depth != 0 || lane.corrupt) snap.lanes.push_back(std::move(lane));
  }

  const auto& st = at<shm::StatsBlock>(base, b.g.stats_offset);
  StatsView& sv = snap.stats;
  // relaxed: the server's statistics counters; a racy snapshot is all we promise.
  constexpr auto relaxed = std::memory_order_relaxed;
#define SHMPS_STATS_READ(name, kind, help) sv.name = st.name.load(relaxed);
  SHMPS_STATS_BLOCK_COUNTERS(SHMPS_STATS_READ)
#undef SHMPS_STATS_READ
  for (const auto& r : st.rejected) sv.rejected.push_back(r.load(relaxed));
  const auto read_histogram = [&](const shm::Histogram& from, HistogramView* v) {
    v->count = from.count.load(relaxed);
    v->sum = from.sum.load(relaxed);
    v->max = from.max.load(relaxed);
    for (const auto& bucket : from.buckets) v->buckets.push_back(bucket.load(relaxed));
  };
#define SHMPS_STATS_READ_HISTOGRAM(name, unit, help) read_histogram(st.name, &sv.name);
  SHMPS_STATS_HISTOGRAMS(SHMPS_STATS_READ_HISTOGRAM)
#undef SHMPS_STATS_READ_HISTOGRAM
  return snap;
}

// ---------------------------------------------------------------- JSON

namespace {

std::string tensor_label(const Snapshot& s, uint32_t id) {
  if (id == shm::kAllTensors) return "all";
  if (id < s.tensors.size()) return s.tensors[id].name;
  return "invalid(" + std::to_string(id) + ")";
}

json optional_json(const std::optional<uint64_t>& v) { return v ? json(*v) : json(nullptr); }

// The byte offset and length are strings (a worker writes any 64-bit
// value there). The union after them is a push's version (with its
// gradient's dtype) or a pull's wait_ns (a string: kMaxTimeout's 3.15e18 ns
// passes 2^53); other opcodes carry neither.
json request_json(const Snapshot& s, uint64_t index, uint32_t capacity, const shm::Request& r) {
  json j{{"index", index},
         {"slot", index & (capacity - 1)},
         {"request_id", r.request_id},
         {"opcode", opcode_name(r.opcode)},
         {"worker_id", r.worker_id},
         {"lease", hex64(r.lease)},
         {"tensor", r.tensor_id},
         {"tensor_name", tensor_label(s, r.tensor_id)},
         {"buffer", r.buffer_id},
         {"offset", std::to_string(r.byte_offset)},
         {"length", std::to_string(r.byte_length)},
         {"flags", r.flags}};
  if (r.opcode == static_cast<uint32_t>(shm::Opcode::kPush)) {
    j["version"] = r.worker_version;
    j["dtype"] = dtype_name(r.dtype);
  } else if (r.opcode == static_cast<uint32_t>(shm::Opcode::kPull)) {
    j["wait_ns"] = std::to_string(r.wait_ns);
  }
  return j;
}

json completion_json(uint64_t index, uint32_t capacity, const shm::Completion& c) {
  return json{{"index", index},
              {"slot", index & (capacity - 1)},
              {"request_id", c.request_id},
              {"opcode", opcode_name(c.opcode)},
              {"code", error_name(c.code)},
              {"version", c.version},
              // An attach's value is the lease (random high bits, past
              // 2^53): 0x-hex as every lease; the others' are counts.
              {"value", c.opcode == static_cast<uint32_t>(shm::Opcode::kAttach) ? json(hex64(c.value)) : json(c.value)},
              // A success leaves an earlier answer's message in the slot
              // (layout.hpp, Completion): only a failure's is its own.
              {"message", c.code != 0 ? printable_name(c.message, sizeof c.message) : std::string()},
              {"message_cut", c.code != 0 && (c.flags & shm::kCompletionMessageCut) != 0}};
}

template <typename Slot, typename F>
json queue_json(const QueueView<Slot>& q, F&& slot_json) {
  json j{{"worker", q.worker}, {"head", q.head}, {"tail", q.tail}, {"corrupt", q.corrupt}};
  j["depth"] = q.corrupt ? json(nullptr) : json(q.depth);
  json slots = json::array();
  for (size_t k = 0; k < q.slots.size(); ++k) slots.push_back(slot_json(q.indices[k], q.slots[k]));
  j["slots"] = std::move(slots);
  j["slots_not_shown"] = q.corrupt ? json(nullptr) : json(q.not_shown);
  return j;
}

}  // namespace

// Values that may pass 2^53, where jq and JavaScript round a JSON number,
// are strings: the random generation and leases (an attach's completion
// value included) and the doorbell's bitmap words as 0x-hex (as the text
// shows them), CLOCK_MONOTONIC nanoseconds (past 2^53 after 104 days of uptime)
// and the histograms' values in ns as decimal, and so are byte counts
// (8 PiB: days at tens of GB/s) and the sizes and offsets a writer of the
// segment may set past 2^53 that validation lets through: element counts,
// offsets and shapes (validation bounds only their sum, by 2^64), a
// buffer's and a request's byte offset and length, the weights export's
// bytes, a pull's wait_ns. Counters of events stay numbers, and so do
// values validation bounds far below 2^53 (segment_size, the counts).
json to_json(const Snapshot& s) {
  const HeaderView& h = s.header;
  json doorbell = json::array();
  for (const uint64_t word : h.doorbell) doorbell.push_back(hex64(word));
  json j;
  j["source"] = printable_text(s.source);  // a --file path as the user gave it, escaped as the text shows it
  if (s.object)
    j["object"] = json{
        {"owner", s.object->owner},
        {"uid", s.object->uid},
        {"gid", s.object->gid},
        {"mode", s.object->mode},
        {"trusted", s.object->trusted ? json(*s.object->trusted) : json(nullptr)},
        {"trust_problem", s.object->trusted && !*s.object->trusted ? json(s.object->trust_problem) : json(nullptr)}};
  else
    j["object"] = nullptr;
  j["header"] = json{{"magic", hex64(h.magic)},
                     {"layout_version", h.layout_version},
                     {"header_size", h.header_size},
                     {"segment_size", h.segment_size},
                     {"generation", hex64(h.generation)},
                     {"server_pid", h.server_pid},
                     {"server_start_time", h.server_start_time},
                     {"server_alive", h.server_alive},
                     {"server_stopped", h.server_stopped},
                     {"server_holds_object", h.server_holds_object ? json(*h.server_holds_object) : json(nullptr)},
                     {"server_unseen", h.server_unseen},
                     {"server_uptime_s", h.server_uptime_s ? json(*h.server_uptime_s) : json(nullptr)},
                     {"state", server_state_name(h.server_state)},
                     {"heartbeat_ns", std::to_string(h.heartbeat_ns)},
                     {"heartbeat_age_ms", optional_json(h.heartbeat_age_ms)},
                     {"tensor_count", h.tensor_count},
                     {"max_workers", h.max_workers},
                     {"max_buffers", h.max_buffers},
                     {"lane_capacity", h.lane_capacity},
                     {"total_elements", std::to_string(h.total_elements)},
                     {"doorbell", std::move(doorbell)}};
  const ConfigView& c = s.config;
  j["config"] = json{{"optimizer", optimizer_name(c.optimizer_kind)},
                     {"lr", json_float(c.lr)},
                     {"momentum", json_float(c.momentum)},
                     {"dampening", json_float(c.dampening)},
                     {"weight_decay", json_float(c.weight_decay)},
                     {"beta1", json_float(c.beta1)},
                     {"beta2", json_float(c.beta2)},
                     {"eps", json_float(c.eps)},
                     {"max_staleness", c.max_staleness},
                     {"staleness_policy", staleness_policy_text(c.staleness_policy)},
                     {"backend", backend_name(c.backend)},
                     {"flags", config_flags_text(c.flags)},
                     {"flags_value", c.flags}};
  if (s.weights_export)
    j["weights_export"] = json{{"device_uuid", s.weights_export->device_uuid},
                               {"allocation_bytes", std::to_string(s.weights_export->allocation_bytes)},
                               {"weights_bytes", std::to_string(s.weights_export->weights_bytes)}};
  else
    j["weights_export"] = nullptr;
  json tensors = json::array();
  for (const TensorView& t : s.tensors) {
    json shape = json::array();
    for (const uint64_t d : t.shape) shape.push_back(std::to_string(d));
    tensors.push_back(json{{"id", t.id},
                           {"name", t.name},
                           {"dtype", dtype_name(t.dtype)},
                           {"ndim", t.ndim},
                           {"shape", std::move(shape)},
                           {"elements", std::to_string(t.element_count)},
                           {"offset", std::to_string(t.element_offset)}});
  }
  j["tensors"] = std::move(tensors);
  json workers = json::array();
  for (const WorkerView& w : s.workers) {
    json buffers = json::array();
    for (const BufferView& b : w.buffers) {
      json bj{{"id", b.id},
              {"kind", buffer_kind_name(b.kind)},
              {"flags", b.flags},
              {"length", std::to_string(b.length)},
              {"offset", std::to_string(b.offset)},
              {"name", b.name}};
      if (!b.device_uuid.empty()) bj["device_uuid"] = b.device_uuid;
      buffers.push_back(std::move(bj));
    }
    // null where the counters are not shown (WorkerView::counters_shown).
    const bool shown = w.counters_shown();
    const auto count = [shown](uint64_t v) { return shown ? json(v) : json(nullptr); };
    const auto big = [shown](uint64_t v) { return shown ? json(std::to_string(v)) : json(nullptr); };
    workers.push_back(json{{"id", w.id},
                           {"pid", w.pid},
                           {"pid_alive", w.pid_alive},
                           {"pid_stopped", w.pid_stopped},
                           {"pid_start_time", w.pid_start_time},
                           {"state", worker_state_name(w.state)},
                           {"lease", hex64(w.lease)},
                           {"pushes_applied", count(w.pushes_applied)},
                           {"applied_bytes", big(w.applied_bytes)},
                           {"pushes_rejected", count(w.pushes_rejected)},
                           {"pulls", count(w.pulls)},
                           {"pulls_waited", count(w.pulls_waited)},
                           {"wait_ns", big(w.wait_ns)},
                           {"pulls_timed_out", count(w.pulls_timed_out)},
                           {"pushes_scaled", count(w.pushes_scaled)},
                           {"scale_factor_sum_micro", count(w.scale_factor_sum_micro)},
                           {"last_request_ns", big(w.last_request_ns)},
                           {"last_request_age_ms", shown ? optional_json(w.last_request_age_ms) : json(nullptr)},
                           {"buffers", std::move(buffers)}});
  }
  j["workers"] = std::move(workers);
  const uint32_t cap = h.lane_capacity;
  json lanes = json::array();
  for (const LaneView& l : s.lanes)
    lanes.push_back(
        queue_json(l, [&](uint64_t index, const shm::Request& r) { return request_json(s, index, cap, r); }));
  json completions = json::array();
  for (const CompletionQueueView& q : s.completions)
    completions.push_back(
        queue_json(q, [&](uint64_t index, const shm::Completion& x) { return completion_json(index, cap, x); }));
  // null: not read (RingReading), rather than seen empty.
  j["lanes"] = s.rings.read ? std::move(lanes) : json(nullptr);
  j["completions"] = s.rings.read ? std::move(completions) : json(nullptr);
  const StatsView& st = s.stats;
  json rejected = json::object();
  for (uint32_t code = 0; code < st.rejected.size(); ++code)
    if (st.rejected[code] != 0) rejected[error_name(code)] = st.rejected[code];
  json stats = json::object();
  // A byte count (a name ending in _bytes) passes 2^53 after days (8 PiB),
  // a time in ns (_ns) after 104 days, a value in 1e-12ths (_pico: the
  // scheduled lr, whose sentinels are 2^64 - 1 and 2^64 - 2) from an lr of
  // 9007: strings, as the 64-bit values of to_json()'s rule.
// A hash (_hash) is 0x-hex, as the generation.
#define SHMPS_STATS_JSON(name, kind, help)                                                            \
  stats[#name] = ends_with(#name, "_hash") ? json(hex64(st.name))                                     \
                 : ends_with(#name, "_bytes") || ends_with(#name, "_ns") || ends_with(#name, "_pico") \
                     ? json(std::to_string(st.name))                                                  \
                     : json(st.name);
  SHMPS_STATS_BLOCK_COUNTERS(SHMPS_STATS_JSON)
#undef SHMPS_STATS_JSON
  stats["avg_staleness"] = static_cast<double>(st.avg_staleness_micro) / 1e6;
  if (st.scheduled_lr_pico == shm::kScheduledLrNotFinite)
    stats["scheduled_lr"] = nullptr;  // not finite: pushes are refused
  else
    stats["scheduled_lr"] = static_cast<double>(st.scheduled_lr_pico) / 1e12;
  json histograms = json::object();
  // The sum, the max and the quantiles are strings: ns pass 2^53 in a sum,
  // and in a max (so a quantile, capped at it) from a garbage stamp.
  const auto histogram_json = [](const HistogramView& hv, const char* unit) {
    const auto digits = [](const std::optional<uint64_t>& v) { return v ? json(std::to_string(*v)) : json(nullptr); };
    return json{{"unit", unit},
                {"count", hv.count},
                {"sum", std::to_string(hv.sum)},
                {"max", std::to_string(hv.max)},
                {"p50", digits(hv.quantile(0.5))},
                {"p99", digits(hv.quantile(0.99))},
                {"buckets", hv.buckets}};
  };
#define SHMPS_STATS_HISTOGRAM_JSON(name, unit, help) histograms[#name] = histogram_json(st.name, #unit);
  SHMPS_STATS_HISTOGRAMS(SHMPS_STATS_HISTOGRAM_JSON)
#undef SHMPS_STATS_HISTOGRAM_JSON
  stats["histograms"] = std::move(histograms);
  stats["rejected"] = std::move(rejected);
  j["stats"] = std::move(stats);
  return j;
}

// ---------------------------------------------------------------- text

namespace {

std::string shape_text(const TensorView& t) {
  std::string out;
  for (size_t d = 0; d < t.shape.size(); ++d) out += (d == 0 ? "" : "x") + std::to_string(t.shape[d]);
  if (t.ndim > shm::kMaxDims) out += " (ndim " + std::to_string(t.ndim) + ")";
  return out.empty() ? "-" : out;
}

// `s` left-aligned in a column of `width`; one that fills it still gets a
// blank, so the next column never runs into it.
std::string pad(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}

std::string request_text(const Snapshot& s, const shm::Request& r) {
  std::string out = "request " + std::to_string(r.request_id) + " " + opcode_name(r.opcode);
  const auto op = static_cast<shm::Opcode>(r.opcode);
  if (op == shm::Opcode::kPush || op == shm::Opcode::kPull)
    out += " tensor " + (r.tensor_id == shm::kAllTensors
                             ? std::string("all")
                             : std::to_string(r.tensor_id) + " (" + tensor_label(s, r.tensor_id) + ")");
  if (op == shm::Opcode::kPush || op == shm::Opcode::kPull || op == shm::Opcode::kRegisterBuffer ||
      op == shm::Opcode::kUnregisterBuffer)
    out += " buffer " + std::to_string(r.buffer_id);
  if (op == shm::Opcode::kPush || op == shm::Opcode::kPull)
    out += " offset " + std::to_string(r.byte_offset) + " length " + std::to_string(r.byte_length);
  if (op == shm::Opcode::kPush) out += " version " + std::to_string(r.worker_version) + " dtype " + dtype_name(r.dtype);
  // The longest the server may hold the pull back (--staleness-policy wait).
  if (op == shm::Opcode::kPull) out += " wait_ns " + std::to_string(r.wait_ns);
  out += " (worker_id " + std::to_string(r.worker_id) + ", lease " + hex64(r.lease);
  if (r.flags != 0) out += ", flags " + std::to_string(r.flags);
  return out + ")";
}

std::string completion_text(const shm::Completion& c) {
  std::string out =
      "request " + std::to_string(c.request_id) + " " + opcode_name(c.opcode) + " -> " + error_name(c.code) +
      " version " + std::to_string(c.version) + " value " +
      // An attach's value is the lease: 0x-hex, as every lease.
      (c.opcode == static_cast<uint32_t>(shm::Opcode::kAttach) ? hex64(c.value) : std::to_string(c.value));
  if (c.code != 0)
    out += " " + quoted(printable_name(c.message, sizeof c.message), !has_nul(c.message, sizeof c.message));
  if (c.code != 0 && (c.flags & shm::kCompletionMessageCut) != 0) out += " (cut)";
  return out;
}

// The line after a ring's slots shown, when it holds more (RingReading).
std::string more_text(uint64_t not_shown, uint32_t max_slots) {
  if (not_shown == 0) return {};
  return "    ... " + std::to_string(not_shown) + " more not shown (the first " + std::to_string(max_slots) +
         " of each ring are)\n";
}

template <typename Slot>
std::string indices_text(const QueueView<Slot>& q, uint32_t capacity) {
  std::string out = "head " + std::to_string(q.head) + ", tail " + std::to_string(q.tail);
  if (q.corrupt)
    out +=
        ": corrupt indices (tail - head = " + std::to_string(q.depth) + " > capacity " + std::to_string(capacity) + ")";
  else
    out += ", depth " + std::to_string(q.depth);
  return out;
}

}  // namespace

std::string render_text(const Snapshot& s) {
  std::ostringstream o;
  const HeaderView& h = s.header;
  o << "shmps segment " << printable_text(s.source) << "\n";  // a --file path as the user gave it
  o << "== header ==\n";
  if (s.object) {
    o << "  object          owner " << s.object->owner << " (uid " << s.object->uid << "), mode " << s.object->mode
      << (s.object->trusted ? "" : " (a copy: not judged)") << "\n";
    if (s.object->trusted && !*s.object->trusted)
      o << "  NOT TRUSTED     a worker of this user (uid " << ::geteuid()
        << ") would refuse it: " << s.object->trust_problem << "\n";
  }
  o << "  magic           " << hex64(h.magic) << "\n";
  o << "  layout version  " << h.layout_version << "\n";
  o << "  segment size    " << h.segment_size << " bytes\n";
  const std::string pid = std::to_string(h.server_pid);
  o << "  server          pid " << pid << " ("
    << (h.server_stopped ? "stopped by a signal or a debugger: it serves no request until continued, kill -CONT " + pid
        : h.server_alive ? "alive"
        : h.server_holds_object
            ? "alive, but not serving this object: it does not hold its lock, as a serving server does; a copy of "
              "its segment"
        : h.server_unseen
            ? "no process here is this pid started at this time, but a process holds the object's lock, as a "
              "serving server does: a server in a pid namespace below this one (a container sharing /dev/shm), or "
              "one starting"
        : h.server_start_time == 0 ? "not judged: no start time in the header, which a server always writes"
                                   : "dead")
    << "), start time " << h.server_start_time;
  if (h.server_uptime_s) o << ", up " << seconds_text(*h.server_uptime_s) << " s";
  o << "\n";
  o << "  generation      " << hex64(h.generation) << "\n";
  o << "  state           " << server_state_name(h.server_state) << "\n";
  o << "  heartbeat       " << age_text(h.heartbeat_age_ms, h.heartbeat_ns) << "\n";
  o << "  geometry        " << h.tensor_count << " tensors (" << h.total_elements << " elements), " << h.max_workers
    << " workers x " << h.max_buffers << " buffers, lane capacity " << h.lane_capacity << "\n";
  std::string bells;
  for (uint64_t w : h.doorbell) bells += (bells.empty() ? "" : " ") + hex64(w);
  o << "  doorbell        " << bells << "\n";

  const ConfigView& c = s.config;
  o << "== config ==\n";
  o << "  optimizer       " << optimizer_name(c.optimizer_kind) << "\n";
  o << "  hyperparameters lr " << num(c.lr) << ", momentum " << num(c.momentum) << ", dampening " << num(c.dampening)
    << ", weight_decay " << num(c.weight_decay) << ", beta1 " << num(c.beta1) << ", beta2 " << num(c.beta2) << ", eps "
    << num(c.eps) << "\n";
  o << "  max_staleness   " << c.max_staleness << " (policy " << staleness_policy_text(c.staleness_policy) << ")\n";
  o << "  backend         " << backend_name(c.backend) << "\n";
  o << "  flags           " << config_flags_text(c.flags) << "\n";
  if (s.weights_export)
    o << "  weights export  CUDA IPC, device " << s.weights_export->device_uuid << ", allocation "
      << s.weights_export->allocation_bytes << " bytes (weights " << s.weights_export->weights_bytes << ")\n";

  o << "== tensors (" << s.tensors.size() << ") ==\n";
  size_t name_width = 4;
  for (const TensorView& t : s.tensors) name_width = std::max(name_width, t.name.size());
  o << "  " << pad("id", 6) << pad("name", name_width + 2) << pad("shape", 16) << pad("elements", 14) << "offset\n";
  for (const TensorView& t : s.tensors) {
    o << "  " << pad(std::to_string(t.id), 6) << pad(t.name, name_width + 2) << pad(shape_text(t), 16)
      << pad(std::to_string(t.element_count), 14) << t.element_offset;
    if (t.dtype != static_cast<uint32_t>(shm::Dtype::kF32)) o << "  dtype " << dtype_name(t.dtype);
    o << "\n";
  }

  o << "== workers (" << s.workers.size() << " of " << h.max_workers << " entries in use) ==\n";
  for (const WorkerView& w : s.workers) {
    o << "  worker " << w.id << ": " << worker_state_name(w.state) << ", pid " << w.pid << " ("
      << (w.pid_stopped ? "stopped"
          : w.pid_alive ? "alive"
                        : "dead")
      << "), lease " << hex64(w.lease);
    // kDetached with a living process: an eviction (or a detach) its
    // process has not yet acknowledged; the entry stays out of use until it does.
    if (w.state == static_cast<uint32_t>(shm::WorkerState::kDetached) && w.pid_alive)
      o << ", released by the server; waiting for the process to free it";
    o << "\n";
    if (!w.counters_shown())
      o << "    pushes applied - (- bytes), rejected -, pulls -, last request - (counted from the attach)\n";
    else
      o << "    pushes applied " << w.pushes_applied << " (" << w.applied_bytes << " bytes), rejected "
        << w.pushes_rejected << ", pulls " << w.pulls << ", last request "
        << age_text(w.last_request_age_ms, w.last_request_ns) << "\n";
    if (w.counters_shown() && (w.pulls_waited != 0 || w.pushes_scaled != 0))
      o << "    pulls held " << w.pulls_waited << " (" << duration_text(w.wait_ns) << " in all, " << w.pulls_timed_out
        << " timed out), pushes scaled " << w.pushes_scaled << " (mean factor "
        << (w.pushes_scaled == 0
                ? std::string("-")
                : num(static_cast<double>(w.scale_factor_sum_micro) / 1e6 / static_cast<double>(w.pushes_scaled)))
        << ")\n";
    for (const BufferView& b : w.buffers) {
      o << "    buffer " << b.id << ": " << buffer_kind_name(b.kind) << ", " << b.length << " bytes at offset "
        << b.offset;
      if (!b.name.empty()) o << ", name " << quoted(b.name, b.name_unterminated);
      if (!b.device_uuid.empty()) o << ", device " << b.device_uuid;
      o << "\n";
    }
  }

  if (s.rings.read) {
    o << "== request lanes (" << s.lanes.size() << " not empty) ==\n";
    for (const LaneView& l : s.lanes) {
      o << "  lane " << l.worker << ": " << indices_text(l, h.lane_capacity) << "\n";
      for (size_t k = 0; k < l.slots.size(); ++k)
        o << "    slot " << (l.indices[k] & (h.lane_capacity - 1)) << " (#" << l.indices[k]
          << "): " << request_text(s, l.slots[k]) << "\n";
      o << more_text(l.not_shown, s.rings.max_slots);
    }
    o << "== completion queues (" << s.completions.size() << ") ==\n";
    for (const CompletionQueueView& q : s.completions) {
      o << "  queue " << q.worker << ": " << indices_text(q, h.lane_capacity) << "\n";
      for (size_t k = 0; k < q.slots.size(); ++k)
        o << "    slot " << (q.indices[k] & (h.lane_capacity - 1)) << " (#" << q.indices[k]
          << "): " << completion_text(q.slots[k]) << "\n";
      o << more_text(q.not_shown, s.rings.max_slots);
    }
  } else {
    o << "== request lanes, completion queues: not read ==\n";
  }

  const StatsView& st = s.stats;
  o << "== stats ==\n";
  o << "  version         " << st.version << "\n";
  o << "  gradients       " << st.gradients_applied << " applied (" << st.applied_bytes << " bytes), avg staleness "
    << num(static_cast<double>(st.avg_staleness_micro) / 1e6) << "\n";
  o << "  weights pulled  " << st.weights_pulled << "\n";
  o << "  requests        " << st.requests << "\n";
  std::string rejected;
  for (uint32_t code = 0; code < st.rejected.size(); ++code)
    if (st.rejected[code] != 0)
      rejected += (rejected.empty() ? "" : ", ") + error_name(code) + " " + std::to_string(st.rejected[code]);
  o << "  rejected        " << (rejected.empty() ? std::string("none") : rejected) << "\n";
  o << "  ring depth      " << st.ring_depth << " (high-water mark " << st.ring_high_water << ")\n";
  o << "  workers         " << st.workers_attached << " attached, " << st.workers_died << " died, "
    << st.workers_evicted << " evicted\n";
  o << "  buffers         " << st.buffers_registered << " registered, mappings " << st.mappings_opened << " opened, "
    << st.mappings_closed << " closed, CUDA IPC handles " << st.ipc_handles_opened << " opened, "
    << st.ipc_handles_closed << " closed\n";
  o << "  lanes corrupt   " << st.lanes_corrupt << "\n";
  o << "  staleness policy pulls held " << st.pulls_waited << " (" << duration_text(st.wait_ns) << " in all), "
    << st.pulls_held << " now, pushes scaled " << st.pushes_scaled << " (mean factor "
    << (st.pushes_scaled == 0
            ? std::string("-")
            : num(static_cast<double>(st.scale_factor_sum_micro) / 1e6 / static_cast<double>(st.pushes_scaled)))
    << ")\n";
  o << "  apply threads   " << st.apply_threads << " (the last update of a tensor from 4 MiB)\n";
  if (st.scheduled_lr_pico == shm::kScheduledLrNotFinite)
    o << "  scheduled lr    not finite: --lr-schedule grew past the float range; pushes are refused\n";
  else
    o << "  scheduled lr    " << (st.scheduled_lr_pico == shm::kScheduledLrSaturated ? "at least " : "")
      << num(static_cast<double>(st.scheduled_lr_pico) / 1e12) << " (the next update's, by --lr-schedule)\n";
  o << "  checkpoints     " << st.checkpoints_written << " written, " << st.checkpoint_failures << " failed, "
    << st.checkpoints_deferred << " deferred by a federation round\n";
  const auto since = [&st] {
    return "after round " + std::to_string(st.fed_round) +
           (st.fed_epoch != 0 ? " (epoch " + std::to_string(st.fed_epoch) + ", " : std::string(" (")) +
           "failed rounds " + std::to_string(st.fed_failures) + ")";
  };
  // The counter is 64 bits: range-checked before the cast to the 32-bit
  // enum, which would take 2^32 + 2 for kInGroup.
  const auto fed_state = st.fed_state <= shm::kFederationStateMax ? static_cast<shm::FederationState>(st.fed_state)
                                                                  : shm::FederationState{0xffffffffu};
  switch (fed_state) {
    case shm::FederationState::kInGroup:
      o << "  federation      round " << st.fed_round << ", " << st.fed_members << " hosts"
        << (st.fed_epoch != 0 ? " (epoch " + std::to_string(st.fed_epoch) + ")" : std::string()) << ", last round "
        << duration_text(st.fed_round_ns) << ", " << st.fed_bytes << " bytes sent, drift " << st.fed_drift
        << " updates, anchor " << hex64(st.fed_anchor_hash) << ", pushes held " << st.fed_pushes_held
        << ", failed rounds " << st.fed_failures << "\n";
      break;
    case shm::FederationState::kForming:
      o << "  federation      forming a group, " << since() << "; serving the local workers\n";
      break;
    case shm::FederationState::kPaused:
      o << "  federation      paused: no majority of the last group's hosts, " << since()
        << "; serving the local workers, trying again\n";
      break;
    case shm::FederationState::kEnded:
      o << "  federation      ended " << since() << ": serving the local workers alone (the log says why)\n";
      break;
    case shm::FederationState::kOff:
      o << "  federation      off\n";
      break;
    default:
      o << "  federation      unknown(" << st.fed_state << ") (not a state this build knows)\n";
  }
  const auto histogram_text = [](const HistogramView& hv, bool ns) {
    if (!hv.quantile(0.5)) return std::string("none yet");
    const auto v = [ns](uint64_t x) { return ns ? duration_text(x) : std::to_string(x); };
    return std::to_string(hv.count) + ", p50 <= " + v(*hv.quantile(0.5)) + ", p99 <= " + v(*hv.quantile(0.99)) +
           ", max " + v(hv.max);
  };
#define SHMPS_STATS_HISTOGRAM_TEXT(name, unit, help) \
  o << "  " << pad(#name, 16) << histogram_text(st.name, std::string_view(#unit) == "ns") << "\n";
  SHMPS_STATS_HISTOGRAMS(SHMPS_STATS_HISTOGRAM_TEXT)
#undef SHMPS_STATS_HISTOGRAM_TEXT
  return o.str();
}

// ---------------------------------------------------------------- prometheus

namespace {

// The length of the well-formed UTF-8 sequence at s[i] (the Unicode
// standard's table 3-7), or 0 when there is none.
size_t utf8_length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) -> unsigned { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0; };
  const auto in = [&](size_t k, unsigned lo, unsigned hi) { return byte(k) >= lo && byte(k) <= hi; };
  const unsigned c = byte(0);
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) return in(1, 0x80, 0xbf) ? 2 : 0;
  if (c >= 0xe0 && c <= 0xef)  // not overlong (e0), no surrogate (ed)
    return in(1, c == 0xe0 ? 0xa0 : 0x80, c == 0xed ? 0x9f : 0xbf) && in(2, 0x80, 0xbf) ? 3 : 0;
  if (c >= 0xf0 && c <= 0xf4)  // not overlong (f0), at most U+10FFFF (f4)
    return in(1, c == 0xf0 ? 0x90 : 0x80, c == 0xf4 ? 0x8f : 0xbf) && in(2, 0x80, 0xbf) && in(3, 0x80, 0xbf) ? 4 : 0;
  return 0;
}

// A label value as the text exposition format wants it: valid UTF-8 (a
// byte that is not, e.g. of a --file path, becomes U+FFFD, as in the JSON),
// with \\, \" and \n escaped.
std::string label_value(const std::string& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    const size_t n = utf8_length(v, i);
    if (n == 0)
      out += "\xef\xbf\xbd";  // U+FFFD
    else if (v[i] == '\\' || v[i] == '"')
      out += std::string("\\") + v[i];
    else if (v[i] == '\n')
      out += "\\n";
    else
      out.append(v, i, n);
    i += std::max<size_t>(n, 1);
  }
  return out;
}

// The `name` label's value: the segment's name or a --file path as the
// user gave it, its control bytes (and `\`) written as \xNN as
// printable_text() writes them, so a scraped label cannot carry an escape
// sequence to a terminal; bytes from 0x80 up are left to label_value().
std::string name_label(const std::string& name) {
  return "name=\"" + label_value(printable_text(name, /*keep_high=*/true)) + "\"";
}

// Prometheus's names: a counter ends in _total; a value in millionths
// (name_micro) or 1e-12ths (name_pico) is given in its unit, one in ns
// (name_ns) in seconds (name_seconds).
std::string metric_name(const std::string& name, const std::string& kind) {
  std::string base = name;
  if (ends_with(base, "_micro")) base.resize(base.size() - 6);
  if (ends_with(base, "_pico")) base.resize(base.size() - 5);
  if (ends_with(base, "_ns")) base.replace(base.size() - 3, 3, "_seconds");
  return "shmps_" + base + (kind == "counter" ? "_total" : "");
}

double metric_value(const std::string& name, uint64_t v) {
  if (name == "scheduled_lr_pico" && v == shm::kScheduledLrNotFinite) return std::numeric_limits<double>::infinity();
  if (ends_with(name, "_micro")) return static_cast<double>(v) / 1e6;
  if (ends_with(name, "_pico")) return static_cast<double>(v) / 1e12;
  if (ends_with(name, "_ns")) return static_cast<double>(v) / 1e9;
  return static_cast<double>(v);
}

class Exposition {
 public:
  explicit Exposition(std::string labels) : labels_(std::move(labels)) {}
  void family(const std::string& metric, const std::string& type, const std::string& help) {
    out_ << "# HELP " << metric << " " << help << "\n# TYPE " << metric << " " << type << "\n";
  }
  void sample(const std::string& metric, double value, const std::string& extra_labels = "") {
    out_ << metric << "{" << labels_ << extra_labels << "} " << sample_value(value) << "\n";
  }
  std::string text() const { return out_.str(); }

  // A bound as a label: the shortest form that reads back (2^b - 1 ns fit
  // 11 digits).
  static std::string label_number(double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.11g", v);
    return buf;
  }
  // The shortest decimal that reads back as `v` (std::to_chars: 0.001,
  // 16, 1e+12); the exposition format spells the non-finite values NaN,
  // +Inf, -Inf (a garbage segment's configuration may hold them).
  static std::string sample_value(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    char buf[40];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, r.ptr);  // 40 bytes hold any double's shortest form (24 at most)
  }

 private:
  std::string labels_;
  std::ostringstream out_;
};

}  // namespace

namespace {

constexpr const char* kUpHelp =
    "1 while the segment's server process is alive and serves it (stopped too: shmps_server_stopped), or "
    "holds it unseen from here (shmps_server_unseen); 0 when it is not, or when the segment could not be read "
    "(shmps_inspect_error).";

// Every reason, at 0 but `error`'s (a state set, as the rejection causes
// are): each series is always there, so an alert reads its value rather
// than its absence; kNone (a read, or no segment at all) is all 0.
void inspect_error(Exposition& e, ReadError error) {
  e.family("shmps_inspect_error", "gauge",
           "1 when shmps-inspect could not read the segment, by reason (permission: no access; bad_segment: "
           "foreign, corrupt or of another layout version; unpublished: not published by its server; usage: a "
           "name no server can take; io: any other failure; its message is on stderr); else 0. shmps_up is 0 "
           "then: the server's state is unknown.");
  for (const auto& [reason, value] : {std::pair{"permission", ReadError::kPermission},
                                      {"bad_segment", ReadError::kBadSegment},
                                      {"unpublished", ReadError::kUnpublished},
                                      {"usage", ReadError::kUsage},
                                      {"io", ReadError::kIo}})
    e.sample("shmps_inspect_error", error == value ? 1 : 0, std::string(",reason=\"") + reason + "\"");
}

}  // namespace

std::string render_prometheus_down(const std::string& name, ReadError error) {
  Exposition e(name_label(name));
  e.family("shmps_up", "gauge", kUpHelp);
  e.sample("shmps_up", 0);
  inspect_error(e, error);
  return e.text();
}

std::string render_prometheus(const Snapshot& s, const std::string& name) {
  Exposition e(name_label(name));
  const HeaderView& h = s.header;
  e.family("shmps_up", "gauge", kUpHelp);
  // An unseen server holds the object's lock, as only a serving server
  // does: up, as seen from the host of a container that runs it.
  e.sample("shmps_up", h.server_alive || h.server_unseen ? 1 : 0);
  inspect_error(e, ReadError::kNone);
  e.family("shmps_server_stopped", "gauge",
           "1 while the server process is stopped (SIGSTOP, a debugger): alive, but serving nothing; else 0.");
  e.sample("shmps_server_stopped", h.server_stopped ? 1 : 0);
  e.family("shmps_server_unseen", "gauge",
           "1 when no process here is the server's pid, but one holds the segment's lock, as a serving server "
           "does: a server in a pid namespace below this one (a container sharing /dev/shm); else 0. Its "
           "stopped state cannot be seen then.");
  e.sample("shmps_server_unseen", h.server_unseen ? 1 : 0);
  if (s.object && s.object->trusted) {
    e.family("shmps_segment_trusted", "gauge",
             "1 when a worker of this user would trust the segment's object (owner, mode), else 0.");
    e.sample("shmps_segment_trusted", *s.object->trusted ? 1 : 0);
  }
  e.family("shmps_info", "gauge", "The server's identity and configuration, as labels; always 1.");
  e.sample("shmps_info", 1,
           ",pid=\"" + std::to_string(h.server_pid) + "\",generation=\"" + hex64(h.generation) + "\",optimizer=\"" +
               optimizer_name(s.config.optimizer_kind) + "\",backend=\"" + backend_name(s.config.backend) +
               "\",staleness_policy=\"" + staleness_policy_text(s.config.staleness_policy) + "\"");
  e.family("shmps_server_state", "gauge", "The server's state: 1 starting, 2 running, 3 stopping, 4 stopped.");
  e.sample("shmps_server_state", h.server_state);
  e.family("shmps_parameters", "gauge", "Parameters (fp32 elements) of the model, all tensors.");
  e.sample("shmps_parameters", static_cast<double>(h.total_elements));
  e.family("shmps_learning_rate", "gauge",
           "The configured learning rate (--lr; each update's follows --lr-schedule from it: shmps_scheduled_lr).");
  e.sample("shmps_learning_rate", json_float(s.config.lr));  // the float's shortest decimal: 0.001
  e.family("shmps_max_staleness", "gauge",
           "The staleness bound: versions (policy reject), clocks ahead of the slowest worker (wait).");
  e.sample("shmps_max_staleness", static_cast<double>(s.config.max_staleness));
  if (h.server_uptime_s) {
    e.family("shmps_uptime_seconds", "gauge", "Time since the server process started.");
    e.sample("shmps_uptime_seconds", *h.server_uptime_s);
  }
  if (h.heartbeat_age_ms) {
    e.family("shmps_heartbeat_age_seconds", "gauge", "Time since the server last wrote its heartbeat.");
    e.sample("shmps_heartbeat_age_seconds", static_cast<double>(*h.heartbeat_age_ms) / 1e3);
  }
  const StatsView& st = s.stats;
  // A hash is no quantity (a double would round it), and as a label it
  // would make a new series every round: not exported (text and JSON
  // carry it).
#define SHMPS_STATS_PROMETHEUS(field, kind, help)                         \
  if (!ends_with(#field, "_hash")) {                                      \
    e.family(metric_name(#field, #kind), #kind, help);                    \
    e.sample(metric_name(#field, #kind), metric_value(#field, st.field)); \
  }
  SHMPS_STATS_BLOCK_COUNTERS(SHMPS_STATS_PROMETHEUS)
#undef SHMPS_STATS_PROMETHEUS
  // Histograms: cumulative buckets at le = 2^b - 1 of the value (seconds
  // for ns), over the range where values fall in practice (127 ns to
  // 68.7 s, 0 to 2^20 - 1 versions); +Inf holds all.
  const auto histogram = [&](const std::string& base, const HistogramView& hv, bool ns, const std::string& help) {
    const std::string metric = "shmps_" + (ns ? base.substr(0, base.size() - 3) + "_seconds" : base);
    e.family(metric, "histogram", help);
    const uint32_t first = ns ? 7 : 0, last = ns ? 36 : 20;  // le 127 ns .. 68.7 s; 0 .. 2^20 - 1 versions
    uint64_t cumulative = 0;
    for (uint32_t b = 0; b < hv.buckets.size(); ++b) {
      // Bucket b holds [2^(b-1), 2^b): at or below le = 2^b - 1, for integers.
      cumulative = hv.buckets[b] > ~uint64_t{0} - cumulative ? ~uint64_t{0} : cumulative + hv.buckets[b];
      if (b < first || b > last) continue;
      const double le = static_cast<double>((uint64_t{1} << b) - 1) / (ns ? 1e9 : 1.0);
      e.sample(metric + "_bucket", static_cast<double>(cumulative), ",le=\"" + Exposition::label_number(le) + "\"");
    }
    e.sample(metric + "_bucket", static_cast<double>(cumulative), ",le=\"+Inf\"");
    e.sample(metric + "_sum", static_cast<double>(hv.sum) / (ns ? 1e9 : 1.0));
    e.sample(metric + "_count", static_cast<double>(cumulative));
  };
#define SHMPS_STATS_HISTOGRAM_PROMETHEUS(name, unit, help) \
  histogram(#name, st.name, std::string_view(#unit) == "ns", help);
  SHMPS_STATS_HISTOGRAMS(SHMPS_STATS_HISTOGRAM_PROMETHEUS)
#undef SHMPS_STATS_HISTOGRAM_PROMETHEUS
  e.family("shmps_requests_rejected_total", "counter", "Requests refused, by cause (the error code's name).");
  // Code 0 ("ok") and codes outside the enum are no causes: a count under
  // them is garbage, shown (as text and JSON show it) only when not 0.
  for (uint32_t code = 0; code < st.rejected.size(); ++code) {
    const std::string cause = error_name(code);
    if ((code == 0 || cause.rfind("unknown(", 0) == 0) && st.rejected[code] == 0) continue;
    e.sample("shmps_requests_rejected_total", static_cast<double>(st.rejected[code]),
             ",cause=\"" + label_value(cause) + "\"");
  }
  // Per worker: labelled by entry and pid, for attached entries only
  // (WorkerView::counters_shown: a claimed entry holds an earlier
  // session's counts until the server attaches it and zeroes them). A
  // session that attaches to the entry its process held before (a worker
  // that reconnects) continues the series from 0: a counter reset.
  const auto per_worker = [&](const std::string& metric, const std::string& type, const std::string& help,
                              const std::function<std::optional<double>(const WorkerView&)>& value) {
    e.family(metric, type, help);
    for (const WorkerView& w : s.workers)
      if (const auto v = w.counters_shown() ? value(w) : std::nullopt)
        e.sample(metric, *v, ",worker=\"" + std::to_string(w.id) + "\",pid=\"" + std::to_string(w.pid) + "\"");
  };
  per_worker("shmps_worker_pushes_applied_total", "counter", "Pushes of this worker applied.",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.pushes_applied)); });
  per_worker("shmps_worker_pushes_rejected_total", "counter", "Pushes of this worker rejected.",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.pushes_rejected)); });
  per_worker("shmps_worker_applied_bytes_total", "counter", "Bytes of gradient of this worker applied.",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.applied_bytes)); });
  per_worker("shmps_worker_pulls_total", "counter", "Pulls of this worker served.",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.pulls)); });
  per_worker("shmps_worker_pulls_waited_total", "counter", "Pulls of this worker held back by --staleness-policy wait.",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.pulls_waited)); });
  per_worker("shmps_worker_wait_seconds_total", "counter", "Time pulls of this worker were held back, in all.",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.wait_ns) / 1e9); });
  per_worker("shmps_worker_pushes_scaled_total", "counter",
             "Pushes of this worker applied with a reduced lr (--staleness-policy scale).",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.pushes_scaled)); });
  per_worker("shmps_worker_pulls_timed_out_total", "counter",
             "Pulls of this worker held back past their wait (answered timeout).",
             [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.pulls_timed_out)); });
  per_worker(
      "shmps_worker_scale_factor_sum_total", "counter",
      "Sum of the lr factors of this worker's scaled pushes (mean factor: this / pushes_scaled).",
      [](const WorkerView& w) { return std::optional<double>(static_cast<double>(w.scale_factor_sum_micro) / 1e6); });
  per_worker("shmps_worker_last_request_age_seconds", "gauge", "Time since this worker's last request.",
             [](const WorkerView& w) -> std::optional<double> {
               if (!w.last_request_age_ms) return std::nullopt;
               return static_cast<double>(*w.last_request_age_ms) / 1e3;
             });
  return e.text();
}

}  // namespace shmps::inspect

namespace shmps::inspect {

namespace {

// Empty when the counter went back (Rates).
Rates::Rate per_second(uint64_t before, uint64_t after, double seconds) {
  if (after < before) return std::nullopt;
  return static_cast<double>(after - before) / seconds;
}

std::string rate_text(const Rates::Rate& rate) {
  if (!rate) return "-";
  const double v = *rate;
  char buf[32];
  std::snprintf(buf, sizeof buf, v >= 100 ? "%.0f" : "%.1f", v);
  return buf;
}

std::string bytes_rate_text(const Rates::Rate& rate) {
  if (!rate) return "- B/s";
  const double v = *rate;
  char buf[32];
  if (v >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2f GB/s", v / 1e9);
  else if (v >= 1e6)
    std::snprintf(buf, sizeof buf, "%.1f MB/s", v / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.0f B/s", v);
  return buf;
}

}  // namespace

std::optional<Rates> rates_between(const Snapshot& a, const Snapshot& b) {
  if (a.header.generation != b.header.generation || b.taken_ns <= a.taken_ns) return std::nullopt;
  Rates r;
  r.seconds = static_cast<double>(b.taken_ns - a.taken_ns) / 1e9;
  r.pushes = per_second(a.stats.gradients_applied, b.stats.gradients_applied, r.seconds);
  r.pulls = per_second(a.stats.weights_pulled, b.stats.weights_pulled, r.seconds);
  r.bytes = per_second(a.stats.applied_bytes, b.stats.applied_bytes, r.seconds);
  r.requests = per_second(a.stats.requests, b.stats.requests, r.seconds);
  for (uint32_t code = 0; code < b.stats.rejected.size() && code < a.stats.rejected.size(); ++code)
    if (b.stats.rejected[code] != a.stats.rejected[code])
      r.rejected.emplace_back(error_name(code), per_second(a.stats.rejected[code], b.stats.rejected[code], r.seconds));
  // Attached in both (WorkerView::counters_shown): a claimed entry's
  // counters are an earlier session's, which its lease and pid may match.
  for (const WorkerView& w : b.workers) {
    if (!w.counters_shown()) continue;
    const auto same = std::find_if(a.workers.begin(), a.workers.end(), [&](const WorkerView& v) {
      return v.id == w.id && v.pid == w.pid && v.lease == w.lease && v.counters_shown();
    });
    if (same == a.workers.end()) continue;
    Rates::Worker x;
    x.id = w.id;
    x.pid = w.pid;
    x.pushes = per_second(same->pushes_applied, w.pushes_applied, r.seconds);
    x.rejected = per_second(same->pushes_rejected, w.pushes_rejected, r.seconds);
    x.pulls = per_second(same->pulls, w.pulls, r.seconds);
    x.bytes = per_second(same->applied_bytes, w.applied_bytes, r.seconds);
    r.workers.push_back(x);
  }
  return r;
}

std::string render_rates_text(const Rates& r) {
  // The window in ms below a second (--interval-ms 5 is no "0.0 s").
  char window[32];
  if (r.seconds < 1)
    std::snprintf(window, sizeof window, "%.1f ms", r.seconds * 1e3);
  else
    std::snprintf(window, sizeof window, "%.1f s", r.seconds);
  std::string out = std::string("== rates (over the last ") + window + ") ==\n";
  out += "  total           " + rate_text(r.pushes) + " pushes/s, " + rate_text(r.pulls) + " pulls/s, " +
         bytes_rate_text(r.bytes) + " applied, " + rate_text(r.requests) + " requests/s\n";
  std::string rejected;
  for (const auto& [cause, v] : r.rejected) rejected += (rejected.empty() ? "" : ", ") + cause + " " + rate_text(v);
  out += "  rejected/s      " + (rejected.empty() ? std::string("none") : rejected) + "\n";
  for (const Rates::Worker& w : r.workers)
    out += "  worker " + std::to_string(w.id) + " (pid " + std::to_string(w.pid) + "): " + rate_text(w.pushes) +
           " pushes/s, " + rate_text(w.pulls) + " pulls/s, " + bytes_rate_text(w.bytes) + ", " + rate_text(w.rejected) +
           " rejected/s\n";
  return out;
}

nlohmann::json rates_json(const Rates& r) {
  const auto rate = [](const Rates::Rate& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  nlohmann::json rejected = nlohmann::json::object();
  for (const auto& [cause, v] : r.rejected) rejected[cause] = rate(v);
  nlohmann::json workers = nlohmann::json::array();
  for (const Rates::Worker& w : r.workers)
    workers.push_back({{"id", w.id},
                       {"pid", w.pid},
                       {"pushes_per_s", rate(w.pushes)},
                       {"rejected_per_s", rate(w.rejected)},
                       {"pulls_per_s", rate(w.pulls)},
                       {"bytes_per_s", rate(w.bytes)}});
  return {{"seconds", r.seconds},         {"pushes_per_s", rate(r.pushes)},     {"pulls_per_s", rate(r.pulls)},
          {"bytes_per_s", rate(r.bytes)}, {"requests_per_s", rate(r.requests)}, {"rejected_per_s", std::move(rejected)},
          {"workers", std::move(workers)}};
}

}  // namespace shmps::inspect
