// A causal LM's token loop for generation, in C++ (decode_loop; srupp/models/lm.py,
// CausalLM.generate): sampling as srupp.models.lm.sample samples, the embedding, the
// stack's step (layer_step.cpp, as stack_step) and the output layer.

#include "common.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/topk.h>

namespace srupp_cpu {

namespace {

// logits.argmax(-1) of (B, V) fp32 or bf16 logits with contiguous rows, in a plain loop:
// ATen's reduction took 30 us for 32 rows of 256 (4% of a 32-stream step, on one
// thread). As torch.argmax: the first index of the row's maximum, or of its first NaN.
template <typename T>
void argmax_rows(const T* l, int64_t ld, int64_t B, int64_t V, int64_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    const T* row = l + b * ld;
    int64_t best = 0;
    float top = static_cast<float>(row[0]);
    for (int64_t v = 1; v < V && !std::isnan(top); ++v) {
      const float x = static_cast<float>(row[v]);
      if (x > top || std::isnan(x)) {
        top = x;
        best = v;
      }
    }
    out[b] = best;
  }
}

Tensor greedy(const Tensor& logits) {
  const bool plain = logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1 &&
                     (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16);
  if (!plain) return logits.argmax(-1);
  const int64_t B = logits.size(0), V = logits.size(1);
  Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat)
    argmax_rows(logits.data_ptr<float>(), logits.stride(0), B, V, out.data_ptr<int64_t>());
  else
    argmax_rows(logits.data_ptr<BFloat16>(), logits.stride(0), B, V, out.data_ptr<int64_t>());
  return out;
}

// srupp.models.lm.sample, ATen op for ATen op, so that a seeded generator draws the
// very tokens the Python loop draws. top_k <= 0 and top_p outside (0, 1) are off.
Tensor sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
              const std::optional<at::Generator>& generator) {
  if (temperature == 0) return greedy(logits);
  const double inf = std::numeric_limits<double>::infinity();
  Tensor l = logits.to(at::kFloat) / temperature;
  if (top_k > 0 && top_k < l.size(-1)) {
    Tensor kth = std::get<0>(at::topk(l, top_k, -1)).narrow(-1, top_k - 1, 1);
    l = l.masked_fill(l < kth, -inf);
  }
  if (top_p > 0 && top_p < 1.0) {
    auto [sorted, order] = at::sort(l, -1, /*descending=*/true);
    Tensor probs = sorted.softmax(-1);
    Tensor drop = (probs.cumsum(-1) - probs) >= top_p;  // the mass before reaches top_p
    sorted = sorted.masked_fill(drop, -inf);
    l = at::full_like(l, -inf).scatter(-1, order, sorted);
  }
  return at::multinomial(l.softmax(-1), 1, false, generator).squeeze(-1);
}

// The next token of every row. One setting (each list of size 1): the batch is drawn
// in one call, as CausalLM.generate draws it. One setting per row (size B): each row
// is drawn alone with its own generator, as the engine's streams draw
// (srupp/engine/engine.py, Engine._sample); greedy rows take the batch's argmax.
Tensor sample_rows(const Tensor& logits, const std::vector<double>& temperature,
                   const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                   const std::vector<std::optional<at::Generator>>& generator) {
  if (temperature.size() == 1)
    return sample(logits, temperature[0], top_k[0], top_p[0], generator[0]);
  Tensor token = greedy(logits);
  for (int64_t i = 0; i < logits.size(0); ++i)
    if (temperature[i] != 0)
      token.narrow(0, i, 1).copy_(
          sample(logits.narrow(0, i, 1), temperature[i], top_k[i], top_p[i], generator[i]));
  return token;
}

// How the LM's output layer computes its logits at these rows, chosen in Python
// (srupp/nn/stack_step.py, output_args) by the rules its module's forward follows.
enum OutputRoute : int64_t { kRows = 0, kAten = 1, kInt8Rows = 2, kW8A8Rows = 3 };

Tensor output(const Tensor& h, const Tensor& w, const std::optional<Tensor>& bias,
              const std::optional<Tensor>& scale, int64_t route) {
  switch (route) {
    case kRows: return linear_rows_cpu(h, w, bias);
    case kAten: return at::linear(h, w, bias);
    case kInt8Rows: return linear_int8_rows_cpu(h, w, *scale, bias, false);
    case kW8A8Rows: return linear_w8a8_rows_cpu(h, w, *scale, bias, false);
  }
  TORCH_CHECK(false, "srupp decode_loop: output route must be 0..3, got ", route);
}

}  // namespace

