// The config file as an operator writes it: errors that name the file, the
// line and the key; the shipped example (server/shmps.conf.example) parses
// and documents every option; config_entries() round-trips; and a reload in
// process applies lr / max_staleness / log level live and nothing else.
#define BOOST_TEST_MODULE test_service_config
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "backend.hpp"
#include "reload.hpp"
#include "server_support.hpp"
#include "service.hpp"
#include "shmps/server/log.hpp"
#include "shmps/server/options.hpp"
#include "shmps/server/server.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"

using namespace shmps;
using namespace shmps::server;

namespace {

// A config file for the scope of a test.
struct ConfFile {
  explicit ConfFile(const std::string& body) : path("/tmp/" + test::unique_name("shmps_conf") + ".conf") {
    std::ofstream(path) << body;
  }
  ~ConfFile() { ::unlink(path.c_str()); }
  std::string path;
};

// parse_options' error for a config file holding `body`.
std::string file_error(const std::string& body, std::vector<std::string> extra = {}) {
  ConfFile f(body);
  std::vector<std::string> args{"--config", f.path};
  args.insert(args.end(), extra.begin(), extra.end());
  auto p = test::parse_server_args(args);
  BOOST_TEST(!p.ok(), "accepted:\n" << body);
  const std::string m = p.ok() ? std::string() : p.status().message();
  BOOST_TEST(m.find("config file " + f.path + " line ") == 0u, m);
  return m;
}

// parse_options' error for a server named j of tensor w:4 and `extra`.
std::string refusal(const std::vector<std::string>& extra) {
  std::vector<std::string> args{"--name", "j", "--tensor", "w:4"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto p = test::parse_server_args(args);
  BOOST_TEST(!p.ok(), "accepted: " << extra[0] << " " << extra[1]);
  return p.ok() ? std::string() : p.status().message();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

using shmps::test::read_file;

const std::string kHead = "name = j\ntensor = w:4\n";  // lines 1-2

// What the server logs (stderr, redirected to a file for the call) while
// apply_live() reloads `running` to `next`; the log level is `running`'s
// before and `next`'s after.
std::string reload_log(ServerConfig running, const ServerConfig& next) {
  test::TempDir dir("reloadlog");
  const std::string path = (dir.path / "stderr").string();
  LogLevel after;
  {
    test::StderrTo capture(path);
    log::set_level(running.log_level);
    shm::ConfigBlock shared{};
    apply_live(running, next, shared);
    after = log::level();
  }
  log::set_level(LogLevel::kInfo);
  BOOST_TEST((after == next.log_level));
  BOOST_TEST((running.log_level == next.log_level));
  return read_file(path);
}

// The in-process reload tests' server: one tensor of 4, lr 1,
// max-staleness 8.
ServerConfig reload_config(const std::string& tag) {
  ServerConfig config;
  config.name = test::unique_name(tag);
  config.tensors = {{"w", {4}}};
  config.optimizer.lr = 1.0f;
  config.max_staleness = 8;
  return config;
}

// A worker of such a server: a gradient buffer of 1s, and a buffer to
// pull the weights into.
struct ReloadWorker {
  explicit ReloadWorker(const std::string& name) {
    WorkerOptions o;
    o.name = name;
    auto connected = Worker::connect(o);
    BOOST_REQUIRE(connected.ok());
    w = std::move(connected).value();
    auto g = w->register_buffer(16);
    auto p = w->register_buffer(16);
    BOOST_REQUIRE(g.ok() && p.ok());
    grad = *g;
    weights = *p;
    std::fill_n(static_cast<float*>(grad.data), 4, 1.0f);
  }
  std::unique_ptr<Worker> w;
  Buffer grad, weights;
};

std::unique_ptr<Server> create_server(const ServerConfig& config) {
  auto created = Server::create(config);
  BOOST_REQUIRE_MESSAGE(created.ok(), created.status().to_string());
  return std::move(created).value();
}

}  // namespace

BOOST_AUTO_TEST_SUITE(service_config)

BOOST_AUTO_TEST_CASE(config_file_errors_name_the_line_and_the_key) {
  BOOST_TEST(contains(file_error(kHead + "learning-rate = 0.1\n"), "line 3: unknown key 'learning-rate'"));
  BOOST_TEST(contains(file_error(kHead + "# lr = 1\n\nlr = fast\n"), "line 5: key 'lr': invalid value 'fast'"));
  BOOST_TEST(
      contains(file_error(kHead + "max-staleness = many\n"), "line 3: key 'max-staleness': invalid value 'many'"));
  BOOST_TEST(contains(file_error(kHead + "lr = -1\n"), "line 3: key 'lr': must be"));
  BOOST_TEST(
      contains(file_error(kHead + "ring-capacity = 48\n"), "line 3: key 'ring-capacity': must be a power of two"));
  BOOST_TEST(contains(file_error(kHead + "max-workers = 0\n"), "line 3: key 'max-workers': must be in 1..256"));
  BOOST_TEST(
      contains(file_error(kHead + "optimizer = rmsprop\n"), "line 3: key 'optimizer': must be sgd, adam or adamw"));
  BOOST_TEST(contains(file_error(kHead + "backend = tpu\n"), "line 3: key 'backend'"));
  BOOST_TEST(contains(file_error(kHead + "log-level = loud\n"),
                      "line 3: key 'log-level': must be error, warn, info or debug"));
  BOOST_TEST(contains(file_error(kHead + "nesterov = true\n"), "line 3: key 'nesterov': requires --momentum > 0"));
  BOOST_TEST(contains(file_error(kHead + "init = file\n"), "line 3: key 'init': file needs --init-file"));
  BOOST_TEST(contains(file_error("name = a/b\ntensor = w:4\n"), "line 1: key 'name'"));
  // The second tensor line is the bad one.
  BOOST_TEST(contains(file_error(kHead + "tensor = b:0x3\n"), "line 3: key 'tensor': 'b:0x3': dimension 0"));
  BOOST_TEST(contains(file_error(kHead + "lr = 0.1\nlr = 0.2\n"), "line 4: key 'lr' is already set on line 3"));
  BOOST_TEST(contains(file_error(kHead + "lr 0.1\n"), "line 3: expected 'key = value', got 'lr 0.1'"));
  BOOST_TEST(contains(file_error(kHead + "[server]\n"), "line 3: sections ('[server]') are not supported"));
  BOOST_TEST(contains(file_error(kHead + "config = other.conf\n"),
                      "line 3: unknown key 'config' (valid on the command line only)"));
  BOOST_TEST(contains(file_error(kHead + "parent-pid = 1\n"),
                      "line 3: unknown key 'parent-pid' (valid on the command line only)"));
  BOOST_TEST(contains(file_error(kHead + " = 3\n"), "line 3: no key before '='"));
  // A blanked switch is refused (program_options would read it as true).
  for (const char* key : {"allow-nonfinite", "group-access", "nesterov", "amsgrad"})
    BOOST_TEST(contains(file_error(kHead + key + " =\n"), std::string("line 3: key '") + key + "' has no value"));
}

// A value in quotes: a config file takes values as written, so
// `checkpoint-dir = "/tmp/x"` would name a directory '"' under the
// working directory. No option's value begins and ends with a quote.
BOOST_AUTO_TEST_CASE(a_value_in_quotes_is_refused_naming_the_fix) {
  BOOST_TEST(
      file_error(kHead + "checkpoint-dir = \"/tmp/x\"\n")
          .ends_with(
              " line 3: key 'checkpoint-dir': the value \"/tmp/x\" is in quotes, which a config file keeps as part "
              "of it; write it without them: checkpoint-dir = /tmp/x"),
      file_error(kHead + "checkpoint-dir = \"/tmp/x\"\n"));
  BOOST_TEST(contains(file_error(kHead + "init-file = '/var/lib/shmps/w.f32'   # a comment\n"),
                      " line 3: key 'init-file': the value '/var/lib/shmps/w.f32' is in quotes"));
  BOOST_TEST(contains(file_error("name = 'j'\ntensor = w:4\n"), " line 1: key 'name': the value 'j' is in quotes"));
  BOOST_TEST(
      contains(file_error(kHead + "tensor = \"v:4\"\n"), " line 3: key 'tensor': the value \"v:4\" is in quotes"));
  BOOST_TEST(contains(file_error(kHead + "lr = \"0.1\"\n"), " line 3: key 'lr': the value \"0.1\" is in quotes"));
  BOOST_TEST(contains(file_error(kHead + "optimizer = ''\n"), " line 3: key 'optimizer': the value '' is in quotes"));
  // A quote inside a value, or at one end only, is the value's (a tensor
  // name may hold one).
  const ConfFile inner(kHead + "tensor = it's:4\n");
  auto p = test::parse_server_args({"--config", inner.path});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().message());
  BOOST_TEST(p->config.tensors.back().name == "it's");
}

// A relative path in a config file is refused: the service's working
// directory (/) is neither the file's directory nor that of an admin
// running --check-config by hand. One on the command line means the
// working directory's, and the configuration holds it made absolute.
BOOST_AUTO_TEST_CASE(relative_paths_are_refused_in_the_file_and_made_absolute_on_the_command_line) {
  const std::string fix =
      ", which would be taken from the server's working directory (/ under systemd), not from "
      "this file's; write an absolute path";
  BOOST_TEST(file_error(kHead + "checkpoint-dir = ckpt\n")
                 .ends_with(" line 3: key 'checkpoint-dir': 'ckpt' is a "
                            "relative path" +
                            fix),
             file_error(kHead + "checkpoint-dir = ckpt\n"));
  BOOST_TEST(contains(file_error(kHead + "init-file = ./w.f32\n"),
                      " line 3: key 'init-file': './w.f32' is a relative path" + fix));
  BOOST_TEST(contains(file_error(kHead + "checkpoint-dir = ~/ckpt\n"),
                      " line 3: key 'checkpoint-dir': '~/ckpt' is a relative path" + fix));
  const std::string gloo = "federation = gloo\nfed-hosts = 1\n";
  BOOST_TEST(contains(file_error(kHead + gloo + "fed-store = file:store\n"),
                      " line 5: key 'fed-store': 'store' (after file:) is a relative path" + fix));
  // Absolute ones, and a fed-store that names no path, pass.
  const std::string dir = std::filesystem::temp_directory_path().string();
  for (const std::string& line :
       {"checkpoint-dir = " + dir + "/ckpt\nfed-store = redis:h", "fed-store = file:" + dir + "/store",
        std::string("fed-store = redis:localhost/job")}) {
    const ConfFile f(kHead + gloo + line + "\n");
    auto p = test::parse_server_args({"--config", f.path});
    BOOST_TEST(p.ok(), line << ": " << p.status().message());
  }
  // The command line's relative paths are the working directory's.
  const std::string cwd = std::filesystem::current_path().string();
  auto p =
      test::parse_server_args({"--name", "j", "--tensor", "w:4", "--checkpoint-dir", "ckpt", "--init-file", "./w.f32",
                               "--federation", "gloo", "--fed-hosts", "1", "--fed-store", "file:store"});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().message());
  BOOST_TEST(p->config.checkpoint_dir == cwd + "/ckpt");
  BOOST_TEST(p->config.init.file == cwd + "/./w.f32");
  BOOST_TEST(p->config.federation.store == "file:" + cwd + "/store");
  auto redis = test::parse_server_args(
      {"--name", "j", "--tensor", "w:4", "--federation", "gloo", "--fed-hosts", "1", "--fed-store", "redis:h/job"});
  BOOST_REQUIRE_MESSAGE(redis.ok(), redis.status().message());
  BOOST_TEST(redis->config.federation.store == "redis:h/job");
  // The checkpoint directory in one form, from the command line and from
  // the file: no "." component, repeated or trailing slash; ".." kept (a
  // link before it would make a lexical step up name another directory).
  auto tidy = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--checkpoint-dir", "ckpt/.//job/"});
  BOOST_REQUIRE_MESSAGE(tidy.ok(), tidy.status().message());
  BOOST_TEST(tidy->config.checkpoint_dir == cwd + "/ckpt/job");
  const ConfFile f(kHead + "checkpoint-dir = " + dir + "//link/../job/\n");
  auto from_file = test::parse_server_args({"--config", f.path});
  BOOST_REQUIRE_MESSAGE(from_file.ok(), from_file.status().message());
  BOOST_TEST(from_file->config.checkpoint_dir == dir + "/link/../job");
}

