// libFuzzer target: what a federated server's Federator receives from its
// peers (a buggy, dying or hostile host). One Federator (this host, at some
// rank of a group of 2 or 3) is driven as FederationLink drives it: an
// optional restore(), the join (after a reform() where the engine is
// elastic), rounds with local training between them, a join again after a
// kIo failure or a regroup of an elastic engine, and a leave() at the end.
// Its engine is the harness's, single-threaded: allgather puts this host's
// header at its rank and the other members' from the input; a broadcast
// rooted elsewhere fills the buffer from the input (the anchor, the record
// of groups, the momentum's flag and the momentum); allreduce_sum adds
// input-derived contributions or fails before or after the sum; reform()
// forms, fails, pauses or refuses as the input says, and may move this host
// to another rank and group size. Checked (a violation traps): no fault or
// UB (ASan+UBSan), no allocation sized from peer bytes (-rss_limit_mb), no
// hang; the engine is called with the sizes its contract gives; and after
// every call the Federator's state is one a checkpoint holds and restore()
// takes back (sizes, a record of groups that fits the round, the round
// below kMaxCheckpointVersion, the anchor's hash), a failed join leaves the
// state unchanged, a failed round leaves the round and the anchor (but for
// a repair from rank 0), a round moves the round by one (none when a peer
// left or asked to regroup, with a zero exchange), a join takes the
// source's round, the anchor it broadcast and a group period some
// --fed-every-ms can be, and weights holding NaN or Inf are never sent
// (the join and the round refuse them), nor taken in: a call that
// received NaN or Inf from a peer (a broadcast anchor or momentum, a sum)
// fails, and after every call that went through the anchor and momentum
// are finite (an outer step that overflows on finite values is refused).
//
// Input: 2 config bytes, then five streams, each a u16 little-endian
// length and its bytes (a stream, and the input, read past their end as
// zeros: a zero byte is the honest choice everywhere):
//   config[0]: bit 0 three members (else two); bits 1-2 this host's rank
//              (mod size); bit 3 Nesterov outer step; bit 4 unweighted
//              mean; bit 5 elastic engine; bit 6 restore a state first
//   config[1]: the initial weights' seed
//   host:      with config bit 6 the restore record (restore_record()),
//              then one op byte per step (a join or a round; at most 12,
//              and none after the stream's end but the first): bits 0-2
//              local updates before the round, bits 3-5 their seed (all
//              three set: a host waits to join, as the engine sees it),
//              bit 6 a NaN in the weights, bit 7 leave instead of the round
//   gather:    per allgather an action byte (bit 0: fail), then for each
//              other member a u16 damage mask and 104 header bytes (the
//              fields whose mask bit is clear are fixed up: Damage)
//   broadcast: per broadcast an action byte (bit 0: fail; rooted
//              elsewhere, bits 1-2 how the data is filled: Fill), then
//              that fill's bytes
//   reduce:    per allreduce an action byte (bit 0: fail before, bit 1:
//              fail after the sum; bits 2-3 how the others' data is made:
//              Fill), then that fill's bytes for each other member
//   reform:    per reform() an action byte (bits 0-1: formed, failed,
//              paused, refused; bit 2: a new size, bit 3 three members;
//              bits 4-7: the new rank, mod size)
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "federation.hpp"
#include "reader.hpp"

namespace {

using namespace shmps;
using namespace shmps::server;
using fuzz::Reader;

constexpr size_t kN = 11;  // the model's elements: 44 bytes, unlike the record (256) and the flag (4)
constexpr int kMaxSteps = 12;
constexpr int kMaxReforms = 3;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_federation: %s\n", what);
  __builtin_trap();
}

// Federator::Header as federation.cpp lays it out (104 bytes, the fields
// at these offsets) and its flags: the harness fixes peers' headers up
// field by field. A change there only costs coverage here (peers refused).
struct PeerHeader {
  uint64_t magic, round, local_updates, anchor_hash, nonce, lineage;
  ModelFingerprint model;
  uint32_t every_ms, flags, host, reserved;
};
static_assert(sizeof(PeerHeader) == Federator::kHeaderBytes);
constexpr uint32_t kFlagJoin = 1u << 0, kFlagLeaving = 1u << 1, kFlagHasState = 1u << 2, kFlagRegroup = 1u << 3,
                   kFlagNonFinite = 1u << 4;

