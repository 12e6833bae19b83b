#include "weft/hstu/launch.hpp"

#include <cuda_runtime_api.h>

#include <charconv>
#include <cstdlib>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"

namespace weft::hstu {
namespace {

int parse_int(const char* name, const char* text) {
  int value = 0;
  const char* end = text + std::char_traits<char>::length(text);
  const auto [ptr, ec] = std::from_chars(text, end, value);
  WEFT_CHECK(ec == std::errc() && ptr == end, "launch: ", name, "='", text, "' is not a number");
  return value;
}

struct Names {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

constexpr Names kLaunchers[] = {
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
};

constexpr const char* kDefaultLocalRendezvous = "127.0.0.1:29571";

}  // namespace

LaunchEnv detect_launch_env(const GetEnv& get_env, const std::string& rendezvous) {
  LaunchEnv env;
  env.launcher = "single";
  for (const Names& n : kLaunchers) {
    const char* rank = get_env(n.rank);
    const char* size = get_env(n.size);
    if (rank == nullptr || size == nullptr) continue;
    env.launcher = n.launcher;
    env.rank = parse_int(n.rank, rank);
    env.world_size = parse_int(n.size, size);
    const char* local_rank = get_env(n.local_rank);
    const char* local_size = get_env(n.local_size);
    // Without local variables every rank is taken to be on this host.
    env.local_rank = local_rank ? parse_int(n.local_rank, local_rank) : env.rank;
    env.local_world_size = local_size ? parse_int(n.local_size, local_size) : env.world_size;
    break;
  }
  WEFT_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "launch (",
             env.launcher, "): rank ", env.rank, " is outside a world of ", env.world_size);
  WEFT_CHECK(env.local_rank >= 0 && env.local_rank < env.local_world_size &&
                 env.local_world_size <= env.world_size,
             "launch (", env.launcher, "): local rank ", env.local_rank, " of ",
             env.local_world_size, " local ranks in a world of ", env.world_size);
  if (env.world_size == 1) return env;
  const char* comm_id = get_env("NCCL_COMM_ID");
  const char* weft_rdv = get_env("WEFT_RENDEZVOUS");
  const char* master_addr = get_env("MASTER_ADDR");
  const char* master_port = get_env("MASTER_PORT");
  if (!rendezvous.empty()) {
    env.rendezvous = rendezvous;
  } else if (comm_id != nullptr) {
    env.rendezvous = comm_id;
  } else if (weft_rdv != nullptr) {
    env.rendezvous = weft_rdv;
  } else if (master_addr != nullptr && master_port != nullptr) {
    env.rendezvous = std::string(master_addr) + ":" +
                     std::to_string(parse_int("MASTER_PORT", master_port) + 1);
  } else {
    WEFT_CHECK(env.local_world_size == env.world_size, "launch (", env.launcher, "): ",
               env.world_size, " ranks on several hosts need a rendezvous: set NCCL_COMM_ID or "
               "WEFT_RENDEZVOUS to host:port of rank 0, or pass --rendezvous");
    env.rendezvous = kDefaultLocalRendezvous;
  }
  WEFT_CHECK(env.rendezvous.find(':') != std::string::npos, "launch: rendezvous '",
             env.rendezvous, "' is not host:port");
  return env;
}

LaunchEnv detect_launch_env(const std::string& rendezvous) {
  return detect_launch_env([](const char* name) { return std::getenv(name); }, rendezvous);
}

ncclComm_t init_communicator(const LaunchEnv& env) {
  WEFT_CUDA_CHECK(cudaSetDevice(env.local_rank));
  ncclUniqueId id{};
  if (env.world_size > 1) {
    // NCCL derives the id from NCCL_COMM_ID, identically on every rank.
    WEFT_CHECK(setenv("NCCL_COMM_ID", env.rendezvous.c_str(), 1) == 0,
               "launch: cannot set NCCL_COMM_ID");
  }
  WEFT_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclComm_t comm = nullptr;
  WEFT_NCCL_CHECK(ncclCommInitRank(&comm, env.world_size, id, env.rank));
  return comm;
}

}  // namespace weft::hstu
