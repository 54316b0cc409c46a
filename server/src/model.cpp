#include "model.hpp"

#include <random>

#include "shmps/server/config.hpp"

namespace shmps::server {

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

}  // namespace shmps::server