BOOST_AUTO_TEST_CASE(malformed_tensors_name_the_problem_and_the_expected_form) {
  const std::string form = "; expected NAME:D0xD1x... such as fc1.weight:256x784";
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"fc1.weight", "no shape"},  // the name is there; the shape is missing
           {"", "empty"},
           {":256", "no name before ':'"},
           {"w:", "no shape after ':'"},
           {"w::f32", "no shape after ':'"},
           {"w:3:", "empty dtype after the second ':' (weights are f32)"},
           {"w:0x3", "dimension 0 in shape '0x3' (every dimension must be at least 1)"},
           {"w:3x0", "dimension 0 in shape '3x0' (every dimension must be at least 1)"},
           {"w:3xa", "dimension 'a' is not a positive integer (dimensions are separated by 'x')"},
           {"w:256X784", "dimension '256X784' is not a positive integer (dimensions are separated by 'x')"},
           {"w:-3", "dimension '-3' is not a positive integer (dimensions are separated by 'x')"},
           {"w:3x", "shape '3x' ends with 'x'"},  // not w:3
           {"w:x3", "shape 'x3' starts with 'x'"},
           {"w:3xx4", "shape '3xx4' has an empty dimension between two 'x'"},
           {"w:1234567890123", "dimension 1234567890123 is too large"},
           {"w:1x2x3x4x5", "5 dimensions in shape '1x2x3x4x5'; at most 4"}}) {
    auto p = parse_tensor(text);
    BOOST_TEST(!p.ok(), "accepted '" << text << "'");
    if (!p.ok()) BOOST_TEST(p.status().message() == "--tensor '" + text + "': " + why + form);
  }
  for (const std::string good : {"w:3", "w:3x4:f32", "w:1x2x3x4", "w:7:float32"})
    BOOST_TEST(parse_tensor(good).ok(), good);
  // From the file: the line, then the same text.
  BOOST_TEST(
      contains(file_error(kHead + "tensor = fc1.weight\n"), "line 3: key 'tensor': 'fc1.weight': no shape" + form));
}

BOOST_AUTO_TEST_CASE(hyperparameters_the_optimizer_does_not_use_are_refused) {
  BOOST_TEST(refusal({"--optimizer", "adam", "--momentum", "0.9"}) ==
             "--optimizer adam does not use --momentum: an SGD option; remove it, or choose --optimizer sgd");
  BOOST_TEST(
      refusal({"--optimizer", "adamw", "--nesterov", "--dampening", "0.1"}) ==
      "--optimizer adamw does not use --dampening and --nesterov: SGD options; remove them, or choose --optimizer sgd");
  BOOST_TEST(refusal({"--optimizer", "sgd", "--beta1", "0.8", "--amsgrad", "--eps", "1e-6"}) ==
             "--optimizer sgd does not use --beta1, --eps and --amsgrad: Adam/AdamW options; remove them, or choose "
             "--optimizer adam or adamw");
  // sgd by default; a value equal to the default is still given.
  BOOST_TEST(
      refusal({"--beta2", "0.999"}) ==
      "--optimizer sgd does not use --beta2: an Adam/AdamW option; remove it, or choose --optimizer adam or adamw");
  BOOST_TEST(
      refusal({"--optimizer", "adam", "--momentum", "0"}).rfind("--optimizer adam does not use --momentum:", 0) == 0u);
  // From the file, each key with its line; the command line's as options.
  const ConfFile f(kHead + "optimizer = adam\nmomentum = 0.9\n");
  auto from_file = test::parse_server_args({"--config", f.path, "--nesterov"});
  BOOST_REQUIRE(!from_file.ok());
  BOOST_TEST(from_file.status().message() ==
             "--optimizer adam does not use momentum (config file " + f.path +
                 " line 4) and --nesterov: SGD options; remove them, or choose --optimizer sgd");
  // What each reads is accepted; defaults of the others do not count.
  for (const std::vector<std::string>& ok : std::vector<std::vector<std::string>>{
           {"--optimizer", "adam"},
           {"--optimizer", "adam", "--beta1", "0.8", "--beta2", "0.99", "--eps", "1e-6", "--amsgrad", "--lr", "0.01",
            "--weight-decay", "0.1"},
           {"--optimizer", "adamw", "--amsgrad"},
           {"--optimizer", "sgd", "--momentum", "0.9", "--nesterov", "--weight-decay", "0.1"},
           {"--momentum", "0.9", "--dampening", "0.5"}}) {
    std::vector<std::string> args{"--name", "j", "--tensor", "w:4"};
    args.insert(args.end(), ok.begin(), ok.end());
    auto p = test::parse_server_args(args);
    BOOST_TEST(p.ok(), ok[0] << " " << ok[1] << ": " << p.status().message());
  }
  // --check-config prints what the optimizer reads, so its output parses back.
  auto adam = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--optimizer", "adam"});
  auto sgd = test::parse_server_args({"--name", "j", "--tensor", "w:4"});
  BOOST_REQUIRE(adam.ok() && sgd.ok());
  std::set<std::string> adam_keys, sgd_keys;
  for (const auto& e : config_entries(adam->config)) adam_keys.insert(e.first);
  for (const auto& e : config_entries(sgd->config)) sgd_keys.insert(e.first);
  for (const std::string k : {"momentum", "dampening", "nesterov"}) {
    BOOST_TEST(adam_keys.count(k) == 0u, k);
    BOOST_TEST(sgd_keys.count(k) == 1u, k);
  }
  for (const std::string k : {"beta1", "beta2", "eps", "amsgrad"}) {
    BOOST_TEST(adam_keys.count(k) == 1u, k);
    BOOST_TEST(sgd_keys.count(k) == 0u, k);
  }
  for (const std::string k : {"lr", "weight-decay"}) BOOST_TEST(adam_keys.count(k) + sgd_keys.count(k) == 2u, k);
}