// Set from Python only (srupp.ops.settings.tuning().decode_row_group, common.h).
std::atomic<int64_t> row_group_rows{16};

namespace {

// What one run of the token loop over some rows leaves: the tokens (rows, t), c, the next
// logits, where each layer's rows start now, the memory length M and the window's shift.
struct LoopRows {
  Tensor tokens, c, logits;
  std::vector<int64_t> ks, ms;
  int64_t M, shift, t;
};

// The token loop (decode_loop_cpu below documents it) over the rows of `stack`, c and the
// other per-row arguments: each of them holds the same rows.
LoopRows run_loop(const layer_step_impl::Stack& stack, const Tensor& logits, const Tensor& done,
                  const Tensor& embedding, const Tensor& out_weight,
                  const std::optional<Tensor>& out_bias, const std::optional<Tensor>& out_scale,
                  int64_t out_route, const Tensor& c, const std::optional<Tensor>& memory_pad,
                  const std::vector<int64_t>& kv_start, const std::vector<int64_t>& memory_start,
                  int64_t cached, int64_t mem_len, int64_t n, bool final, bool keep,
                  const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                  const std::vector<double>& top_p,
                  const std::vector<std::optional<at::Generator>>& generator, int64_t eos_id,
                  const std::optional<Tensor>& first) {
  using layer_step_impl::Stack;
  const size_t L = kv_start.size();
  const int64_t B = c.size(1);
  const bool has_pad = memory_pad.has_value() && memory_pad->defined();
  std::vector<int64_t> ks(kv_start), ms(memory_start);  // where each layer's rows start now
  Tensor tokens = at::empty({B, n}, c.options().dtype(at::kLong));
  Tensor next_logits = logits, c_cur = c;
  int64_t M = cached, shift = 0, t = 0;
  bool unfed_first = first.has_value() && first->defined();
  while (unfed_first || t < n) {
    Tensor token;
    if (unfed_first) {  // fed as it is: not sampled, not among the tokens returned
      token = *first;
      unfed_first = false;
    } else {
      token = sample_rows(next_logits, temperature, top_k, top_p, generator);
      tokens.select(1, t).copy_(token);
      ++t;
      if (eos_id >= 0) {
        done.logical_or_(token == eos_id);
        if (done.all().item<bool>()) break;
      }
      if (final && t == n) break;
    }
    const Tensor x = at::embedding(embedding, token);                       // (B, n_in)
    std::optional<Tensor> pad;
    if (has_pad && M > 0) pad = memory_pad->narrow(1, shift, M);
    Tensor c_next = at::empty_like(c_cur);
    const Tensor h = stack.run(x, c_cur, c_next, pad, ks.data(), ms.data(), M);
    c_cur = std::move(c_next);
    next_logits = output(h, out_weight, out_bias, out_scale, out_route);
    if (keep) {  // the memory window after the token: its last `kept` rows
      const int64_t kept = mem_len < 0 ? M + 1 : std::min(M + 1, mem_len);
      const int64_t dropped = M + 1 - kept;
      for (size_t l = 0; l < L; ++l)
        if (Stack::has(stack.memory[l])) { ks[l] += dropped; ms[l] += dropped; }
      shift += dropped;
      M = kept;
    }
  }
  return {tokens.narrow(1, 0, t), c_cur, next_logits, ks, ms, M, shift, t};
}

template <typename V>
V slice(const V& v, int64_t r0, int64_t g) {  // a per-row list's rows r0 .. r0+g-1 (or its one)
  if (v.size() == 1) return v;
  return V(v.begin() + r0, v.begin() + r0 + g);
}

}  // namespace

