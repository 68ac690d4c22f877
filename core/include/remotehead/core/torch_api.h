// The parts of LibTorch the project's sources use, in one place: tensors and their operations
// (ATen) with the factories and dtypes (torch/types.h), NoGradGuard and manual_seed
// (torch/utils.h), CUDA's availability (torch/cuda.h), autograd and custom autograd functions
// (torch/autograd.h) and the version macros. Sources include this rather than <torch/torch.h>,
// which adds torch::nn, torch::optim, the data loaders, JIT and serialisation: a source loading
// the precompiled <torch/torch.h> paid 3.6 s before its own first line, this set 2.0 s
// (cmake/RemoteheadPch.cmake precompiles exactly this header). A source that uses
// torch::nn::functional or torch::optim (tests comparing with PyTorch's own) includes that too.
#pragma once

#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>
