// Federator: the rounds of the federation as math and collectives, with no
// thread and no server of its own (FederationLink drives it; tests drive
// it with an in-process engine). It keeps the anchor A (identical on every
// host), the round number and the outer optimizer's momentum. One thread
// at a time; every member calls join(), round() and leave() in the same
// order (docs/federation.md, "A round").
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "checkpoint.hpp"
#include "shmps/server/config.hpp"
#include "shmps/server/federation.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

// What every host must agree on before its deltas are averaged: the tensor
// table (names and shapes, hashed), the optimizer, and the outer step.
// Fixed-width fields only: it crosses hosts as bytes, in each round's
// header (all hosts little-endian).
struct ModelFingerprint {
  uint64_t hash = 0;
  uint64_t total_elements = 0;
  uint32_t tensors = 0;
  uint32_t optimizer = 0;            // kernels::OptimizerKind
  uint32_t outer = 0;                // outer_code()
  uint32_t outer_lr_bits = 0;        // kNesterov: the outer lr's float bits
  uint32_t outer_momentum_bits = 0;  // kNesterov: the outer momentum's
  uint32_t reserved = 0;
  bool operator==(const ModelFingerprint&) const = default;
  // "3 tensors, 203530 parameters, optimizer adam, outer average weighted (tensor table hash 0x...)"
  std::string describe() const;
};
static_assert(sizeof(ModelFingerprint) == 40 && std::is_trivially_copyable_v<ModelFingerprint>);

// The fingerprint's `outer` field: OuterStep | (weight_by_updates << 8).
uint32_t outer_code(const FederationConfig& config) noexcept;

// The fingerprint of what `config` serves: its tensor table, optimizer
// kind and federation outer step (with its hyperparameters).
ModelFingerprint model_fingerprint(const ServerConfig& config);

// With config.federation.rank_in_name, what host `rank` (Membership::host)
// runs as: ".r<rank>"
// appended to the name, "/r<rank>" to the checkpoint directory (several
// ranks on one machine: each its own segment and checkpoints). Applied to
// the configuration at start and to each reloaded one, so that a reload
// compares like with like.
void apply_rank_in_name(ServerConfig& config, uint32_t rank);

// 64-bit hash of a float array's bytes (anchors, for the equality check
// across hosts; not cryptographic).
uint64_t hash_floats(std::span<const float> values) noexcept;

struct RoundResult {
  uint64_t round = 0;             // the round this call completed (1 for the first)
  uint32_t members = 0;           // hosts in it
  uint64_t updates_total = 0;     // local updates summed over the hosts
  uint64_t bytes = 0;             // what this host sent: its header, its delta, rank 0 the anchor
  bool peer_left = false;         // a member announced it leaves: no delta was exchanged
  uint32_t left_rank = 0;         // which one (the lowest), when peer_left
  bool anchors_repaired = false;  // the anchors' hashes differed: rank 0's was broadcast
  // A member asked for a new group (a host waits to join, seen by the
  // engine): no delta was exchanged; the members re-form and join again.
  bool regroup = false;
  // The join: the member whose anchor became everybody's (rank 0 when no
  // member restored a state), and whether it had restored one.
  uint32_t source_rank = 0;
  bool resumed = false;
  bool drift_kept = false;  // the join left this host's W - A as it was (its local updates not yet merged)
  // The join: a round this host saw fail had completed at the source, in
  // the same group, with this host's delta in it: the drift kept is only
  // what was applied after that round's snapshot.
  bool failed_round_merged = false;
  uint64_t failed_round_updates = 0;  // then: that round's local updates, merged with it
  // The join: this host restored a checkpoint of round
  // `restored_round`, older than the group's (docs/federation.md,
  // "Checkpoints and restarts"). Either it took W = A, dropping the
  // checkpoint's drift W_ckpt - A_ckpt (and the updates since the restart):
  bool restored_drift_dropped = false;
  uint64_t restored_round = 0;
  // then, when the source's record shows this host a member of a group
  // that completed a round after restored_round, that drift went into it;
  // otherwise the record could not tell whether a round merged it.
  bool restored_drift_merged = false;
  // Or the source's record shows every round after restored_round
  // completed by groups without this host: no round merged that drift,
  // and it is kept (drift_kept), W + (A - A_ckpt).
  bool restored_drift_rebased = false;
  // The join: a restored host that did not keep its drift kept the
  // updates applied since the restart, W + (A - W_ckpt) (restore() was
  // given the checkpoint's weights W_ckpt).
  bool restart_updates_kept = false;
  // The join: members of the group's lineage held another anchor at the
  // source's round than the source (a fork: a round completed at some
  // hosts only, and the others completed a round of that number without
  // them). The anchor more members hold is the source's (the lowest rank
  // among equals); the other branch's rounds since the fork are replaced,
  // and each of its hosts keeps its drift since its last merge, rebased.
  bool fork = false;
  uint32_t fork_rank = 0;     // then: the lowest rank whose anchor was replaced
  uint32_t fork_holders = 0;  // the members that held the source's anchor
  uint32_t fork_others = 0;   // those that held another at its round
  bool fork_lost = false;     // this host's anchor was one of those replaced
};