// The rule of the optimizer's hyperparameters, for every option read only
// under some setting: given where nothing reads it, it is refused.
BOOST_AUTO_TEST_CASE(options_the_configuration_does_not_read_are_refused) {
  BOOST_TEST(refusal({"--init-scale", "nan", "--init-seed", "3"}) ==
             "--init zero does not use --init-scale and --init-seed: options of --init normal and uniform; remove "
             "them, or choose --init normal or uniform");
  // --init-file implies --init file only where --init is not given.
  BOOST_TEST(refusal({"--init", "normal", "--init-file", "/tmp/w.f32"}) ==
             "--init normal does not use --init-file: an option of --init file; remove it, or choose --init file");
  BOOST_TEST(refusal({"--init", "file", "--init-file", "/tmp/w.f32", "--init-seed", "2"}) ==
             "--init file does not use --init-seed: an option of --init normal and uniform; remove it, or choose "
             "--init normal or uniform");
  BOOST_TEST(refusal({"--backend", "host", "--device", "GPU-1234"}) ==
             "--backend host does not use --device: an option of --backend cuda and auto; remove it, or choose "
             "--backend cuda or auto");
  BOOST_TEST(refusal({"--checkpoint-keep", "5"}) ==
             "a server without --checkpoint-dir does not use --checkpoint-keep: a checkpoint option; remove it, or "
             "give --checkpoint-dir DIR");
  // A federation's options without one; Gloo's elsewhere; the outer
  // step's hyperparameters without nesterov. A switch given false counts.
  BOOST_TEST(refusal({"--fed-every-ms", "100", "--fed-store", "file:/tmp/s", "--fed-unweighted"}) ==
             "--federation none does not use --fed-every-ms, --fed-unweighted and --fed-store: federation options; "
             "remove them, or choose --federation mpi or gloo");
  BOOST_TEST(refusal({"--federation", "mpi", "--fed-timeout-ms", "2000"}) ==
             "--federation mpi does not use --fed-timeout-ms: an option of --federation gloo; remove it, or choose "
             "--federation gloo");
  BOOST_TEST(refusal({"--federation", "mpi", "--fed-outer-lr", "0.5"}) ==
             "--fed-outer average does not use --fed-outer-lr: an option of --fed-outer nesterov; remove it, or "
             "choose --fed-outer nesterov");
  // From the file, with its line.
  const ConfFile f(kHead + "federation = mpi\nfed-rank-in-name = false\nfed-hosts = 3\n");
  auto from_file = test::parse_server_args({"--config", f.path});
  BOOST_REQUIRE(!from_file.ok());
  BOOST_TEST(from_file.status().message() == "--federation mpi does not use fed-hosts (config file " + f.path +
                                                 " line 5): an option of --federation gloo; remove it, or choose "
                                                 "--federation gloo");
  // What each setting reads is accepted, and --check-config prints only
  // what is read (so its output parses back).
  for (const std::vector<std::string>& ok : std::vector<std::vector<std::string>>{
           {"--init", "uniform", "--init-scale", "0.5", "--init-seed", "9"},
           {"--init-file", "/tmp/w.f32"},
           {"--backend", "cuda", "--device", "GPU-1234"},
           {"--device", "GPU-1234"},
           {"--checkpoint-dir", "/tmp/ck", "--checkpoint-keep", "5", "--checkpoint-every", "3"},
           {"--federation", "mpi", "--fed-every-ms", "100", "--fed-rank-in-name", "--fed-outer", "nesterov",
            "--fed-outer-lr", "0.5"},
           {"--federation", "gloo", "--fed-store", "file:/tmp/s", "--fed-hosts", "2", "--fed-timeout-ms", "900"}}) {
    std::vector<std::string> args{"--name", "j", "--tensor", "w:4"};
    args.insert(args.end(), ok.begin(), ok.end());
    auto p = test::parse_server_args(args);
    BOOST_TEST_REQUIRE(p.ok(), ok[0] << " " << ok[1] << ": " << p.status().message());
    std::string body;
    for (const auto& [key, value] : config_entries(p->config)) body += key + " = " + value + "\n";
    ConfFile printed(body);
    auto back = test::parse_server_args({"--config", printed.path});
    BOOST_TEST(back.ok(), ok[0] << " " << ok[1] << ": " << back.status().message() << "\n" << body);
  }
  std::set<std::string> keys;
  auto plain = test::parse_server_args({"--name", "j", "--tensor", "w:4"});
  BOOST_REQUIRE(plain.ok());
  for (const auto& e : config_entries(plain->config)) keys.insert(e.first);
  for (const std::string k : {"init-scale", "init-seed", "checkpoint-keep", "fed-every-ms", "fed-store"})
    BOOST_TEST(keys.count(k) == 0u, k);
  BOOST_TEST(keys.count("federation") == 1u);
}

BOOST_AUTO_TEST_CASE(hostile_values_are_refused_not_wrapped_or_cut) {
  // lexical_cast read "-1" for an unsigned option as 2^64 - 1 (or 2^32 - 1),
  // and "-4294967295" as 1.
  for (const std::string key : {"max-staleness", "max-workers", "checkpoint-keep", "idle-spin-us", "init-seed",
                                "checkpoint-every", "stopped-worker-timeout-ms"}) {
    BOOST_TEST(
        contains(file_error(kHead + key + " = -1\n"), "line 3: key '" + key + "': must be a non-negative integer"));
    auto cmdline = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--" + key + "=-1"});
    BOOST_TEST(!cmdline.ok(), key);
    if (!cmdline.ok()) BOOST_TEST(contains(cmdline.status().message(), "--" + key + " must be a non-negative integer"));
  }
  BOOST_TEST(contains(file_error(kHead + "max-workers = -4294967295\n"), "must be a non-negative integer"));
  // A NUL cut "/tmp/ckA\0evil" to "/tmp/ckA"; an empty path turned the
  // feature off without a word.
  BOOST_TEST(
      contains(file_error(kHead + std::string("checkpoint-dir = /tmp/ckA\0evil\n", 31)), "line 3: holds a NUL byte"));
  BOOST_TEST(contains(file_error(kHead + "checkpoint-dir =\n"), "line 3: key 'checkpoint-dir': is an empty path"));
  BOOST_TEST(contains(file_error(kHead + "init-file =\n"), "line 3: key 'init-file': is an empty path"));
  // init-scale: NaN weights, or a negative stddev; past 1e30, draws that
  // overflow the float range.
  for (const char* scale : {"nan", "inf", "-1", "0", "1e38"})
    BOOST_TEST(contains(file_error(kHead + "init = uniform\ninit-scale = " + scale + "\n"),
                        "line 4: key 'init-scale': must be > 0 and at most 1e30"),
               scale);
  // A forgotten --config: the word is refused by name (program_options
  // would drop it, and the server start with none of the file's options).
  auto stray = test::parse_server_args({"--name", "j", "--tensor", "w:4", "job1.conf"});
  BOOST_TEST_REQUIRE(!stray.ok());
  BOOST_TEST(stray.status().message() == "unexpected argument 'job1.conf': every option is --name value (see --help)");
  // A key the command line gives too: the command line's value wins, and
  // the file's line is named as not used (logged at start and reload).
  {
    const std::string path = "/tmp/shmps_cfg_shadow_" + std::to_string(::getpid()) + ".conf";
    std::ofstream(path) << kHead << "lr = 0.9\n";
    auto p = test::parse_server_args({"--config", path, "--lr", "0.1"});
    BOOST_TEST_REQUIRE(p.ok(), p.status().message());
    BOOST_TEST(p->config.optimizer.lr == 0.1f);
    BOOST_TEST_REQUIRE(p->shadowed.size() == 1u);
    BOOST_TEST(contains(p->shadowed[0], "line 3: key 'lr' = 0.9 is not used: the command line's --lr wins"),
               p->shadowed[0]);
    // The same value on both is no override: the unit passes --name <instance>
    // and the instance's file sets that name, which must not warn at every
    // start and reload. Another name is named as not used.
    std::ofstream(path) << kHead << "lr = 0.9\n";
    auto same = test::parse_server_args({"--config", path, "--name", "j", "--lr", "0.9"});
    BOOST_TEST_REQUIRE(same.ok(), same.status().message());
    BOOST_TEST(same->shadowed.empty());
    auto other = test::parse_server_args({"--config", path, "--name", "job2"});
    BOOST_TEST_REQUIRE(other.ok(), other.status().message());
    BOOST_TEST(other->config.name == "job2");
    BOOST_TEST_REQUIRE(other->shadowed.size() == 1u);
    BOOST_TEST(contains(other->shadowed[0], "line 1: key 'name' = j is not used: the command line's --name wins"),
               other->shadowed[0]);
    std::filesystem::remove(path);
  }
  // A '#' begins a comment at the start of a line or after a blank, not
  // inside a value; a leading byte order mark is no part of the first key.
  {
    const std::string dir = "/tmp/shmps_cfg_" + std::to_string(::getpid());
    std::filesystem::create_directories(dir);
    const std::string path = dir + "/c.conf";
    std::ofstream(path) << "\xEF\xBB\xBF" << kHead << "checkpoint-dir = " << dir << "/job#1   # a comment\n";
    auto p = test::parse_server_args({"--config", path});
    BOOST_TEST_REQUIRE(p.ok(), p.status().message());
    BOOST_TEST(p->config.checkpoint_dir == dir + "/job#1");
    std::filesystem::remove_all(dir);
  }
  // Not a regular file, or over 1 MiB: refused unread (/dev/zero would be read until memory ran out).
  const std::string fifo = "/tmp/shmps_cfg_fifo_" + std::to_string(::getpid());
  BOOST_TEST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  for (const std::string& path : {std::string("/dev/zero"), std::string("/tmp"), fifo}) {
    auto p = test::parse_server_args({"--config", path});
    BOOST_TEST(!p.ok(), path);
    if (!p.ok()) BOOST_TEST(contains(p.status().message(), "not a regular file"), p.status().message());
  }
  ::unlink(fifo.c_str());
  const ConfFile huge(kHead + std::string(1 << 20, '#'));
  auto big = test::parse_server_args({"--config", huge.path});
  BOOST_TEST(!big.ok());
  if (!big.ok()) BOOST_TEST(contains(big.status().message(), "at most 1 MiB"), big.status().message());
  // The staleness policy and the apply threads: named, never guessed.
  for (const auto& [arg, why] : std::vector<std::pair<std::string, std::string>>{
           {"--staleness-policy=bounded", "--staleness-policy must be reject, wait or scale, got 'bounded'"},
           {"--staleness-policy=Wait", "--staleness-policy must be reject, wait or scale, got 'Wait'"},
           {"--apply-threads=0", "--apply-threads must be auto or a number in 1..1024, got '0'"},
           {"--apply-threads=1025", "--apply-threads must be auto or a number in 1..1024, got '1025'"},
           {"--apply-threads=2x", "--apply-threads must be auto or a number in 1..1024, got '2x'"},
           {"--apply-threads=-1", "--apply-threads must be auto or a number in 1..1024, got '-1'"}}) {
    auto p = test::parse_server_args({"--name", "j", "--tensor", "w:4", arg});
    BOOST_TEST(!p.ok(), arg);
    if (!p.ok()) BOOST_TEST(contains(p.status().message(), why), p.status().message());
  }
  BOOST_TEST(contains(file_error(kHead + "staleness-policy = later\n"), "line 3"));
  for (const std::string policy : {"reject", "wait", "scale"}) {
    auto p = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--staleness-policy", policy});
    BOOST_REQUIRE(p.ok());
    BOOST_TEST(shm::staleness_policy_name(static_cast<uint32_t>(p->config.staleness_policy)) == policy);
  }
  // What Server::create() refuses, --check-config refuses too.
  for (const auto& [tensors, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"a:4", "a:2"}, "given twice"},
           {{"a:4294967296x2147483648", "b:4294967296x2147483648"}, "over 2^40 elements"},
           {{"a:1048576x1048576", "b:2"}, "over 2^40 elements in total"}}) {
    std::vector<std::string> args{"--name", "j", "--check-config"};
    for (const std::string& t : tensors) args.insert(args.end(), {"--tensor", t});
    auto p = test::parse_server_args(args);
    BOOST_TEST(!p.ok(), tensors[0]);
    if (!p.ok()) BOOST_TEST(contains(p.status().message(), why), p.status().message());
  }
}

