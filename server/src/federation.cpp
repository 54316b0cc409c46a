#include "federation.hpp"

#include <unistd.h>
#include <algorithm>

#include <bit>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <string_view>
#include <type_traits>

#include "shmps/kernels/model_passes.hpp"
#include "shmps/kernels/optimizer.hpp"

namespace shmps::server {

namespace {

constexpr uint64_t kHeaderMagic = 0x35444546534d4853ull;  // "SHMSFED5" little-endian
constexpr uint32_t kFlagJoin = 1u << 0;
constexpr uint32_t kFlagLeaving = 1u << 1;
constexpr uint32_t kFlagHasState = 1u << 2;   // the join: this host has an anchor (its round in the header)
constexpr uint32_t kFlagRegroup = 1u << 3;    // a round: this host's engine saw a host waiting to join
constexpr uint32_t kFlagNonFinite = 1u << 4;  // the join: this host's weights, anchor or outer momentum hold NaN or Inf
constexpr uint32_t kKnownFlags = kFlagJoin | kFlagLeaving | kFlagHasState | kFlagRegroup | kFlagNonFinite;

// Ends every refusal of bytes from a peer that no honest server sends.
constexpr const char* kDamaged = " (damaged, or not a shmps-server of this version)";

}  // namespace

// One per member per collective step, gathered before any delta moves.
// Fixed-width fields only: it crosses hosts as bytes (all little-endian).
struct Federator::Header {
  uint64_t magic;
  uint64_t round;  // the round this call completes; the join: the restored round (0: none)
  uint64_t local_updates;
  uint64_t anchor_hash;
  uint64_t nonce;    // the join: this host's random number (the group's id hashes the members'); 0 in a round
  uint64_t lineage;  // this host's lineage (Federator::lineage()), read at the join; 0: unknown
  ModelFingerprint model;
  uint32_t every_ms;  // this host's period (the stop's timeout takes the group's longest)
  uint32_t flags;     // kFlag*
  uint32_t host;      // Membership::host: the join records the group's members by it
  uint32_t reserved;  // 0
};

namespace {

// The names of the options' values, in enum order: one table per enum
// for both directions.
constexpr const char* kFederationKindNames[] = {"none", "mpi", "gloo"};
constexpr const char* kOuterStepNames[] = {"average", "nesterov"};
constexpr const char* kFederationPriorityNames[] = {"normal", "low", "idle"};

template <class E, size_t N>
const char* name_of(E value, const char* const (&names)[N]) noexcept {
  const auto i = static_cast<size_t>(value);
  return i < N ? names[i] : "unknown";
}

template <class E, size_t N>
bool parse_name(std::string_view text, const char* const (&names)[N], E* out) noexcept {
  for (size_t i = 0; i < N; ++i)
    if (text == names[i]) {
      *out = static_cast<E>(i);
      return true;
    }
  return false;
}

}  // namespace

const char* federation_kind_name(FederationKind kind) noexcept { return name_of(kind, kFederationKindNames); }
const char* outer_step_name(OuterStep step) noexcept { return name_of(step, kOuterStepNames); }
bool parse_federation_kind(std::string_view text, FederationKind* out) noexcept {
  return parse_name(text, kFederationKindNames, out);
}
bool parse_outer_step(std::string_view text, OuterStep* out) noexcept { return parse_name(text, kOuterStepNames, out); }
const char* federation_priority_name(FederationPriority priority) noexcept {
  return name_of(priority, kFederationPriorityNames);
}
bool parse_federation_priority(std::string_view text, FederationPriority* out) noexcept {
  return parse_name(text, kFederationPriorityNames, out);
}

bool parse_cpu_list(std::string_view text, std::vector<uint32_t>* out) {
  std::vector<bool> in(kMaxCpus, false);
  const auto number = [](std::string_view digits, uint32_t* n) {
    const char* end = digits.data() + digits.size();
    const auto [ptr, ec] = std::from_chars(digits.data(), end, *n);
    return !digits.empty() && ec == std::errc() && ptr == end && *n < kMaxCpus;
  };
  size_t start = 0;
  while (true) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    const size_t dash = item.find('-');
    uint32_t first = 0, last = 0;
    if (!number(item.substr(0, dash), &first)) return false;
    if (dash == std::string_view::npos) {
      last = first;
    } else if (!number(item.substr(dash + 1), &last) || last < first) {
      return false;
    }
    for (uint32_t c = first; c <= last; ++c) in[c] = true;
    if (comma == text.size()) break;
    start = comma + 1;
  }
  out->clear();
  for (uint32_t c = 0; c < kMaxCpus; ++c)
    if (in[c]) out->push_back(c);
  return true;
}

std::string cpu_list_text(const std::vector<uint32_t>& cpus) {
  std::string text;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!text.empty()) text += ',';
    text += std::to_string(cpus[i]);
    if (j > i) text += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return text;
}

