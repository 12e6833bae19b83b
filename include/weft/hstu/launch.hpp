// How a `weft run` process finds its place: rank, world size, local rank and the rendezvous, from
// the launcher's environment, and the NCCL communicator built from them.
//
// Recognised, in this order: Open MPI (`mpirun -np N`: OMPI_COMM_WORLD_RANK / _SIZE /
// _LOCAL_RANK / _LOCAL_SIZE), PMI/Hydra (PMI_RANK / PMI_SIZE, MPI_LOCALRANKID), plain variables
// (RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, as torchrun sets them); none of them: one
// process, world size 1.
// Rendezvous (host:port where NCCL's bootstrap root listens), in this order: the explicit value,
// NCCL_COMM_ID, WEFT_RENDEZVOUS, MASTER_ADDR:MASTER_PORT+1 (MASTER_PORT itself is usually taken
// by the launcher's own store), and 127.0.0.1:29571 when every rank runs on this host.
//
//   auto env = detect_launch_env();                 // or detect_launch_env(getenv_fn, "h:p")
//   ncclComm_t comm = init_communicator(env);       // device = env.local_rank
#pragma once

#include "weft/cuda/nccl_include.hpp"

#include <functional>
#include <string>

namespace weft::hstu {

struct LaunchEnv {
  int rank = 0;              // in [0, world_size)
  int world_size = 1;        // >= 1
  int local_rank = 0;        // this host's index of the rank, which picks its GPU
  int local_world_size = 1;  // ranks on this host
  std::string launcher;    // "mpirun", "pmi", "env" or "single"
  std::string rendezvous;  // host:port; empty for world size 1
};

using GetEnv = std::function<const char*(const char*)>;

// Throws weft::Error for inconsistent values (rank outside the world, a bad number, a world of
// several hosts without a rendezvous).
LaunchEnv detect_launch_env(const GetEnv& get_env, const std::string& rendezvous = {});
LaunchEnv detect_launch_env(const std::string& rendezvous = {});

// ncclCommInitRank on device env.local_rank. World size 1 needs no rendezvous; otherwise every
// rank derives the same unique id from NCCL_COMM_ID (set here to env.rendezvous) and rank 0
// listens there.
ncclComm_t init_communicator(const LaunchEnv& env);

}  // namespace weft::hstu