class Federator {
 public:
  // What every member sends before any delta moves (the header).
  static constexpr uint64_t kHeaderBytes = 104;

  // `fingerprint.total_elements` sizes every span below.
  Federator(const FederationConfig& config, FederationEngine& engine, const ModelFingerprint& fingerprint);

  // Before the join: resume from a checkpoint's state (its anchor, round,
  // outer momentum and which groups completed its rounds, stored with the
  // weights this host restored, `weights`). With `weights`, a join that
  // does not keep the checkpoint's drift keeps the updates applied since
  // the restart (W - W_ckpt: no round merged them); they are held until a
  // join goes through (a copy of the model). A state with a restore base
  // (a checkpoint written after an earlier restore, before a join) gives
  // that base instead of `weights`: the updates since the earlier restore
  // are in no round either. kInvalidArgument when the sizes do not fit the
  // model, or the record of groups does not fit the round.
  Status restore(FederationState state, std::vector<float> weights = {});

  // The first collective: checks that every host serves the same model
  // and agrees on the anchor. When no member restored a state, rank 0's
  // weights become the anchor and everybody's weights. Otherwise the
  // source is the member with the highest round (the lowest rank among
  // equals; of members at one round with different anchors, a fork, the
  // anchor more members hold: RoundResult::fork): its anchor, round and
  // outer momentum become everybody's, and
  // each member keeps its own drift, rebased onto that anchor:
  // W + (A - own anchor); of a checkpoint older than the source's round,
  // only when the source's record shows every round since completed by
  // groups without this host (else its drift went into one of them, or
  // cannot be shown not to have: RoundResult::restored_drift_*). A member
  // without a state takes W = A; one with a checkpoint whose drift is not
  // kept W = A too, plus the updates since its restart where restore()
  // had the checkpoint's weights. A member whose last
  // round failed at its end (its allreduce) while the source's rounds
  // show it completed in the same group keeps only the drift since that
  // round's snapshot S: W + (A - S), its delta being in A already. A join
  // that fails leaves this host's state as it was. `exchange` holds this
  // host's weights S on entry and the correction on return (the consumer
  // adds it to W). Errors: kInvalidArgument when the models differ (the
  // message names both), when states of unrelated lineages meet
  // (settle_lineage()), when this host's weights, anchor or outer
  // momentum hold NaN or Inf (kIo at the others of an elastic engine: they
  // leave it out), when two members give one host id, a member's round
  // is one no checkpoint holds (kMaxCheckpointVersion or past it), its
  // period one no --fed-every-ms has or its local updates more than a
  // round can sum, the source's record of groups does not fit its round,
  // or the anchor or outer momentum it broadcasts holds NaN or Inf; the
  // engine's.
  Result<RoundResult> join(std::span<float> exchange);

  // One round: `exchange` holds the snapshot S on entry, taken after
  // `local_updates` updates since the previous snapshot, and A' - S on
  // return, where A' is the new anchor (the same bits on every host).
  // When a member announces it leaves (result.peer_left) or asks for a
  // new group (result.regroup), nothing is exchanged and `exchange` is
  // zero. When no host has updates, only the
  // headers travel and the anchor and the outer momentum stay. Errors:
  // kInvalidArgument (a host serves another model, or is at another
  // round; a header out of the bounds join() names; an anchor or momentum
  // broadcast by a repair, or the outer step on the summed deltas, that is
  // not finite), the engine's; the anchor and outer momentum are
  // unchanged then (but for a repair from rank 0 that went through), and
  // `exchange` holds S only where the error came before the outer step.
  Result<RoundResult> round(std::span<float> exchange, uint64_t local_updates);

  // Tells the others this host leaves: the collective that pairs with
  // their next round(), in which they see peer_left. Nothing before a join.
  Status leave();

  // After the group changed (an elastic engine re-formed it): the next
  // call is a join() again, with this host's state (its anchor, round and
  // outer momentum), so that the new members agree on the newest anchor.
  void rejoin() noexcept {
    joined_ = false;
    group_every_ms_ = 0;
  }

  uint64_t round_number() const noexcept { return round_; }
  uint64_t anchor_hash() const noexcept { return anchor_hash_; }
  // The id of the history this anchor belongs to (0: unknown, a state
  // restored from a checkpoint that predates it): drawn at a fresh group's
  // join (its group id), kept by every join that continues it.
  uint64_t lineage() const noexcept { return lineage_; }
  // The longest --fed-every-ms of the group, known after the join.
  uint32_t group_every_ms() const noexcept { return group_every_ms_; }
  std::span<const float> anchor() const noexcept { return anchor_; }
  // The state to checkpoint with the weights after the last merge: none
  // before a join or restore. Restored and not joined since, it holds the
  // restore base (FederationState::restore_base; its count is the
  // caller's).
  std::optional<FederationState> state() const;