std::string ModelFingerprint::describe() const {
  const char* opt = kernels::optimizer_kind_name(static_cast<kernels::OptimizerKind>(optimizer));
  const auto outer_step = static_cast<OuterStep>(outer & 0xff);
  std::string text = std::to_string(tensors) + " tensors, " + std::to_string(total_elements) +
                     " parameters, optimizer " + (opt != nullptr ? opt : "?") + ", outer " +
                     outer_step_name(outer_step) + ((outer >> 8) != 0 ? " weighted" : " unweighted");
  if (outer_step == OuterStep::kNesterov) {
    char hyper[64];
    std::snprintf(hyper, sizeof hyper, " (lr %g, momentum %g)", std::bit_cast<float>(outer_lr_bits),
                  std::bit_cast<float>(outer_momentum_bits));
    text += hyper;
  }
  return text + " (tensor table hash " + hex64(hash) + ")";
}

uint32_t outer_code(const FederationConfig& config) noexcept {
  return static_cast<uint32_t>(config.outer) | (config.weight_by_updates ? 1u << 8 : 0u);
}

ModelFingerprint model_fingerprint(const ServerConfig& config) {
  // FNV-1a over each tensor's name, a separator and its dimensions.
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&h](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 0x100000001b3ull;
  };
  ModelFingerprint f;
  for (const shm::TensorSpec& t : config.tensors) {
    mix(t.name.data(), t.name.size() + 1);  // the NUL separates the name from the shape
    uint64_t n = 1;
    for (uint64_t d : t.shape) {
      mix(&d, sizeof d);
      n *= d;
    }
    const uint64_t end = ~uint64_t{0};
    mix(&end, sizeof end);
    f.total_elements += n;
  }
  f.hash = h;
  f.tensors = static_cast<uint32_t>(config.tensors.size());
  f.optimizer = static_cast<uint32_t>(config.optimizer.kind);
  f.outer = outer_code(config.federation);
  if (config.federation.outer == OuterStep::kNesterov) {
    f.outer_lr_bits = std::bit_cast<uint32_t>(config.federation.outer_lr);
    f.outer_momentum_bits = std::bit_cast<uint32_t>(config.federation.outer_momentum);
  }
  return f;
}

void apply_rank_in_name(ServerConfig& config, uint32_t rank) {
  if (!config.federation.rank_in_name) return;
  config.name += ".r" + std::to_string(rank);
  if (!config.checkpoint_dir.empty()) config.checkpoint_dir += "/r" + std::to_string(rank);
}

namespace {

// One step of a 64-bit multiply-xorshift mix: w into h.
uint64_t mix64(uint64_t h, uint64_t w) noexcept {
  h = (h ^ w) * 0xff51afd7ed558ccdull;
  return h ^ (h >> 32);
}

// hash_floats() in pieces: add() spans in order, each a multiple of
// kStride elements long but the last, then finish(). Four chains of a
// 64-bit multiply-xorshift mix, each taking every fourth pair of elements,
// run side by side (one chain is serial, about 3 cycles an element);
// finish() folds them into one.
class FloatHash {
 public:
  static constexpr size_t kStride = 8;  // elements: a pair for each chain

  explicit FloatHash(size_t total) noexcept {
    for (size_t k = 0; k < kLanes; ++k) h_[k] = (0x9e3779b97f4a7c15ull * (k + 1)) ^ total;
  }
  void add(const float* p, size_t n) noexcept {
    size_t i = 0;
    for (; i + kStride <= n; i += kStride)
      for (size_t k = 0; k < kLanes; ++k) h_[k] = mix64(h_[k], pair(p + i + 2 * k));
    // The last span's tail: its pairs to the first chains, then the last
    // element of an odd total.
    for (size_t k = 0; i + 2 <= n; i += 2, ++k) h_[k] = mix64(h_[k], pair(p + i));
    if (i < n) {
      uint32_t w;
      std::memcpy(&w, p + i, sizeof w);
      h_[0] = (h_[0] ^ w) * 0xc4ceb9fe1a85ec53ull;
    }
  }
  uint64_t finish() const noexcept {
    uint64_t h = h_[0];
    for (size_t k = 1; k < kLanes; ++k) h = mix64(h, h_[k]);
    h ^= h >> 29;
    return h * 0x94d049bb133111ebull ^ (h >> 32);
  }

 private:
  static constexpr size_t kLanes = 4;
  static uint64_t pair(const float* p) noexcept {
    uint64_t w;
    std::memcpy(&w, p, sizeof w);
    return w;
  }
  uint64_t h_[kLanes];
};

}  // namespace

namespace {

// A seed no other process draws: the system's entropy, and the clock and
// pid besides (a std::random_device that cannot be opened throws).
uint64_t random_seed() noexcept {
  uint64_t seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  seed = mix64(seed, static_cast<uint64_t>(::getpid()));
  try {
    std::random_device device;
    seed = mix64(seed, (uint64_t{device()} << 32) | device());
  } catch (const std::exception&) {
  }
  return seed;
}

}  // namespace

uint64_t hash_floats(std::span<const float> values) noexcept {
  FloatHash h(values.size());
  h.add(values.data(), values.size());
  return h.finish();
}

