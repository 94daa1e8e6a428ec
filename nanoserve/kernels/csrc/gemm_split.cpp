// Prefill-sized GEMMs split by rows. One oneDNN matmul (a weight prepacked by mkldnn._reorder_linear_weight,
// epilogue `attr`, times `other` when given) with each of the threads computing its own rows against the
// whole weight, each call single-threaded (oneDNN runs serially inside a parallel region). oneDNN's own
// split of a bf16 AMX matmul over 2 threads is ~1.2x one thread's speed at 1024 rows, this one ~1.7x (the
// embedded model's four projections: 3.53 / 2.88 / 2.08 ms on a 2-core AMX Xeon). With fewer or more rows,
// and in fp32, oneDNN's split measured faster: the caller (layers/linear.py) decides.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <algorithm>
#include "kernels.h"

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>);
using LinearMulFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::string_view);

const c10::TypedOperatorHandle<LinearFn>& mkldnn_linear() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearFn>();
  return op;
}

const c10::TypedOperatorHandle<LinearMulFn>& mkldnn_linear_mul() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                             .typed<LinearMulFn>();
  return op;
}

}  // namespace

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         c10::string_view attr, const at::Tensor* other) {
  if (other != nullptr) return mkldnn_linear_mul().call(x, *other, packed, bias, attr);
  return mkldnn_linear().call(x, packed, bias, attr, c10::List<std::optional<at::Scalar>>(),
                              c10::string_view(""));
}

at::Tensor linear_rows(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n_out,
                       std::string attr, c10::optional<at::Tensor> other) {
  const auto& linear = mkldnn_linear();
  const auto& linear_mul = mkldnn_linear_mul();
  TORCH_CHECK(x.dim() == 2 &&
              (!other || (other->dim() == 2 && other->size(0) == x.size(0) && other->size(1) == n_out)));
  const int64_t rows = x.size(0),
                parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  const int64_t per = (rows + parts - 1) / parts;
  at::Tensor out = at::empty({rows, n_out}, x.options());
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the pool's threads need it too
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);
    at::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i * per, n = std::min(per, rows - r0);
      if (n <= 0) continue;
      const at::Tensor xs = x.narrow(0, r0, n);
      out.narrow(0, r0, n).copy_(
          other ? linear_mul.call(xs, other->narrow(0, r0, n), packed, bias, attr)
                : linear.call(xs, packed, bias, attr, c10::List<std::optional<at::Scalar>>(), std::nullopt));
    }
  });
  return out;
}
