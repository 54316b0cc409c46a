#include "model.hpp"

#include <algorithm>
#include <random>

#include "shmps/server/config.hpp"

namespace shmps::server {

namespace {

// Draws `total` values from `dist` in chunks; the sequence is that of one
// loop over all of them.
template <typename Dist>
Status draw(uint64_t total, uint64_t seed, Dist dist, const WeightsSink& sink) {
  if (!sink) return Status::Ok();
  constexpr uint64_t kChunkElements = 1 << 20;
  std::mt19937_64 rng(seed);
  std::vector<float> chunk(std::min(total, kChunkElements));
  for (uint64_t done = 0; done < total;) {
    const uint64_t n = std::min(total - done, kChunkElements);
    for (uint64_t i = 0; i < n; ++i) chunk[i] = dist(rng);
    if (Status s = sink(done, std::span<const float>(chunk.data(), n)); !s.ok()) return s;
    done += n;
  }
  return Status::Ok();
}

}  // namespace

Status initial_weights(const InitSpec& init, uint64_t total, const WeightsSink& sink) {
  switch (init.kind) {
    case InitSpec::Kind::kZero:
      return Status::Ok();
    case InitSpec::Kind::kNormal:
      return draw(total, init.seed, std::normal_distribution<float>(0.0f, init.scale), sink);
    case InitSpec::Kind::kUniform:
      return draw(total, init.seed, std::uniform_real_distribution<float>(-init.scale, init.scale), sink);
    case InitSpec::Kind::kFile:
      return read_init_file(init.file, total, sink);
  }
  return Status::Ok();
}

}  // namespace shmps::server