namespace {

// The optimizers' own vectorized check, for a float span.
bool all_finite(std::span<const float> values) {
  return kernels::all_finite_cpu(values.data(), kernels::GradDtype::kF32, values.size());
}

}  // namespace

Federator::Federator(const FederationConfig& config, FederationEngine& engine, const ModelFingerprint& fingerprint)
    : config_(config),
      engine_(engine),
      fingerprint_(fingerprint),
      anchor_(fingerprint.total_elements),
      payload_(fingerprint.total_elements),
      nonces_(random_seed()) {
  if (config_.outer == OuterStep::kNesterov) {
    momentum_.assign(fingerprint.total_elements, 0.0f);
    momentum_next_.assign(fingerprint.total_elements, 0.0f);
  }
}

Status Federator::check_header(const Header& h, uint32_t rank) {
  const auto refuse = [rank](const std::string& what) {
    return Status{ErrorCode::kInvalidArgument, "federation: host rank " + std::to_string(rank) + " sent " + what};
  };
  if (h.magic != kHeaderMagic)
    return refuse("no shmps round header (magic " + hex64(h.magic) +
                  "): is every rank a shmps-server of the same version?");
  // Bits this build gives no meaning (a newer build's, or damage): what
  // they would ask of this host is unknown.
  if ((h.flags & ~kKnownFlags) != 0 || h.reserved != 0)
    return refuse("a round header this build does not know (flags " + hex64(h.flags) + ", reserved word " +
                  std::to_string(h.reserved) + "): is every rank a shmps-server of the same version?");
  // A round is a count that no checkpoint holds past kMaxCheckpointVersion:
  // taken at the join, it would be written where a restart refuses it, or
  // wrap.
  if (h.round >= kMaxCheckpointVersion)
    return refuse("round " + std::to_string(h.round) + ", past any a checkpoint holds" + kDamaged);
  // Local updates are counted in versions (below kMaxCheckpointVersion);
  // a round sums the members' counts, which this bound keeps from
  // wrapping (a wrap to 0 would take the path of a round nobody trained).
  if (h.local_updates > kMaxCheckpointVersion / kMaxFederationHosts)
    return refuse(std::to_string(h.local_updates) + " local updates, more than a round can sum" + kDamaged);
  // A period no --fed-every-ms has: the join takes the group's longest,
  // which each round's first collective and a stop wait for beyond their
  // timeouts (FederationEngine::set_group_period_ms()).
  if (h.every_ms == 0 || h.every_ms > kMaxFederationEveryMs)
    return refuse("a round period of " + std::to_string(h.every_ms) + " ms, outside 1.." +
                  std::to_string(kMaxFederationEveryMs) + kDamaged);
  return Status::Ok();
}

Status Federator::gather_headers(uint64_t local_updates, bool leaving, std::vector<Header>* all, bool non_finite) {
  static_assert(sizeof(Header) == kHeaderBytes && std::is_trivially_copyable_v<Header>);
  const Membership m = engine_.membership();
  Header mine{};
  mine.magic = kHeaderMagic;
  mine.round = joined_ ? round_ + 1 : round_;
  mine.local_updates = local_updates;
  mine.anchor_hash = anchor_hash_;
  mine.model = fingerprint_;
  mine.every_ms = config_.every_ms;
  mine.nonce = joined_ ? 0 : nonces_();
  mine.lineage = lineage_;
  mine.host = m.host;
  mine.flags = (joined_ ? 0 : kFlagJoin) | (leaving ? kFlagLeaving : 0) | (!joined_ && has_state_ ? kFlagHasState : 0) |
               (joined_ && !leaving && engine_.joiner_waiting() ? kFlagRegroup : 0) | (non_finite ? kFlagNonFinite : 0);
  all->assign(m.size, Header{});
  if (Status s = engine_.allgather(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(*all)));
      !s.ok())
    return s;
  // What each header holds by itself first, over all of them, then how
  // they compare with this host's: every member meets a damaged header in
  // the first loop and refuses it alike, whatever the comparisons would say.
  // Headers this build cannot read (a newer build's bits, damage): the
  // members whose headers it reads, when they are a strict majority and
  // this host one of them (its header as the others got it), leave the
  // others out (kIo: an elastic group
  // re-forms without them), as for a model mismatch; without a majority,
  // or over a static engine, every member ends.
  Status first_refused = Status::Ok();
  uint32_t readable = 0;
  for (uint32_t r = 0; r < m.size; ++r) {
    Status s = check_header((*all)[r], r);
    if (s.ok())
      ++readable;
    else if (first_refused.ok())
      first_refused = std::move(s);
  }
  if (!first_refused.ok()) {
    const bool kept = 2 * readable > m.size && check_header((*all)[m.rank], m.rank).ok() && engine_.elastic();
    const std::string count = std::to_string(m.size - readable) + " of " + std::to_string(m.size) + " hosts";
    return {kept ? ErrorCode::kIo : ErrorCode::kInvalidArgument,
            first_refused.message() +
                (kept ? "; leaving out the " + count + " whose headers this build cannot read, as the majority"
                 : 2 * readable > m.size ? std::string()
                                         : " (" + count + " sent such headers: no majority reads the others)")};
  }
  for (uint32_t r = 0; r < m.size; ++r) {
    const Header& h = (*all)[r];
    if (h.model != fingerprint_) {
      // The hosts outside a strict majority of one model end their
      // federation (a configuration to fix); the majority leaves them out
      // (kIo: an elastic group re-forms without them). Without a majority,
      // nobody can tell which is wrong: every host ends.
      uint32_t largest = 0;
      for (const Header& a : *all) {
        uint32_t n = 0;
        for (const Header& b : *all) n += b.model == a.model ? 1 : 0;
        largest = std::max(largest, n);
      }
      uint32_t same = 0;
      for (const Header& other : *all) same += other.model == fingerprint_ ? 1 : 0;
      const bool kept = 2 * same > m.size && engine_.elastic();
      const bool majority = 2 * largest > m.size;
      return {kept ? ErrorCode::kIo : ErrorCode::kInvalidArgument,
              "federation: host rank " + std::to_string(r) + " serves another model: " + h.model.describe() +
                  "; this host (rank " + std::to_string(m.rank) + ") serves " + fingerprint_.describe() +
                  (kept ? std::string("; leaving it out, as the majority")
                        : std::string("; start every host with the same --tensor, --optimizer and --fed-outer "
                                      "options") +
                              (majority ? "" : " (no model has a majority of the hosts)"))};
    }
    // At the join the members' restored rounds may differ (join() settles them).
    if ((h.flags & kFlagJoin) != (mine.flags & kFlagJoin) || (!(mine.flags & kFlagJoin) && h.round != mine.round))
      return {ErrorCode::kInvalidArgument, "federation: host rank " + std::to_string(r) + " is at round " +
                                               std::to_string(h.round) + ", this host (rank " + std::to_string(m.rank) +
                                               ") at " + std::to_string(mine.round)};
  }
  return Status::Ok();
}

