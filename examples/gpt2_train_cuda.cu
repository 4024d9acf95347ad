// gpt2_train --device cuda: the same training loop (gpt2_train.hpp) on the CUDA backend, each
// rank with a GPU and a stream of its own.
//
//   gpt2_train --demo --device cuda                         # one rank on GPU 0
//   gpt2_train --demo --device cuda --dp 2 --tp 2           # 4 thread ranks sharing the GPU(s)
//   gpt2_train --demo --device cuda --dp 8 --comm nccl      # 8 thread ranks on 8 GPUs, NCCL
//   mpirun -n 8 gpt2_train --demo --device cuda --comm mpi-nccl
//
// Communicators: NCCL moves GPU buffers directly and needs a GPU per rank (NCCL refuses two
// ranks of one communicator on one GPU). --comm threads and --comm mpi stage every buffer through
// host memory (StagedCommunicator), so that ranks may share a GPU and every strategy and schedule
// runs where there is only one.

#include <algorithm>
#include <cstdlib>
#include <string>

#include "loom/backend/cuda/kernels.cuh"
#include "loom/comm/staged.hpp"
#include "loom/comm/threads.hpp"
#if LOOM_EXAMPLE_WITH_NCCL
#include "loom/comm/nccl.hpp"
#endif
#if LOOM_EXAMPLE_WITH_MPI
#include "loom/comm/mpi.hpp"
#endif
#include "gpt2_train.hpp"

namespace gpt2_example {
namespace {

//! Trains this rank on GPU `device` over `world`: NCCL between the GPUs with --comm nccl or
//! mpi-nccl, else `world` itself with every buffer staged through host memory.
template <class World>
int train_on_gpu(const Options& o, World& world, int device) {
  loom::cuda backend(device);
  backend.set_flash_attention(o.flash_attention);
  backend.set_warpgroup_attention(o.warpgroup_attention);
  backend.set_overlap_communication(o.communication_stream);
  // Unset, the epilogues are on for bf16 only: cuBLASLt's GELU and GELU' are approximations good
  // to about 2^-9 (tests/cuda/test_cuda_gemm_epilogues.cu), under bf16's rounding, not fp32's.
  backend.set_gemm_epilogues(o.gemm_epilogues.value_or(o.dtype == "bf16"));
  if (o.comm == "nccl" || o.comm == "mpi-nccl") {
#if LOOM_EXAMPLE_WITH_NCCL
    loom::nccl::Communicator group = loom::nccl::Communicator::bootstrap(backend, world);
    return train_on(o, backend, group);
#else
    throw loom::Error("--comm", o.comm, std::string("this ") + program + " was built without NCCL");
#endif
  }
  // A communicator of the staged world's own (split is collective): the launcher keeps `world`.
  loom::StagedCommunicator<World, loom::cuda> staged(world.split(0, world.rank()), backend);
  return train_on(o, backend, staged);
}

//! This process's rank among the MPI processes on its machine (OpenMPI's variable), or its
//! world rank where the launcher does not say.
int local_rank(int world_rank) {
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) return std::atoi(local);
  return world_rank;
}

}  // namespace

int run_cuda(const Options& o, int& argc, char**& argv) {
  // Every schedule runs over NCCL (no tags, one stream): the Trainer groups each stage's sends
  // with the receives after them so that none waits behind another, and checks that plan for
  // every rank before step 1 (docs/cuda.md, "Pipelines over NCCL").
  const int visible = loom::cuda::device_count();
  LOOM_CHECK(visible > 0, "--device", "cuda", "no CUDA device is available to this process");
  if (o.comm == "mpi" || o.comm == "mpi-nccl") {
#if LOOM_EXAMPLE_WITH_MPI
    return loom::mpi::run(argc, argv, [&](loom::mpi::Communicator& world) {
      check_mpi_world(o, world.size());
      return mpi_status(train_on_gpu(o, world, local_rank(world.rank()) % visible));
    });
#else
    throw loom::Error("--comm", o.comm, std::string("this ") + gpt2_example::program + " was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }
  const int ranks = o.dp * o.tp * o.pp;
  const int gpus = o.gpus > 0 ? std::min(o.gpus, visible) : visible;
  if (o.comm == "nccl")
    LOOM_CHECK(ranks <= gpus, "--comm nccl: ranks", ranks,
               "must be <= the GPUs used (" + std::to_string(gpus) +
                   "): NCCL refuses two ranks of one communicator on the same GPU; --comm threads lets "
                   "ranks share a GPU");
  int code = 0;
  // Thread ranks take the GPUs round robin.
  loom::threads::run(ranks, [&](loom::threads::Communicator& world) {
    const int c = train_on_gpu(o, world, world.rank() % gpus);
    if (world.rank() == 0) code = c;
  });
  return code;
}

}  // namespace gpt2_example
