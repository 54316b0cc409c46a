#include "shmps/server/options.hpp"

#include <boost/program_options.hpp>
#include <fstream>
#include <sstream>

namespace po = boost::program_options;

namespace shmps::server {

Result<shm::TensorSpec> parse_tensor(const std::string& text) {
  const auto bad = [&](const std::string& why) {
    return Status{ErrorCode::kInvalidArgument, "--tensor '" + text + "': " + why + " (expected NAME:DIMxDIM[:f32])"};
  };
  const size_t c1 = text.find(':');
  if (c1 == std::string::npos || c1 == 0) return bad("no name");
  shm::TensorSpec t;
  t.name = text.substr(0, c1);
  const size_t c2 = text.find(':', c1 + 1);
  const std::string shape = text.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
  if (c2 != std::string::npos) {
    const std::string dtype = text.substr(c2 + 1);
    if (dtype != "f32" && dtype != "float32") return bad("weights are fp32 only, got dtype '" + dtype + "'");
  }
  std::stringstream ss(shape);
  std::string dim;
  while (std::getline(ss, dim, 'x')) {
    if (dim.empty() || dim.find_first_not_of("0123456789") != std::string::npos || dim.size() > 12)
      return bad("bad dimension '" + dim + "'");
    const uint64_t d = std::stoull(dim);
    if (d == 0) return bad("dimension 0");
    t.shape.push_back(d);
  }
  if (t.shape.empty() || t.shape.size() > shm::kMaxDims) return bad("1..4 dimensions");
  return t;
}

Result<ParsedOptions> parse_options(int argc, const char* const* argv) {
  ParsedOptions out;
  ServerConfig& c = out.config;
  kernels::OptimizerConfig& o = c.optimizer;
  std::string config_file, optimizer = "sgd", backend = "auto", init = "zero";
  std::vector<std::string> tensors;
  float weight_decay = 0.0f;

  po::options_description generic("General");
  generic.add_options()
      ("help,h", "print this help and exit")
      ("config", po::value(&config_file), "read options from this file (key = value lines)");
  po::options_description server("Server (also valid in the config file)");
  server.add_options()
      ("name", po::value(&c.name), "instance name: the segment is /dev/shm/shmps.<name> (required)")
      ("tensor", po::value(&tensors)->composing(), "NAME:SHAPE[:f32], e.g. fc1.weight:256x784; repeatable, in order (required)")
      ("optimizer", po::value(&optimizer)->default_value("sgd"), "sgd | adam | adamw")
      ("lr", po::value(&o.lr)->default_value(0.001f), "learning rate (> 0)")
      ("momentum", po::value(&o.momentum)->default_value(0.0f), "SGD momentum (>= 0)")
      ("dampening", po::value(&o.dampening)->default_value(0.0f), "SGD dampening (>= 0)")
      ("nesterov", po::bool_switch(&o.nesterov), "SGD Nesterov momentum (needs momentum > 0, dampening 0)")
      ("weight-decay", po::value(&weight_decay), "L2 penalty (SGD, Adam) or decoupled decay (AdamW); default 0, AdamW 0.01")
      ("beta1", po::value(&o.beta1)->default_value(0.9f), "Adam beta1 in [0, 1)")
      ("beta2", po::value(&o.beta2)->default_value(0.999f), "Adam beta2 in [0, 1)")
      ("eps", po::value(&o.eps)->default_value(1e-8f), "Adam epsilon (> 0)")
      ("amsgrad", po::bool_switch(&o.amsgrad), "Adam/AdamW AMSGrad variant")
      ("max-staleness", po::value(&c.max_staleness)->default_value(4), "reject pushes computed more than this many versions ago")
      ("allow-nonfinite", po::bool_switch(&c.allow_nonfinite), "apply gradients holding NaN or Inf (rejected by default)")
      ("ring-capacity", po::value(&c.lane_capacity)->default_value(64), "slots per worker request lane (power of two)")
      ("max-workers", po::value(&c.max_workers)->default_value(16), "worker table size (1..256)")
      ("max-buffers", po::value(&c.max_buffers)->default_value(16), "registered buffers per worker (1..64)")
      ("backend", po::value(&backend)->default_value("auto"), "host | cuda | auto (cuda when a device is present)")
      ("init", po::value(&init)->default_value("zero"), "initial weights: zero | normal | uniform | file")
      ("init-scale", po::value(&c.init.scale)->default_value(0.01f), "normal: stddev; uniform: half-width")
      ("init-seed", po::value(&c.init.seed)->default_value(1), "seed of normal/uniform init")
      ("init-file", po::value(&c.init.file), "raw little-endian fp32, all tensors in order (implies --init file)")
      ("group-access", po::bool_switch(&c.group_access), "create the segment with mode 0660 instead of 0600")
      ("idle-spin-us", po::value(&c.idle_spin_us)->default_value(50), "spin this long on an empty ring before sleeping");
  po::options_description all;
  all.add(generic).add(server);

  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, all), vm);
    if (vm.count("config")) {
      const std::string file = vm["config"].as<std::string>();
      std::ifstream in(file);
      if (!in) return Status{ErrorCode::kInvalidArgument, "--config " + file + ": cannot open"};
      try {
        po::store(po::parse_config_file(in, server, /*allow_unregistered=*/false), vm);
      } catch (const po::error& e) {
        return Status{ErrorCode::kInvalidArgument, "config file " + file + ": " + e.what()};
      }
    }
    if (vm.count("help")) {
      std::ostringstream text;
      text << "shmps-server: a parameter server for the workers of one host\n\n" << all;
      out.help = true;
      out.help_text = text.str();
      return out;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    return Status{ErrorCode::kInvalidArgument, e.what()};
  }

  if (c.name.empty()) return Status{ErrorCode::kInvalidArgument, "--name is required"};
  if (Status s = shm::validate_name(c.name); !s.ok()) return Status{s.code(), "--name: " + s.message()};
  if (tensors.empty()) return Status{ErrorCode::kInvalidArgument, "at least one --tensor is required"};
  for (const std::string& t : tensors) {
    auto spec = parse_tensor(t);
    if (!spec.ok()) return spec.status();
    c.tensors.push_back(std::move(spec).value());
  }
  if (!kernels::parse_optimizer_kind(optimizer, &o.kind))
    return Status{ErrorCode::kInvalidArgument, "--optimizer must be sgd, adam or adamw, got '" + optimizer + "'"};
  o.weight_decay = vm.count("weight-decay") ? weight_decay : (o.kind == kernels::OptimizerKind::kAdamW ? 0.01f : 0.0f);
  if (std::string err = kernels::validate(o); !err.empty()) return Status{ErrorCode::kInvalidArgument, err};
  if (backend == "host") c.backend = BackendKind::kHost;
  else if (backend == "cuda") c.backend = BackendKind::kCuda;
  else if (backend == "auto") c.backend = BackendKind::kAuto;
  else return Status{ErrorCode::kInvalidArgument, "--backend must be host, cuda or auto, got '" + backend + "'"};
  if (vm.count("init-file")) init = "file";
  if (init == "zero") c.init.kind = InitSpec::Kind::kZero;
  else if (init == "normal") c.init.kind = InitSpec::Kind::kNormal;
  else if (init == "uniform") c.init.kind = InitSpec::Kind::kUniform;
  else if (init == "file") {
    if (c.init.file.empty()) return Status{ErrorCode::kInvalidArgument, "--init file needs --init-file PATH"};
    c.init.kind = InitSpec::Kind::kFile;
  } else {
    return Status{ErrorCode::kInvalidArgument, "--init must be zero, normal, uniform or file, got '" + init + "'"};
  }
  return out;
}

}  // namespace shmps::server
