#include "reload.hpp"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/log.hpp"
#include "shmps/server/options.hpp"

namespace shmps::server {
namespace {

// The entries of config_entries() with repeated keys (tensor) joined, in order.
std::vector<std::pair<std::string, std::string>> grouped_entries(const ServerConfig& config) {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& [key, value] : config_entries(config)) {
    auto it = std::find_if(out.begin(), out.end(), [&key = key](const auto& e) { return e.first == key; });
    if (it == out.end())
      out.emplace_back(key, value);
    else
      it->second += "," + value;
  }
  return out;
}

}  // namespace

void apply_live(ServerConfig& running, const ServerConfig& next, shm::ConfigBlock& shared) {
  const auto before = grouped_entries(running);
  const auto after = grouped_entries(next);
  std::vector<std::string> keys;
  for (const auto* side : {&after, &before})
    for (const auto& e : *side)
      if (std::find(keys.begin(), keys.end(), e.first) == keys.end()) keys.push_back(e.first);
  const auto value_of = [](const auto& entries, const std::string& key) {
    for (const auto& e : entries)
      if (e.first == key) return e.second;
    return std::string("(unset)");
  };
  // The whole reload is logged under the more verbose of the old and the
  // new level, then the new one is set: a reload that raises the level
  // (warn -> info) shows the changes it makes with it, and one that lowers
  // it still shows its own lines.
  const LogLevel level_after = next.log_level;
  if (static_cast<int>(level_after) > static_cast<int>(log::level())) log::set_level(level_after);
  int applied = 0, pending = 0;
  for (const std::string& key : keys) {
    const std::string old_value = value_of(before, key), new_value = value_of(after, key);
    if (old_value == new_value) continue;
    // Read on one side only: it comes or goes with the setting that makes
    // it read (momentum with the optimizer), whose change is logged itself.
    if (!config_reads(running, key) || !config_reads(next, key)) continue;
    // Each side's default weight decay: it changes with the optimizer
    // (needs a restart, logged itself), not on its own.
    const kernels::OptimizerConfig &was = running.optimizer, &will = next.optimizer;
    if (key == "weight-decay" && was.kind != will.kind && was.weight_decay == default_weight_decay(was.kind) &&
        will.weight_decay == default_weight_decay(will.kind))
      continue;
    const std::string change = "reload: " + key + " " + old_value + " -> " + new_value;
    if (key == "lr") {
      kernels::OptimizerConfig candidate = running.optimizer;
      candidate.lr = next.optimizer.lr;
      if (Status s = kernels::validate(candidate); !s.ok()) {
        log::error("reload: lr " + new_value + " refused, keeping " + old_value + ": " + s.message());
        continue;
      }
      running.optimizer.lr = next.optimizer.lr;
      // relaxed: a display value for shmps-inspect (an aligned 4-byte
      // store, never torn); the server reads its own copy.
      std::atomic_ref<float>(shared.lr).store(running.optimizer.lr, std::memory_order_relaxed);
      log::info(change);
    } else if (key == "lr-schedule") {
      running.lr_schedule = next.lr_schedule;  // from the next update, at the version reached
      log::info(change);
    } else if (key == "max-staleness") {
      running.max_staleness = next.max_staleness;
      // relaxed: as lr above.
      std::atomic_ref<uint64_t>(shared.max_staleness).store(running.max_staleness, std::memory_order_relaxed);
      log::info(change);
    } else if (key == "staleness-policy") {
      running.staleness_policy = next.staleness_policy;
      // relaxed: as lr above.
      std::atomic_ref<uint32_t>(shared.staleness_policy)
          .store(static_cast<uint32_t>(running.staleness_policy), std::memory_order_relaxed);
      log::info(change);
    } else if (key == "apply-threads") {
      running.apply_threads = next.apply_threads;  // read at the next large update
      log::info(change);
    } else if (key == "log-level") {
      running.log_level = next.log_level;  // set after the loop (above)
      log::info(change);
    } else {
      log::warn(change + " needs a restart; still " + old_value);
      ++pending;
      continue;
    }
    ++applied;
  }
  log::info("reloaded the configuration: " + std::to_string(applied) + " change(s) applied" +
            (pending > 0 ? ", " + std::to_string(pending) + " need a restart" : std::string()));
  log::set_level(level_after);
}

}  // namespace shmps::server