Status Federator::restore(FederationState state, std::vector<float> weights) {
  if (joined_) return {ErrorCode::kInternal, "federation: restore() after join()"};
  // A checkpoint written between an earlier restore and a join: the
  // updates since that restore are in no round either.
  if (!state.restore_base.empty()) weights = std::move(state.restore_base);
  if (state.anchor.size() != anchor_.size() || (!state.momentum.empty() && state.momentum.size() != anchor_.size()) ||
      (!weights.empty() && weights.size() != anchor_.size()))
    return {ErrorCode::kInvalidArgument, "federation: the checkpoint's anchor does not fit this model"};
  if (!state.history.plausible(state.round))
    return {ErrorCode::kInvalidArgument,
            "federation: the checkpoint's record of groups does not fit its round " + std::to_string(state.round)};
  round_ = state.round;
  history_ = state.history;
  lineage_ = state.lineage;
  host_ = state.host;
  forget_failed_round();
  restored_ = true;
  restored_weights_ = std::move(weights);
  anchor_ = std::move(state.anchor);
  anchor_hash_ = hash_floats(anchor_);
  // A momentum only for the Nesterov outer step; one stored by another
  // outer step (none) starts afresh.
  if (!momentum_.empty()) {
    momentum_started_ = state.momentum_started && !state.momentum.empty();
    if (momentum_started_) momentum_ = std::move(state.momentum);
  }
  has_state_ = true;
  return Status::Ok();
}

std::optional<FederationState> Federator::state() const {
  if (!has_state_) return std::nullopt;
  FederationState s;
  s.round = round_;
  s.anchor = anchor_;
  s.momentum = momentum_;
  s.momentum_started = momentum_started_;
  s.history = history_;
  s.lineage = lineage_;
  s.host = host_;
  if (restored_) s.restore_base = restored_weights_;
  return s;
}

Result<uint64_t> Federator::receive_state(uint32_t root, bool with_momentum, RoundGroups* history,
                                          uint64_t history_round) {
  // Into scratch first: a broadcast that fails halfway (a host gone) must
  // leave this host's anchor and momentum as they were.
  std::vector<float>& anchor_in = payload_;
  if (engine_.membership().rank == root) std::copy(anchor_.begin(), anchor_.end(), anchor_in.begin());
  if (Status s = engine_.broadcast(std::as_writable_bytes(std::span(anchor_in)), root); !s.ok()) return s;
  uint64_t sent = anchor_in.size() * sizeof(float);
  if (history != nullptr) {
    *history = history_;
    if (Status s = engine_.broadcast(std::as_writable_bytes(std::span(history, 1)), root); !s.ok()) return s;
    sent += sizeof *history;
    // Bytes from a peer: every member checks the same ones (the root its
    // own copy too), so all of them stop here together.
    if (!history->plausible(history_round))
      return Status{ErrorCode::kInvalidArgument,
                    "federation: the record of groups that host rank " + std::to_string(root) +
                        " (the join's source) sent does not fit its round " + std::to_string(history_round) + kDamaged};
  }
  uint32_t started = momentum_started_ ? 1 : 0;
  std::vector<float> momentum_in;
  if (with_momentum && !momentum_.empty()) {
    momentum_in = momentum_;
    if (Status s = engine_.broadcast(std::as_writable_bytes(std::span(&started, 1)), root); !s.ok()) return s;
    if (Status s = engine_.broadcast(std::as_writable_bytes(std::span(momentum_in)), root); !s.ok()) return s;
    sent += sizeof started + momentum_in.size() * sizeof(float);
  }
  // Bytes from a peer again, checked by every member alike: a root's own
  // anchor and momentum are finite (its header says so, or it stays out),
  // so NaN or Inf here is damage, which would become every host's anchor.
  if (!all_finite(anchor_in) || !all_finite(momentum_in))
    return Status{ErrorCode::kInvalidArgument, "federation: the anchor or outer momentum that host rank " +
                                                   std::to_string(root) + " sent holds NaN or Inf" + kDamaged};
  // Every collective went through: commit.
  if (!momentum_in.empty()) {
    momentum_.swap(momentum_in);
    momentum_started_ = started != 0;
  }
  return engine_.membership().rank == root ? sent : 0;  // what this host sent
}

