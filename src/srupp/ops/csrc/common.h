// srupp's C++ CPU kernels: what their files share. srupp/ops/cpu_kernels.py builds
// every .cpp file of this folder as one extension (ninja compiles them in parallel) and
// names the build after a hash of all of them and of this header.
//
// The files, one kernel family each:
// - recurrence.cpp: the fused SRU element-wise recurrence, forward and backward (sru_fwd,
//   sru_bwd), with its math, work split, precision, determinism and memory rules, and its
//   large outputs on huge pages from a cache of freed blocks (empty_cache, ...);
// - matmul_few_rows.cpp: few-row projections for decoding (linear_rows);
// - attention_one_query.cpp: one query's attention for decoding (attend_one_query);
// - quant.cpp: the same products with int8 weights (linear_int8_rows) and with int8
//   weights and activations (linear_w8a8_rows);
// - layer_step.cpp: one SRU++ layer's decoding step (srupp::layer_step) and a stack's
//   (stack_step);
// - decode_loop.cpp: a causal LM's token loop (decode_loop);
// - cpu_kernels.cpp: the Python module, binding all of the above.
//
// Everything lives in namespace srupp_cpu; what only one file uses stays in that file's
// anonymous namespace. Templates that another family calls (the few-rows products and
// the one-query attention, which the layer step runs inside its own parallel region) are
// declared here and instantiated for float and BFloat16 in their own file.
//
// One mutable global: layer_step_impl::team_enabled (layer_step.cpp), which Python sets
// through srupp.ops.settings.tuning().layer_step_team (the binding set_layer_step_team);
// the tests turn it off to compare a layer step's two paths.

#pragma once

// Narrow ATen headers, not <ATen/ATen.h> or <torch/extension.h>: every file parses this
// header, and the wide ones cost seconds each (the first build compiles every file).
// Tensor.h brings the tensor's methods, empty.h at::empty, which every kernel calls; each
// file includes the other ATen functions it calls.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace srupp_cpu {

using at::Tensor;
using c10::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();  // floats per vector

// ---------------------------------------------------------------------------------
// Loads and stores of fp32 / bf16 into Vectorized<float>. `n` < kW is a tail.

template <typename T>
struct IO;

template <>
struct IO<float> {
  static inline Vec load(const float* p) { return Vec::loadu(p); }
  static inline Vec load(const float* p, int n) { return Vec::loadu(p, n); }
  static inline void store(float* p, const Vec& v) { v.store(p); }
  static inline void store(float* p, const Vec& v, int n) { v.store(p, n); }
};

// fp32 -> bf16, round to nearest even. With AVX512-BF16 (when -march=native finds
// it) this is one instruction, vcvtneps2bf16, instead of ATen's ~8-instruction
// emulation, which the bf16 backward (3-4 gradients stored per element) feels
// (docs/performance.md). Results are identical except that the instruction flushes
// fp32 denormals (< 1.2e-38) to 0.
#if defined(CPU_CAPABILITY_AVX512)
inline __m256i to_bf16(const Vec& v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(__m512(v));
#else
  return at::vec::cvtfp32_bf16(__m512(v));
#endif
}
#endif