BOOST_AUTO_TEST_CASE(command_line_wins_over_the_file_and_errors_name_the_option) {
  ConfFile f(kHead + "lr = 0.5\nmax-staleness = 9\ntensor = b:2\n");
  auto p = test::parse_server_args({"--config", f.path, "--lr", "0.25", "--tensor", "a:1"});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  BOOST_TEST(p->config.optimizer.lr == 0.25f);
  BOOST_TEST(p->config.max_staleness == 9u);
  BOOST_REQUIRE(p->config.tensors.size() == 3u);  // command line's first, then the file's in order
  BOOST_TEST(p->config.tensors[0].name == "a");
  BOOST_TEST(p->config.tensors[2].name == "b");
  // A bad value the command line gave is not blamed on the file.
  auto bad = test::parse_server_args({"--config", f.path, "--ring-capacity", "3"});
  BOOST_REQUIRE(!bad.ok());
  BOOST_TEST(bad.status().message().find("--ring-capacity") == 0u, bad.status().message());
  BOOST_TEST(test::parse_server_args({"--version"})->version);
  auto check = test::parse_server_args({"--config", f.path, "--check-config"});
  BOOST_REQUIRE(check.ok());
  BOOST_TEST(check->check);
  BOOST_TEST(!test::parse_server_args({"--config", f.path})->check);
  auto missing = test::parse_server_args({"--config", "/nonexistent/x.conf"});
  BOOST_TEST(contains(missing.status().message(), "cannot open"));
}

BOOST_AUTO_TEST_CASE(open_failures_carry_the_path_and_the_errno_text) {
  // Without the reason, a typo, a missing folder and a permission problem
  // read the same.
  auto missing = test::parse_server_args({"--config", "/nonexistent/x.conf"});
  BOOST_REQUIRE(!missing.ok());
  BOOST_TEST(missing.status().message() ==
             "--config /nonexistent/x.conf: cannot open: No such file or directory (errno 2)");
  auto not_dir = test::parse_server_args({"--config", "/etc/passwd/x.conf"});
  BOOST_REQUIRE(!not_dir.ok());
  BOOST_TEST(not_dir.status().message() == "--config /etc/passwd/x.conf: cannot open: Not a directory (errno 20)");
  ServerConfig config;
  config.name = test::unique_name("initopen");
  config.tensors = {{"w", {4}}};
  config.init.kind = InitSpec::Kind::kFile;
  config.init.file = "/nonexistent/init.bin";
  auto created = Server::create(config);
  BOOST_REQUIRE(!created.ok());
  BOOST_TEST(created.status().to_string() ==
             "io: --init-file /nonexistent/init.bin: cannot open: No such file or directory (errno 2)");
}

BOOST_AUTO_TEST_CASE(check_config_reads_the_init_file_as_the_start_does) {
  // --check-config reads the init file as the start does; a plain parse
  // (the start, a reload) leaves that to Server::create().
  const std::vector<std::string> init_args{"--name", "j", "--tensor", "w:4", "--init-file", "/nonexistent/init.bin"};
  BOOST_TEST(test::parse_server_args(init_args).ok());
  std::vector<std::string> check_args = init_args;
  check_args.push_back("--check-config");
  auto check = test::parse_server_args(check_args);
  BOOST_REQUIRE(!check.ok());
  BOOST_TEST(check.status().to_string() ==
             "io: --init-file /nonexistent/init.bin: cannot open: No such file or directory (errno 2)");
  // With a checkpoint directory the start needs the file only when no
  // checkpoint is restored, which the check cannot know: not refused.
  check_args.insert(check_args.end(), {"--checkpoint-dir", std::filesystem::temp_directory_path().string()});
  BOOST_TEST(test::parse_server_args(check_args).ok());
}

// --check-config --backend cuda where no device is usable: refused, as the
// start is; auto passes (the start falls back to the host backend).
BOOST_AUTO_TEST_CASE(check_config_refuses_backend_cuda_without_a_device) {
  auto check = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--backend", "cuda", "--check-config"});
  if (std::string why; cuda_backend_available(&why)) {
    BOOST_TEST(check.ok(), check.status().message());
  } else {
    BOOST_REQUIRE(!check.ok());
    BOOST_TEST(check.status().message() == "--backend cuda needs a usable CUDA device, and none is usable here (" +
                                               why +
                                               "); use --backend host, or auto (the host backend where no device "
                                               "is present)");
    const ConfFile f(kHead + "backend = cuda\n");
    auto from_file = test::parse_server_args({"--config", f.path, "--check-config"});
    BOOST_REQUIRE(!from_file.ok());
    BOOST_TEST(contains(from_file.status().message(), "line 3: key 'backend': cuda needs a usable CUDA device"),
               from_file.status().message());
  }
  // A plain parse (the start, a reload) leaves the device to the backend.
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--backend", "cuda"}).ok());
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--backend", "auto", "--check-config"}).ok());
}

