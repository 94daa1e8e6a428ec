// The KV tiers' bookkeeping on the step path, a load at a time in one call each: which runs of free device
// blocks a load's destinations are cut from (kvcache/extents.py: free_runs, then choose_extents), and the
// load's copies run by run (kvcache/transfer.py: cut_runs, then a copy per run). In Python each is a dozen
// numpy or tensor-slicing calls of ~5-10 us apiece when the step's forward has left the caches cold.
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstring>
#include <vector>
#include "kernels.h"

std::vector<BlockExtent> free_extents(const uint8_t* where, int64_t num_blocks, uint8_t code, int64_t n) {
  std::vector<BlockExtent> runs;  // the maximal runs of `code`, ascending
  for (int64_t i = 0; i < num_blocks;) {
    const void* hit = std::memchr(where + i, code, static_cast<size_t>(num_blocks - i));
    if (hit == nullptr) break;
    const int64_t start = static_cast<const uint8_t*>(hit) - where;
    int64_t end = start + 1;
    while (end < num_blocks && where[end] == code) ++end;
    runs.push_back({start, end - start});
    i = end;
  }
  std::vector<BlockExtent> chosen;
  if (n <= 0 || runs.empty()) return chosen;
  // Longest first, ties by start (choose_extents' stable argsort), but only the runs that can be taken
  // whole are sorted: those of the power-of-two length classes, longest class down, whose total first
  // reaches n (a pool's free space is mostly short runs; a load takes the long ones)
  int64_t class_total[64] = {};
  for (const BlockExtent& r : runs) class_total[63 - __builtin_clzll(r.length)] += r.length;
  int cut = 63;
  for (int64_t sum = 0; cut > 0 && (sum += class_total[cut]) < n;) --cut;
  std::vector<int32_t> order;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].length >= (int64_t{1} << cut)) order.push_back(static_cast<int32_t>(i));
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return runs[a].length > runs[b].length; });
  // whole runs while the sum so far stays below n (searchsorted's left side: the run reaching n exactly
  // is not taken whole, the best fit below may be another run of its length)
  int64_t taken = 0;
  size_t whole = 0;
  while (whole < order.size() && taken + runs[order[whole]].length < n) taken += runs[order[whole++]].length;
  std::vector<bool> is_whole(runs.size());
  for (size_t i = 0; i < whole; ++i) {
    chosen.push_back(runs[order[i]]);
    is_whole[order[i]] = true;
  }
  const int64_t rest = n - taken;
  if (whole < runs.size()) {
    // the rest from the smallest other run that holds it, the latest of equal ones (the last in that
    // order that holds it); one exists: the next run in the order does
    int64_t fit = -1;
    for (size_t i = 0; i < runs.size(); ++i)
      if (!is_whole[i] && runs[i].length >= rest && (fit < 0 || runs[i].length <= runs[fit].length))
        fit = static_cast<int64_t>(i);
    chosen.push_back({runs[fit].start, rest});
  }
  std::sort(chosen.begin(), chosen.end(),
            [](const BlockExtent& a, const BlockExtent& b) { return a.start < b.start; });
  return chosen;
}

void copy_runs(const at::Tensor& src, const at::Tensor& dst, const std::vector<std::array<int64_t, 3>>& runs,
               int64_t span, bool non_blocking) {
  TORCH_CHECK(span >= 1, "copy_runs: span must be >= 1, got ", span);
  for (const auto& run : runs) {
    int64_t s = run[0], d = run[1], n = run[2];
    TORCH_CHECK(s >= 0 && d >= 0 && n >= 0, "copy_runs: a run (", s, ", ", d, ", ", n, ") is negative");
    // IndexError, as transfer.copy_blocks raises (narrow's own checks raise other types for some of these)
    TORCH_CHECK_INDEX(s + n <= src.size(0) && d + n <= dst.size(0), "copy_runs: a copy of blocks [", s, ", ",
                      s + n, ") -> [", d, ", ", d + n, ") is outside pools of ", src.size(0), " -> ",
                      dst.size(0), " blocks");
    while (n > 0) {  // cut before either side reaches a multiple of `span` (transfer.py's cut_runs)
      const int64_t k = std::min({n, span - s % span, span - d % span});
      dst.narrow(0, d, k).copy_(src.narrow(0, s, k), non_blocking);
      s += k, d += k, n -= k;
    }
  }
}