// The row groups the loop runs, as (first row, rows): all B at once, or groups of
// tuning().decode_row_group rows (a remainder under half a group joins the last one),
// each running every token of the call before the next starts. A group's keys and values
// then stay in the cache from one token to the next, where all B rows' overflow it (32
// rows of the 5M shakespeare-cpu model: 17 MB with the weights' 10, on a 32 MB L3;
// docs/deploy.md). Only where no row's tokens can depend on the others' or on the order
// rows are drawn in: every product on the few-rows kernels (B <= few_rows: a row's
// result the same in any batch) and none with int8 weights (whose rows' bits depend on
// how many rows share a call: tests/engine/test_engine.py), the logits by a per-row
// float or w8a8 kernel (not ATen's GEMM), no end token (every row runs the same steps),
// and each row greedy or drawn by a generator of its own.
std::vector<std::pair<int64_t, int64_t>> decode_row_groups(
    int64_t B, int64_t few_rows, const std::vector<int64_t>& quant, int64_t out_route,
    int64_t eos_id, const std::vector<double>& temperature,
    const std::vector<std::optional<at::Generator>>& generator) {
  TORCH_CHECK(generator.size() == temperature.size() &&
                  (temperature.size() == 1 || temperature.size() == static_cast<size_t>(B)),
              "srupp decode_row_groups: temperature and generator: one each, or one per row");
  const int64_t G = row_group_rows.load(std::memory_order_relaxed);
  const std::vector<std::pair<int64_t, int64_t>> all{{0, B}};
  if (G <= 0 || B < G + (G + 1) / 2 || B > few_rows || out_route == kAten ||
      out_route == kInt8Rows || eos_id >= 0)
    return all;
  for (int64_t q : quant)
    if (q == 1) return all;  // int8 weights (layer_step.cpp's kInt8)
  if (temperature.size() == 1) {
    if (temperature[0] != 0) return all;  // the batch is drawn in one call
  } else {
    std::vector<const void*> own;
    for (size_t i = 0; i < temperature.size(); ++i) {
      if (temperature[i] == 0) continue;
      if (!generator[i].has_value() || !generator[i]->defined()) return all;  // the global one
      own.push_back(generator[i]->unsafeGetGeneratorImpl());
    }
    std::sort(own.begin(), own.end());
    if (std::adjacent_find(own.begin(), own.end()) != own.end()) return all;  // one shared
  }
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t r0 = 0; r0 < B; r0 += G) groups.push_back({r0, std::min(G, B - r0)});
  if (groups.back().second < (G + 1) / 2) {  // too few rows alone: they join the last group
    const int64_t rest = groups.back().second;
    groups.pop_back();
    groups.back().second += rest;
  }
  return groups;
}

// Up to n tokens of a causal LM with an SRU++ stack, all in C++ (srupp/models/lm.py,
// CausalLM.generate): per token, sample from `logits` (B, V), then embed the token, run
// the stack (as stack_step) and the output layer for the next logits. The Python loop
// spent about as long around the stack's kernel as the kernel itself.
//   done (B,) bool, updated in place: rows that sampled eos_id (-1: none); the loop stops
//     once every row is done, before stepping.
//   embedding (V, n_in); out_weight (V, D) with out_bias, out_scale (int8) and route.
//   c and the stack's lists: as stack_step. memory_pad: None, or the pad mask of the
//     cached rows followed by zeros for the tokens' own, (B, >= cached + n - 1) bool;
//     mem_len: the memory window (-1: none).
//     kv_start / memory_start: where each layer's cached rows start; the buffers have
//     room for n more rows after them.
//   final: skip the step after the n-th token (nothing reads its logits).
//   temperature, top_k, top_p, generator: one setting for every row, or one per row
//     (sample_rows).
//   first: None, or tokens (B,) long fed before the first sample (`logits` then unused):
//     the memory buffers and memory_pad then need room for one more row.
// Returns the tokens (B, t <= n) long, the new c, the next logits, and as stack_step
// each layer's memory and [K | V] views after the last step, and `shift`, how far the
// window moved every layer's first row (their views start at start[l] + shift).
// The rows may run in groups (decode_row_groups): the same tokens, state and logits.
std::tuple<Tensor, Tensor, Tensor, std::vector<std::optional<Tensor>>,
           std::vector<std::optional<Tensor>>, int64_t>
