// One SRU++ layer's decoding step (srupp::layer_step): one token per sequence, no
// gradient, every small operation of the layer in one call (srupp/ops/layer_step.py
// has its plain reference and the exact contract). At batch 1 the cost of dispatching the
// layer's ~30 small operations one by one rivals their work (docs/performance.md); here
// they are loops over a few thousand floats each, and the products are the few-rows
// kernel (matmul_few_rows.cpp; ATen's GEMM for larger batches). Rounding follows the layer's
// modules: every intermediate the modules store in the weights' dtype (q, K and V, o,
// U, h) is rounded to it here too; sums, norms and the recurrence are in fp32.

#include "common.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>

#include <atomic>

namespace srupp_cpu {

namespace layer_step_impl {

// runs the lambda given (which uses scalar_t) for float32 or bfloat16 tensors
#define SRUPP_DISPATCH_F32_BF16(dt, ...)               \
  if ((dt) == at::kFloat) {                            \
    using scalar_t = float;                            \
    __VA_ARGS__();                                     \
  } else {                                             \
    using scalar_t = BFloat16;                         \
    __VA_ARGS__();                                     \
  }

// How a layer's projections hold their weights (srupp/nn/quant.py): float, int8 with the
// activations as they are, int8 with the activations rounded per row (w8a8), or bf16 with
// a pair-packed copy for the few-rows products (matmul_few_rows.cpp, pack_pairs_bf16).
enum Quant : int64_t { kFloatWeights = 0, kInt8 = 1, kW8A8 = 2, kPairs = 3 };
constexpr int64_t kInt8FewRows = 32;  // srupp.ops.quant.INT8_FEW_ROWS

// y = x @ w^T: the few-rows kernel up to `few` rows (with kPairs, the pair-packed copy
// `extra`), else ATen (oneDNN / BLAS). Quantized weights (w int8, `extra` its scale per
// output) go where srupp.ops.quant sends them: weight-only int8 to its kernel up to 32
// rows, else dequantized in fp32 and multiplied in x's dtype; w8a8 to its kernel at any
// rows (the same integer sums as its reference).
Tensor project(const Tensor& x, const Tensor& w, int64_t few, const Tensor* extra = nullptr,
               int64_t quant = kFloatWeights) {
  if (quant == kW8A8) return linear_w8a8_rows_cpu(x, w, *extra, std::nullopt, false);
  if (quant == kInt8) {
    if (x.size(0) <= kInt8FewRows) return linear_int8_rows_cpu(x, w, *extra, std::nullopt, false);
    return at::linear(x, (w.to(at::kFloat) * extra->to(at::kFloat).unsqueeze(1)).to(x.scalar_type()));
  }
  if (x.size(0) > few) return at::linear(x, w);
  if (quant == kPairs) return linear_pairs_bf16_cpu(x, *extra, w.size(0), std::nullopt);
  return linear_rows_cpu(x, w, std::nullopt);
}

// LayerNorm of R rows of width N (row strides ldx, ldy), fp32 statistics, biased variance.
// The sums run in two vector accumulators (a scalar chain of N adds, at 4 cycles an add,
// made the norms 5% of a 32-row step, all of it on one thread).
template <typename T>
void layer_norm_rows(const T* x, int64_t ldx, const T* g, const T* b, float eps, T* y,
                     int64_t ldy, int64_t R, int64_t N) {
  const int64_t full = N / kW * kW;
  const int tail = static_cast<int>(N - full);
  auto sum = [](const Vec& v) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, v);
  };
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * ldx;
    T* yr = y + r * ldy;
    Vec s0(0.f), s1(0.f);
    int64_t i = 0;
    for (; i + 2 * kW <= full; i += 2 * kW) {
      s0 = s0 + IO<T>::load(xr + i);
      s1 = s1 + IO<T>::load(xr + i + kW);
    }
    if (i < full) s0 = s0 + IO<T>::load(xr + i);
    if (tail) s1 = s1 + IO<T>::load(xr + full, tail);  // zeros past N
    const float mean = sum(s0 + s1) / static_cast<float>(N);
    const Vec m(mean);
    Vec v0(0.f), v1(0.f);
    for (i = 0; i + 2 * kW <= full; i += 2 * kW) {
      const Vec d0 = IO<T>::load(xr + i) - m, d1 = IO<T>::load(xr + i + kW) - m;
      v0 = at::vec::fmadd(d0, d0, v0);
      v1 = at::vec::fmadd(d1, d1, v1);
    }
    if (i < full) {
      const Vec d = IO<T>::load(xr + i) - m;
      v0 = at::vec::fmadd(d, d, v0);
    }
    if (tail) {
      const Vec d = Vec::set(Vec(0.f), IO<T>::load(xr + full, tail) - m, tail);
      v1 = at::vec::fmadd(d, d, v1);
    }
    const float inv = 1.f / std::sqrt(sum(v0 + v1) / static_cast<float>(N) + eps);
    const Vec vi(inv);
    for (i = 0; i < full; i += kW)
      IO<T>::store(yr + i, at::vec::fmadd((IO<T>::load(xr + i) - m) * vi, IO<T>::load(g + i),
                                          IO<T>::load(b + i)));
    if (tail)
      IO<T>::store(yr + full, at::vec::fmadd((IO<T>::load(xr + full, tail) - m) * vi,
                                             IO<T>::load(g + full, tail),
                                             IO<T>::load(b + full, tail)), tail);
  }
}

