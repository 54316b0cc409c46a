// shmps-fed-bench: the federation's costs, for bench/federation.py
// (docs/federation.md, "Figures"). Two modes:
//
//   round  one member of a group (MPI: run under mpirun; Gloo: one process
//          per host, --fed-store ...): for each model size, the median of
//          a bare allreduce loop of the model's floats on the engine, of a
//          whole round (Federator::round(): the header allgather, the
//          weighted delta, its allreduce, the outer step, the anchor's
//          hash), and of the consumer's two passes (the snapshot copy and
//          the merge add) beside a memcpy of the same bytes; the median
//          over --repeats of each repeat's median. Rank 0 prints the table.
//   serve  a worker of a running server (--connect NAME, one tensor):
//          --pushes synchronous pushes of the whole tensor; prints the
//          round trip's p50, p99 and max and the pushes per second.
//
// Both print one line "RESULT <json>" for the script, after the table.
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "federation.hpp"
#include "shmps/kernels/model_passes.hpp"
#include "shmps/server/federation.hpp"
#include "shmps/worker.hpp"

namespace po = boost::program_options;
using namespace shmps;
using namespace shmps::server;
using bench::median;
using bench::now_ns;

namespace {

double ms(uint64_t ns) { return static_cast<double>(ns) / 1e6; }

// The engine, in a group (an elastic one formed first).
Result<std::unique_ptr<FederationEngine>> join_engine(const FederationConfig& config) {
  auto engine = make_federation_engine(config);
  if (!engine.ok()) return engine;
  if ((*engine)->elastic()) {
    std::string why;
    for (int tries = 0; (*engine)->reform(&why, [] { return false; }) != FederationEngine::Reform::kFormed; ++tries) {
      if (tries == 200) return Status{ErrorCode::kIo, "no group formed: " + why};
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  return engine;
}

struct SizeResult {
  uint64_t elements = 0;
  double allreduce_ms = 0, round_ms = 0, snapshot_ms = 0, merge_ms = 0, memcpy_ms = 0;
};

Result<SizeResult> measure_size(FederationEngine& engine, const FederationConfig& config, uint64_t n, int rounds,
                                int repeats) {
  ModelFingerprint print;
  print.hash = 0xbe7c4;
  print.total_elements = n;
  print.tensors = 1;
  print.outer = outer_code(config);
  Federator fed(config, engine, print);
  std::vector<float> w(n), exchange(n), payload(n), copy(n);
  std::mt19937 rng(engine.membership().rank + 1);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (float& v : w) v = normal(rng);
  exchange = w;
  if (auto j = fed.join(exchange); !j.ok()) return j.status();
  for (uint64_t i = 0; i < n; ++i) w[i] += exchange[i];
  // Both loops start each timed step together (a small allgather), so
  // that neither counts the others' local passes as its own wait.
  std::vector<std::byte> mark(8), marks(8 * engine.membership().size);
  const auto align = [&] { return engine.allgather(mark, marks); };
  std::vector<double> allreduce, round, snapshot, merge, memcpy_ref;
  for (int rep = 0; rep < repeats; ++rep) {
    std::vector<double> a, r, s, m, c;
    for (int k = 0; k < rounds; ++k) {
      for (uint64_t i = 0; i < n; i += 97) w[i] += 1e-4f;  // a local update's change
      uint64_t t0 = now_ns();
      std::memcpy(exchange.data(), w.data(), n * sizeof(float));  // the consumer's snapshot pass
      const uint64_t snapshot_ns = now_ns() - t0;
      if (Status st = align(); !st.ok()) return st;
      uint64_t t1 = now_ns();
      auto res = fed.round(exchange, 1);
      uint64_t t2 = now_ns();
      if (!res.ok()) return res.status();
      kernels::add_cpu(w.data(), exchange.data(), n);  // the consumer's merge pass (the backends')
      uint64_t t3 = now_ns();
      s.push_back(ms(snapshot_ns));
      r.push_back(ms(t2 - t1));
      m.push_back(ms(t3 - t2));
      t0 = now_ns();
      std::memcpy(copy.data(), w.data(), n * sizeof(float));
      c.push_back(ms(now_ns() - t0));
      bench::escape(copy.data());
    }
    for (int k = 0; k < rounds; ++k) {
      std::fill(payload.begin(), payload.end(), 1e-3f);
      if (Status st = align(); !st.ok()) return st;
      const uint64_t t0 = now_ns();
      if (Status st = engine.allreduce_sum(payload); !st.ok()) return st;
      a.push_back(ms(now_ns() - t0));
    }
    allreduce.push_back(median(a));
    round.push_back(median(r));
    snapshot.push_back(median(s));
    merge.push_back(median(m));
    memcpy_ref.push_back(median(c));
  }
  return SizeResult{n, median(allreduce), median(round), median(snapshot), median(merge), median(memcpy_ref)};
}

int run_round(const po::variables_map& vm, FederationConfig config) {
  const std::string kind = vm["federation"].as<std::string>();
  if (!parse_federation_kind(kind, &config.kind) || config.kind == FederationKind::kNone) {
    std::cerr << "shmps-fed-bench: --federation must be mpi or gloo\n";
    return 2;
  }
  auto engine = join_engine(config);
  if (!engine.ok()) {
    std::cerr << "shmps-fed-bench: " << engine.status().message() << "\n";
    return 1;
  }
  const Membership m = (*engine)->membership();
  std::vector<SizeResult> results;
  for (uint64_t n : vm["elements"].as<std::vector<uint64_t>>()) {
    auto r = measure_size(**engine, config, n, vm["rounds"].as<int>(), vm["repeats"].as<int>());
    if (!r.ok()) {
      std::cerr << "shmps-fed-bench: " << r.status().message() << "\n";
      return 1;
    }
    results.push_back(*r);
  }
  if (m.rank != 0) return 0;
  const auto gbps = [](uint64_t n, double t) { return bench::fixed(static_cast<double>(n) * 4 / t / 1e6, 1); };
  std::printf("Federation round cost: %s, %u hosts, outer %s (medians of %d repeats of %d rounds)\n", (*engine)->name(),
              m.size, outer_step_name(config.outer), vm["repeats"].as<int>(), vm["rounds"].as<int>());
  bench::Table t("round", {"model", "allreduce ms", "round ms", "round/allreduce", "snapshot ms (GB/s)",
                           "merge ms (GB/s)", "memcpy ms (GB/s)"});
  std::ostringstream json;
  json << "{\"engine\":\"" << (*engine)->name() << "\",\"hosts\":" << m.size << ",\"sizes\":[";
  for (size_t i = 0; i < results.size(); ++i) {
    const SizeResult& r = results[i];
    t.add_row({bench::fixed(static_cast<double>(r.elements) * 4 / 1024, 0) + " KiB", bench::fixed(r.allreduce_ms, 3),
               bench::fixed(r.round_ms, 3), bench::fixed(r.round_ms / r.allreduce_ms, 2),
               bench::fixed(r.snapshot_ms, 3) + " (" + gbps(r.elements, r.snapshot_ms) + ")",
               bench::fixed(r.merge_ms, 3) + " (" + gbps(r.elements, r.merge_ms) + ")",
               bench::fixed(r.memcpy_ms, 3) + " (" + gbps(r.elements, r.memcpy_ms) + ")"});
    json << (i ? "," : "") << "{\"elements\":" << r.elements << ",\"allreduce_ms\":" << r.allreduce_ms
         << ",\"round_ms\":" << r.round_ms << ",\"snapshot_ms\":" << r.snapshot_ms << ",\"merge_ms\":" << r.merge_ms
         << ",\"memcpy_ms\":" << r.memcpy_ms << "}";
  }
  t.print(stdout);
  std::printf("RESULT %s]}\n", json.str().c_str());
  return 0;
}

int run_serve(const po::variables_map& vm) {
  WorkerOptions options;
  options.name = vm["connect"].as<std::string>();
  auto w = Worker::connect(options);
  if (!w.ok()) {
    std::cerr << "shmps-fed-bench: " << w.status().message() << "\n";
    return 1;
  }
  const uint64_t n = vm["elements"].as<std::vector<uint64_t>>().front();
  auto grad = (*w)->register_buffer(n * sizeof(float));
  if (!grad.ok()) {
    std::cerr << "shmps-fed-bench: " << grad.status().message() << "\n";
    return 1;
  }
  std::fill_n(static_cast<float*>(grad->data), n, 1e-4f);
  const int pushes = vm["pushes"].as<int>();
  std::vector<double> us;
  us.reserve(static_cast<size_t>(pushes));
  uint64_t version = 0;
  const uint64_t start = now_ns();
  for (int k = 0; k < pushes; ++k) {
    const uint64_t t0 = now_ns();
    auto v = (*w)->push(0, grad->id, 0, n * sizeof(float), Dtype::kF32, version);
    us.push_back(static_cast<double>(now_ns() - t0) / 1e3);
    if (!v.ok()) {
      std::cerr << "shmps-fed-bench: push " << k << ": " << v.status().message() << "\n";
      return 1;
    }
    version = *v;
  }
  const double seconds = static_cast<double>(now_ns() - start) / 1e9;
  const double p50 = bench::percentile(us, 0.5), p99 = bench::percentile(us, 0.99), max = bench::percentile(us, 1.0);
  std::printf("%d pushes of %llu floats to %s: round trip p50 %.1f us, p99 %.1f us, max %.1f us; %.0f pushes/s\n",
              pushes, static_cast<unsigned long long>(n), options.name.c_str(), p50, p99, max, pushes / seconds);
  std::printf("RESULT {\"p50_us\":%.3f,\"p99_us\":%.3f,\"max_us\":%.3f,\"pushes_per_s\":%.1f}\n", p50, p99, max,
              pushes / seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  FederationConfig config;
  std::string outer = "average";
  po::options_description desc(
      "shmps-fed-bench round|serve: the federation's round cost against its engine's bare allreduce, or push round "
      "trips at a (federated) server (bench/federation.py)");
  desc.add_options()("help,h", "print this help and exit")("mode", po::value<std::string>()->default_value("round"),
                                                           "round | serve")(
      "federation", po::value<std::string>()->default_value("gloo"), "round: mpi | gloo")(
      "fed-store", po::value(&config.store), "gloo: where the hosts meet")(
      "fed-hosts", po::value(&config.hosts)->default_value(0), "gloo: the hosts")(
      "fed-host", po::value(&config.host)->default_value(0), "gloo: this host's id")(
      "fed-address", po::value(&config.address)->default_value("127.0.0.1"), "gloo: the address to listen on")(
      "fed-timeout-ms", po::value(&config.timeout_ms)->default_value(30000), "gloo: the collectives' timeout")(
      "fed-outer", po::value(&outer)->default_value("average"), "average | nesterov")(
      "elements",
      po::value<std::vector<uint64_t>>()->multitoken()->default_value({203530, 16777216}, "203530 16777216"),
      "model sizes in floats (serve: the first)")("rounds", po::value<int>()->default_value(20), "round: per repeat")(
      "repeats", po::value<int>()->default_value(5), "round: repeats")(
      "connect", po::value<std::string>()->default_value(""), "serve: the server's name")(
      "pushes", po::value<int>()->default_value(2000), "serve: pushes");
  po::positional_options_description positional;
  positional.add("mode", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).positional(positional).run(), vm);
    po::notify(vm);
  } catch (const std::exception& e) {
    std::cerr << "shmps-fed-bench: " << e.what() << "\n";
    return 2;
  }
  if (vm.count("help") != 0) {
    std::cout << desc << "\n";
    return 0;
  }
  // Counts below 1 would divide by zero (NaN in the JSON) or size a vector
  // from a negative number.
  for (const char* count : {"pushes", "rounds", "repeats"}) {
    if (const int v = vm[count].as<int>(); v < 1) {
      std::cerr << "shmps-fed-bench: --" << count << " must be >= 1, got " << v << "\n";
      return 2;
    }
  }
  for (const uint64_t n : vm["elements"].as<std::vector<uint64_t>>()) {
    if (n == 0) {
      std::cerr << "shmps-fed-bench: --elements must be >= 1\n";
      return 2;
    }
  }
  if (!parse_outer_step(outer, &config.outer)) {
    std::cerr << "shmps-fed-bench: --fed-outer must be average or nesterov\n";
    return 2;
  }
  const std::string mode = vm["mode"].as<std::string>();
  if (mode == "round") return run_round(vm, config);
  if (mode == "serve") return run_serve(vm);
  std::cerr << "shmps-fed-bench: the mode is round or serve, got '" << mode << "'\n";
  return 2;
}