// --check-config refuses a checkpoint directory the start could not use:
// a file, a path under a file, or one on a kernel file system; a
// directory, or one it can create, passes.
BOOST_AUTO_TEST_CASE(check_config_refuses_a_checkpoint_dir_the_start_would) {
  ConfFile file("x");
  const auto check = [](const std::string& dir) {
    return test::parse_server_args({"--name", "j", "--tensor", "w:4", "--checkpoint-dir", dir, "--check-config"});
  };
  for (const std::string& bad : {file.path, file.path + "/sub"}) {
    auto p = check(bad);
    BOOST_TEST(!p.ok(), bad);
    if (!p.ok()) BOOST_TEST(contains(p.status().message(), "Not a directory"), p.status().message());
  }
  const std::string tmp = std::filesystem::temp_directory_path().string();
  BOOST_TEST(check(tmp).ok());
  BOOST_TEST(check(tmp + "/" + test::unique_name("ckpt") + "/deeper").ok());
  // A directory this process may not write in (0555; as root, checked by a
  // child that runs as nobody, for whom root's 0755 one is the same).
  test::TempDir dir("ckpt_ro");
  std::filesystem::permissions(dir.path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec |
                                             std::filesystem::perms::group_read | std::filesystem::perms::group_exec |
                                             std::filesystem::perms::others_read | std::filesystem::perms::others_exec);
  auto child = test::Process::fork_fn([&] {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 90;
    auto p = check(dir.path.string());
    return !p.ok() && contains(p.status().message(), "cannot write checkpoints in it: Permission denied") ? 0 : 1;
  });
  BOOST_TEST(child.wait(std::chrono::seconds(10)) == 0);
  std::filesystem::permissions(dir.path, std::filesystem::perms::owner_all);
  // The kernel's file systems, where root passes access() but can create
  // nothing: an existing directory there, and a path to be made under one;
  // a cgroup (v1 or v2) mount where the host has one.
  std::vector<std::string> kernel_dirs = {"/proc", "/proc/x", "/proc/x/y", "/sys/kernel", "/sys/x"};
  std::ifstream mounts("/proc/self/mounts");
  for (std::string device, at, type, rest; mounts >> device >> at >> type && std::getline(mounts, rest);) {
    if (type == "cgroup" || type == "cgroup2") {
      kernel_dirs.insert(kernel_dirs.end(), {at, at + "/shmps-x"});
      break;
    }
  }
  for (const std::string& kernel : kernel_dirs) {
    auto p = check(kernel);
    BOOST_TEST(!p.ok(), kernel);
    if (!p.ok()) BOOST_TEST(contains(p.status().message(), "on a kernel file system"), p.status().message());
  }
}

// --check-config prints the configuration as a config file: a value that
// no config file line reads back as written is refused by name, with the
// reason; the start (a parse without --check-config) takes it.
BOOST_AUTO_TEST_CASE(check_config_refuses_a_value_no_config_file_line_holds) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  const std::vector<std::string> gloo{"--federation", "gloo", "--fed-hosts", "1", "--fed-store", "file:" + dir + "/s"};
  const std::string comment = "'#' at the start of a value or after a blank begins a comment there";
  const std::string blanks = "a config file trims the blanks at the ends of a value";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases{
      {{"--checkpoint-dir", dir + "/ck #1"},
       "--check-config cannot print --checkpoint-dir '" + dir + "/ck #1' as a config file line: " + comment +
           " (it would read back as '" + dir + "/ck')"},
      {{"--checkpoint-dir", dir + "/ck\t#1"},
       "--check-config cannot print --checkpoint-dir '" + dir + "/ck\t#1' as a config file line: " + comment +
           " (it would read back as '" + dir + "/ck')"},
      {{"--checkpoint-dir", dir + "/ck "},
       "--check-config cannot print --checkpoint-dir '" + dir + "/ck ' as a config file line: " + blanks +
           " (it would read back as '" + dir + "/ck')"},
      {{"--checkpoint-dir", dir + "/a\nb"},
       "--check-config cannot print --checkpoint-dir '" + dir +
           "/a\nb' as a config file line: a line break ends a config file's line"},
      {{"--device", "GPU-1 #2"},
       "--check-config cannot print --device 'GPU-1 #2' as a config file line: " + comment +
           " (it would read back as 'GPU-1')"},
      {{"--fed-address", " 10.0.0.1"},
       "--check-config cannot print --fed-address ' 10.0.0.1' as a config file line: " + blanks +
           " (it would read back as '10.0.0.1')"},
      {{"--fed-address", "#x"},
       "--check-config cannot print --fed-address '#x' as a config file line: " + comment +
           " (it would read back as '')"},
      {{"--fed-address", "'x'"},
       "--check-config cannot print --fed-address ''x'' as a config file line: a config file refuses a value in "
       "quotes"},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.args[1]) {
      std::vector<std::string> args{"--name", "j", "--tensor", "w:4"};
      args.insert(args.end(), c.args.begin(), c.args.end());
      if (c.args[0] == "--fed-address") args.insert(args.end(), gloo.begin(), gloo.end());
      BOOST_TEST(test::parse_server_args(args).ok());  // the start takes it
      args.push_back("--check-config");
      auto p = test::parse_server_args(args);
      BOOST_REQUIRE(!p.ok());
      BOOST_TEST(p.status().message() == c.message);
    }
  }
  // '#' inside a value, after no blank, is the value's.
  auto hash =
      test::parse_server_args({"--name", "j", "--tensor", "w:4", "--checkpoint-dir", dir + "/job#1", "--check-config"});
  BOOST_TEST(hash.ok(), hash.status().message());
}

BOOST_AUTO_TEST_CASE(example_config_parses_and_documents_every_option) {
  // $SHMPS_SOURCE_DIR (set by CTest) first: a build tree unpacked beside
  // another checkout (tools/gpu-check.sh) reads that checkout's file.
  const char* source_dir = std::getenv("SHMPS_SOURCE_DIR");
  const std::string example =
      std::string(source_dir != nullptr ? source_dir : SHMPS_SOURCE_DIR) + "/server/shmps.conf.example";
  auto p = test::parse_server_args({"--config", example});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  BOOST_TEST(p->config.group_access);  // workers of the shmps group can attach
  BOOST_TEST(p->config.tensors.size() == 4u);

  // With every commented-out "# key = value" line switched on, it still
  // parses, and its keys are exactly the options read, in variants that
  // set what chooses the options read (the optimizer, init, federation,
  // outer step) and leave off what each does not read (refused, below).
  // "# key = value" with a lower-case key: a documented option, not prose.
  const auto is_commented_option = [](const std::string& line) {
    if (line.rfind("# ", 0) != 0) return false;
    const size_t eq = line.find(" = ", 2);
    return eq != std::string::npos && eq > 2 &&
           line.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-", 2) == eq;
  };
  const std::set<std::string> sgd_only{"momentum", "dampening", "nesterov"};
  const std::set<std::string> adam_only{"beta1", "beta2", "eps", "amsgrad"};
  struct Variant {
    std::map<std::string, std::string> set;
    std::set<std::string> skip;
  };
  const std::map<std::string, std::string> gloo{{"federation", "gloo"}, {"fed-hosts", "2"}};
  const auto set_also = [](std::map<std::string, std::string> a, const std::map<std::string, std::string>& b) {
    a.insert(b.begin(), b.end());
    return a;
  };
  const auto skip_also = [](std::set<std::string> a, const std::set<std::string>& b) {
    a.insert(b.begin(), b.end());
    return a;
  };
  const std::vector<Variant> variants = {
      {set_also(gloo, {{"optimizer", "sgd"}, {"init", "normal"}, {"fed-outer", "nesterov"}}),
       skip_also(adam_only, {"init-file"})},
      {set_also(gloo, {{"optimizer", "adam"}, {"init", "uniform"}}),
       skip_also(sgd_only, {"init-file", "fed-outer-lr", "fed-outer-momentum"})},
      {set_also(gloo, {{"optimizer", "adamw"}, {"init", "file"}, {"fed-outer", "nesterov"}}),
       skip_also(sgd_only, {"init-scale", "init-seed"})},
  };
  // The example with its commented options switched on, but for `skip`,
  // and the keys of `set` given those values; `documented` gets its keys.
  const auto switched_on = [&](const Variant& v, std::set<std::string>* documented) {
    std::istringstream in(read_file(example));
    std::ostringstream all;
    for (std::string line; std::getline(in, line);) {
      if (is_commented_option(line) && v.skip.count(line.substr(2, line.find(' ', 2) - 2)) == 0) line = line.substr(2);
      if (!line.empty() && line[0] != '#') {
        const std::string key = line.substr(0, line.find(' '));
        if (const auto it = v.set.find(key); it != v.set.end()) line = key + " = " + it->second;
        documented->insert(key);
      }
      all << line << "\n";
    }
    return all.str();
  };
  std::set<std::string> documented_by_any, option_of_any;
  for (size_t i = 0; i < variants.size(); ++i) {
    BOOST_TEST_CONTEXT("variant " << i) {
      std::set<std::string> documented;
      ConfFile f(switched_on(variants[i], &documented));
      auto every = test::parse_server_args({"--config", f.path});
      BOOST_REQUIRE_MESSAGE(every.ok(), every.status().to_string());
      std::set<std::string> options;
      for (const auto& e : config_entries(every->config)) options.insert(e.first);
      BOOST_TEST((documented == options));
      for (const std::string& k : options) BOOST_TEST(documented.count(k) == 1u, "undocumented: " << k);
      for (const std::string& k : documented) BOOST_TEST(options.count(k) == 1u, "not an option: " << k);
      documented_by_any.insert(documented.begin(), documented.end());
      option_of_any.insert(options.begin(), options.end());
    }
  }
  BOOST_TEST((documented_by_any == option_of_any));
  for (const std::set<std::string>* family : {&sgd_only, &adam_only})
    for (const std::string& k : *family) BOOST_TEST(option_of_any.count(k) == 1u, "never an option: " << k);
  // Every line switched on: the example's sgd refuses the Adam lines, each named.
  std::set<std::string> ignored;
  ConfFile both(switched_on({}, &ignored));
  auto refused = test::parse_server_args({"--config", both.path});
  BOOST_REQUIRE(!refused.ok());
  const std::string m = refused.status().message();
  BOOST_TEST(m.rfind("--optimizer sgd does not use beta1 (config file " + both.path + " line ", 0) == 0u, m);
  for (const std::string& k : adam_only) BOOST_TEST(contains(m, k + " (config file " + both.path + " line "), m);
  BOOST_TEST(contains(m, ": Adam/AdamW options; remove them, or choose --optimizer adam or adamw"), m);
}