// dst[:, row] = src (R, N) for a (R, S, N) dst with a contiguous last dim: a plain copy of
// R rows, no dispatcher call (these run once per layer and token)
void write_row(const Tensor& dst, int64_t row, const Tensor& src) {
  const int64_t R = src.size(0), bytes = src.size(1) * src.element_size();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr()) + row * dst.stride(1) * dst.element_size();
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(to + r * dst.stride(0) * dst.element_size(), from + r * src.stride(0) * src.element_size(), bytes);
}

// y (R, N) = LN(x) when a norm is given, else x itself
Tensor maybe_norm(const Tensor& x, const std::optional<Tensor>& g, const std::optional<Tensor>& b,
                  double eps) {
  if (!g.has_value() || !g->defined()) return x;
  Tensor y = at::empty_like(x);
  const int64_t R = x.size(0), N = x.size(1);
  SRUPP_DISPATCH_F32_BF16(x.scalar_type(), [&] {
    layer_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), g->data_ptr<scalar_t>(),
                              b->data_ptr<scalar_t>(), static_cast<float>(eps),
                              y.data_ptr<scalar_t>(), y.stride(0), R, N);
  });
  return y;
}

// y = q + alpha * o, rounded as the modules round it: alpha * o to T, then the sum to T
template <typename T>
void residual(const T* q, const T* o, float alpha, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T ao = static_cast<T>(alpha * static_cast<float>(o[i]));
    y[i] = static_cast<T>(static_cast<float>(q[i]) + static_cast<float>(ao));
  }
}

// Rows r0 .. r1 - 1 and units j0 .. j1 - 1 of recurrence_step (below).
template <typename T>
void recurrence_cols(const T* U, int64_t k, const T* x, int64_t ldx, const float* c,
                     const T* wc, const T* bias, float scale_x, T* h, float* c_new, int64_t D,
                     int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
  const Vec one(1.f), sx(scale_x);
  for (int64_t r = r0; r < r1; ++r) {
    const T* u = U + r * k * D;
    const float* cr = c + r * D;
    for (int64_t j = j0; j < j1; j += kW) {
      const int n = static_cast<int>(std::min<int64_t>(kW, j1 - j));
      // whole vectors but for the last (IO's partial loads go element by element)
      auto in = [&](const T* p) { return n == kW ? IO<T>::load(p) : IO<T>::load(p, n); };
      const Vec u0 = in(u + j), u1 = in(u + D + j), u2 = in(u + 2 * D + j);
      const Vec cp = Vec::loadu(cr + j, n);
      const Vec f = sigmoid(at::vec::fmadd(in(wc + j), cp, u1 + in(bias + j)));
      const Vec rg = sigmoid(at::vec::fmadd(in(wc + D + j), cp, u2 + in(bias + D + j)));
      const Vec cn = f * cp + (one - f) * u0;
      const Vec s = k == 4 ? in(u + 3 * D + j) : in(x + r * ldx + j) * sx;
      const Vec hv = s + rg * (cn - s);
      cn.store(c_new + r * D + j, n);
      if (n == kW) IO<T>::store(h + r * D + j, hv); else IO<T>::store(h + r * D + j, hv, n);
    }
  }
}

// One recurrence step for R rows of D units: U (R, k*D) planes [u0|u1|u2|u3], x (R, D)
// the raw layer input (the skip when k == 3), c (R, D) fp32; writes h (R, D) and c_new.
template <typename T>
void recurrence_step(const T* U, int64_t k, const T* x, int64_t ldx, const float* c,
                     const T* wc, const T* bias, float scale_x, T* h, float* c_new, int64_t R,
                     int64_t D) {
  // rows in parallel when there are many (batched streams); one row stays on this thread
  at::parallel_for(0, R, R >= 8 ? 4 : R, [&](int64_t r0, int64_t r1) {
    recurrence_cols<T>(U, k, x, ldx, c, wc, bias, scale_x, h, c_new, D, r0, r1, 0, D);
  });
}