Result<RoundResult> Federator::join(std::span<float> exchange) {
  // Weights, or a restored anchor or outer momentum, that hold NaN or Inf
  // would become every host's (a fresh group's anchor is rank 0's weights,
  // a resumed one the source's anchor and momentum, and a NaN momentum
  // makes the next outer step's anchor NaN): such a host says so in its
  // header and stays out, as a round's check makes it leave.
  const bool non_finite = !all_finite(exchange) || (has_state_ && (!all_finite(anchor_) || !all_finite(momentum_)));
  std::vector<Header> all;
  if (Status s = gather_headers(0, false, &all, non_finite); !s.ok()) return s;
  if (Status s = refuse_non_finite(all); !s.ok()) return s;
  uint64_t lineage = 0;
  if (Status s = settle_lineage(all, &lineage); !s.ok()) return s;
  const Membership m = engine_.membership();
  uint64_t members = 0;
  if (Status s = group_members(all, &members); !s.ok()) return s;
  RoundResult r;
  r.members = m.size;
  uint32_t group_every_ms = 0;
  // A state the source may be: of the group's lineage where one is known
  // (a state of unknown lineage, an older checkpoint, rebases onto it,
  // never replaces it).
  const auto candidate = [&](const Header& h) {
    return (h.flags & kFlagHasState) != 0 && (lineage == 0 || h.lineage == lineage);
  };
  // The members holding the same state as `h`: its round and anchor.
  const auto holders = [&](const Header& h) {
    return static_cast<uint32_t>(std::count_if(all.begin(), all.end(), [&](const Header& o) {
      return candidate(o) && o.round == h.round && o.anchor_hash == h.anchor_hash;
    }));
  };
  for (uint32_t k = 0; k < all.size(); ++k) {
    group_every_ms = std::max(group_every_ms, all[k].every_ms);
    if (!candidate(all[k])) continue;
    // The newest anchor the group agreed on: it holds every merged round.
    // Two anchors of one lineage at one round are a fork (a round that
    // completed at some members only, whose others completed a round of
    // that number without them): the one more members hold wins, the
    // lowest rank among equals.
    const Header* source = r.resumed ? &all[r.source_rank] : nullptr;
    if (source == nullptr || all[k].round > source->round ||
        (all[k].round == source->round && all[k].anchor_hash != source->anchor_hash &&
         holders(all[k]) > holders(*source))) {
      r.source_rank = k;
      r.resumed = true;
    }
  }
  if (r.resumed) {
    const Header& source = all[r.source_rank];
    for (uint32_t k = 0; k < all.size(); ++k) {
      if (!candidate(all[k]) || all[k].round != source.round || all[k].anchor_hash == source.anchor_hash) continue;
      if (!r.fork) r.fork_rank = k;
      r.fork = true;
      ++r.fork_others;
    }
    if (r.fork) {
      r.fork_holders = holders(source);
      r.fork_lost =
          candidate(all[m.rank]) && all[m.rank].round == source.round && all[m.rank].anchor_hash != source.anchor_hash;
    }
  }
  // A fresh group takes rank 0's weights as its anchor.
  if (!r.resumed && m.rank == 0) std::copy(exchange.begin(), exchange.end(), anchor_.begin());
  // This group's id: every member's nonce, in rank order.
  uint64_t group = 0x2545f4914f6cdd1dull ^ all.size();
  for (const Header& h : all) group = mix64(group, h.nonce);
  const uint64_t group_round = r.resumed ? all[r.source_rank].round : 0;
  RoundGroups history;  // the source's: which group completed the rounds its anchor holds
  Result<uint64_t> sent = receive_state(r.source_rank, r.resumed, r.resumed ? &history : nullptr, group_round);
  if (!sent.ok()) return sent.status();
  const std::vector<float>& incoming = payload_;  // the group's anchor (receive_state())
  // A checkpoint older than the group's round: its drift went into the
  // rounds after it if this host was a member of one of them (W = A then,
  // as for a host without an anchor), and into none if the source's record
  // shows every one of them completed by groups without it (the drift is
  // rebased as a live host's is). When neither can be shown (the record
  // does not reach back, its members are unknown, a state of no known
  // lineage, a checkpoint written under another host id or none) it is
  // dropped: keeping drift that a round merged would count it twice.
  if (r.resumed && has_state_ && restored_ && round_ < group_round) {
    r.restored_round = round_;
    const RoundGroups::Presence presence = lineage_ != 0 && lineage_ == lineage && host_ == m.host
                                               ? history.presence(m.host, round_, group_round)
                                               : RoundGroups::Presence::kUnknown;
    // Without the members: round k + 1 in the checkpoint's own group of
    // round k (history_: the checkpoint's record still) shows this host in it.
    const uint64_t own_group = history_.group_of(round_);
    const bool next_in_own_group = own_group != 0 && history.holds(round_ + 1, own_group);
    r.restored_drift_merged = presence == RoundGroups::Presence::kMember ||
                              (presence == RoundGroups::Presence::kUnknown && next_in_own_group);
    r.restored_drift_rebased = presence == RoundGroups::Presence::kAbsent;
    r.restored_drift_dropped = !r.restored_drift_rebased;
  }
  // This host keeps its drift W - own anchor (rebased onto the group's)
  // when it has an anchor whose drift no round merged: one it holds live
  // (a member of a group that changed, or one left behind by it), one
  // restored at the group's round, or an older one that no round since
  // merged (above).
  r.drift_kept = r.resumed && has_state_ && (!restored_ || round_ == group_round || r.restored_drift_rebased);
  // A restored host that does not keep its drift keeps what it applied
  // since the restart, W - W_ckpt: no round merged it.
  r.restart_updates_kept = r.resumed && restored_ && !r.drift_kept && !restored_weights_.empty();
  // A restored state whose drift is not kept for another reason than its
  // age (of no known lineage, it is not the source of a group at a lower
  // round): dropped all the same, and said so.
  if (r.resumed && has_state_ && restored_ && !r.drift_kept && !r.restored_drift_dropped) {
    r.restored_round = round_;
    r.restored_drift_dropped = true;
  }
  // A round this host saw fail that the source completed in the same
  // group holds this host's delta S - A of its snapshot S (an allreduce
  // that completed anywhere summed every member's): only the drift since
  // that snapshot is kept, W + (A' - S). A group still behind that round
  // cannot have merged it: the snapshot is kept for a later join, rebased
  // onto this group's anchor as the drift is.
  r.failed_round_merged = r.drift_kept && failed_.round != 0 && history.holds(failed_.round, failed_.group);
  if (r.failed_round_merged) r.failed_round_updates = failed_.updates;
  const bool keep_failed = r.drift_kept && failed_.round != 0 && group_round < failed_.round;
  // What W keeps besides the group's anchor, W - base (none: W = A).
  const std::vector<float>* base = r.failed_round_merged    ? &failed_.snapshot
                                   : r.restart_updates_kept ? &restored_weights_
                                   : r.drift_kept           ? &anchor_
                                                            : nullptr;
  for (size_t i = 0; i < exchange.size(); ++i) {
    if (keep_failed) failed_.snapshot[i] += incoming[i] - anchor_[i];
    exchange[i] = incoming[i] - (base != nullptr ? (*base)[i] : exchange[i]);
  }
  std::copy(incoming.begin(), incoming.end(), anchor_.begin());
  round_ = group_round;
  if (!r.resumed) round_ = 0;
  history_ = history;
  if (!keep_failed) forget_failed_round();
  anchor_hash_ = hash_floats(anchor_);
  group_every_ms_ = group_every_ms;
  group_ = group;
  members_ = members;
  lineage_ = lineage != 0 ? lineage : group;  // a fresh group's, or one resumed from states of none known
  joined_ = has_state_ = true;
  host_ = m.host;
  restored_ = false;
  std::vector<float>().swap(restored_weights_);  // the memory goes too
  r.round = round_;
  r.bytes = kHeaderBytes + *sent;
  return r;
}