BOOST_AUTO_TEST_CASE(config_entries_round_trip_through_a_file) {
  auto p = test::parse_server_args({"--name",
                                    "rt",
                                    "--tensor",
                                    "a:2x3",
                                    "--tensor",
                                    "b:7",
                                    "--optimizer",
                                    "adamw",
                                    "--lr",
                                    "0.0003",
                                    "--beta2",
                                    "0.98",
                                    "--amsgrad",
                                    "--max-staleness",
                                    "11",
                                    "--ring-capacity",
                                    "16",
                                    "--init",
                                    "normal",
                                    "--init-scale",
                                    "0.5",
                                    "--init-seed",
                                    "42",
                                    "--group-access",
                                    "--idle-spin-us",
                                    "7",
                                    "--log-level",
                                    "debug",
                                    "--allow-nonfinite",
                                    "--backend",
                                    "host",
                                    "--max-workers",
                                    "3",
                                    "--max-buffers",
                                    "5"});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  std::string body;
  for (const auto& [key, value] : config_entries(p->config)) body += key + " = " + value + "\n";
  ConfFile f(body);
  auto back = test::parse_server_args({"--config", f.path});
  BOOST_REQUIRE_MESSAGE(back.ok(), back.status().to_string() + "\n" + body);
  BOOST_TEST((config_entries(back->config) == config_entries(p->config)), body);
  BOOST_TEST(back->config.optimizer.lr == 0.0003f);
  BOOST_TEST((back->config.log_level == LogLevel::kDebug));
}

BOOST_AUTO_TEST_CASE(log_levels_parse_and_filter) {
  LogLevel l = LogLevel::kInfo;
  BOOST_TEST(parse_log_level("warn", &l));
  BOOST_TEST((l == LogLevel::kWarn));
  BOOST_TEST(!parse_log_level("warning", &l));
  log::set_level(LogLevel::kWarn);
  BOOST_TEST(log::enabled(LogLevel::kError));
  BOOST_TEST(log::enabled(LogLevel::kWarn));
  BOOST_TEST(!log::enabled(LogLevel::kInfo));
  log::set_level(LogLevel::kInfo);
  ::unsetenv("JOURNAL_STREAM");
  BOOST_TEST(!log::stderr_is_journal());
  ::setenv("JOURNAL_STREAM", "1:2", 1);
  BOOST_TEST(!log::stderr_is_journal());
  ::unsetenv("JOURNAL_STREAM");
}