// ---- The layer's step in one parallel region (float weights, few rows) ----------------
//
// At batch 1 the step is a chain of small pieces: three products, the attention, two
// norms and the recurrence. As separate at::parallel_for regions each costs a fork and a
// join, and between them the second thread idles while the first allocates and runs the
// serial pieces. Here the team enters once per layer; the products, the attention's keys
// and the recurrence's units are split over its threads, and so are the rows of the
// pieces that go row by row (norms, copies, the residual); barriers stand between
// dependent pieces, and the intermediates live in a reused workspace. The arithmetic is
// the other path's, piece for piece: the same kernels on the same rows, so the results are
// bit for bit the same (tests/ops/test_layer_step.py checks it).

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline int team_rank() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Every thread of the team waits here for the others (called inside the region; a no-op
// for a team of one).
inline void team_barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// Set from Python only (srupp.ops.settings.tuning().layer_step_team, common.h); atomic, so
// that a change while another thread steps is not a data race (that step takes either path).
std::atomic<bool> team_enabled{true};
template <typename T>
const T* ptr_or_null(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<T>() : nullptr;
}

// Raw pointers and sizes of one layer's step, as check_layer checked them.
template <typename T>
struct LayerView {
  const T* x;
  int64_t ldx, B, n_in, D, dp, kD, k, H, cached;
  const float* c;
  const T *w1, *w2, *w3;  // w3 null: no attention
  const T *p1, *p2, *p3;  // their pair-packed copies (bf16, kPairs), else null
  float alpha;
  const T *norm_w, *norm_b, *attn_norm_w, *attn_norm_b;  // null: no such norm
  float norm_eps, attn_norm_eps, scale_x;
  bool pre, post;
  const T *wc, *bias;
  T* kv;       // row kv_start of the [K | V] buffer (null: no attention)
  int64_t kv_s0, kv_s1;
  T* memory;   // row memory_start + cached, the token's own (null: no memory)
  int64_t mem_s0;
  const bool* pad;  // (B, cached) at row stride pad_s0, or null
  int64_t pad_s0;
};

// A bump allocator over one thread-local buffer that only grows: no allocation per step.
struct Workspace {
  std::vector<float>& buf;
  size_t used = 0;
  explicit Workspace(size_t floats) : buf(storage()) {
    if (buf.size() < floats) buf.resize(floats);
  }
  static std::vector<float>& storage() {
    static thread_local std::vector<float> b;
    return b;
  }
  template <typename U>
  U* take(int64_t n) {  // n elements of U; the next take starts 64 bytes on at least
    U* p = reinterpret_cast<U*>(buf.data() + used);
    used += (static_cast<size_t>(n) * sizeof(U) + 63) / 64 * 16;
    return p;
  }
  static size_t floats(int64_t bytes) { return static_cast<size_t>((bytes + 63) / 64 * 16); }
};

// One layer's step in one parallel region: the plan (the attention's split over the
// threads, the intermediates in the workspace) and the pieces each thread runs between
// barriers, in run()'s order. Built and run on one thread, by layer_step_team.
template <typename T>
struct TeamStep {
  // fp32 copies of the products' inputs for the generic kernel (bf16 without the dot
  // instruction); fp32 tensors are their own copies
  static constexpr bool widen = std::is_same<T, BFloat16>::value && !kBf16Dot;

  const LayerView<T>& L;
  T* const h;
  float* const c_new;
  const bool attention;
  const int threads;
  const int64_t sq[2], skv[3];  // the attention's strides (att points at them)
  OneQuery<T> att;
  const int64_t att_stride;     // floats of attention scratch per thread
  Workspace ws;
  T *xin, *q, *o, *y, *yn, *U;
  float *wide, *att_scratch;

  TeamStep(const LayerView<T>& L_, T* h_, float* c_new_)
      : L(L_), h(h_), c_new(c_new_), attention(L_.w3 != nullptr),
        threads(at::get_num_threads()),
        sq{L_.dp, L_.dp / L_.H},
        skv{L_.kv_s0, L_.dp / L_.H, L_.kv_s1},
        // a layer without attention plans no keys: no split, no part buffers, no scratch
        att(nullptr, L_.kv, attention ? L_.kv + L_.dp : nullptr, nullptr, L_.B, L_.H,
            attention ? L_.cached + 1 : 0, L_.dp / L_.H, sq, skv, skv,
            1.f / std::sqrt(static_cast<float>(L_.dp / L_.H)), L_.pad, L_.pad_s0, L_.cached,
            threads),
        att_stride((att.scratch() + 15) / 16 * 16),
        ws(workspace_floats()) {
    const int64_t B = L.B, dp = L.dp;
    xin = L.pre ? ws.take<T>(B * L.n_in) : const_cast<T*>(L.x);
    q = ws.take<T>(B * dp);
    o = ws.take<T>(B * dp);
    y = ws.take<T>(B * dp);
    yn = ws.take<T>(B * dp);
    U = ws.take<T>(B * L.kD);
    wide = widen ? ws.take<float>(B * std::max(L.n_in, dp)) : nullptr;
    att_scratch = ws.take<float>(threads * att_stride);
    att.q = q;
    att.o = o;
  }

  size_t workspace_floats() const {
    const int64_t B = L.B, dp = L.dp;
    return Workspace::floats(B * L.n_in * sizeof(T)) + 4 * Workspace::floats(B * dp * sizeof(T)) +
           Workspace::floats(B * L.kD * sizeof(T)) +
           Workspace::floats(B * std::max(L.n_in, dp) * 4) +
           Workspace::floats(threads * att_stride * 4);
  }

  // widen: `wide` = the next product's input in fp32 (thread 0, before a barrier)
  void widen_input(const T* in, int64_t n) const {
    if (widen)
      for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<float>(in[i]);
  }

  // this thread's share of out (B rows ldo apart) = in (B, I) @ w (O, I)^T; `packed`: w
  // pair-packed (kPairs), split over the threads by vectors of 16 outputs (by tiles of 48,
  // 256 outputs went 144 / 112)
  void product(int tid, int nt, const T* in, const T* w, const T* packed, int64_t I, int64_t O,
               T* out, int64_t ldo) const {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    if constexpr (std::is_same<T, BFloat16>::value) {
      if (packed != nullptr) {
        const int64_t vecs = (O + 15) / 16, per = (vecs + nt - 1) / nt;
        const int64_t v0 = std::min(vecs, tid * per), v1 = std::min(vecs, v0 + per);
        if (v0 < v1) linear_pairs_bf16_range(in, I, packed, I, O, nullptr, out, ldo, L.B, v0, v1);
        return;
      }
    }
#endif
    const int64_t chunk = ((O + nt - 1) / nt + 3) / 4 * 4;
    const int64_t o0 = std::min(O, tid * chunk), o1 = std::min(O, o0 + chunk);
    if (o0 >= o1) return;
    if constexpr (std::is_same<T, float>::value) {
      linear_rows_range<T>(in, w, I, nullptr, out, ldo, L.B, I, o0, o1);
    } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
      linear_rows_bf16_dot_range(in, w, I, nullptr, out, ldo, L.B, I, o0, o1);
#else
      linear_rows_range<T>(wide, w, I, nullptr, out, ldo, L.B, I, o0, o1);
#endif
    }
  }

  // this thread's rows of the pieces that go row by row (norms, copies, the residual)
  std::pair<int64_t, int64_t> rows_of(int tid, int nt) const {
    const int64_t per = (L.B + nt - 1) / nt;
    const int64_t r0 = std::min(L.B, tid * per);
    return {r0, std::min(L.B, r0 + per)};
  }

  // every thread, its rows: the pre-norm into xin, the memory's new row; then (thread 0)
  // xin widened for W1
  void read_input(int tid, int nt) const {
    const auto [r0, r1] = rows_of(tid, nt);
    if (L.pre && r0 < r1)
      layer_norm_rows<T>(L.x + r0 * L.ldx, L.ldx, L.norm_w, L.norm_b, L.norm_eps,
                         xin + r0 * L.n_in, L.n_in, r1 - r0, L.n_in);
    if (L.memory != nullptr)
      for (int64_t r = r0; r < r1; ++r)
        std::memcpy(L.memory + r * L.mem_s0, xin + r * (L.pre ? L.n_in : L.ldx),
                    sizeof(T) * L.n_in);
    if (widen) {
      team_barrier();
      if (tid == 0) widen_input(xin, L.B * L.n_in);
    }
  }

  // every thread: the token's [K | V] row from q, the attention over the keys, the blocks
  // merged, then its rows of y = q + alpha * o
  void attend(int tid, int nt) {
    const int64_t B = L.B, dp = L.dp;
    if (widen) {
      if (tid == 0) widen_input(q, B * dp);
      team_barrier();
    }
    product(tid, nt, q, L.w2, L.p2, dp, 2 * dp, L.kv + L.cached * L.kv_s1, L.kv_s0);  // [K | V]
    team_barrier();
    float* mine = att_scratch + tid * att_stride;
    for (int64_t t = tid; t < att.tasks(); t += nt) att.task(t, mine);
    team_barrier();
    if (att.blocks > 1) {  // (one block: each task merged its own)
      for (int64_t n = tid; n < att.NH; n += nt) att.finish(n, mine);
      team_barrier();
    }
    const auto [r0, r1] = rows_of(tid, nt);
    if (r0 < r1) residual<T>(q + r0 * dp, o + r0 * dp, L.alpha, y + r0 * dp, (r1 - r0) * dp);
  }

  // W3's (W2's without attention) input: the attention's output or q, after the
  // attention's norm when there is one; the same choice on every thread
  const T* gate_input() const {
    return L.attn_norm_w != nullptr ? yn : (attention ? y : q);
  }

  // every thread, its rows (those of its residual): the attention's norm into yn; then
  // (thread 0) W3's input widened
  void norm_gate_input(int tid, int nt) const {
    const T* u_in = attention ? y : q;
    const auto [r0, r1] = rows_of(tid, nt);
    if (L.attn_norm_w != nullptr) {
      if (r0 < r1)
        layer_norm_rows<T>(u_in + r0 * L.dp, L.dp, L.attn_norm_w, L.attn_norm_b,
                           L.attn_norm_eps, yn + r0 * L.dp, L.dp, r1 - r0, L.dp);
      u_in = yn;
    }
    if (widen) {
      team_barrier();
      if (tid == 0) widen_input(u_in, L.B * L.dp);
    }
  }

  // every thread: its units of the recurrence, then (thread 0) the post-norm of h
  void recur(int tid, int nt) const {
    const int64_t D = L.D;
    const int64_t cols = ((D + nt - 1) / nt + kW - 1) / kW * kW;
    const int64_t j0 = std::min(D, tid * cols), j1 = std::min(D, j0 + cols);
    if (j0 < j1)
      recurrence_cols<T>(U, L.k, L.x, L.ldx, L.c, L.wc, L.bias, L.scale_x, h, c_new, D, 0, L.B,
                         j0, j1);
    if (L.post) {
      team_barrier();
      const auto [r0, r1] = rows_of(tid, nt);
      if (r0 < r1)
        layer_norm_rows<T>(h + r0 * D, D, L.norm_w, L.norm_b, L.norm_eps, h + r0 * D, D,
                           r1 - r0, D);
    }
  }

  void run() {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (!omp_in_parallel())
#endif
    {
      const int nt = team_size(), tid = team_rank();
      read_input(tid, nt);
      team_barrier();
      product(tid, nt, xin, L.w1, L.p1, L.n_in, L.dp, q, L.dp);                // q (B, d')
      team_barrier();
      if (attention) attend(tid, nt);                                         // y (B, d')
      norm_gate_input(tid, nt);
      team_barrier();
      product(tid, nt, gate_input(), attention ? L.w3 : L.w2, attention ? L.p3 : L.p2, L.dp,
              L.kD, U, L.kD);                                                 // U
      team_barrier();
      recur(tid, nt);                                                         // h, c_new
    }
  }
};