Status Federator::group_members(const std::vector<Header>& all, uint64_t* members) const {
  *members = 0;
  for (uint32_t k = 0; k < all.size(); ++k) {
    for (uint32_t q = 0; q < k; ++q)
      if (all[q].host == all[k].host)
        return {ErrorCode::kInvalidArgument, "federation: host ranks " + std::to_string(q) + " and " +
                                                 std::to_string(k) + " both say they are host " +
                                                 std::to_string(all[k].host) + ": the group's members are unknown"};
    *members |= RoundGroups::member_bit(all[k].host);
  }
  return Status::Ok();
}

Status Federator::refuse_non_finite(const std::vector<Header>& all) const {
  const auto it = std::find_if(all.begin(), all.end(), [](const Header& h) { return (h.flags & kFlagNonFinite) != 0; });
  if (it == all.end()) return Status::Ok();
  const auto rank = static_cast<uint32_t>(it - all.begin());
  const Membership m = engine_.membership();
  if ((all[m.rank].flags & kFlagNonFinite) != 0)
    return {
        ErrorCode::kInvalidArgument,
        "federation: this host's weights (or the anchor or outer momentum it restored) hold NaN or Inf (an "
        "update that overflowed, --allow-nonfinite, or a checkpoint that holds them): not joining, rather than sending "
        "them to every host"};
  const std::string text = "federation: host rank " + std::to_string(rank) +
                           "'s weights (or the anchor or outer momentum it restored) hold NaN or Inf";
  return engine_.elastic() ? Status{ErrorCode::kIo, text + "; leaving it out"}
                           : Status{ErrorCode::kInvalidArgument,
                                    text + "; " + engine_.name() + " cannot re-form the group without it"};
}