 private:
  struct Header;
  // Gathers every member's header; checks each (check_header()), then
  // their models and rounds against this host's. Fills `all` (one per
  // member). Headers this build cannot read are refused by the strict
  // majority whose headers it reads with kIo where the engine re-forms
  // (leaving their senders out), else with kInvalidArgument, as a model
  // mismatch is.
  // `non_finite` (the join): this host's weights, anchor or outer momentum
  // hold NaN or Inf.
  Status gather_headers(uint64_t local_updates, bool leaving, std::vector<Header>* all, bool non_finite = false);
  // The join: a member whose weights, anchor or outer momentum are not
  // finite (its header says so) is refused (kInvalidArgument at that
  // host); the others leave it out (kIo) where the engine re-forms, and
  // end otherwise.
  Status refuse_non_finite(const std::vector<Header>& all) const;
  // The join: the lineage the group continues (0: none known), or the
  // refusal of members whose states belong to unrelated lineages.
  Status settle_lineage(const std::vector<Header>& all, uint64_t* lineage) const;
  // kInvalidArgument, naming `rank`, when a header is one no
  // shmps-server of this version sends (magic, unknown bits, or a round,
  // count of local updates or period out of bounds).
  static Status check_header(const Header& h, uint32_t rank);
  // Makes rank 0's anchor (and outer momentum) everybody's; the bytes
  // this host sent.
  Result<uint64_t> repair_anchor();
  // Broadcasts `root`'s anchor into payload_ (and, `with_momentum`, its
  // outer momentum into momentum_, committed only once every collective
  // went through; with `history`, its RoundGroups into *history, refused
  // with kInvalidArgument unless plausible for `history_round`; an anchor
  // or momentum holding NaN or Inf is refused the same way); the bytes
  // this host sent.
  Result<uint64_t> receive_state(uint32_t root, bool with_momentum, RoundGroups* history = nullptr,
                                 uint64_t history_round = 0);
  // The join: the members' host ids (their headers') as RoundGroups
  // bits; kInvalidArgument when two members give the same id.
  Status group_members(const std::vector<Header>& all, uint64_t* members) const;
  // A' from A and the mean delta (payload_ / divisor) into payload_ (and
  // the new momentum into momentum_next_), A' - S into exchange; then,
  // when every value is finite, commits A', its hash and the momentum and
  // returns true; else (a damaged sum, or values that overflowed) false,
  // the anchor and momentum unchanged, exchange overwritten.
  bool outer_step(std::span<float> exchange, float divisor);
  // Records the round in progress as failed here, with its snapshot.
  void keep_failed_round(std::span<const float> snapshot, uint64_t local_updates) noexcept;
  // The id the rounds completed now are recorded under: this group's
  // (its join's) and the engine's epoch.
  uint64_t round_group() const noexcept;
  void forget_failed_round() noexcept {
    failed_.round = 0;
    failed_.snapshot = {};
  }

  FederationConfig config_;
  FederationEngine& engine_;
  ModelFingerprint fingerprint_;
  uint64_t round_ = 0;
  RoundGroups history_;   // of the rounds up to round_ (a checkpoint's after a restore)
  uint64_t group_ = 0;    // this group's id (the join's members' nonces hashed)
  uint64_t members_ = 0;  // this group's members (RoundGroups::member_bit() of each)
  uint64_t lineage_ = 0;  // lineage(): the state's, restored or joined
  uint64_t anchor_hash_ = 0;
  uint32_t group_every_ms_ = 0;
  bool joined_ = false;
  bool has_state_ = false;                  // joined, or restored from a checkpoint
  bool restored_ = false;                   // restored, and not joined since
  std::vector<float> restored_weights_;     // while restored_: the restore base (restore()), or none
  uint32_t host_ = kUnknownFederationHost;  // the id of the last join (a restored state's writer before one)
  bool momentum_started_ = false;           // PyTorch's SGD: the first step's buffer is the gradient itself
  std::vector<float> anchor_;
  std::vector<float> payload_;        // the weighted deltas, summed in place by the engine
  std::vector<float> momentum_;       // kNesterov only
  std::vector<float> momentum_next_;  // kNesterov only: outer_step()'s until it commits
  // The last round, when its allreduce failed here (an elastic engine):
  // its number, its group (round_group()), this host's snapshot S and
  // local updates (round 0: none). Kept until a join into a group at or
  // past that round.
  struct FailedRound {
    uint64_t round = 0;
    uint64_t group = 0;
    uint64_t updates = 0;
    std::vector<float> snapshot;
  } failed_;
  std::mt19937_64 nonces_;  // the joins' nonces
};

}  // namespace shmps::server
