// RoundGroups: which group of hosts completed which of the federation's
// rounds, and who its members were. A group is one join's: its id is a
// hash of every member's random nonce at that join (and of the engine's
// epoch), so it differs between any two joins, of this job or of another
// one that used another store (the engines' epochs restart with a store).
// A host whose round failed at its very end tells by it whether the source
// of its next join completed that round with its delta in it; a host
// restored from an older checkpoint tells whether any round since merged
// its drift (docs/federation.md, "Engines" and "Checkpoints and
// restarts"). A plain value: no synchronisation of its own.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace shmps::server {

// The last kSpans runs of consecutive rounds that one group completed,
// oldest first (rounds count from 1: a span with first 0 is empty, and
// all zero). Fixed-size: it crosses hosts as bytes at the join, and is
// stored in checkpoints (from format 4; format 3 held the spans without their
// members), so that a host restored from one still shows which rounds its
// anchor holds.
struct RoundGroups {
  static constexpr size_t kSpans = 8;
  // The members' host ids (Membership::host: Gloo's --fed-host, the MPI
  // rank) as bits: host h is bit h. Only ids below kMemberBits have a bit:
  // a group always holds one (Gloo's ids are below 64, an MPI group holds
  // rank 0), and a host of a higher id cannot tell from the record whether
  // it was a member. kMembersUnknown: a span read from a format-3
  // checkpoint, or handed on from one.
  static constexpr uint32_t kMemberBits = 64;
  static constexpr uint64_t kMembersUnknown = 0;
  struct Span {
    uint64_t group = 0;
    uint64_t first = 0;
    uint64_t last = 0;
    uint64_t members = kMembersUnknown;
    bool operator==(const Span&) const = default;
  };
  std::array<Span, kSpans> spans{};

  // Round `round` completed in `group`, whose members are `members`
  // (member_bit() of each).
  void completed(uint64_t round, uint64_t group, uint64_t members) noexcept;
  // Whether round `round` is known to have completed in `group`.
  bool holds(uint64_t round, uint64_t group) const noexcept;
  // The group that completed round `round`; 0 when the record does not
  // reach back to it.
  uint64_t group_of(uint64_t round) const noexcept;

  // Whether host `host` was a member of a group that completed one of the
  // rounds after..through (after < through):
  enum class Presence {
    kMember,   // of at least one of them (the record shows it)
    kAbsent,   // of none: the record holds every one of them, each with its members known
    kUnknown,  // neither can be shown (the record does not reach back, a span's members are unknown, or the host's
               // id has no bit)
  };
  Presence presence(uint32_t host, uint64_t after, uint64_t through) const noexcept;

  // Whether this could be a record of rounds up to `round`, as completed()
  // builds one: the empty spans last and all zero (their members too),
  // each span's rounds within 1..round and after the span before it. A
  // span's members are any bits, kMembersUnknown included.
  bool plausible(uint64_t round) const noexcept;
  bool operator==(const RoundGroups&) const = default;

  // The bit of host `host` in a span's members; 0 for an id without one.
  static constexpr uint64_t member_bit(uint32_t host) noexcept { return host < kMemberBits ? uint64_t{1} << host : 0; }
};
static_assert(std::is_trivially_copyable_v<RoundGroups> && std::is_standard_layout_v<RoundGroups> &&
              sizeof(RoundGroups) == 256);
static_assert(offsetof(RoundGroups::Span, members) == 24 && sizeof(RoundGroups::Span) == 32);

}  // namespace shmps::server