template <typename T>
void layer_step_team(const LayerView<T>& L, T* h, float* c_new) {
  TeamStep<T>(L, h, c_new).run();
}

// ---- layer_step_run: checks, then one of the two paths --------------------------------

// One layer's step arguments, as layer_step_run takes them (layer_step_cpu's, with the
// projections' weights W1, W2, W3 optionally int8: `quant` says how (enum Quant) and
// extras[0..2] hold their scales, fp32, one per output feature; with kPairs, bf16 weights
// and extras[0..2] their pair-packed copies). It holds references:
// build it where its arguments live, for one call.
struct LayerArgs {
  const Tensor &x, &c, &w1, &w2;
  const std::optional<Tensor> &w3, &alpha, &norm_weight, &norm_bias, &attn_norm_weight,
      &attn_norm_bias;
  const Tensor &weight_c, &bias;
  const std::optional<Tensor> &kv, &memory, &memory_pad;
  int64_t kv_start, memory_start, cached;
  double norm_eps, attn_norm_eps, scale_x;
  int64_t num_heads;
  bool normalize_after;
  int64_t few_rows, quant;
  const std::optional<Tensor>* extras;
  // where the new c goes: (B, D) fp32 contiguous (a stack's slice of its c out), or
  // undefined for a new tensor
  Tensor c_out = {};
};

