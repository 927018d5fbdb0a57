// Umbrella header: everything a user of qmm needs.
#pragma once

#include "qmm/context.h"
#include "qmm/dist.h"
#include "qmm/error.h"
#include "qmm/nf4.h"
#include "qmm/nn.h"
#include "qmm/ops.h"
#include "qmm/safetensors.h"
#include "qmm/tensor.h"
#include "qmm/train_ops.h"
