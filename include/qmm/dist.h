// Data parallelism: one process per GPU, each with the frozen base and a replica of the adapters; the adapter
// gradients are averaged across the processes with NCCL (all-reduce) before every optimizer step.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "qmm/context.h"
#include "qmm/tensor.h"

namespace qmm {

class Communicator {
 public:
  // Joins a world of `world_size` ranks on ctx's GPU. Rank 0 creates the NCCL id and writes it to the file
  // `rendezvous` (written whole, then renamed into place); the other ranks wait up to timeout_s for that file.
  // World size 1 needs no file and runs NCCL as well (the same code path as more ranks). Throws Distributed on a
  // rendezvous timeout or an NCCL failure, Unsupported when qmm was built without NCCL, InvalidArgument on bad
  // ranks. A CPU context accepts only world size 1 (and then averaging is the identity).
  Communicator(const Context& ctx, int rank, int world_size, const std::string& rendezvous = "",
               double timeout_s = 120.0);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world_size() const;
  const Context& context() const;

  // Replaces each f32 tensor (on ctx's device) by its mean over the ranks, in place, ordered on ctx's stream.
  void all_reduce_mean(const std::vector<TensorView>& tensors);
  // Whether every rank holds bit-identical values in `tensors` (a 64-bit hash of the bytes, compared through
  // a min/max all-reduce). Synchronizes ctx.
  bool same_on_all_ranks(const std::vector<TensorView>& tensors);

  // Whether this build can create communicators on the GPU.
  static bool available();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qmm