Status Federator::settle_lineage(const std::vector<Header>& all, uint64_t* lineage) const {
  const auto known = [](const Header& h) { return (h.flags & kFlagHasState) != 0 && h.lineage != 0; };
  // Each lineage's members (in rank order), their highest round.
  struct Held {
    uint64_t lineage = 0;
    uint64_t round = 0;
    std::vector<uint32_t> ranks;
  };
  std::vector<Held> held;
  uint32_t holders = 0;
  for (uint32_t k = 0; k < all.size(); ++k) {
    if (!known(all[k])) continue;
    ++holders;
    auto it = std::find_if(held.begin(), held.end(), [&](const Held& h) { return h.lineage == all[k].lineage; });
    if (it == held.end()) it = held.insert(held.end(), Held{all[k].lineage, 0, {}});
    it->round = std::max(it->round, all[k].round);
    it->ranks.push_back(k);
  }
  *lineage = held.empty() ? 0 : held[0].lineage;
  if (held.size() <= 1) return Status::Ok();
  // Unrelated histories: the source's anchor would replace the others',
  // and with it every round merged into them. The members outside a
  // strict majority of the states end their federation (their weights
  // stay as they are); the majority leaves them out where the engine can
  // re-form (kIo), as for a model mismatch. Without a majority every
  // member with a state ends (those without re-form where the engine
  // can); over a static engine every member ends.
  const auto largest = std::max_element(held.begin(), held.end(),
                                        [](const Held& a, const Held& b) { return a.ranks.size() < b.ranks.size(); });
  const bool majority = 2 * largest->ranks.size() > holders;
  const Membership m = engine_.membership();
  const bool outside = known(all[m.rank]) && (!majority || all[m.rank].lineage != largest->lineage);
  // A member without a known lineage may re-form with any, or with none.
  const bool kept = !outside && engine_.elastic();
  std::string text =
      "federation: the hosts' anchors belong to unrelated lineages (hosts of a job restarted "
      "without their checkpoints, or a checkpoint of another job):";
  for (const Held& h : held) {
    text += " lineage " + hex64(h.lineage) + " at round " + std::to_string(h.round) + " (rank";
    for (const uint32_t k : h.ranks) text += " " + std::to_string(k);
    text += ")";
  }
  text += "; this host is rank " + std::to_string(m.rank);
  if (kept) {
    text += majority ? "; leaving out the hosts outside lineage " + hex64(largest->lineage) + ", the majority"
                     : std::string("; leaving them out (no lineage has a majority of them)");
  } else if (outside && majority) {
    text += ", outside the majority: joining it would replace this host's anchor and the rounds merged into it. " +
            std::string(
                "The weights stay as they are; to join the others, restart this host without its federation "
                "state (an empty --checkpoint-dir)");
  } else {
    text += majority ? std::string("; restart the hosts outside lineage ") + hex64(largest->lineage) +
                           " without their federation state (an empty --checkpoint-dir)"
                     : std::string(
                           "; no lineage has a majority of them: every host ends its federation; restart "
                           "all but one lineage's hosts without their federation state (an empty "
                           "--checkpoint-dir)");
  }
  return {kept ? ErrorCode::kIo : ErrorCode::kInvalidArgument, text};
}

uint64_t Federator::round_group() const noexcept { return mix64(group_, engine_.membership().epoch); }

void Federator::keep_failed_round(std::span<const float> snapshot, uint64_t local_updates) noexcept {
  try {
    failed_.snapshot.assign(snapshot.begin(), snapshot.end());
  } catch (const std::bad_alloc&) {
    forget_failed_round();  // without the memory: as if nobody had completed it
    return;
  }
  failed_.round = round_ + 1;
  failed_.group = round_group();
  failed_.updates = local_updates;
}

Result<uint64_t> Federator::repair_anchor() {
  Result<uint64_t> sent = receive_state(0, /*with_momentum=*/true);
  if (!sent.ok()) return sent;
  std::copy(payload_.begin(), payload_.end(), anchor_.begin());
  anchor_hash_ = hash_floats(anchor_);
  return sent;
}

