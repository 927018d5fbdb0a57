// AdamW over the adapters of LoRA layers: one adamw_step over all of them, then the bf16 working copies.
#include <algorithm>
#include <string>

#include "core/validate.h"
#include "qmm/nn.h"

namespace qmm {

AdamW::AdamW(const Context& ctx, const AdamWOptions& options) : ctx_(ctx), options_(options) {}

void AdamW::add(LoraLinear& layer) {
  const char* op = "AdamW::add";
  QMM_REQUIRE(layer.context().device() == ctx_.device(), ErrorCode::DeviceMismatch, op,
              "layer runs on " + layer.context().device().str() + " but the optimizer on " +
                  ctx_.device().str());
  QMM_REQUIRE(std::find(layers_.begin(), layers_.end(), &layer) == layers_.end(), ErrorCode::InvalidArgument,
              op, "layer was already added (it would be stepped twice)");
  layers_.push_back(&layer);
  for (const AdamWParam& p : layer.parameters()) params_.push_back(p);
}

void AdamW::add(SwiGluMlp& mlp) {
  add(mlp.gate());
  add(mlp.up());
  add(mlp.down());
}

void AdamW::step(const TensorView& norm) {
  QMM_REQUIRE(!params_.empty(), ErrorCode::InvalidArgument, "AdamW::step", "no parameters: add layers first");
  if (comm_) {
    std::vector<TensorView> grads;
    for (const AdamWParam& p : params_) grads.push_back(p.grad);
    comm_->all_reduce_mean(grads);
  }
  adamw_step(ctx_, params_, options_, steps_ + 1, norm);
  ++steps_;
  for (LoraLinear* l : layers_) l->refresh_working_copies();
}

void AdamW::all_reduce_with(Communicator* comm) {
  QMM_REQUIRE(!comm || comm->context().device() == ctx_.device(), ErrorCode::DeviceMismatch,
              "AdamW::all_reduce_with", "the communicator is not on the optimizer's device");
  comm_ = comm;
}

void AdamW::zero_grad() {
  for (LoraLinear* l : layers_) l->zero_grad();
}

}  // namespace qmm