// A peer header's fields taken from the input as they are (mask bit set)
// rather than fixed up to what an honest member of the group sends.
enum Damage : uint16_t {
  kRawMagic = 1 << 0,
  kRawModel = 1 << 1,
  kRawFlags = 1 << 2,  // fixed up: the join bit as this host's, the others that fit the call from the input
  kRawReserved = 1 << 3,
  kRawRound = 1 << 4,  // fixed up: this host's round in a round; at the join 0 without a state, else small
  kRawHost = 1 << 5,   // fixed up: an id no other member has
  kRawLineage = 1 << 6,
  kRawAnchorHash = 1 << 7,
  kRawUpdates = 1 << 8,  // fixed up: below 16
  kRawEveryMs = 1 << 9,
};

// How a broadcast rooted elsewhere, or the others' part of an allreduce,
// is made. kHonest: one input byte per element, a small finite value (the
// record of groups: honest_record(); the flag: a byte's bit 0);
// kRawBytes: the data's bytes from the input; kOneNonFinite: honest, then
// one element NaN or Inf (the record: one span's 32 bytes from the input);
// kUntouched: the buffer unchanged.
enum Fill : uint8_t { kHonest = 0, kRawBytes = 1, kOneNonFinite = 2, kUntouched = 3 };

float small(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)) / 8.0f; }

