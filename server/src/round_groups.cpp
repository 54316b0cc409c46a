#include "round_groups.hpp"

#include <algorithm>

namespace shmps::server {

void RoundGroups::completed(uint64_t round, uint64_t group, uint64_t members) noexcept {
  size_t used = 0;
  while (used < kSpans && spans[used].first != 0) ++used;
  if (used > 0 && spans[used - 1].group == group && spans[used - 1].last + 1 == round) {
    spans[used - 1].last = round;
    return;
  }
  if (used == kSpans) {
    std::move(spans.begin() + 1, spans.end(), spans.begin());
    used = kSpans - 1;
  }
  spans[used] = {group, round, round, members};
}

bool RoundGroups::holds(uint64_t round, uint64_t group) const noexcept {
  return std::any_of(spans.begin(), spans.end(), [&](const Span& s) {
    return s.first != 0 && s.group == group && s.first <= round && round <= s.last;
  });
}

uint64_t RoundGroups::group_of(uint64_t round) const noexcept {
  for (const Span& s : spans)
    if (s.first != 0 && s.first <= round && round <= s.last) return s.group;
  return 0;
}

RoundGroups::Presence RoundGroups::presence(uint32_t host, uint64_t after, uint64_t through) const noexcept {
  const uint64_t bit = member_bit(host);
  uint64_t next = after + 1;  // the first round of after..through not yet seen in a span
  bool all_known = bit != 0;
  for (const Span& s : spans) {
    if (s.first == 0 || s.last <= after || s.first > through) continue;
    if ((s.members & bit) != 0) return Presence::kMember;
    // A round of the range that no span holds (the record starts later, or
    // a gap), or a span whose members are unknown: absence is not shown.
    if (s.first > next || s.members == kMembersUnknown) all_known = false;
    next = std::max(next, s.last + 1);
  }
  return all_known && next > through ? Presence::kAbsent : Presence::kUnknown;
}

bool RoundGroups::plausible(uint64_t round) const noexcept {
  uint64_t after = 0;  // the last round of the span before
  bool empty_seen = false;
  for (const Span& s : spans) {
    if (s.first == 0) {
      if (s.last != 0 || s.group != 0 || s.members != kMembersUnknown) return false;
      empty_seen = true;
      continue;
    }
    if (empty_seen || s.first <= after || s.last < s.first || s.last > round) return false;
    after = s.last;
  }
  return true;
}

}  // namespace shmps::server