// c_new (B, D) fp32: the caller's c_out when given, else a new tensor
Tensor new_c(const LayerArgs& a, int64_t B, int64_t D) {
  if (!a.c_out.defined()) return at::empty({B, D}, a.c.options());
  TORCH_CHECK(a.c_out.scalar_type() == at::kFloat && a.c_out.is_contiguous() &&
                  a.c_out.size(0) == B && a.c_out.size(1) == D,
              "srupp layer_step: c_out (B, D) float32 contiguous");
  return a.c_out;
}

// What check_layer reads from a layer's arguments.
struct LayerShape {
  at::ScalarType dt;
  bool attention, pre, has_memory;
  int64_t B, n_in, D, dp, kD, k, H, hd;
  const Tensor* extra[3];  // the projections' int8 scales or pair-packed copies (else null)
  Tensor pad;               // (B, cached) bool, last dim contiguous, or undefined
};

// The projections' weights: x's dtype (with kPairs, bf16 and their pair-packed copies),
// or int8 with their scales.
void check_projections(const LayerArgs& a, LayerShape& s) {
  TORCH_CHECK(a.quant == kFloatWeights || a.quant == kInt8 || a.quant == kW8A8 ||
                  a.quant == kPairs,
              "srupp layer_step: quant must be 0 (float), 1 (int8), 2 (w8a8) or 3 (bf16 pairs)");
  const Tensor* proj[3] = {&a.w1, &a.w2, s.attention ? &*a.w3 : nullptr};
  for (int i = 0; i < 3; ++i) {
    s.extra[i] = nullptr;
    if (proj[i] == nullptr) continue;
    if (a.quant == kFloatWeights || a.quant == kPairs) {
      TORCH_CHECK(proj[i]->scalar_type() == s.dt && proj[i]->is_contiguous(),
                  "srupp layer_step: weights contiguous, of x's dtype");
      if (a.quant == kFloatWeights) continue;
      const Tensor* packed = a.extras != nullptr && a.extras[i].has_value() && a.extras[i]->defined()
                                 ? &*a.extras[i] : nullptr;
      TORCH_CHECK(linear_rows_bf16_native() && s.dt == at::kBFloat16 && proj[i]->dim() == 2 &&
                      packed != nullptr && check_pairs(*packed) &&
                      packed->size(0) == pairs_tiles(proj[i]->size(0)) &&
                      2 * packed->size(1) == proj[i]->size(1),
                  "srupp layer_step: quant 3 takes bf16 weights and their copies packed by "
                  "pack_pairs_bf16 (on a CPU with AVX512-BF16)");
      s.extra[i] = packed;
      continue;
    }
    TORCH_CHECK(proj[i]->scalar_type() == at::kChar && proj[i]->is_contiguous() &&
                    a.extras != nullptr && a.extras[i].has_value() && a.extras[i]->defined() &&
                    a.extras[i]->numel() == proj[i]->size(0),
                "srupp layer_step: quantized projections take contiguous int8 weights with "
                "one scale per output feature");
    s.extra[i] = &*a.extras[i];
  }
}

// The buffers (memory, [K | V], the padding of the cached keys) and the attention's scalars.
void check_buffers(const LayerArgs& a, LayerShape& s) {
  TORCH_CHECK(a.cached >= 0 && a.kv_start >= 0 && a.memory_start >= 0,
              "srupp layer_step: kv_start, memory_start and cached must be >= 0");
  if (s.has_memory) {
    const Tensor& memory = *a.memory;
    TORCH_CHECK(memory.scalar_type() == s.dt && memory.dim() == 3 && memory.size(0) == s.B &&
                memory.size(2) == s.n_in && memory.stride(2) == 1 &&
                a.memory_start + a.cached < memory.size(1),
                "srupp layer_step: memory (B, > memory_start + cached, n_in) of x's dtype, "
                "last dim contiguous");
  }
  if (!s.attention) return;
  const std::optional<Tensor>& kv = a.kv;
  TORCH_CHECK(kv.has_value() && kv->defined() && kv->scalar_type() == s.dt && kv->dim() == 3 &&
              kv->size(0) == s.B && kv->size(2) == 2 * s.dp && kv->stride(2) == 1 &&
              a.kv_start + a.cached < kv->size(1),
              "srupp layer_step: kv (B, > kv_start + cached, 2*d') of x's dtype, last dim "
              "contiguous");
  TORCH_CHECK(s.H >= 1 && s.dp % s.H == 0, "srupp layer_step: num_heads must divide d'");
  TORCH_CHECK(a.alpha.has_value() && a.alpha->defined() && a.alpha->scalar_type() == s.dt &&
              a.alpha->numel() == 1, "srupp layer_step: alpha (1,) of x's dtype");
  const std::optional<Tensor>& memory_pad = a.memory_pad;
  if (memory_pad.has_value() && memory_pad->defined()) {
    TORCH_CHECK(memory_pad->scalar_type() == at::kBool && memory_pad->dim() == 2 &&
                memory_pad->size(0) == s.B && memory_pad->size(1) == a.cached,
                "srupp layer_step: memory_pad (B, M) bool");
    s.pad = memory_pad->stride(1) == 1 ? *memory_pad : memory_pad->contiguous();
  }
}

