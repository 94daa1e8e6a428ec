// A quantized linear kernel as another extension module calls it: quant_kernels.cpp and kquant_kernels.cpp
// hand quant_linear / quant_linear_glu to cpu_kernels.cpp's decoder stack as PyCapsules holding this
// function type (separate modules share C functions through capsules, as CPython's own C APIs do)
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <cstdint>

using QuantLinearFn = void (*)(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out);
inline constexpr const char* kQuantLinearCapsule = "nanoserve.quant_linear";

// a module's (linear, glu) entry points as the decoder stack takes them (its `entry_points()`)
inline pybind11::tuple entry_capsules(QuantLinearFn linear, QuantLinearFn glu) {
  const auto entry = [](QuantLinearFn f) { return pybind11::capsule(reinterpret_cast<void*>(f), kQuantLinearCapsule); };
  return pybind11::make_tuple(entry(linear), entry(glu));
}
