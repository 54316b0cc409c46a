// RoundGroups: which group of hosts completed which of the federation's
// rounds. A group is one join's: its id is a hash of every member's random
// nonce at that join (and of the engine's epoch), so it differs between
// any two joins, of this job or of another one that used another store
// (the engines' epochs restart with a store). A host whose round failed
// at its very end tells by it whether the source of its next join
// completed that round with its delta in it (docs/federation.md,
// "Engines").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace shmps::server {

// The last kSpans runs of consecutive rounds that one group completed,
// oldest first (rounds count from 1: a span with first 0 is empty, and
// all zero). Fixed-size: it crosses hosts as bytes at the join, and is
// stored in checkpoints (format 3), so that a host restored from one
// still shows which rounds its anchor holds.
struct RoundGroups {
  static constexpr size_t kSpans = 8;
  struct Span {
    uint64_t group = 0;
    uint64_t first = 0;
    uint64_t last = 0;
    bool operator==(const Span&) const = default;
  };
  std::array<Span, kSpans> spans{};

  // Round `round` completed in `group`.
  void completed(uint64_t round, uint64_t group) noexcept;
  // Whether round `round` is known to have completed in `group`.
  bool holds(uint64_t round, uint64_t group) const noexcept;
  // The group that completed round `round`; 0 when the record does not
  // reach back to it.
  uint64_t group_of(uint64_t round) const noexcept;
  // Whether this could be a record of rounds up to `round`, as completed()
  // builds one: the empty spans last, each span's rounds within 1..round
  // and after the span before it.
  bool plausible(uint64_t round) const noexcept;
  bool operator==(const RoundGroups&) const = default;
};
static_assert(std::is_trivially_copyable_v<RoundGroups> && sizeof(RoundGroups) == 192);

}  // namespace shmps::server