LayerShape check_layer(const LayerArgs& a) {
  LayerShape s;
  const Tensor& x = a.x;
  s.dt = x.scalar_type();
  TORCH_CHECK(s.dt == at::kFloat || s.dt == at::kBFloat16,
              "srupp layer_step: float32 or bfloat16 tensors, got ", s.dt);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "srupp layer_step: x (B, n_in) contiguous");
  for (const Tensor* t : {&a.weight_c, &a.bias})
    TORCH_CHECK(t->scalar_type() == s.dt && t->is_contiguous(),
                "srupp layer_step: weights contiguous, of x's dtype");
  s.attention = a.w3.has_value() && a.w3->defined();
  check_projections(a, s);
  s.B = x.size(0);
  s.n_in = x.size(1);
  s.D = a.weight_c.size(1);
  TORCH_CHECK(a.weight_c.dim() == 2 && a.weight_c.size(0) == 2 && s.D >= 1 &&
                  a.bias.numel() == 2 * s.D, "srupp layer_step: weight_c and bias (2, D), D >= 1");
  TORCH_CHECK(a.c.scalar_type() == at::kFloat && a.c.is_contiguous() && a.c.size(0) == s.B &&
              a.c.size(1) == s.D, "srupp layer_step: c (B, D) float32 contiguous");
  s.kD = (s.attention ? *a.w3 : a.w2).size(0);
  s.k = s.kD / s.D;
  TORCH_CHECK(s.kD % s.D == 0 && ((s.k == 3 && s.n_in == s.D) || s.k == 4),
              "srupp layer_step: U must have 3 planes (n_in == D) or 4, got ", s.kD,
              " rows for D = ", s.D);
  s.pre = !a.normalize_after && a.norm_weight.has_value() && a.norm_weight->defined();
  s.has_memory = a.memory.has_value() && a.memory->defined();
  s.dp = a.w1.size(0);
  s.H = a.num_heads;
  s.hd = s.H >= 1 ? s.dp / s.H : 0;
  check_buffers(a, s);
  // the products' shapes (the one-region path reads the weights raw)
  TORCH_CHECK(a.w1.dim() == 2 && a.w1.size(1) == s.n_in && a.w2.dim() == 2 &&
                  a.w2.size(1) == s.dp && a.w2.size(0) == (s.attention ? 2 * s.dp : s.kD) &&
                  (!s.attention || (a.w3->dim() == 2 && a.w3->size(1) == s.dp)),
              "srupp layer_step: w1 (d', n_in), w2 (2 d', d') and w3 (k D, d') with attention, "
              "w2 (k D, d') without; got ", a.w1.sizes(), " and ", a.w2.sizes());
  auto check_norm = [&](const std::optional<Tensor>& g, const std::optional<Tensor>& b,
                        int64_t n, const char* name) {
    if (!g.has_value() || !g->defined()) return;
    TORCH_CHECK(b.has_value() && b->defined() && g->numel() == n && b->numel() == n &&
                    g->scalar_type() == s.dt && b->scalar_type() == s.dt && g->is_contiguous() &&
                    b->is_contiguous(),
                "srupp layer_step: ", name, " weight and bias (", n, ",) of x's dtype");
  };
  check_norm(a.norm_weight, a.norm_bias, a.normalize_after ? s.D : s.n_in, "norm");
  check_norm(a.attn_norm_weight, a.attn_norm_bias, s.dp, "attn_norm");
  return s;
}

// The one-region path (float weights, few rows): the arguments as raw pointers for
// TeamStep.
std::tuple<Tensor, Tensor> step_in_one_region(const LayerArgs& a, const LayerShape& s) {
  Tensor h = at::empty({s.B, s.D}, a.x.options());
  Tensor c_new = new_c(a, s.B, s.D);
  SRUPP_DISPATCH_F32_BF16(s.dt, [&] {
    using T = scalar_t;
    LayerView<T> L;
    L.x = a.x.data_ptr<T>(); L.ldx = a.x.stride(0); L.B = s.B; L.n_in = s.n_in; L.D = s.D;
    L.dp = s.dp; L.kD = s.kD; L.k = s.k; L.H = s.attention ? s.H : 1; L.cached = a.cached;
    L.c = a.c.data_ptr<float>();
    L.w1 = a.w1.data_ptr<T>(); L.w2 = a.w2.data_ptr<T>();
    L.w3 = s.attention ? a.w3->data_ptr<T>() : nullptr;
    auto packed = [&](int i) { return s.extra[i] != nullptr ? s.extra[i]->data_ptr<T>() : nullptr; };
    L.p1 = packed(0); L.p2 = packed(1); L.p3 = packed(2);
    L.alpha = s.attention ? static_cast<float>(*a.alpha->data_ptr<T>()) : 0.f;
    L.norm_w = ptr_or_null<T>(a.norm_weight); L.norm_b = ptr_or_null<T>(a.norm_bias);
    L.attn_norm_w = ptr_or_null<T>(a.attn_norm_weight);
    L.attn_norm_b = ptr_or_null<T>(a.attn_norm_bias);
    L.norm_eps = static_cast<float>(a.norm_eps);
    L.attn_norm_eps = static_cast<float>(a.attn_norm_eps);
    L.scale_x = static_cast<float>(a.scale_x);
    L.pre = s.pre; L.post = a.normalize_after && L.norm_w != nullptr;
    L.wc = a.weight_c.data_ptr<T>(); L.bias = a.bias.data_ptr<T>();
    const std::optional<Tensor>& kv = a.kv;
    L.kv = s.attention ? kv->data_ptr<T>() + a.kv_start * kv->stride(1) : nullptr;
    L.kv_s0 = s.attention ? kv->stride(0) : 0; L.kv_s1 = s.attention ? kv->stride(1) : 0;
    const std::optional<Tensor>& memory = a.memory;
    L.memory = s.has_memory
                   ? memory->data_ptr<T>() + (a.memory_start + a.cached) * memory->stride(1)
                   : nullptr;
    L.mem_s0 = s.has_memory ? memory->stride(0) : 0;
    L.pad = s.pad.defined() ? s.pad.data_ptr<bool>() : nullptr;
    L.pad_s0 = s.pad.defined() ? s.pad.stride(0) : 0;
    layer_step_team<T>(L, h.data_ptr<T>(), c_new.data_ptr<float>());
  });
  return {h, c_new};
}