template <>
struct IO<BFloat16> {
  static inline Vec load(const BFloat16* p) {
    Vec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
  }
  static inline Vec load(const BFloat16* p, int n) {
    alignas(64) float tmp[kW] = {0};
    for (int i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
  }
  static inline void store(BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
#elif defined(CPU_CAPABILITY_AVX2)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
#else
    store(p, v, kW);
#endif
  }
  static inline void store(BFloat16* p, const Vec& v, int n) {
    alignas(64) float tmp[kW];
    v.store(tmp);
    for (int i = 0; i < n; ++i) p[i] = BFloat16(tmp[i]);  // round to nearest even
  }
};

// sigmoid(x) = 1 / (1 + exp(-x)), with ATen's inline polynomial exp (exp_u20, a few
// ulp; Sleef's exp is an out-of-line call that spills every vector register) and a
// reciprocal estimate refined by one Newton step instead of a division. Measured
// against float64 the result is within 3.4e-7 relative (5 ulp) over [-40, 40].
inline Vec sigmoid(const Vec& x) {
  const Vec one(1.f);
  // exp(88) is finite, so den never overflows to inf (where den * rcp(den) is NaN).
  const Vec den = one + at::vec::minimum(x.neg(), Vec(88.f)).exp_u20();
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 r = _mm512_rcp14_ps(den);
  return Vec(_mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, _mm512_set1_ps(2.f))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 r = _mm256_rcp_ps(den);  // 12-bit estimate; Newton gives ~23 bits
  return Vec(_mm256_mul_ps(r, _mm256_fnmadd_ps(den, r, _mm256_set1_ps(2.f))));
#else
  return one / den;
#endif
}

// ---------------------------------------------------------------------------------
// recurrence.cpp: the SRU recurrence (its comments have the arguments and results), and the
// cache of its large outputs' freed blocks, as srupp.ops.cpu_kernels names its functions.

std::tuple<Tensor, Tensor, Tensor> sru_fwd_cpu(
    const Tensor& U, const std::optional<Tensor>& x, const Tensor& weight_c, const Tensor& bias,
    const std::optional<Tensor>& c0, const std::optional<Tensor>& mask_pad,
    const std::optional<Tensor>& dropout_mask, double scale_x, bool bidirectional, bool store_c);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sru_bwd_cpu(
    const Tensor& U, const std::optional<Tensor>& x, const Tensor& weight_c, const Tensor& bias,
    const std::optional<Tensor>& c0, const std::optional<Tensor>& mask_pad,
    const std::optional<Tensor>& dropout_mask, const Tensor& c_all, const Tensor& grad_h,
    const std::optional<Tensor>& grad_c_last, double scale_x, bool bidirectional,
    bool need_grad_x);
size_t empty_cache();  // frees every cached block; returns the bytes released
void set_cache_limit(size_t bytes);
size_t cache_limit();
size_t cached_bytes();

// ---------------------------------------------------------------------------------
// matmul_few_rows.cpp: y (R, O) = x (R, I) @ W (O, I)^T [+ bias] for a few rows.

// Output features o0 .. o1 - 1 of the product, x in fp32, y's rows ldy apart
// (instantiated for float and BFloat16).
template <typename T>
void linear_rows_range(const float* x, const T* w, int64_t ldw, const T* bias, T* y, int64_t ldy,
                       int64_t R, int64_t I, int64_t o0, int64_t o1);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// The same for bf16 x and W with AVX512-BF16 dot products.
void linear_rows_bf16_dot_range(const BFloat16* x, const BFloat16* w, int64_t ldw,
                                const BFloat16* bias, BFloat16* y, int64_t ldy, int64_t R,
                                int64_t I, int64_t o0, int64_t o1);
// Vectors v0 .. v1 - 1 of 16 outputs (outputs 16 v0 .. min(O, 16 v1) - 1) of x (R, I; rows
// ldx apart) against pair-packed weights wp (pack_pairs_bf16), I even.
void linear_pairs_bf16_range(const BFloat16* x, int64_t ldx, const BFloat16* wp, int64_t I,
                             int64_t O, const BFloat16* bias, BFloat16* y, int64_t ldy,
                             int64_t R, int64_t v0, int64_t v1);
#endif
Tensor linear_rows_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias);
bool linear_rows_bf16_native();
Tensor pack_pairs_bf16_cpu(const Tensor& weight);
int64_t pairs_tiles(int64_t O);     // tiles of 48 outputs
bool check_pairs(const Tensor& wp);  // (T, I/2, 48, 2) bf16 contiguous
Tensor linear_pairs_bf16_cpu(const Tensor& x, const Tensor& wp, int64_t O,
                             const std::optional<Tensor>& bias);

// ---------------------------------------------------------------------------------
// attention_one_query.cpp: o = softmax(scale q K^T) V for one query per (batch, head).

// The attention of B x H single queries as tasks for a team of threads: task t covers
// (batch, head) t / blocks and its keys' block t % blocks (blocks of 128 keys cut from the
// newest key, their number set by S alone); finish(n) merges pair n's blocks into o when
// there are several (one block: the task writes o). Each pair's result is the same bits at
// any B, H and thread count, and under extra padded keys on the left. q (B, H, hd) at
// strides sq, K and V (B, H, S, hd) at strides sk and sv; key_pad (B, >= pad_len) at row
// stride spad, or null. o (B*H, hd) contiguous. `threads` is not used (the cut may not
// depend on it). (Instantiated for float and BFloat16.)
template <typename T>
struct OneQuery {
  const T *q, *k, *v;
  T* o;
  int64_t B, H, S, hd;
  const int64_t *sq, *sk, *sv;
  float scale;
  const bool* key_pad;
  int64_t spad, pad_len;
  int64_t hd_pad, NH, blocks;
  std::vector<float> part_m, part_l, part_acc;  // per task when there are several blocks

  OneQuery(const T* q_, const T* k_, const T* v_, T* o_, int64_t B_, int64_t H_, int64_t S_,
           int64_t hd_, const int64_t* sq_, const int64_t* sk_, const int64_t* sv_,
           float scale_, const bool* key_pad_, int64_t spad_, int64_t pad_len_,
           int64_t threads);

  int64_t tasks() const { return NH * blocks; }
  // floats of scratch a thread needs for its tasks
  int64_t scratch() const;

  void task(int64_t t, float* scratch_);
  // pair n's blocks rescaled to their common max and added in block order (out: hd_pad
  // floats of scratch)
  void finish(int64_t n, float* out) const;
};

// key_pad (B, S) bool with row stride spad, or null: True keys are skipped; a query
// with no key left gets o = 0. Keys from pad_len on are never padding (-1: S).
template <typename T>
void one_query_kernel(const T* q, const T* k, const T* v, T* o, int64_t B, int64_t H,
                      int64_t S, int64_t hd, const int64_t* sq, const int64_t* sk,
                      const int64_t* sv, float scale, const bool* key_pad = nullptr,
                      int64_t spad = 0, int64_t pad_len = -1);
