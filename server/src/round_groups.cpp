#include "round_groups.hpp"

#include <algorithm>

namespace shmps::server {

void RoundGroups::completed(uint64_t round, uint64_t group) noexcept {
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
  spans[used] = {group, round, round};
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

bool RoundGroups::plausible(uint64_t round) const noexcept {
  uint64_t after = 0;  // the last round of the span before
  bool empty_seen = false;
  for (const Span& s : spans) {
    if (s.first == 0) {
      if (s.last != 0 || s.group != 0) return false;
      empty_seen = true;
      continue;
    }
    if (empty_seen || s.first <= after || s.last < s.first || s.last > round) return false;
    after = s.last;
  }
  return true;
}

}  // namespace shmps::server