decode_loop_cpu(const Tensor& logits, const Tensor& done, const Tensor& embedding,
                const Tensor& out_weight, const std::optional<Tensor>& out_bias,
                const std::optional<Tensor>& out_scale, int64_t out_route, const Tensor& c,
                const std::vector<std::optional<Tensor>>& weights,
                const std::vector<std::optional<Tensor>>& kv,
                const std::vector<std::optional<Tensor>>& memory,
                const std::optional<Tensor>& memory_pad, const std::vector<int64_t>& kv_start,
                const std::vector<int64_t>& memory_start, int64_t cached, int64_t mem_len,
                const std::vector<double>& norm_eps, const std::vector<double>& attn_norm_eps,
                const std::vector<double>& scale_x, const std::vector<int64_t>& num_heads,
                const std::vector<int64_t>& normalize_after, int64_t few_rows,
                const std::vector<std::optional<Tensor>>& extras,
                const std::vector<int64_t>& quant, int64_t n, bool final,
                const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                const std::vector<double>& top_p,
                const std::vector<std::optional<at::Generator>>& generator, int64_t eos_id,
                const std::optional<Tensor>& first) {
  using layer_step_impl::Stack;
  const Stack stack{weights, kv, memory, norm_eps, attn_norm_eps, scale_x,
                    num_heads, normalize_after, few_rows, extras, quant};
  const size_t L = stack.check(c, "decode_loop");
  const int64_t B = c.size(1);
  TORCH_CHECK(kv_start.size() == L && memory_start.size() == L,
              "srupp decode_loop: one kv_start and one memory_start per layer");
  const bool feed_first = first.has_value() && first->defined();
  TORCH_CHECK(!feed_first || (first->dim() == 1 && first->size(0) == B &&
                              first->scalar_type() == at::kLong),
              "srupp decode_loop: first (B,) long");
  TORCH_CHECK((feed_first || (logits.dim() == 2 && logits.size(0) == B)) && done.dim() == 1 &&
                  done.size(0) == B && done.scalar_type() == at::kBool && done.is_contiguous(),
              "srupp decode_loop: logits (B, V) and done (B,) bool contiguous");
  const size_t settings = temperature.size();
  TORCH_CHECK((settings == 1 || settings == static_cast<size_t>(B)) && top_k.size() == settings &&
                  top_p.size() == settings && generator.size() == settings,
              "srupp decode_loop: temperature, top_k, top_p and generator: one each, or one "
              "per row");
  TORCH_CHECK(embedding.dim() == 2 && n >= 0 && cached >= 0,
              "srupp decode_loop: embedding (V, n_in), n >= 0 and cached >= 0");
  bool keep = false;  // whether the token's row stays in memory (else M stays 0)
  for (size_t l = 0; l < L; ++l) keep = keep || Stack::has(memory[l]);
  const bool has_pad = memory_pad.has_value() && memory_pad->defined();
  // the step that feeds the f-th token reads the pad of at most cached + f - 1 rows
  const int64_t most_fed = n - 1 + (feed_first ? 1 : 0);
  TORCH_CHECK(!has_pad || (memory_pad->dim() == 2 && memory_pad->size(0) == B &&
                           memory_pad->size(1) >= cached + most_fed),
              "srupp decode_loop: memory_pad (B, >= cached + n - 1, + 1 with first) bool");
  const auto groups =
      decode_row_groups(B, few_rows, quant, out_route, eos_id, temperature, generator);
  std::vector<LoopRows> parts;
  for (const auto& rows_g : groups) {
    const int64_t r0 = rows_g.first, g = rows_g.second;
    if (g == B) {
      parts.push_back(run_loop(stack, logits, done, embedding, out_weight, out_bias, out_scale,
                               out_route, c, memory_pad, kv_start, memory_start, cached,
                               mem_len, n, final, keep, temperature, top_k, top_p, generator,
                               eos_id, first));
      break;
    }
    auto rows = [&](const std::optional<Tensor>& t) -> std::optional<Tensor> {
      if (!t.has_value() || !t->defined()) return t;
      return t->narrow(0, r0, g);
    };
    layer_step_impl::OptTensors kv_g(L), memory_g(L);
    for (size_t l = 0; l < L; ++l) { kv_g[l] = rows(kv[l]); memory_g[l] = rows(memory[l]); }
    const Stack group{weights, kv_g, memory_g, norm_eps, attn_norm_eps, scale_x,
                      num_heads, normalize_after, few_rows, extras, quant};
    parts.push_back(run_loop(
        group, feed_first ? logits : logits.narrow(0, r0, g), done.narrow(0, r0, g), embedding,
        out_weight, out_bias, out_scale, out_route, c.narrow(1, r0, g).contiguous(),
        rows(memory_pad), kv_start, memory_start, cached, mem_len, n, final, keep,
        slice(temperature, r0, g), slice(top_k, r0, g), slice(top_p, r0, g),
        slice(generator, r0, g), eos_id, rows(first)));
    TORCH_CHECK(parts.back().t == parts.front().t,
                "srupp decode_loop: row groups ran different numbers of tokens");  // a bug
  }
  LoopRows& r = parts.front();
  if (parts.size() > 1) {
    std::vector<Tensor> tokens, cs, logits_out;
    for (const LoopRows& p : parts) {
      tokens.push_back(p.tokens);
      cs.push_back(p.c);
      logits_out.push_back(p.logits);
    }
    r.tokens = at::cat(tokens, 0);
    r.c = at::cat(cs, 1);
    r.logits = at::cat(logits_out, 0);
  }
  auto [mem_views, kv_views] = stack.views(r.ks.data(), r.ms.data(), 0, r.M);
  return {r.tokens, r.c, r.logits, mem_views, kv_views, r.shift};
}

}  // namespace srupp_cpu