Tensor attend_one_query_cpu(const Tensor& q, const Tensor& k, const Tensor& v, double scale);

// ---------------------------------------------------------------------------------
// quant.cpp: the few-rows products with int8 weights. plain=True takes the plain loop
// even where AVX-512 (int8) or VNNI (w8a8) is built in.

Tensor linear_int8_rows_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale,
                            const std::optional<Tensor>& bias, bool plain);
Tensor linear_w8a8_rows_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale,
                            const std::optional<Tensor>& bias, bool plain);
bool linear_int8_rows_avx512();
bool linear_w8a8_rows_vnni();

// ---------------------------------------------------------------------------------
// layer_step.cpp: one SRU++ layer's decoding step, and a stack's.

std::tuple<Tensor, Tensor> layer_step_cpu(
    const Tensor& x, const Tensor& c, const Tensor& w1, const Tensor& w2,
    const std::optional<Tensor>& w3, const std::optional<Tensor>& alpha,
    const std::optional<Tensor>& norm_weight, const std::optional<Tensor>& norm_bias,
    const std::optional<Tensor>& attn_norm_weight, const std::optional<Tensor>& attn_norm_bias,
    const Tensor& weight_c, const Tensor& bias, const std::optional<Tensor>& kv,
    const std::optional<Tensor>& memory, const std::optional<Tensor>& memory_pad,
    int64_t kv_start, int64_t memory_start, int64_t cached, double norm_eps, double attn_norm_eps, double scale_x, int64_t num_heads,
    bool normalize_after, int64_t few_rows);

std::tuple<Tensor, Tensor, std::vector<std::optional<Tensor>>, std::vector<std::optional<Tensor>>>
stack_step_cpu(const Tensor& x, const Tensor& c, const std::vector<std::optional<Tensor>>& weights,
               const std::vector<std::optional<Tensor>>& kv,
               const std::vector<std::optional<Tensor>>& memory,
               const std::optional<Tensor>& memory_pad, const std::vector<int64_t>& kv_start,
               const std::vector<int64_t>& memory_start, int64_t cached, int64_t first,
               int64_t kept, const std::vector<double>& norm_eps,
               const std::vector<double>& attn_norm_eps, const std::vector<double>& scale_x,
               const std::vector<int64_t>& num_heads, const std::vector<int64_t>& normalize_after,
               int64_t few_rows, const std::vector<std::optional<Tensor>>& extras,
               const std::vector<int64_t>& quant);

namespace layer_step_impl {

// Whether a layer's step at few rows with float weights runs in one parallel region
// (layer_step_team); the tests turn it off to compare the two paths. The one mutable
// global of the extension (see the top of this file).
extern std::atomic<bool> team_enabled;

using OptTensors = std::vector<std::optional<Tensor>>;

// A stack's per-layer arguments, as stack_step_cpu (layer_step.cpp) documents them; the
// decode loop runs its token's step through it too.
struct Stack {
  const OptTensors& weights;
  const OptTensors& kv;
  const OptTensors& memory;
  const std::vector<double>& norm_eps;
  const std::vector<double>& attn_norm_eps;
  const std::vector<double>& scale_x;
  const std::vector<int64_t>& num_heads;
  const std::vector<int64_t>& normalize_after;
  int64_t few_rows;
  const OptTensors& extras;
  const std::vector<int64_t>& quant;

  // the number of layers, after checking every list has its entries for c's layers
  size_t check(const Tensor& c, const char* op) const;

  static bool has(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

  // One token x (B, n_in) through every layer, layer l at row offsets kv_start[l] and
  // memory_start[l] with `cached` rows before the token's: returns the last layer's h
  // (B, D) and writes each layer's new c into c_out (layers, B, D).
  Tensor run(const Tensor& x, const Tensor& c, Tensor& c_out,
             const std::optional<Tensor>& memory_pad, const int64_t* kv_start,
             const int64_t* memory_start, int64_t cached) const;

  // The views rows start[l] + first .. + kept - 1 of each layer's memory and kv buffers
  // (None for a layer without a memory buffer).
  std::pair<OptTensors, OptTensors> views(const int64_t* kv_start, const int64_t* memory_start,
                                          int64_t first, int64_t kept) const;
};

}  // namespace layer_step_impl

// ---------------------------------------------------------------------------------
// decode_loop.cpp: up to n tokens of a causal LM with an SRU++ stack, in C++.

// Rows the token loop runs at once when it may split the batch (decode_loop.cpp,
// decode_row_groups; 0: all); set from Python only
// (srupp.ops.settings.tuning().decode_row_group).
extern std::atomic<int64_t> row_group_rows;

// The row groups decode_loop runs, as (first row, rows): all B rows, or groups of
// row_group_rows where no row's tokens can depend on the others' (decode_loop.cpp).
std::vector<std::pair<int64_t, int64_t>> decode_row_groups(
    int64_t B, int64_t few_rows, const std::vector<int64_t>& quant, int64_t out_route,
    int64_t eos_id, const std::vector<double>& temperature,
    const std::vector<std::optional<at::Generator>>& generator);

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
                const std::optional<Tensor>& first);

}  // namespace srupp_cpu