BOOST_AUTO_TEST_CASE(reload_in_process_applies_live_options_only) {
  const ServerConfig config = reload_config("reload");
  std::unique_ptr<Server> server = create_server(config);

  // What the reload source returns; written before request_reload()
  // (SYNC(reload) makes it visible to the server thread).
  ServerConfig next = config;
  std::atomic<int> reloads{0};
  RunOptions options;
  options.reload = [&]() -> Result<ServerConfig> {
    ServerConfig copy = next;  // before the count: the test writes `next` again once it sees it
    ++reloads;
    return copy;
  };
  Status ran = Status::Ok();  // checked after join: Boost.Test is not thread-safe
  std::thread thread([&] { ran = server->run(options); });

  ReloadWorker rw(config.name);
  BOOST_REQUIRE(rw.w->push(kAllTensors, rw.grad.id, 0, 16, Dtype::kF32, 0).ok());  // w = -1

  // The values in force, as the segment's config block shows them: the
  // server applies a reload there after the callback's parse.
  auto view = shm::Segment::open(config.name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(view.ok(), view.status().to_string());
  const auto max_staleness_in_force = [&] {
    return std::atomic_ref<uint64_t>((*view)->header().config.max_staleness).load(std::memory_order_relaxed);
  };

  next.optimizer.lr = 0.5f;
  next.max_staleness = 0;
  next.max_workers = 4;            // needs a restart: ignored
  next.optimizer.momentum = 0.9f;  // needs a restart: ignored
  server->request_reload();
  BOOST_REQUIRE(test::eventually([&] { return reloads.load() == 1 && max_staleness_in_force() == 0; }));
  BOOST_REQUIRE(rw.w->push(kAllTensors, rw.grad.id, 0, 16, Dtype::kF32, 1).ok());  // w = -1.5
  BOOST_TEST((rw.w->push(kAllTensors, rw.grad.id, 0, 16, Dtype::kF32, 1).status().code() == ErrorCode::kStale));
  BOOST_REQUIRE(rw.w->pull(kAllTensors, rw.weights.id, 0).ok());
  BOOST_TEST(static_cast<const float*>(rw.weights.data)[0] == -1.5f);  // lr 0.5, no momentum

  // An lr the optimizer refuses is logged and the running one kept (the
  // bound's change shows the reload was applied).
  next.optimizer.lr = -1.0f;
  next.max_staleness = 3;
  server->request_reload();
  BOOST_REQUIRE(test::eventually([&] { return reloads.load() == 2 && max_staleness_in_force() == 3; }));
  BOOST_REQUIRE(rw.w->push(kAllTensors, rw.grad.id, 0, 16, Dtype::kF32, 2).ok());
  BOOST_REQUIRE(rw.w->pull(kAllTensors, rw.weights.id, 0).ok());
  BOOST_TEST(static_cast<const float*>(rw.weights.data)[0] == -2.0f);  // still lr 0.5

  rw.w.reset();
  view->reset();
  server->request_stop();
  thread.join();
  BOOST_TEST(ran.ok(), ran.to_string());
}

// A reload's parse runs off the serving thread: while the configuration
// source is held inside its parse, workers are served (pushes and pulls
// answered); the reload is applied once the parse returns, and SIGHUPs
// during it merge into one more parse after it. On a server that parsed
// on its serving thread, the pushes would wait for the parse (the
// watchdog below ends the hold after 20 s, and the check fails).
BOOST_AUTO_TEST_CASE(a_slow_reload_parse_does_not_stall_serving) {
  const ServerConfig config = reload_config("reloadslow");
  std::unique_ptr<Server> server = create_server(config);

  std::mutex mu;
  std::condition_variable cv;
  bool in_parse = false, released = false, released_by_watchdog = false;  // guarded by mu
  std::atomic<int> parses{0};
  ServerConfig next = config;
  next.max_staleness = 5;
  RunOptions options;
  options.reload = [&]() -> Result<ServerConfig> {
    std::unique_lock lock(mu);
    in_parse = true;
    cv.notify_all();
    cv.wait(lock, [&] { return released; });
    ++parses;
    return next;
  };
  Status ran = Status::Ok();
  std::thread thread([&] { ran = server->run(options); });
  std::thread watchdog([&] {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return released; })) released = released_by_watchdog = true;
    cv.notify_all();
  });

  ReloadWorker rw(config.name);
  server->request_reload();
  {
    std::unique_lock lock(mu);
    BOOST_REQUIRE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return in_parse; }));
  }
  for (int k = 0; k < 3; ++k) server->request_reload();  // merged into one parse after this one
  for (uint64_t v = 0; v < 20; ++v) BOOST_REQUIRE(rw.w->push(kAllTensors, rw.grad.id, 0, 16, Dtype::kF32, v).ok());
  BOOST_REQUIRE(rw.w->pull(kAllTensors, rw.weights.id, 0).ok());
  BOOST_TEST(static_cast<const float*>(rw.weights.data)[0] == -20.0f);
  bool by_watchdog = false;
  {
    std::lock_guard lock(mu);
    by_watchdog = released_by_watchdog;
    released = true;
  }
  cv.notify_all();
  BOOST_TEST(!by_watchdog, "the pushes waited for the reload's parse");

  auto view = shm::Segment::open(config.name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(view.ok(), view.status().to_string());
  BOOST_TEST(test::eventually([&] {
    return std::atomic_ref<uint64_t>((*view)->header().config.max_staleness).load(std::memory_order_relaxed) == 5;
  }));
  BOOST_TEST(test::eventually([&] { return parses.load() == 2; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  BOOST_TEST(parses.load() == 2);  // three requests during the first parse: one more

  rw.w.reset();
  view->reset();
  server->request_stop();
  thread.join();
  watchdog.join();
  BOOST_TEST(ran.ok(), ran.to_string());
}

// A float option past fp32's range (1e39 reads as Inf) is refused naming
// the option and the value as written, as is a schedule's number; a value
// that fp32 rounds to a bound (1e-50 to 0, 0.99999999 to 1) is refused
// showing both.
BOOST_AUTO_TEST_CASE(float_values_past_or_rounded_by_fp32_are_refused_as_written) {
  const std::string range = "must be a finite fp32 number (at most 3.4028235e+38 in magnitude), got '";
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{{"lr", "1e39"},
                                                                                   {"lr", "-3.5e38"},
                                                                                   {"momentum", "1e39"},
                                                                                   {"dampening", "1e400"},
                                                                                   {"weight-decay", "5e38"},
                                                                                   {"init-scale", "1e39"},
                                                                                   {"fed-outer-lr", "1e300"}}) {
    auto p = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--" + key, value});
    BOOST_TEST(!p.ok(), key << " " << value);
    if (!p.ok()) BOOST_TEST(p.status().message() == "--" + key + " " + range + value + "'");
    BOOST_TEST(
        contains(file_error(kHead + key + " = " + value + "\n"), "line 3: key '" + key + "': " + range + value + "'"));
  }
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--lr", "3e38"}).ok());  // finite fp32
  // The bound as the message writes it reads as a double just above
  // FLT_MAX, and is FLT_MAX in fp32: taken.
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--lr", "3.4028235e+38"}).ok());
  BOOST_TEST(
      test::parse_server_args({"--name", "j", "--tensor", "w:4", "--lr-schedule", "exponential:3.4028235e+38"}).ok());
  BOOST_TEST(refusal({"--lr-schedule", "cosine:10:1e300"}) ==
             "--lr-schedule: 'cosine:10:1e300': 1e300 is past the fp32 range (at most 3.4028235e+38)");
  BOOST_TEST(contains(file_error(kHead + "lr-schedule = linear:0.1:1:5,step:2:1e39\n"),
                      "line 3: key 'lr-schedule': 'step:2:1e39': 1e39 is past the fp32 range"));
  // Rounded by fp32 to a bound: the value as written, and what it became.
  BOOST_TEST(refusal({"--lr", "1e-50"}) == "--lr must be > 0, got 1e-50, which rounds to 0 in fp32");
  BOOST_TEST(refusal({"--optimizer", "adam", "--beta1", "0.99999999"}) ==
             "--beta1 must be in [0, 1), got 0.99999999, which rounds to 1 in fp32");
  BOOST_TEST(contains(file_error(kHead + "optimizer = adam\nbeta2 = 0.99999999\n"),
                      "line 4: key 'beta2': must be in [0, 1), got 0.99999999, which rounds to 1 in fp32"));
  BOOST_TEST(contains(file_error(kHead + "init = normal\ninit-scale = 1e-46\n"),
                      "line 4: key 'init-scale': must be > 0 and at most 1e30 for --init normal or uniform, got "
                      "1e-46, which rounds to 0 in fp32"));
  // Written otherwise but the same number (no rounding): the message gives
  // the value as read, with no note about fp32.
  BOOST_TEST(refusal({"--lr", "-0.50"}) == "--lr must be > 0, got -0.5");
  BOOST_TEST(refusal({"--lr", "nan"}) == "--lr must be a finite number, got nan");
}

// Errors of the tensor table name the file's line of the tensor they are
// found at; an empty name names its line; a list given to one --tensor
// is named as such.
BOOST_AUTO_TEST_CASE(tensor_table_errors_and_an_empty_name_name_their_line) {
  std::string body = "name = j\n";
  for (int i = 0; i < 2000; ++i) body += "tensor = l" + std::to_string(i) + ".w:8\n";  // lines 2-2001
  BOOST_TEST(file_error(body + "tensor = l77.w:8\n")
                 .find(" line 2002: key 'tensor': tensor name 'l77.w' given twice "
                       "(first on line 79)") != std::string::npos);
  BOOST_TEST(contains(file_error(kHead + "tensor = big:2097152x1048576\n"),
                      "line 3: key 'tensor': tensor 'big' has a dimension of 0, or over 2^40 elements"));
  BOOST_TEST(contains(file_error(kHead + "tensor = a:1048576x1048576\n"),
                      "line 3: key 'tensor': the tensors hold over 2^40 elements in total (at 'a')"));
  {
    const ConfFile f(kHead);
    auto p = test::parse_server_args({"--config", f.path, "--tensor", "w:2"});
    BOOST_REQUIRE(!p.ok());
    BOOST_TEST(p.status().message() ==
               "config file " + f.path + " line 2: key 'tensor': tensor name 'w' given twice (first by --tensor)");
  }
  std::string many = "name = j\n";
  for (uint32_t i = 0; i <= shm::kMaxTensorsLimit; ++i) many += "tensor = t" + std::to_string(i) + ":1\n";
  BOOST_TEST(contains(file_error(many), "line 4098: key 'tensor': a model needs 1..4096 tensors, got 4097"));
  BOOST_TEST(
      contains(file_error("name =\ntensor = w:4\n"), "line 1: key 'name': is empty; the instance name is required"));
  auto empty = test::parse_server_args({"--name", "", "--tensor", "w:4"});
  BOOST_REQUIRE(!empty.ok());
  BOOST_TEST(empty.status().message() == "--name is empty; the instance name is required");
  // One --tensor, one tensor.
  const std::string one =
      "one --tensor takes one tensor: give each its own --tensor (in a config file, its own "
      "tensor line); expected NAME:D0xD1x... such as fc1.weight:256x784";
  BOOST_TEST(refusal({"--tensor", "v:4,u:5"}) == "--tensor 'v:4,u:5': " + one);
  BOOST_TEST(refusal({"--tensor", "v:4,u"}) == "--tensor 'v:4,u': " + one);
  BOOST_TEST(contains(file_error(kHead + "tensor = v:4, u:5:f32\n"), "line 3: key 'tensor': 'v:4, u:5:f32': " + one));
}

// --idle-spin-us: at most 1 s of spinning.
// An abbreviated option (--max-stal for --max-staleness) is refused on
// the command line as in the file: an option added later would make it
// ambiguous, breaking the scripts that used it.
// --help (and the man page made from it) gives the float defaults as
// written, not as fp32 holds them (0.00100000005).
BOOST_AUTO_TEST_CASE(help_gives_float_defaults_as_written) {
  auto p = test::parse_server_args({"--help"});
  BOOST_REQUIRE(p.ok());
  for (const char* d : {"--lr arg (=0.001)", "--beta1 arg (=0.9)", "--beta2 arg (=0.999)", "--eps arg (=1e-08)",
                        "--init-scale arg (=0.01)", "--fed-outer-lr arg (=0.7)", "--fed-outer-momentum arg (=0.9)"})
    BOOST_TEST(contains(p->help_text, d), d);
  BOOST_TEST(!contains(p->help_text, "0000000"), p->help_text);  // 0.00100000005, 0.899999976
  BOOST_TEST(!contains(p->help_text, "99999"), p->help_text);
}

// An integer past its type (2^32 for a 32-bit option, 2^64) is refused as
// an in-range bad value is: naming the option, the rule or range it must
// meet, and the value as written, on the command line and in the file.
BOOST_AUTO_TEST_CASE(integers_past_their_type_name_the_option_the_range_and_the_value) {
  BOOST_TEST(refusal({"--ring-capacity", "4294967296"}) ==
             "--ring-capacity must be a power of two in 2..65536, got 4294967296");
  BOOST_TEST(refusal({"--max-workers", "99999999999999999999"}) ==
             "--max-workers must be in 1..256, got "
             "99999999999999999999");
  BOOST_TEST(refusal({"--max-staleness", "18446744073709551616"}) ==
             "--max-staleness must be an integer in 0..18446744073709551615, got 18446744073709551616");
  BOOST_TEST(refusal({"--parent-pid", "4294967296"}) ==
             "--parent-pid must be an integer in 0..4294967295, got 4294967296");
  BOOST_TEST(refusal({"--stopped-worker-timeout-ms", "+4294967296"}) ==
             "--stopped-worker-timeout-ms must be an integer in 0..4294967295, got +4294967296");
  BOOST_TEST(file_error(kHead + "max-staleness = 99999999999999999999\n")
                 .ends_with(" line 3: key 'max-staleness': must be an integer in 0..18446744073709551615, got "
                            "99999999999999999999"),
             file_error(kHead + "max-staleness = 99999999999999999999\n"));
  BOOST_TEST(file_error(kHead + "ring-capacity = 4294967296\n")
                 .ends_with(" line 3: key 'ring-capacity': must be a power of two in 2..65536, got 4294967296"));
  BOOST_TEST(contains(
      refusal({"--federation", "gloo", "--fed-store", "file:/tmp/s", "--fed-hosts", "2", "--fed-host", "4294967296"}),
      "--fed-host must be below --fed-hosts (2), got 4294967296"));
  // The top of each type is read (and judged by the option's own rule).
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--max-staleness", "18446744073709551615",
                                      "--init", "normal", "--init-seed", "018446744073709551615"})
                 .ok());
  BOOST_TEST(refusal({"--idle-spin-us", "4294967295"}) ==
             "--idle-spin-us must be at most 1000000 (1 s), got 4294967295");
  // Every integer option (those config_entries() writes as digits, in a
  // configuration that reads them all), given 2^64 on the command line
  // and in the file.
  std::map<std::string, std::string> base{
      {"name", "j"},          {"tensor", "w:4"},  {"init", "normal"},          {"checkpoint-dir", "/tmp/ck"},
      {"federation", "gloo"}, {"fed-hosts", "2"}, {"fed-store", "file:/tmp/s"}};
  std::vector<std::string> base_args;
  for (const auto& [k, v] : base) base_args.insert(base_args.end(), {"--" + k, v});
  auto all = test::parse_server_args(base_args);
  BOOST_REQUIRE_MESSAGE(all.ok(), all.status().message());
  // Written as digits, and refusing 0.5 (a float option takes it).
  std::set<std::string> integers;
  for (const auto& [key, value] : config_entries(all->config)) {
    if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos) continue;
    std::vector<std::string> args;
    for (const auto& [k, v] : base)
      if (k != key) args.insert(args.end(), {"--" + k, v});
    args.insert(args.end(), {"--" + key, "0.5"});
    if (!test::parse_server_args(args).ok()) integers.insert(key);
  }
  BOOST_TEST(integers.size() >= 16u);
  const std::string big = "18446744073709551616";
  for (const std::string& key : integers) {
    BOOST_TEST_CONTEXT(key) {
      std::map<std::string, std::string> with = base;
      with[key] = big;
      std::vector<std::string> args;
      std::string body;
      for (const auto& [k, v] : with) {
        args.insert(args.end(), {"--" + k, v});
        body += k + " = " + v + "\n";
      }
      auto p = test::parse_server_args(args);
      BOOST_REQUIRE(!p.ok());
      const std::string m = p.status().message();
      BOOST_TEST(contains(m, "--" + key + " "), m);
      BOOST_TEST((contains(m, " must be ") || contains(m, " needs --" + key + " in ")), m);
      BOOST_TEST(m.ends_with(", got " + big), m);
      const ConfFile f(body);
      auto from_file = test::parse_server_args({"--config", f.path});
      BOOST_REQUIRE(!from_file.ok());
      const std::string fm = from_file.status().message();
      BOOST_TEST((contains(fm, "key '" + key + "': must be ") || contains(fm, "--" + key + " ")), fm);
      BOOST_TEST(fm.ends_with(", got " + big), fm);
    }
  }
}

