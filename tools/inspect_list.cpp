#include "inspect_list.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>

namespace shmps::inspect {
namespace {

using nlohmann::json;

constexpr const char* kShmDir = "/dev/shm";
constexpr const char* kPrefix = "shmps.";

std::string pad(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size() + 1, ' ');
}

// The name column's widest: a longer name (any user may create one) is cut
// there, so that one row does not widen every row.
constexpr size_t kNameColumn = 40;

// A name as the table shows it: escaped (printable_text), and cut to
// kNameColumn characters with "..." when longer, never inside a \xNN.
std::string name_cell(const std::string& name) {
  std::string shown = printable_text(name);
  if (shown.size() <= kNameColumn) return shown;
  size_t cut = kNameColumn - 3;
  // Every '\' in the escaped text starts a \xNN (a backslash itself is \x5c).
  const size_t escape = shown.rfind('\\', cut);
  if (escape != std::string::npos && escape + 4 > cut) cut = escape;
  return shown.substr(0, cut) + "...";
}

// The workers served now: attached entries whose process lives, while the
// server lives (stopped too); 0 for a dead server's segment, whose entries
// stay as its workers left them.
uint32_t workers_attached(const Snapshot& s) {
  if (!s.header.server_alive) return 0;
  return static_cast<uint32_t>(std::count_if(s.workers.begin(), s.workers.end(), [](const WorkerView& w) {
    return w.state == static_cast<uint32_t>(shm::WorkerState::kAttached) && w.pid_alive;
  }));
}

// "copy": the server lives but does not hold this object; "unseen": its
// pid and start time name no process here, but a process holds the
// object's lock (judge_server_lock).
std::string alive_text(const Snapshot& s) {
  if (s.header.server_stopped) return "stopped";
  if (s.header.server_alive) return "alive";
  if (s.header.server_holds_object == false) return "copy";
  return s.header.server_unseen ? "unseen" : "dead";
}

// The model's fp32 bytes, saturating at 2^64 - 1 (a garbage element count
// can pass 2^62).
uint64_t model_bytes(const HeaderView& h) {
  uint64_t bytes = 0;
  return __builtin_mul_overflow(h.total_elements, uint64_t{4}, &bytes) ? ~uint64_t{0} : bytes;
}

}  // namespace