bool finite(std::span<const float> v) {
  for (const float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

bool same_state(const std::optional<FederationState>& a, const std::optional<FederationState>& b) {
  if (a.has_value() != b.has_value()) return false;
  if (!a) return true;
  return a->round == b->round && a->momentum_started == b->momentum_started && same_bits(a->anchor, b->anchor) &&
         same_bits(a->momentum, b->momentum) && a->unmerged_updates == b->unmerged_updates &&
         a->history == b->history && a->lineage == b->lineage && a->host == b->host &&
         same_bits(a->restore_base, b->restore_base) && a->restore_base_updates == b->restore_base_updates;
}

// federation.cpp's mix64 and a join's group id (every member's nonce, in
// rank order), so that honest records can name this host's groups.
uint64_t mix64(uint64_t h, uint64_t w) {
  h = (h ^ w) * 0xff51afd7ed558ccdull;
  return h ^ (h >> 32);
}

class Engine final : public FederationEngine {
 public:
  Engine(uint32_t size, uint32_t rank, bool elastic, Reader gather, Reader broadcast, Reader reduce, Reader reform)
      : size_(size),
        rank_(rank),
        host_(rank),
        elastic_(elastic),
        gather_(gather),
        bcast_(broadcast),
        reduce_(reduce),
        reform_(reform) {}

  const char* name() const noexcept override { return "fuzz"; }
  Membership membership() const noexcept override { return {epoch_, rank_, size_, host_}; }
  bool elastic() const noexcept override { return elastic_; }
  bool joiner_waiting() override { return joiner; }

  Status allgather(std::span<const std::byte> mine, std::span<std::byte> all) override {
    if (mine.size() != sizeof(PeerHeader) || all.size() != size_ * mine.size()) fail("allgather: sizes");
    PeerHeader own;
    std::memcpy(&own, mine.data(), sizeof own);
    if ((gather_.byte() & 1) != 0) return io("allgather");
    const bool join = (own.flags & kFlagJoin) != 0;
    gathered.assign(size_, own);
    uint32_t next_host = 0;
    for (uint32_t r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto damage = gather_.value<uint16_t>();
      PeerHeader h = gather_.value<PeerHeader>();
      if (!(damage & kRawMagic)) h.magic = own.magic;
      if (!(damage & kRawModel)) h.model = own.model;
      if (!(damage & kRawFlags))
        h.flags =
            (own.flags & kFlagJoin) | (h.flags & (join ? kFlagHasState | kFlagNonFinite : kFlagLeaving | kFlagRegroup));
      if (!(damage & kRawReserved)) h.reserved = 0;
      if (!(damage & kRawRound))
        h.round = !join ? own.round : (h.flags & kFlagHasState) == 0 ? 0 : own.round + h.round % 4;
      if (!(damage & kRawHost)) {
        if (next_host == host_) ++next_host;
        h.host = next_host++;
      }
      if (!(damage & kRawLineage)) h.lineage = (h.flags & kFlagHasState) != 0 || !join ? own.lineage : 0;
      if (!(damage & kRawAnchorHash)) h.anchor_hash = own.anchor_hash;
      if (!(damage & kRawUpdates)) h.local_updates %= 16;
      if (!(damage & kRawEveryMs)) h.every_ms = own.every_ms;
      gathered[r] = h;
    }
    std::memcpy(all.data(), gathered.data(), all.size());
    if (join) {
      // The id this join's rounds are recorded under (Federator's
      // round_group(): its members' nonces in rank order, and the epoch),
      // and the round a source would bring (the highest of the members
      // with a state).
      uint64_t group = 0x2545f4914f6cdd1dull ^ size_;
      for (const PeerHeader& h : gathered) group = mix64(group, h.nonce);
      previous_round_group_ = round_group_;
      round_group_ = mix64(group, epoch_);
      join_round = 0;
      for (const PeerHeader& h : gathered)
        if ((h.flags & kFlagHasState) != 0 && h.round > join_round) join_round = h.round;
    }
    return Status::Ok();
  }

  Status broadcast(std::span<std::byte> data, uint32_t root) override {
    const bool floats = data.size() == kN * sizeof(float), record = data.size() == sizeof(RoundGroups),
               flag = data.size() == sizeof(uint32_t);
    if (root >= size_ || !(floats || record || flag)) fail("broadcast: root or size");
    const uint8_t action = bcast_.byte();
    if ((action & 1) != 0) return io("broadcast");
    if (root != rank_) fill_broadcast(data, static_cast<Fill>((action >> 1) & 3), floats, record);
    if (floats) non_finite_received |= !finite(std::span(reinterpret_cast<const float*>(data.data()), kN));
    if (floats && float_broadcasts++ == 0) {  // the anchor comes first (then the momentum)
      anchor_broadcast.resize(kN);
      std::memcpy(anchor_broadcast.data(), data.data(), data.size());
    }
    return Status::Ok();
  }

  Status allreduce_sum(std::span<float> data) override {
    if (data.size() != kN) fail("allreduce: size");
    const uint8_t action = reduce_.byte();
    if ((action & 1) != 0) return io("allreduce");
    for (uint32_t r = 0; r + 1 < size_; ++r) {
      std::vector<float> theirs(kN);
      fill_floats(theirs, static_cast<Fill>((action >> 2) & 3), reduce_);
      for (size_t i = 0; i < kN; ++i) data[i] += theirs[i];
    }
    non_finite_received |= !finite(data);
    return (action & 2) != 0 ? io("allreduce (after the sum)") : Status::Ok();
  }

  Reform reform(std::string* why, const std::function<bool()>& /*cancelled*/) override {
    const uint8_t action = reform_.byte();
    switch (action & 3) {
      case 0:
        ++epoch_;
        if ((action & 4) != 0) size_ = (action & 8) != 0 ? 3 : 2;
        rank_ = (action >> 4) % size_;
        return Reform::kFormed;
      case 1:
        *why = "fuzz: the hosts did not agree";
        return Reform::kFailed;
      case 2:
        *why = "fuzz: no majority";
        return Reform::kPaused;
      default:
        *why = "fuzz: another server has this host id";
        return Reform::kRefused;
    }
  }

  bool joiner = false;
  // Of the last allgather: every member's header; of the last join's: the
  // round a source would bring.
  std::vector<PeerHeader> gathered;
  uint64_t join_round = 0;
  // Of the call's first broadcast of the model's size, the anchor: what
  // every member got.
  std::vector<float> anchor_broadcast;
  uint64_t float_broadcasts = 0;
  bool non_finite_received = false;  // in the call: a broadcast of floats or a sum holding NaN or Inf
  RoundGroups own_history;           // this host's record before the call (honest records extend it)

 private:
  static Status io(const char* what) { return {ErrorCode::kIo, std::string("federation (fuzz): ") + what + " failed"}; }

  void fill_floats(std::span<float> out, Fill how, Reader& in) {
    switch (how) {
      case kHonest:
      case kOneNonFinite:
        for (float& x : out) x = small(in.byte());
        if (how == kOneNonFinite) {
          const uint8_t b = in.byte();
          const float bad[] = {NAN, INFINITY, -INFINITY, std::bit_cast<float>(0x7fa00000u)};
          out[b % out.size()] = bad[(b >> 6) & 3];
        }
        break;
      case kRawBytes:
        in.bytes(out.data(), out.size_bytes());
        break;
      case kUntouched:
        break;
    }
  }

  void fill_broadcast(std::span<std::byte> data, Fill how, bool floats, bool record) {
    if (floats) {
      std::vector<float> v(kN);
      std::memcpy(v.data(), data.data(), data.size());
      fill_floats(v, how, bcast_);
      std::memcpy(data.data(), v.data(), data.size());
      return;
    }
    if (!record) {  // the momentum's flag
      if (how == kRawBytes) {
        bcast_.bytes(data.data(), data.size());
      } else if (how != kUntouched) {
        const uint32_t started = bcast_.byte() & 1;
        std::memcpy(data.data(), &started, sizeof started);
      }
      return;
    }
    RoundGroups groups;
    std::memcpy(&groups, data.data(), sizeof groups);
    if (how == kRawBytes) {
      bcast_.bytes(&groups, sizeof groups);
    } else if (how != kUntouched) {
      groups = honest_record();
      if (how == kOneNonFinite)
        bcast_.bytes(&groups.spans[bcast_.byte() % RoundGroups::kSpans], sizeof(RoundGroups::Span));
    }
    std::memcpy(data.data(), &groups, sizeof groups);
  }

  // A source's record of the rounds through join_round: this host's own
  // record, then up to 7 runs of rounds (a pick byte and a length byte
  // each), each of a group (pick bits 0-1: this join's, the one before,
  // that of the record's last span, or another) and its members (length
  // bits 4-7: host ids 0-3, or unknown), after a gap of a round (length
  // bit 2), 1 to 4 rounds long (length bits 0-1).
  RoundGroups honest_record() {
    RoundGroups g;
    uint64_t round = 0;
    size_t used = 0;
    for (const RoundGroups::Span& s : own_history.spans)
      if (s.first != 0 && s.last <= join_round) {
        g.spans[used++] = s;
        round = s.last;
      }
    const uint8_t runs = bcast_.byte() % 8;
    uint64_t last_group = 0;
    for (const RoundGroups::Span& s : own_history.spans)
      if (s.first != 0) last_group = s.group;
    for (uint8_t k = 0; k < runs && round < join_round; ++k) {
      const uint8_t pick = bcast_.byte(), length = bcast_.byte();
      const uint64_t groups[] = {round_group_, previous_round_group_, last_group, 0x5eed0000u + (pick >> 2)};
      const uint64_t members = length >> 4;  // 0: unknown
      // Rounds skipped (a gap the record shows), then a run.
      round += (length >> 2) & 1;
      for (uint64_t end = std::min(join_round, round + 1 + (length & 3)); round < end;)
        g.completed(++round, groups[pick & 3], members);
    }
    return g;
  }

  uint32_t size_, rank_, host_;
  uint64_t epoch_ = 0;
  uint64_t round_group_ = 0, previous_round_group_ = 0;  // of the last join, and the one before
  bool elastic_;
  Reader gather_, bcast_, reduce_, reform_;
};

// What the Federator holds is what a checkpoint stores and restore() takes
// back: sizes of the model, a record that fits the round, a round below
// the checkpoint format's bound, the anchor's hash.
void check_state(const Federator& fed, Federator& checker, bool nesterov) {
  if (fed.anchor().size() != kN) fail("the anchor's size changed");
  const std::optional<FederationState> s = fed.state();
  if (!s) return;
  if (s->round != fed.round_number()) fail("state(): another round");
  if (s->anchor.size() != kN || s->momentum.size() != (nesterov ? kN : 0) ||
      (!s->restore_base.empty() && s->restore_base.size() != kN))
    fail("state(): sizes");
  if (s->round >= kMaxCheckpointVersion) fail("state(): a round no checkpoint holds");
  if (!s->history.plausible(s->round)) fail("state(): a record of groups that does not fit the round");
  if (fed.anchor_hash() != hash_floats(fed.anchor())) fail("anchor_hash() is not the anchor's");
  if (Status st = checker.restore(*s); !st.ok()) fail(("restore() refuses state(): " + st.to_string()).c_str());
}

struct Driver {
  FederationConfig config;
  bool nesterov = false;
  Engine* engine = nullptr;
  Federator* fed = nullptr;
  Federator* checker = nullptr;
  std::vector<float> weights;
  uint64_t unmerged = 0;

  enum class Outcome { kMerged, kRegroup, kOver };

  void before_call() {
    engine->gathered.clear();
    engine->anchor_broadcast.clear();
    engine->float_broadcasts = 0;
    engine->non_finite_received = false;
    const std::optional<FederationState> s = fed->state();
    engine->own_history = s ? s->history : RoundGroups{};
  }

  // The join: merged, to join again (a kIo failure of an elastic engine),
  // or over (FederationLink ends federation).
  Outcome join() {
    before_call();
    const std::optional<FederationState> before = fed->state();
    const uint64_t lineage = fed->lineage(), hash = fed->anchor_hash(), round = fed->round_number();
    std::vector<float> exchange = weights;
    const Result<RoundResult> r = fed->join(exchange);
    check_state(*fed, *checker, nesterov);
    if (!r.ok()) {
      if (!same_state(before, fed->state()) || fed->lineage() != lineage || fed->round_number() != round ||
          (before && fed->anchor_hash() != hash))
        fail("a failed join changed the state");
      return engine->elastic() && r.status().code() == ErrorCode::kIo ? Outcome::kRegroup : Outcome::kOver;
    }
    if (!finite(weights)) fail("a join with weights holding NaN or Inf went through");
    const Membership m = engine->membership();
    if (r->members != m.size || r->round != fed->round_number() || r->source_rank >= m.size) fail("join: result");
    if (r->resumed) {
      const PeerHeader& source = engine->gathered.at(r->source_rank);
      if ((source.flags & kFlagHasState) == 0 || fed->round_number() != source.round)
        fail("join: not the source's round");
    } else if (fed->round_number() != 0) {
      fail("join: a fresh group not at round 0");
    }
    if (!same_bits(fed->anchor(), engine->anchor_broadcast)) fail("join: the anchor is not the one broadcast");
    // The group's longest --fed-every-ms: a period some member may have
    // (the engine waits for it in each round's first collective).
    if (fed->group_every_ms() < config.every_ms || fed->group_every_ms() > kMaxFederationEveryMs)
      fail("join: a group period no member can have");
    const std::optional<FederationState> s = fed->state();
    if (!s || !s->restore_base.empty()) fail("join: no state, or a restore base kept");
    if (engine->non_finite_received) fail("join: a peer's NaN or Inf taken in");
    if (!finite(s->anchor) || !finite(s->momentum)) fail("join: an anchor or momentum not finite");
    for (size_t i = 0; i < kN; ++i) weights[i] += exchange[i];
    if (!r->drift_kept) unmerged = 0;
    return Outcome::kMerged;
  }

  Outcome round() {
    before_call();
    const uint64_t round = fed->round_number();
    const std::vector<float> anchor(fed->anchor().begin(), fed->anchor().end());
    std::vector<float> exchange = weights;
    const Result<RoundResult> r = fed->round(exchange, unmerged);
    check_state(*fed, *checker, nesterov);
    if (!r.ok()) {
      if (fed->round_number() != round) fail("a failed round moved the round");
      // A repair from rank 0 that went through stays (round()'s contract).
      if (!same_bits(fed->anchor(), anchor) && !same_bits(fed->anchor(), engine->anchor_broadcast))
        fail("a failed round changed the anchor");
      if (!finite(weights) && r.status().code() != ErrorCode::kInvalidArgument)
        fail("weights holding NaN or Inf: not refused as such");
      return engine->elastic() && r.status().code() == ErrorCode::kIo ? Outcome::kRegroup : Outcome::kOver;
    }
    if (!finite(weights)) fail("a round with weights holding NaN or Inf went through");
    if (r->members != engine->membership().size) fail("round: members");
    if (r->peer_left || r->regroup) {
      if (fed->round_number() != round || !same_bits(fed->anchor(), anchor))
        fail("round: nothing exchanged, yet moved");
      for (const float x : exchange)
        if (x != 0.0f) fail("round: nothing exchanged, yet a correction");
      return engine->elastic() ? Outcome::kRegroup : Outcome::kOver;
    }
    if (fed->round_number() != round + 1 || r->round != round + 1) fail("round: not the next round");
    if (engine->non_finite_received) fail("round: a peer's NaN or Inf taken in");
    if (const std::optional<FederationState> s = fed->state(); !finite(s->anchor) || !finite(s->momentum))
      fail("round: an anchor or momentum not finite");
    if (r->updates_total == 0 && !r->anchors_repaired && !same_bits(fed->anchor(), anchor))
      fail("round: no updates anywhere, yet the anchor moved");
    for (size_t i = 0; i < kN; ++i) weights[i] += exchange[i];
    unmerged = 0;
    return Outcome::kMerged;
  }

  // An elastic engine's reform() before each join, tried a few times.
  bool form_group() {
    fed->rejoin();
    for (int k = 0; k < kMaxReforms; ++k) {
      std::string why;
      switch (engine->reform(&why, [] { return false; })) {
        case FederationEngine::Reform::kFormed:
          return true;
        case FederationEngine::Reform::kRefused:
          return false;
        default:
          break;
      }
    }
    return false;
  }

  void train(uint8_t op) {
    const uint64_t updates = op & 7;
    const float step = static_cast<float>((op >> 3) & 7) / 16.0f - 0.25f;
    for (uint64_t u = 0; u < updates; ++u)
      for (size_t i = 0; i < kN; ++i) weights[i] += step * static_cast<float>((i + u) % 3) - 0.0625f;
    unmerged += updates;
    if ((op & 0x40) != 0) weights[op % kN] = NAN;
  }
};

// The restore record: round (u16), lineage (a byte: 0 unknown, 1 and 2
// two fixed ones, else a u64), host (a byte: 0 this host's id, 1 unknown,
// else that id minus 2), a flags byte (bit 0 momentum started, bit 1 a NaN
// in the anchor, bit 2 pass the weights as restore()'s, bit 3 a restore
// base, bit 4 a momentum, which restore() keeps for the Nesterov outer
// step only), the anchor (a byte an element), the momentum (as much), then
// up to 7 spans
// of the record (a count byte; each a group byte, a length byte and a
// members byte, bit 7: unknown; the runs end at the round).
FederationState restore_record(Reader& in, uint32_t host, std::vector<float>* weights_out,
                               const std::vector<float>& weights) {
  FederationState s;
  s.round = in.value<uint16_t>();
  const uint8_t lineage = in.byte();
  s.lineage = lineage == 0 ? 0 : lineage == 1 ? 0x11aa : lineage == 2 ? 0x22bb : in.value<uint64_t>();
  const uint8_t who = in.byte();
  s.host = who == 0 ? host : who == 1 ? kUnknownFederationHost : who - 2u;
  const uint8_t flags = in.byte();
  s.momentum_started = (flags & 1) != 0;
  s.anchor.resize(kN);
  for (float& x : s.anchor) x = small(in.byte());
  if ((flags & 2) != 0) s.anchor[0] = NAN;
  if ((flags & 4) != 0) *weights_out = weights;
  if ((flags & 8) != 0) {
    s.restore_base = weights;
    for (float& x : s.restore_base) x -= 0.5f;
  }
  if ((flags & 16) != 0) {
    s.momentum.resize(kN);
    for (float& x : s.momentum) x = small(in.byte());
  }
  const uint8_t spans = in.byte() % 8;
  uint64_t total = 0;
  std::vector<uint64_t> groups, lengths, members;
  for (uint8_t k = 0; k < spans; ++k) {
    groups.push_back(0x5eed0000u + in.byte());
    lengths.push_back(1 + in.byte() % 8);
    const uint8_t m = in.byte();
    members.push_back((m & 0x80) != 0 ? RoundGroups::kMembersUnknown : m & 0x0f);
    total += lengths.back();
  }
  uint64_t round = total < s.round ? s.round - total : 0;
  for (size_t k = 0; k < groups.size(); ++k)
    for (uint64_t j = 0; j < lengths[k] && round < s.round; ++j) s.history.completed(++round, groups[k], members[k]);
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const uint8_t c0 = in.byte(), c1 = in.byte();
  Reader host = in.section(), gather = in.section(), bcast = in.section(), reduce = in.section(), reform = in.section();
  const uint32_t members = (c0 & 1) != 0 ? 3 : 2;
  const uint32_t rank = ((c0 >> 1) & 3) % members;
  Driver d;
  d.nesterov = (c0 & 8) != 0;
  d.config.outer = d.nesterov ? OuterStep::kNesterov : OuterStep::kAverage;
  d.config.weight_by_updates = (c0 & 16) == 0;
  const bool elastic = (c0 & 32) != 0;
  ModelFingerprint print;
  print.hash = 0xf00d;
  print.total_elements = kN;
  print.tensors = 2;
  print.optimizer = 1;
  print.outer = outer_code(d.config);
  if (d.nesterov) {
    print.outer_lr_bits = std::bit_cast<uint32_t>(d.config.outer_lr);
    print.outer_momentum_bits = std::bit_cast<uint32_t>(d.config.outer_momentum);
  }
  Engine engine(members, rank, elastic, gather, bcast, reduce, reform);
  Federator fed(d.config, engine, print);
  Engine idle(members, rank, false, {}, {}, {}, {});
  Federator checker(d.config, idle, print);  // restore() only: no collective
  d.engine = &engine;
  d.fed = &fed;
  d.checker = &checker;
  d.weights.resize(kN);
  for (size_t i = 0; i < kN; ++i) d.weights[i] = small(static_cast<uint8_t>(c1 + 37 * i));
  if ((c0 & 64) != 0) {
    std::vector<float> restored_weights;
    FederationState s = restore_record(host, rank, &restored_weights, d.weights);
    const bool plausible = s.history.plausible(s.round);
    const Status st = fed.restore(std::move(s), std::move(restored_weights));
    if (st.ok() != plausible) fail("restore(): a state of the model's sizes refused, or an implausible one taken");
    check_state(fed, checker, d.nesterov);
  }
  bool need_join = true;
  bool joined = false;  // a join went through (leave() then announces)
  for (int step = 0; step < kMaxSteps; ++step) {
    if (step > 0 && host.done()) break;
    const uint8_t op = host.byte();
    if (need_join) {
      if (elastic && !d.form_group()) return 0;
      if ((op & 0x40) != 0) d.weights[op % kN] = NAN;
      switch (d.join()) {
        case Driver::Outcome::kMerged:
          need_join = false;
          joined = true;
          break;
        case Driver::Outcome::kRegroup:
          break;
        case Driver::Outcome::kOver:
          return 0;
      }
      continue;
    }
    if ((op & 0x80) != 0) break;
    d.train(op);
    engine.joiner = (op & 0x38) == 0x38;
    switch (d.round()) {
      case Driver::Outcome::kMerged:
        break;
      case Driver::Outcome::kRegroup:
        need_join = true;
        break;
      case Driver::Outcome::kOver:
        return 0;
    }
    engine.joiner = false;
  }
  if (joined) {
    d.before_call();
    static_cast<void>(fed.leave());
  }
  return 0;
}