BOOST_AUTO_TEST_CASE(an_abbreviated_option_is_refused) {
  const std::string e = refusal({"--max-stal", "3"});
  BOOST_TEST(contains(e, "unrecognised option '--max-stal'"), e);
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--max-staleness", "3"}).ok());
}

BOOST_AUTO_TEST_CASE(idle_spin_is_at_most_one_second) {
  BOOST_TEST(refusal({"--idle-spin-us", "4294967295"}) ==
             "--idle-spin-us must be at most 1000000 (1 s), got 4294967295");
  BOOST_TEST(
      contains(file_error(kHead + "idle-spin-us = 1000001\n"), "line 3: key 'idle-spin-us': must be at most 1000000"));
  BOOST_TEST(test::parse_server_args({"--name", "j", "--tensor", "w:4", "--idle-spin-us", "1000000"}).ok());
}

// --checkpoint-keep is in 1..1000, refused outside naming the option: the
// start's allowance for the restore counts keep + 1 files, which must not
// wrap (4294967295 + 1 in 32 bits is 0). The allowance saturates rather
// than wrap whatever it is given.
BOOST_AUTO_TEST_CASE(checkpoint_keep_is_bounded_and_the_start_allowance_saturates) {
  for (const std::string keep : {"0", "1001", "4294967295"})
    BOOST_TEST(refusal({"--checkpoint-dir", "/tmp/ck", "--checkpoint-keep", keep}) ==
               "--checkpoint-keep must be in 1..1000, got " + keep);
  BOOST_TEST(contains(file_error(kHead + "checkpoint-dir = /tmp/ck\ncheckpoint-keep = 4294967295\n"),
                      "line 4: key 'checkpoint-keep': must be in 1..1000, got 4294967295"));
  for (const std::string keep : {"1", "1000"})
    BOOST_TEST(test::parse_server_args(
                   {"--name", "j", "--tensor", "w:4", "--checkpoint-dir", "/tmp/ck", "--checkpoint-keep", keep})
                   .ok(),
               keep);
  const uint64_t most_elements = uint64_t{1} << 40;
  BOOST_TEST(checkpoint_io_allowance(most_elements, ~uint64_t{0}) == std::chrono::microseconds::max());
  BOOST_TEST(checkpoint_io_allowance(most_elements, uint64_t{kMaxCheckpointKeep} + 1) ==
             checkpoint_io_allowance(most_elements) * (kMaxCheckpointKeep + 1));
  BOOST_TEST(checkpoint_io_allowance(4, 0).count() == 0);
  // Per file 30 s plus seven arrays (weights, 3 of Adam+amsgrad's state,
  // the federation's anchor, outer momentum and restore base) at 20 MB/s:
  // 1e9 parameters, 28 GB, 1400 s.
  BOOST_TEST(checkpoint_io_allowance(1'000'000'000).count() == 1'430'000'000);
}

// The threads the server starts block the stop and reload signals, so
// that the signals reach the thread that handles them and never interrupt
// a helper's system calls (the handlers are installed without
// SA_RESTART). Here the calling thread blocks none of them, so the old
// writer and parser threads, which inherited its mask, blocked none.
BOOST_AUTO_TEST_CASE(the_servers_helper_threads_block_the_stop_and_reload_signals) {
  test::TempDir dir("helpermask");
  ServerConfig config = reload_config("helpermask");
  config.checkpoint_dir = (dir.path / "ckpt").string();
  std::unique_ptr<Server> server = create_server(config);
  RunOptions options;
  options.reload = [&]() -> Result<ServerConfig> { return config; };
  Status ran = Status::Ok();
  std::thread thread([&] { ran = server->run(options); });
  for (const char* name : {"shmps-ckpt", "shmps-reload", "shmps-sweep"}) {
    BOOST_TEST_CONTEXT(name) {
      BOOST_REQUIRE(test::eventually([&] { return test::stop_signals_blocked(name).size() == 1; }));
      BOOST_TEST(test::stop_signals_blocked(name).front());
    }
  }
  server->request_stop();
  thread.join();
  BOOST_TEST(ran.ok(), ran.to_string());
}

// A reload that raises the log level (warn -> info) logs the other
// changes of the same reload too, though config_entries() puts log-level
// last; one that lowers it (info -> warn) still logs its own lines.
BOOST_AUTO_TEST_CASE(reload_logs_its_changes_under_the_more_verbose_log_level) {
  ServerConfig quiet;
  quiet.name = "j";
  quiet.tensors = {{"w", {4}}};
  quiet.optimizer.lr = 0.001f;
  quiet.log_level = LogLevel::kWarn;
  ServerConfig loud = quiet;
  loud.log_level = LogLevel::kInfo;
  loud.optimizer.lr = 0.5f;
  loud.max_staleness = 9;
  loud.lane_capacity = 128;
  for (const auto& [from, to] : {std::pair{&quiet, &loud}, std::pair{&loud, &quiet}}) {
    const std::string text = reload_log(*from, *to);
    const std::string lr = from == &quiet ? "0.001 -> 0.5" : "0.5 -> 0.001";
    BOOST_TEST(contains(text, "shmps-server info: reload: lr " + lr + "\n"), text);
    BOOST_TEST(contains(text, "shmps-server info: reload: max-staleness "), text);
    BOOST_TEST(contains(text, "shmps-server warn: reload: ring-capacity "), text);
    BOOST_TEST(contains(text, "shmps-server info: reload: log-level "), text);
    BOOST_TEST(contains(text, "reloaded the configuration: 3 change(s) applied, 1 need a restart"), text);
  }
}

// A switch of optimizer is logged once: the weight decay that is each
// optimizer's default (0 for sgd, 0.01 for adamw) follows it unlogged; a
// weight decay written in the file is logged as any other key.
BOOST_AUTO_TEST_CASE(reload_leaves_out_the_weight_decay_default_that_follows_the_optimizer) {
  const ConfFile sgd(kHead + "optimizer = sgd\n");
  const ConfFile adamw(kHead + "optimizer = adamw\n");
  const ConfFile adamw_decay(kHead + "optimizer = adamw\nweight-decay = 0.05\n");
  auto from = test::parse_server_args({"--config", sgd.path});
  auto to = test::parse_server_args({"--config", adamw.path});
  auto to_decay = test::parse_server_args({"--config", adamw_decay.path});
  BOOST_REQUIRE(from.ok() && to.ok() && to_decay.ok());
  BOOST_REQUIRE(to->config.optimizer.weight_decay == 0.01f);
  std::string text = reload_log(from->config, to->config);
  BOOST_TEST(contains(text, "reload: optimizer sgd -> adamw needs a restart; still sgd"), text);
  BOOST_TEST(!contains(text, "weight-decay"), text);
  BOOST_TEST(contains(text, "0 change(s) applied, 1 need a restart"), text);
  text = reload_log(to->config, from->config);
  BOOST_TEST(!contains(text, "weight-decay"), text);
  text = reload_log(from->config, to_decay->config);
  BOOST_TEST(contains(text, "reload: weight-decay 0 -> 0.05 needs a restart; still 0"), text);
  BOOST_TEST(contains(text, "0 change(s) applied, 2 need a restart"), text);
}

BOOST_AUTO_TEST_SUITE_END()
