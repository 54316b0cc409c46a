// The MPI engine of the federation (Open MPI or MPICH): static membership
// from the launcher (mpirun, srun), a duplicate of MPI_COMM_WORLD with
// errors returned rather than fatal. MPI is fail-stop: a dead rank ends the
// job (docs/federation.md, "Engines"). MPI_THREAD_SERIALIZED: MPI is
// initialised on the creating thread and then used by the federation
// thread alone.
#include <mpi.h>

#include <climits>
#include <string>
#include <type_traits>
#include <vector>

#include "federation_plugin.hpp"
#include "shmps/server/federation.hpp"
#include "threads.hpp"

namespace shmps::server {

namespace {

std::string mpi_error(int code, const char* call) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return std::string("federation (mpi): ") + call + " failed: " + std::string(text, static_cast<size_t>(len));
}

// MPI counts are ints: spans past INT_MAX elements go in pieces.
constexpr size_t kMaxCount = INT_MAX / 2;

class MpiEngine final : public FederationEngine {
 public:
  static Result<std::unique_ptr<FederationEngine>> create(const FederationConfig& config) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized != 0) return Status{ErrorCode::kIo, "federation (mpi): MPI is already initialised in this process"};
    int provided = 0;
    // The threads MPI starts here (Open MPI's progress threads) take the
    // calling thread's CPUs and name: --fed-cpus and shmps-fed-io while
    // they start, as an engine's own threads are placed and named
    // (threads.hpp); the caller, the consumer to be, then gets its own
    // back. A failure to place them leaves them where the server runs (the
    // round loop logs its own).
    char own_name[16] = "";
    (void)::pthread_getname_np(::pthread_self(), own_name, sizeof own_name);
    const std::vector<uint32_t> own_cpus = config.cpus.empty() ? std::vector<uint32_t>{} : thread_cpus();
    const bool placed = !own_cpus.empty() && pin_this_thread(config.cpus).empty();
    name_this_thread("shmps-fed-io");
    const int init = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    name_this_thread(own_name);
    const std::string unrestored = placed ? pin_this_thread(own_cpus) : "";
    if (init != MPI_SUCCESS) return Status{ErrorCode::kIo, mpi_error(init, "MPI_Init_thread")};
    auto engine = std::unique_ptr<MpiEngine>(new MpiEngine());
    if (!unrestored.empty())
      return Status{ErrorCode::kIo,
                    "federation (mpi): cannot give the server's thread its CPUs back after placing "
                    "MPI's threads on --fed-cpus (" +
                        unrestored + ")"};
    if (provided < MPI_THREAD_SERIALIZED)
      return Status{ErrorCode::kIo, "federation (mpi): the MPI library offers no MPI_THREAD_SERIALIZED (got level " +
                                        std::to_string(provided) + "); the federation thread needs it"};
    if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &engine->comm_); rc != MPI_SUCCESS)
      return Status{ErrorCode::kIo, mpi_error(rc, "MPI_Comm_dup")};
    engine->have_comm_ = true;
    MPI_Comm_set_errhandler(engine->comm_, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(engine->comm_, &rank);
    MPI_Comm_size(engine->comm_, &size);
    engine->membership_.rank = static_cast<uint32_t>(rank);
    engine->membership_.size = static_cast<uint32_t>(size);
    engine->membership_.host = static_cast<uint32_t>(rank);
    return std::unique_ptr<FederationEngine>(std::move(engine));
  }

  // MPI_Finalize returns once every rank of the job called it (Open MPI);
  // not calling it is no way out, since mpirun then aborts the whole job.
  ~MpiEngine() override {
    if (have_comm_) MPI_Comm_free(&comm_);
    MPI_Finalize();
  }

  const char* name() const noexcept override { return "mpi"; }
  bool close_waits_for_every_member() const noexcept override { return true; }
  Membership membership() const noexcept override { return membership_; }

  Status allreduce_sum(std::span<float> data) override {
    for (size_t done = 0; done < data.size();) {
      const size_t n = std::min(kMaxCount, data.size() - done);
      if (int rc = MPI_Allreduce(MPI_IN_PLACE, data.data() + done, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_);
          rc != MPI_SUCCESS)
        return {ErrorCode::kIo, mpi_error(rc, "MPI_Allreduce")};
      done += n;
    }
    return Status::Ok();
  }

  Status allgather(std::span<const std::byte> mine, std::span<std::byte> all) override {
    if (mine.size() > kMaxCount || all.size() != mine.size() * membership_.size)
      return {ErrorCode::kInternal, "federation (mpi): allgather of a size it cannot take"};
    const int n = static_cast<int>(mine.size());
    if (int rc = MPI_Allgather(mine.data(), n, MPI_BYTE, all.data(), n, MPI_BYTE, comm_); rc != MPI_SUCCESS)
      return {ErrorCode::kIo, mpi_error(rc, "MPI_Allgather")};
    return Status::Ok();
  }

  Status broadcast(std::span<std::byte> data, uint32_t root) override {
    for (size_t done = 0; done < data.size();) {
      const size_t n = std::min(kMaxCount, data.size() - done);
      if (int rc = MPI_Bcast(data.data() + done, static_cast<int>(n), MPI_BYTE, static_cast<int>(root), comm_);
          rc != MPI_SUCCESS)
        return {ErrorCode::kIo, mpi_error(rc, "MPI_Bcast")};
      done += n;
    }
    return Status::Ok();
  }

 private:
  MpiEngine() = default;
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool have_comm_ = false;
  Membership membership_;
};

}  // namespace

}  // namespace shmps::server

extern "C" __attribute__((visibility("default"))) void shmps_fed_mpi_make(
    const shmps::server::FederationConfig& config, std::unique_ptr<shmps::server::FederationEngine>* engine,
    shmps::Status* status) {
  auto made = shmps::server::MpiEngine::create(config);
  if (!made.ok()) {
    *status = made.status();
    return;
  }
  *engine = std::move(made).value();
}
static_assert(std::is_same_v<decltype(shmps_fed_mpi_make), FederationEngineMaker>);