// The path by pieces (int8 weights, or more rows): each piece its own kernel (and
// parallel region), the products through project().
std::tuple<Tensor, Tensor> step_by_pieces(const LayerArgs& a, const LayerShape& s) {
  const Tensor& x = a.x;
  const int64_t B = s.B, dp = s.dp, few = a.few_rows;
  const Tensor xin = s.pre ? maybe_norm(x, a.norm_weight, a.norm_bias, a.norm_eps) : x;  // (B, n_in)
  if (s.has_memory) write_row(*a.memory, a.memory_start + a.cached, xin);
  const Tensor q = project(xin, a.w1, few, s.extra[0], a.quant);                 // (B, d')
  Tensor U;
  if (s.attention) {
    const Tensor& kv = *a.kv;
    write_row(kv, a.kv_start + a.cached,
              project(q, a.w2, few, s.extra[1], a.quant).contiguous());        // new [K | V]
    Tensor o = at::empty({B, dp}, x.options());
    const int64_t sq[2] = {dp, s.hd};
    const int64_t sk[3] = {kv.stride(0), s.hd, kv.stride(1)};
    const float scale = 1.f / std::sqrt(static_cast<float>(s.hd));
    Tensor y = at::empty({B, dp}, x.options());
    SRUPP_DISPATCH_F32_BF16(s.dt, [&] {
      const float alpha = static_cast<float>(*a.alpha->data_ptr<scalar_t>());
      const scalar_t* kvp = kv.data_ptr<scalar_t>() + a.kv_start * kv.stride(1);
      one_query_kernel<scalar_t>(q.data_ptr<scalar_t>(), kvp, kvp + dp, o.data_ptr<scalar_t>(),
                                 B, s.H, a.cached + 1, s.hd, sq, sk, sk, scale,
                                 s.pad.defined() ? s.pad.data_ptr<bool>() : nullptr,
                                 s.pad.defined() ? s.pad.stride(0) : 0, a.cached);
      residual<scalar_t>(q.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), alpha,
                         y.data_ptr<scalar_t>(), B * dp);
    });
    U = project(maybe_norm(y, a.attn_norm_weight, a.attn_norm_bias, a.attn_norm_eps), *a.w3,
                few, s.extra[2], a.quant);                                       // (B, k*D)
  } else {
    U = project(maybe_norm(q, a.attn_norm_weight, a.attn_norm_bias, a.attn_norm_eps), a.w2,
                few, s.extra[1], a.quant);
  }
  U = U.contiguous();
  Tensor h = at::empty({B, s.D}, x.options());
  Tensor c_new = new_c(a, B, s.D);
  SRUPP_DISPATCH_F32_BF16(s.dt, [&] {
    recurrence_step<scalar_t>(U.data_ptr<scalar_t>(), s.k, x.data_ptr<scalar_t>(), x.stride(0),
                              a.c.data_ptr<float>(), a.weight_c.data_ptr<scalar_t>(),
                              a.bias.data_ptr<scalar_t>(), static_cast<float>(a.scale_x),
                              h.data_ptr<scalar_t>(), c_new.data_ptr<float>(), B, s.D);
  });
  if (a.normalize_after) h = maybe_norm(h, a.norm_weight, a.norm_bias, a.norm_eps);
  return {h, c_new};
}

// One layer's step (layer_step_cpu's, with W1, W2, W3 optionally int8: LayerArgs).
std::tuple<Tensor, Tensor> layer_step_run(const LayerArgs& a) {
  const LayerShape s = check_layer(a);
  // One region, wherever the few-rows kernels run: with the pieces that go row by row split
  // over the threads too, it was as fast as a region per piece or faster at 1 to 128 rows
  // (3.5% at 32, 6-7% at 8 and 16; docs/deploy.md). Both give the same bits.
  if ((a.quant == kFloatWeights || a.quant == kPairs) && s.B <= a.few_rows &&
      team_enabled.load(std::memory_order_relaxed))
    return step_in_one_region(a, s);
  return step_by_pieces(a, s);
}

}  // namespace layer_step_impl

// See srupp/ops/layer_step.py (the schema, its fake kernel and the reference).
std::tuple<Tensor, Tensor> layer_step_cpu(
    const Tensor& x, const Tensor& c, const Tensor& w1, const Tensor& w2,
    const std::optional<Tensor>& w3, const std::optional<Tensor>& alpha,
    const std::optional<Tensor>& norm_weight, const std::optional<Tensor>& norm_bias,
    const std::optional<Tensor>& attn_norm_weight, const std::optional<Tensor>& attn_norm_bias,
    const Tensor& weight_c, const Tensor& bias, const std::optional<Tensor>& kv,
    const std::optional<Tensor>& memory, const std::optional<Tensor>& memory_pad,
    int64_t kv_start, int64_t memory_start, int64_t cached, double norm_eps, double attn_norm_eps, double scale_x, int64_t num_heads,
    bool normalize_after, int64_t few_rows) {
  return layer_step_impl::layer_step_run(
      {x, c, w1, w2, w3, alpha, norm_weight, norm_bias, attn_norm_weight, attn_norm_bias,
       weight_c, bias, kv, memory, memory_pad, kv_start, memory_start, cached, norm_eps,
       attn_norm_eps, scale_x, num_heads, normalize_after, few_rows,
       layer_step_impl::kFloatWeights, nullptr});
}