Result<RoundResult> Federator::round(std::span<float> exchange, uint64_t local_updates) {
  if (!joined_) return Status{ErrorCode::kInternal, "federation: round() before join()"};
  std::vector<Header> all;
  // Weights that hold NaN or Inf (--allow-nonfinite, or updates that
  // overflowed) would make every host's the same through the mean delta:
  // this host leaves instead (the others see it go, as at a stop), and
  // serves its workers alone.
  if (!all_finite(exchange)) {
    static_cast<void>(gather_headers(0, /*leaving=*/true, &all));
    return Status{ErrorCode::kInvalidArgument,
                  "federation: this host's weights hold NaN or Inf (an update that overflowed, or "
                  "--allow-nonfinite); leaving the federation rather than sending them to every host"};
  }
  if (Status s = gather_headers(local_updates, false, &all); !s.ok()) return s;
  RoundResult r;
  r.members = static_cast<uint32_t>(all.size());
  r.bytes = kHeaderBytes;
  for (uint32_t k = 0; k < all.size(); ++k) {
    r.updates_total += all[k].local_updates;
    if ((all[k].flags & kFlagLeaving) != 0 && !r.peer_left) {
      r.peer_left = true;
      r.left_rank = k;
    }
    r.regroup |= (all[k].flags & kFlagRegroup) != 0;
  }
  if (r.peer_left || r.regroup) {
    std::fill(exchange.begin(), exchange.end(), 0.0f);
    return r;
  }
  const bool anchors_equal =
      std::all_of(all.begin(), all.end(), [&](const Header& h) { return h.anchor_hash == all[0].anchor_hash; });
  if (!anchors_equal) {
    Result<uint64_t> sent = repair_anchor();
    if (!sent.ok()) return sent.status();
    r.anchors_repaired = true;
    r.bytes += *sent;
  }
  if (r.updates_total == 0) {
    // Nobody trained: the anchor (its hash) and the outer momentum stay;
    // the correction only takes W back to A (the merge's rounding).
    for (size_t i = 0; i < exchange.size(); ++i) exchange[i] = anchor_[i] - exchange[i];
  } else {
    // The divisor: updates of all hosts (weighted), or the member count.
    // A division, not a product with a rounded 1/n: (n d) / n is d exactly
    // when n d is exact.
    const float divisor = static_cast<float>(config_.weight_by_updates ? r.updates_total : r.members);
    const float w = config_.weight_by_updates ? static_cast<float>(local_updates) : 1.0f;
    kernels::weighted_difference_cpu(payload_.data(), exchange.data(), anchor_.data(), w, exchange.size());
    if (Status s = engine_.allreduce_sum(payload_); !s.ok()) {
      // Other members may have completed it (a host that died at its very
      // end): the join after compares, and needs S to tell which drift
      // they merged. Only an elastic engine joins again.
      if (engine_.elastic()) {
        keep_failed_round(exchange, local_updates);
      } else {
        forget_failed_round();
      }
      return s;
    }
    r.bytes += payload_.size() * sizeof(float);
    // Every member's delta was finite, so a step that is not (NaN or Inf
    // in the sum: a damaged peer; or finite values that overflowed) is
    // refused by every member alike: the engine gives each the same sum.
    if (!outer_step(exchange, divisor)) {
      forget_failed_round();
      return Status{
          ErrorCode::kInvalidArgument,
          "federation: round " + std::to_string(round_ + 1) +
              ": the outer step on the hosts' summed deltas gives NaN or Inf (a damaged host, or "
              "values past the float range); the step changes nothing: this host's weights, round, anchor and "
              "momentum are kept"};
    }
  }
  ++round_;
  history_.completed(round_, round_group(), members_);
  forget_failed_round();
  r.round = round_;
  return r;
}

bool Federator::outer_step(std::span<float> exchange, float divisor) {
  // One pass over the model: the mean delta, the step, the correction, and
  // the new anchor's hash a block behind (while the block is in cache).
  constexpr size_t kBlock = 4096;
  static_assert(kBlock % FloatHash::kStride == 0);
  const size_t n = anchor_.size();
  FloatHash hash(n);
  const bool nesterov = config_.outer == OuterStep::kNesterov;
  const kernels::NesterovStep step{config_.outer_lr, config_.outer_momentum, momentum_started_};
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t len = std::min(n, base + kBlock) - base;
    const bool finite = nesterov
                            ? kernels::nesterov_step_cpu(&anchor_[base], &momentum_[base], &payload_[base], divisor,
                                                         step, &momentum_next_[base], &exchange[base], len)
                            : kernels::average_step_cpu(&anchor_[base], &payload_[base], divisor, &exchange[base], len);
    if (!finite) return false;
    hash.add(payload_.data() + base, len);
  }
  anchor_.swap(payload_);  // payload_ is scratch until the next round's delta
  if (nesterov) {
    momentum_.swap(momentum_next_);
    momentum_started_ = true;
  }
  anchor_hash_ = hash.finish();
  return true;
}

Status Federator::leave() {
  if (!joined_) return Status::Ok();
  std::vector<Header> all;
  return gather_headers(0, true, &all);
}

}  // namespace shmps::server
