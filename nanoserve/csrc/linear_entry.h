// A quantized linear kernel as another extension module calls it: quant_kernels.cpp and kquant_kernels.cpp
// hand quant_linear / quant_linear_glu to cpu_kernels.cpp's decoder stack as PyCapsules holding this
// function type (separate modules share C functions through capsules, as CPython's own C APIs do)
#pragma once
#include <ATen/ATen.h>
#include <cstdint>

using QuantLinearFn = void (*)(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out);
inline constexpr const char* kQuantLinearCapsule = "nanoserve.quant_linear";