namespace layer_step_impl {

size_t Stack::check(const Tensor& c, const char* op) const {
  TORCH_CHECK(c.dim() == 3 && c.scalar_type() == at::kFloat && c.is_contiguous(),
              "srupp ", op, ": c (layers, B, D) float32 contiguous");
  const auto n = static_cast<size_t>(c.size(0));
  TORCH_CHECK(weights.size() == 10 * n && kv.size() == n && memory.size() == n &&
                  norm_eps.size() == n && attn_norm_eps.size() == n && scale_x.size() == n &&
                  num_heads.size() == n && normalize_after.size() == n &&
                  extras.size() == 3 * n && quant.size() == n,
              "srupp ", op, ": 10 weights, 3 extras and one of each per-layer argument for "
              "each of the ", n, " layers");
  for (size_t l = 0; l < n; ++l) {
    for (int i : {0, 1, 8, 9})
      TORCH_CHECK(weights[10 * l + i].has_value() && weights[10 * l + i]->defined(),
                  "srupp ", op, ": every layer needs w1, w2, weight_c and bias");
    TORCH_CHECK(!has(memory[l]) || has(kv[l]),
                "srupp ", op, ": a layer with a memory buffer needs its kv buffer");
  }
  return n;
}

Tensor Stack::run(const Tensor& x, const Tensor& c, Tensor& c_out,
                  const std::optional<Tensor>& memory_pad, const int64_t* kv_start,
                  const int64_t* memory_start, int64_t cached) const {
  Tensor h = x;
  for (size_t l = 0; l < memory.size(); ++l) {
    const std::optional<Tensor>* w = &weights[10 * l];
    const Tensor c_l = c.select(0, static_cast<int64_t>(l));
    // the layer writes its new c straight into c_out's slice (no copy of B x D floats)
    auto [h_next, c_next] = layer_step_run(
        {h, c_l, *w[0], *w[1], w[2], w[3], w[4], w[5], w[6], w[7], *w[8], *w[9], kv[l],
         memory[l], memory_pad, kv_start[l], memory_start[l], cached, norm_eps[l],
         attn_norm_eps[l], scale_x[l], num_heads[l], normalize_after[l] != 0, few_rows,
         quant[l], &extras[3 * l], c_out.select(0, static_cast<int64_t>(l))});
    h = std::move(h_next);
  }
  return h;
}

std::pair<OptTensors, OptTensors> Stack::views(const int64_t* kv_start,
                                               const int64_t* memory_start, int64_t first,
                                               int64_t kept) const {
  OptTensors mem_views(memory.size()), kv_views(memory.size());
  for (size_t l = 0; l < memory.size(); ++l) {
    if (!has(memory[l])) continue;
    mem_views[l] = memory[l]->narrow(1, memory_start[l] + first, kept);
    kv_views[l] = kv[l]->narrow(1, kv_start[l] + first, kept);
  }
  return {mem_views, kv_views};
}

}  // namespace layer_step_impl

// A whole stack's decoding step: layer_step_cpu for each layer in turn, h feeding the
// next, in one call from Python (srupp/nn/stack_step.py, _fused_step), so that the Python
// loop over layers, its argument passing and the views of the rows kept are paid once per
// step, not per layer. Layer l reads weights[10l .. 10l+9] (layer_step's w1, w2, w3,
// alpha, norm_weight, norm_bias, attn_norm_weight, attn_norm_bias, weight_c, bias), its
// buffers kv[l] and memory[l] (None: none) at row offsets kv_start[l] and
// memory_start[l], and its own scalars; `cached` and memory_pad are the stack's. quant[l]
// says how layer l's W1, W2, W3 are held (0 float, 1 int8, 2 w8a8, 3 bf16 pairs: enum Quant
// above), and extras[3l .. 3l+2] hold their scales when they are int8, their pair-packed
// copies with 3 (else None).
// Returns the last layer's h (B, D), every layer's new c (layers, B, D) fp32, and for
// each layer with a memory buffer its memory and [K | V] after the token, the views
// rows start + first .. start + first + kept - 1 of its buffers (None for the others).
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
               const std::vector<int64_t>& quant) {
  const layer_step_impl::Stack stack{weights, kv, memory, norm_eps, attn_norm_eps, scale_x,
                                     num_heads, normalize_after, few_rows, extras, quant};
  const size_t n = stack.check(c, "stack_step");
  TORCH_CHECK(kv_start.size() == n && memory_start.size() == n,
              "srupp stack_step: one kv_start and one memory_start per layer");
  TORCH_CHECK(first >= 0 && kept >= 0, "srupp stack_step: first and kept must be >= 0");
  Tensor c_out = at::empty_like(c);
  Tensor h = stack.run(x, c, c_out, memory_pad, kv_start.data(), memory_start.data(), cached);
  auto [mem_views, kv_views] = stack.views(kv_start.data(), memory_start.data(), first, kept);
  return {h, c_out, mem_views, kv_views};
}

}  // namespace srupp_cpu