Result<std::vector<ListedSegment>> list_segments() {
  std::set<std::string> names;
  std::error_code ec;
  // The error_code forms throughout: the increment of an iterator made
  // with one reports a failed readdir there instead of throwing.
  for (std::filesystem::directory_iterator it(kShmDir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (file.rfind(kPrefix, 0) == 0 && file.size() > std::char_traits<char>::length(kPrefix))
      names.insert(file.substr(std::char_traits<char>::length(kPrefix)));
  }
  if (ec)
    return Status{ec == std::errc::permission_denied ? ErrorCode::kPermission : ErrorCode::kIo,
                  std::string("cannot list ") + kShmDir + ": " + ec.message()};
  // /proc/locks once for every row: it holds every lock on the host, and
  // any user can add thousands (a flock on files of their own) as well as
  // objects at shmps names, so a read per row would cost their product.
  // Read again once (no more: any user can plant copies) where it says a
  // live server does not hold its object: one that started under the
  // name after the read holds the new object, which the read predates.
  shm::FlockTable flocks = shm::FlockTable::read();
  bool flocks_read_again = false;
  std::vector<ListedSegment> out;
  for (const std::string& name : names) {
    // A worker's buffer: "<segment name>.p<pid>.<n>" beside its segment.
    const auto buffer = shm::parse_buffer_object_name(kPrefix + name);
    const bool buffer_like = buffer.has_value();
    if (buffer_like && names.count(buffer->server) != 0) continue;
    // A name no server can take (a space, a control byte, too long; a
    // buffer's shape among them) is listed too, as not a segment: it is
    // what a user sees in /dev/shm.
    const Status name_ok = shm::validate_name(name);
    ListedSegment row;
    row.name = name;
    row.source = std::string(kShmDir) + "/" + kPrefix + name;
    struct stat st {};
    if (::lstat(row.source.c_str(), &st) != 0) continue;  // gone meanwhile
    row.owner_uid = st.st_uid;
    row.owner_gid = st.st_gid;
    row.mode = st.st_mode & 0777;
    row.bytes = static_cast<uint64_t>(st.st_size);
    // No server may take a buffer's name: one without its segment is left
    // by a worker of a server that is gone.
    // One look, no wait: any user can leave empty objects at valid names,
    // and a 2 s wait for each would make --list as slow as they please.
    // No ring: the table shows none.
    Loaded loaded =
        buffer_like || !name_ok.ok() ? Loaded{} : load_segment(name, /*wait_for_start=*/false, kNoRings, &flocks);
    // A plain `shmps-inspect <name>` refuses a name no server can take
    // before it looks (a usage error, exit 1): the row's exit code is that.
    if (buffer_like) {
      row.exit = ExitCode::kError;
      row.error = "not a segment";
    } else if (!name_ok.ok()) {
      row.exit = ExitCode::kError;
      row.error = "not a segment: no server can take this name (" + name_ok.message() +
                  "); remove it by hand once no process uses it";
    } else if (loaded.exit != ExitCode::kOk) {
      row.exit = loaded.exit;
      row.error = loaded.error;
      // The message for an object no start will finish (empty or unwritten
      // for longer than a start's wait, or left by a dead server) already
      // says what left it and what replaces it. A server replaces only an
      // object of its own user's (it refuses another user's): the hint
      // says so when that is not this user.
      if (loaded.exit == ExitCode::kUnpublished && loaded.error.find("replaces it") == std::string::npos)
        row.error += "; not waited for: a server starting, or what a start that crashed left (" +
                     (st.st_uid == ::geteuid()
                          ? std::string("the next start under the name replaces it)")
                          : "owned by " + shm::owner_text(st.st_uid, st.st_gid) +
                                ": only a start by its owner replaces it; or remove it: sudo rm " + row.source + ")");
    } else {
      auto snap = take_snapshot(loaded.image.data, loaded.image.size, loaded.image.source, kNoRings);
      if (snap.ok()) {
        const ImageOwner& object = loaded.image.owner;
        if (snap->header.server_alive && !flocks_read_again &&
            flocks.holds(static_cast<pid_t>(snap->header.server_pid), object.device, object.inode) == false) {
          flocks = shm::FlockTable::read();
          flocks_read_again = true;
        }
        judge_server_lock(&*snap, object.device, object.inode, &flocks);
        row.segment = std::move(snap).value();
      } else {
        row.exit = exit_code_for(snap.status());
        row.error = snap.status().message();
      }
    }
    if (!row.segment && buffer_like) {
      row.error += " (named as a worker's buffer of segment '" + buffer->server + "', which is not there; ";
      // A server removes the buffers of its dead workers, under its own
      // name only.
      const Status segment_name = shm::validate_name(buffer->server);
      row.error += segment_name.ok() ? "a server started under that name removes it once its worker is gone)"
                                     : "no server can take that name (" + segment_name.message() +
                                           "), so none removes it: remove it by hand once no process uses it)";
    }
    out.push_back(std::move(row));
  }
  return out;
}

std::string render_list_text(const std::vector<ListedSegment>& list) {
  if (list.empty()) return std::string("no shmps segments in ") + kShmDir + "\n";
  size_t width = 4;
  for (const ListedSegment& r : list) width = std::max(width, name_cell(r.name).size());
  std::string out =
      pad("name", width) + "server pid  alive    state      parameters  model MiB  workers  owner, mode\n";
  std::string problems;
  for (const ListedSegment& r : list) {
    const std::string owner = shm::owner_text(r.owner_uid, r.owner_gid) + " " + shm::mode_text(r.mode);
    if (!r.segment) {
      out += pad(name_cell(r.name), width) + pad("-", 11) + pad("-", 8) + pad("unreadable", 10) + pad("-", 11) +
             pad("-", 10) + pad("-", 8) + owner + "\n";
      problems += "  " + printable_text(r.name) + ": " + printable_text(r.error) + "\n";
      continue;
    }
    const Snapshot& s = *r.segment;
    char mib[32];
    std::snprintf(mib, sizeof mib, "%.2f", static_cast<double>(model_bytes(s.header)) / (1 << 20));
    out += pad(name_cell(r.name), width) + pad(std::to_string(s.header.server_pid), 11) + pad(alive_text(s), 8) +
           pad(server_state_name(s.header.server_state), 10) + pad(std::to_string(s.header.total_elements), 11) +
           pad(mib, 10) + pad(std::to_string(workers_attached(s)), 8) + owner + "\n";
  }
  if (!problems.empty()) out += "not readable as a segment:\n" + problems;
  return out;
}

json list_json(const std::vector<ListedSegment>& list) {
  json segments = json::array();
  for (const ListedSegment& r : list) {
    // Names as the user who made the file gave them, whole, escaped.
    json j{{"name", printable_text(r.name)},
           {"source", printable_text(r.source)},
           {"owner", shm::owner_text(r.owner_uid, r.owner_gid)},
           {"mode", shm::mode_text(r.mode)},
           {"bytes", std::to_string(r.bytes)}};
    if (!r.segment) {
      j["error"] = printable_text(r.error);
      j["exit_code"] = static_cast<int>(r.exit);
    } else {
      const HeaderView& h = r.segment->header;
      j["server_pid"] = h.server_pid;
      j["server_alive"] = h.server_alive;
      j["server_stopped"] = h.server_stopped;
      j["server_holds_object"] = h.server_holds_object ? json(*h.server_holds_object) : json(nullptr);
      j["server_unseen"] = h.server_unseen;
      j["state"] = server_state_name(h.server_state);
      j["generation"] = hex64(h.generation);
      j["parameters"] = std::to_string(h.total_elements);
      j["model_bytes"] = std::to_string(model_bytes(h));
      j["workers_attached"] = workers_attached(*r.segment);
    }
    segments.push_back(std::move(j));
  }
  return json{{"segments", std::move(segments)}};
}

}  // namespace shmps::inspect
