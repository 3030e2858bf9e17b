// srupp's C++ CPU kernels (srupp/ops/cpu_kernels.py builds and loads them):
// - the fused SRU element-wise recurrence, forward and backward (sru_fwd, sru_bwd);
// - decoding: few-row projections (linear_rows), the same with int8 weights
//   (linear_int8_rows) and with int8 weights and activations (linear_w8a8_rows), one
//   query's attention (attend_one_query) and a stack's whole step (stack_step), further
//   down;
// - the cache of large output blocks (empty_cache, set_cache_limit, ...).
//
// Math and argument conventions: srupp/ops/reference.py, the oracle (its docstring has the
// equations, those of the SRU paper, Lei et al. 2018, section 2); the backward is their
// derivative, as autograd takes it through the reference.
//
// Work split. A task is one batch row b, one direction and one contiguous chunk of
// that direction's units; at::parallel_for spreads the tasks over the threads. A task
// walks its time steps in order and keeps its state (c, or the backward carry and the
// four weight-gradient accumulators) in small stack arrays that stay in L1, while the
// per-step data (u0..u3, x, h, ...) streams through contiguous runs of `ch` units.
// Inner loops run over units with at::vec::Vectorized<float>; a chunk whose length
// is not a multiple of the vector width ends with one partial (masked) vector.
//
// Precision. U / x / h and their gradients may be fp32 or bf16; everything is
// converted to fp32 in registers. State, stored c and all accumulators are fp32.
//
// Determinism. Each output element is written by exactly one task, and each task's
// sums run serially over time. The weight_c / bias gradients are summed per batch row
// into a (B, 4, D) buffer and then reduced over B serially, in index order. No
// atomics: results are bit-for-bit identical from run to run, and do not even depend
// on the thread count. (The decoding attention further down is the exception: at batch
// 1 it splits a query's keys over the threads, so its sums depend on the thread count,
// though still not on the run.)
//
// Memory. The loops are bandwidth-bound, so the big outputs (h, the stored c, grad_U,
// grad_x) are written with streaming stores when they are too large to stay in cache,
// and are allocated on 2 MiB pages from a small cache of freed blocks (see
// HugePageAllocator): fresh 4 KiB pages would cost more in faults and zeroing than the
// recurrence itself.
//
// Debugging. With the environment variable SRUPP_DEBUG_NAN_FILL=1 (read at every call,
// as the Triton kernels read it) every output buffer is filled with NaN before the kernel
// writes it, so an element that is never written shows up in the tests.

#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
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
#include <mutex>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using at::Tensor;
using c10::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();            // floats per vector
constexpr int64_t kMaxChunk = 512;         // units per task at most (state arrays fit L1)
static_assert(kMaxChunk % 16 == 0, "kMaxChunk must be a multiple of every vector width");

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

// Non-temporal (streaming) stores of a whole vector to an address aligned to its size:
// large outputs that won't be read again soon skip the read-for-ownership and the
// cache. Falls back to a normal store where unsupported.
inline void stream_vec(float* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_ps(p, __m512(v));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_ps(p, __m256(v));
#else
  v.store(p);
#endif
}
inline void stream_vec(BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
#else
  IO<BFloat16>::store(p, v);
#endif
}
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// FULL: a whole vector at p; otherwise the first n elements.
template <bool FULL, typename T>
inline Vec ld(const T* p, int n) {
  if constexpr (FULL) return IO<T>::load(p); else return IO<T>::load(p, n);
}
template <bool FULL, typename T>
inline void st(T* p, const Vec& v, int n) {
  if constexpr (FULL) IO<T>::store(p, v); else IO<T>::store(p, v, n);
}
// A store to a large output: streaming when nt and the address is aligned.
template <bool FULL, typename T>
inline void out(T* p, const Vec& v, int n, bool nt) {
  if constexpr (FULL) {
    if (nt && (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kW)) == 0) {
      stream_vec(p, v);
      return;
    }
  }
  st<FULL>(p, v, n);
}

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
// Geometry and arguments.

enum Skip : int { kNoSkip = 0, kSkipX = 1, kSkipU3 = 2 };

struct Args {
  int64_t B = 0, L = 0, D = 0, d = 0, dirs = 1;
  int64_t ch = 0, chunks = 0;  // units per task, tasks per (row, direction)
  // inputs
  const void* U = nullptr; int64_t sUb = 0, sUt = 0, sUk = 0;
  const void* x = nullptr; int64_t sxb = 0, sxt = 0;
  const float* wc = nullptr;    // (2, D) contiguous
  const float* bias = nullptr;  // (2, D) contiguous
  const float* c0 = nullptr;    // (B, D) contiguous, or null (zeros)
  const bool* mask = nullptr;   // (B, L) contiguous, or null
  const float* dm = nullptr;    // (B, D) contiguous, or null
  float scale_x = 1.f;
  bool nt = false;               // streaming stores for the big outputs
  // forward outputs
  void* h = nullptr;            // (B, L, D) contiguous
  float* c_all = nullptr;       // (B, L, D) contiguous, or null
  float* c_last = nullptr;      // (B, D)
  // backward
  const float* c_all_in = nullptr;
  const void* gh = nullptr; int64_t sghb = 0, sght = 0;
  const float* gcl = nullptr;   // (B, D) contiguous, or null
  void* gU = nullptr; int64_t sgUb = 0, sgUt = 0, sgUk = 0;
  void* gx = nullptr; int64_t sgxb = 0, sgxt = 0;   // null: grad of x not wanted
  float* gc0 = nullptr;         // (B, D)
  float* partial = nullptr;     // (B, 4, D)
};

void plan_chunks(Args& a) {
  a.d = a.D / a.dirs;
  const int64_t rows = std::max<int64_t>(1, a.B * a.dirs);
  // Enough tasks to keep every thread busy with some balance, but no chunk longer than
  // kMaxChunk and none (except a direction's only one) shorter than one vector.
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t chunks = std::max<int64_t>((a.d + kMaxChunk - 1) / kMaxChunk,
                                     (want_tasks + rows - 1) / rows);
  chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, (a.d + kW - 1) / kW));
  int64_t ch = (a.d + chunks - 1) / chunks;
  ch = std::max<int64_t>(kW, (ch + kW - 1) / kW * kW);
  ch = std::min<int64_t>(ch, kMaxChunk);
  a.ch = ch;
  a.chunks = std::max<int64_t>(1, (a.d + ch - 1) / ch);
}

struct Task {
  int64_t b, dir, j0, j1;
};
inline Task task_of(const Args& a, int64_t i) {
  const int64_t per_row = a.dirs * a.chunks;
  Task t;
  t.b = i / per_row;
  const int64_t rem = i % per_row;
  t.dir = rem / a.chunks;
  const int64_t ci = rem % a.chunks;
  t.j0 = t.dir * a.d + ci * a.ch;
  t.j1 = std::min<int64_t>(t.j0 + a.ch, (t.dir + 1) * a.d);
  return t;
}

// Streaming stores pay off once the outputs are too big to still be in cache when
// they are next read (the next layer's input, or the backward's reads).
bool stream_outputs(int64_t bytes_written) { return bytes_written >= (int64_t(16) << 20); }

bool debug_nan_fill() {
  const char* v = std::getenv("SRUPP_DEBUG_NAN_FILL");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// ---------------------------------------------------------------------------------
// Large outputs on transparent huge pages, recycled.
//
// A fresh multi-megabyte output is a fresh mmap: writing it first costs one page fault
// per 4 KiB page plus the kernel zeroing the page, which can cost more than the
// recurrence itself (docs/performance.md, "The recurrence kernel"). So outputs of 4 MiB
// or more are allocated 2 MiB-aligned with madvise(MADV_HUGEPAGE), and freed blocks are
// kept in a cache (at most 512 MiB; srupp.ops.cpu_kernels.set_cache_limit / empty_cache) and
// handed out again for the same size, which is what a training loop asks for every
// step. Linux only (elsewhere torch's own allocator is used, as it is for smaller
// outputs); the system's transparent-huge-page setting decides whether madvise helps.

struct Block {
  void* ptr;
  size_t bytes;
};

class BlockCache {
 public:
  static BlockCache& get() {
    static BlockCache* cache = new BlockCache();  // never destroyed: deleters may run at exit
    return *cache;
  }
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].bytes == bytes) {
        void* p = free_[i].ptr;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        cached_ -= bytes;
        return p;
      }
    }
    return nullptr;
  }
  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (cached_ + bytes <= cap_) {
        free_.push_back({p, bytes});
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }
  size_t release() {
    std::vector<Block> blocks;
    {
      std::lock_guard<std::mutex> g(mu_);
      blocks.swap(free_);
      cached_ = 0;
    }
    size_t total = 0;
    for (auto& b : blocks) {
      total += b.bytes;
      std::free(b.ptr);
    }
    return total;
  }
  size_t cached() {
    std::lock_guard<std::mutex> g(mu_);
    return cached_;
  }
  void set_cap(size_t bytes) {
    {
      std::lock_guard<std::mutex> g(mu_);
      cap_ = bytes;
    }
    if (cached() > bytes) release();
  }
  size_t cap() const { return cap_.load(); }

 private:
  BlockCache() = default;
  std::atomic<size_t> cap_{size_t(512) << 20};
  std::mutex mu_;
  std::vector<Block> free_;
  size_t cached_ = 0;
};

void free_block(void* ctx) {
  Block* b = static_cast<Block*>(ctx);
  BlockCache::get().give(b->ptr, b->bytes);
  delete b;
}

struct HugePageAllocator final : c10::Allocator {
  static constexpr size_t kPage = size_t(2) << 20;
  c10::DataPtr allocate(size_t n) override {
#if defined(__linux__)
    const size_t bytes = (n + kPage - 1) / kPage * kPage;
    void* p = n > 0 ? BlockCache::get().take(bytes) : nullptr;
    if (p == nullptr && n > 0 && posix_memalign(&p, kPage, bytes) == 0 && p != nullptr) {
      madvise(p, bytes, MADV_HUGEPAGE);
    }
    if (p != nullptr) {
      return {p, new Block{p, bytes}, &free_block, c10::Device(c10::DeviceType::CPU)};
    }
#endif
    return c10::GetCPUAllocator()->allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Like at::empty_strided (at::empty when strides is empty), on huge pages when large.
Tensor empty_out(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (nbytes < (int64_t(4) << 20)) {
    const auto opts = at::TensorOptions().dtype(dtype).device(at::kCPU);
    return strides.empty() ? at::empty(sizes, opts) : at::empty_strided(sizes, strides, opts);
  }
  static HugePageAllocator alloc;
  const c10::DispatchKeySet ks(c10::DispatchKey::CPU);
  if (strides.empty()) return at::detail::empty_generic(sizes, &alloc, ks, dtype, std::nullopt);
  return at::detail::empty_strided_generic(sizes, strides, &alloc, ks, dtype);
}

// An output shaped like t: t's strides when t is dense (so e.g. grad_x of a
// transposed time-major x is time-major again), else contiguous.
Tensor empty_like_dense(const Tensor& t) {
  if (t.is_non_overlapping_and_dense() && (t.size(-1) <= 1 || t.stride(-1) == 1))
    return empty_out(t.sizes(), t.strides(), t.scalar_type());
  return empty_out(t.sizes(), {}, t.scalar_type());
}

Tensor maybe_nan(Tensor t, bool fill) {
  if (fill && t.numel() > 0) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

// Tasks this small run on the calling thread: waking a second thread costs far more
// than one decoding step (L = 1) of a few thousand units takes.
constexpr int64_t kMinParallelWork = 32768;  // element-steps (units x time) per thread

int64_t task_grain(const Args& a) {
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, a.L * a.ch));
}

// ---------------------------------------------------------------------------------
// Forward.

template <typename TU, typename TX, int SKIP>
void fwd_kernel(const Args& a) {
  const int64_t ntasks = a.B * a.dirs * a.chunks;
  at::parallel_for(0, ntasks, task_grain(a), [&](int64_t begin, int64_t end) {
    alignas(64) float cst[kMaxChunk];
    const TU* U = static_cast<const TU*>(a.U);
    const TX* X = static_cast<const TX*>(a.x);
    TU* H = static_cast<TU*>(a.h);
    const Vec scale(a.scale_x);
    const Vec one(1.f);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task tk = task_of(a, ti);
      const int64_t b = tk.b, j0 = tk.j0, n_units = tk.j1 - tk.j0;
      if (n_units <= 0) continue;
      const int64_t padded = (n_units + kW - 1) / kW * kW;  // tail lanes: zeros
      for (int64_t j = 0; j < padded; ++j)
        cst[j] = (a.c0 && j < n_units) ? a.c0[b * a.D + j0 + j] : 0.f;
      const float* vf = a.wc + j0;
      const float* vr = a.wc + a.D + j0;
      const float* bf = a.bias + j0;
      const float* br = a.bias + a.D + j0;
      const float* dm = a.dm ? a.dm + b * a.D + j0 : nullptr;
      const bool rev = tk.dir == 1;

      for (int64_t s = 0; s < a.L; ++s) {
        const int64_t t = rev ? a.L - 1 - s : s;
        TU* h = H + (b * a.L + t) * a.D + j0;
        float* call = a.c_all ? a.c_all + (b * a.L + t) * a.D + j0 : nullptr;
        if (a.mask && a.mask[b * a.L + t]) {  // padding: state held, h = 0
          const Vec zero(0.f);
          int64_t j = 0;
          for (; j + kW <= n_units; j += kW) {
            out<true>(h + j, zero, kW, a.nt);
            if (call) out<true>(call + j, Vec::loadu(cst + j), kW, a.nt);
          }
          if (j < n_units) {
            const int n = static_cast<int>(n_units - j);
            st<false>(h + j, zero, n);
            if (call) st<false>(call + j, Vec::loadu(cst + j), n);
          }
          continue;
        }
        const TU* u0 = U + b * a.sUb + t * a.sUt + j0;
        const TU* u1 = u0 + a.sUk;
        const TU* u2 = u1 + a.sUk;
        const TU* u3 = u2 + a.sUk;
        const TX* xp = SKIP == kSkipX ? X + b * a.sxb + t * a.sxt + j0 : nullptr;

        auto body = [&](int64_t j, int n, auto full_tag) {
          constexpr bool FULL = decltype(full_tag)::value;
          const Vec c = Vec::loadu(cst + j);
          const Vec f = sigmoid(ld<FULL>(u1 + j, n) + ld<FULL>(vf + j, n) * c + ld<FULL>(bf + j, n));
          const Vec r = sigmoid(ld<FULL>(u2 + j, n) + ld<FULL>(vr + j, n) * c + ld<FULL>(br + j, n));
          const Vec cn = f * c + (one - f) * ld<FULL>(u0 + j, n);
          Vec hv;
          if constexpr (SKIP == kNoSkip) {
            hv = r * cn;
            if (dm) hv = ld<FULL>(dm + j, n) * hv;
          } else {
            Vec sk;
            if constexpr (SKIP == kSkipX) sk = ld<FULL>(xp + j, n) * scale;
            else sk = ld<FULL>(u3 + j, n);
            const Vec gate = dm ? ld<FULL>(dm + j, n) * r : r;
            hv = sk + gate * (cn - sk);
          }
          cn.store(cst + j);
          out<FULL>(h + j, hv, n, a.nt);
          if (call) out<FULL>(call + j, cn, n, a.nt);
        };
        int64_t j = 0;
        for (; j + kW <= n_units; j += kW) body(j, kW, std::true_type{});
        if (j < n_units) body(j, static_cast<int>(n_units - j), std::false_type{});
      }
      for (int64_t j = 0; j < n_units; ++j) a.c_last[b * a.D + j0 + j] = cst[j];
    }
    if (a.nt) stream_fence();
  });
}

// ---------------------------------------------------------------------------------
// Backward (spec section 3): walk time in the reverse of the forward order,
// recomputing f, r and c_t from the stored c_{t-1}.

template <typename TU, typename TX, int SKIP>
void bwd_kernel(const Args& a) {
  const int64_t ntasks = a.B * a.dirs * a.chunks;
  at::parallel_for(0, ntasks, task_grain(a), [&](int64_t begin, int64_t end) {
    alignas(64) float carry[kMaxChunk];
    alignas(64) float acc[4][kMaxChunk];  // d v_f, d v_r, d b_f, d b_r
    const TU* U = static_cast<const TU*>(a.U);
    const TX* X = static_cast<const TX*>(a.x);
    const TU* GH = static_cast<const TU*>(a.gh);
    TU* GU = static_cast<TU*>(a.gU);
    TX* GX = static_cast<TX*>(a.gx);
    const Vec scale(a.scale_x);
    const Vec one(1.f);
    const Vec zero(0.f);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task tk = task_of(a, ti);
      const int64_t b = tk.b, j0 = tk.j0, n_units = tk.j1 - tk.j0;
      if (n_units <= 0) continue;
      const int64_t padded = (n_units + kW - 1) / kW * kW;  // tail lanes: zeros
      for (int64_t j = 0; j < padded; ++j) {
        carry[j] = (a.gcl && j < n_units) ? a.gcl[b * a.D + j0 + j] : 0.f;
        acc[0][j] = acc[1][j] = acc[2][j] = acc[3][j] = 0.f;
      }
      const float* vf = a.wc + j0;
      const float* vr = a.wc + a.D + j0;
      const float* bf = a.bias + j0;
      const float* br = a.bias + a.D + j0;
      const float* dm = a.dm ? a.dm + b * a.D + j0 : nullptr;
      const float* c0 = a.c0 ? a.c0 + b * a.D + j0 : nullptr;
      const bool rev = tk.dir == 1;

      for (int64_t s = a.L - 1; s >= 0; --s) {  // s: forward step index
        const int64_t t = rev ? a.L - 1 - s : s;
        TU* gu0 = GU + b * a.sgUb + t * a.sgUt + j0;
        TU* gu1 = gu0 + a.sgUk;
        TU* gu2 = gu1 + a.sgUk;
        TU* gu3 = gu2 + a.sgUk;
        TX* gx = GX ? GX + b * a.sgxb + t * a.sgxt + j0 : nullptr;
        if (a.mask && a.mask[b * a.L + t]) {  // padding: no gradient, carry passes through
          auto zfill = [&](int64_t j, int n, auto full_tag) {
            constexpr bool FULL = decltype(full_tag)::value;
            out<FULL>(gu0 + j, zero, n, a.nt);
            out<FULL>(gu1 + j, zero, n, a.nt);
            out<FULL>(gu2 + j, zero, n, a.nt);
            if constexpr (SKIP == kSkipU3) out<FULL>(gu3 + j, zero, n, a.nt);
            if constexpr (SKIP == kSkipX) if (gx) out<FULL>(gx + j, zero, n, a.nt);
          };
          int64_t j = 0;
          for (; j + kW <= n_units; j += kW) zfill(j, kW, std::true_type{});
          if (j < n_units) zfill(j, static_cast<int>(n_units - j), std::false_type{});
          continue;
        }
        // c_{t-1} in the direction's own time order.
        const float* cp;
        if (s == 0) cp = c0;  // may be null: zeros
        else cp = a.c_all_in + (b * a.L + (rev ? t + 1 : t - 1)) * a.D + j0;
        const TU* u0 = U + b * a.sUb + t * a.sUt + j0;
        const TU* u1 = u0 + a.sUk;
        const TU* u2 = u1 + a.sUk;
        const TU* u3 = u2 + a.sUk;
        const TX* xp = SKIP == kSkipX ? X + b * a.sxb + t * a.sxt + j0 : nullptr;
        const TU* gh = GH + b * a.sghb + t * a.sght + j0;

        auto body = [&](int64_t j, int n, auto full_tag) {
          constexpr bool FULL = decltype(full_tag)::value;
          const Vec c = cp ? ld<FULL>(cp + j, n) : zero;
          const Vec wf = ld<FULL>(vf + j, n), wr = ld<FULL>(vr + j, n);
          const Vec f = sigmoid(ld<FULL>(u1 + j, n) + wf * c + ld<FULL>(bf + j, n));
          const Vec r = sigmoid(ld<FULL>(u2 + j, n) + wr * c + ld<FULL>(br + j, n));
          const Vec u0v = ld<FULL>(u0 + j, n);
          const Vec cn = f * c + (one - f) * u0v;
          const Vec g = ld<FULL>(gh + j, n);
          const Vec gm = dm ? g * ld<FULL>(dm + j, n) : g;  // gh * m
          Vec gr, gc;
          if constexpr (SKIP == kNoSkip) {
            gr = gm * cn * r * (one - r);
          } else {
            Vec sk;
            if constexpr (SKIP == kSkipX) sk = ld<FULL>(xp + j, n) * scale;
            else sk = ld<FULL>(u3 + j, n);
            gr = gm * (cn - sk) * r * (one - r);
            const Vec mr = dm ? ld<FULL>(dm + j, n) * r : r;
            const Vec gs = g * (one - mr);  // d h / d s
            if constexpr (SKIP == kSkipX) {
              if (gx) out<FULL>(gx + j, gs * scale, n, a.nt);
            } else {
              out<FULL>(gu3 + j, gs, n, a.nt);
            }
          }
          gc = gm * r + Vec::loadu(carry + j);
          const Vec gf = gc * (c - u0v) * f * (one - f);
          (gc * f + gf * wf + gr * wr).store(carry + j);
          out<FULL>(gu0 + j, gc * (one - f), n, a.nt);
          out<FULL>(gu1 + j, gf, n, a.nt);
          out<FULL>(gu2 + j, gr, n, a.nt);
          (Vec::loadu(acc[0] + j) + gf * c).store(acc[0] + j);
          (Vec::loadu(acc[1] + j) + gr * c).store(acc[1] + j);
          (Vec::loadu(acc[2] + j) + gf).store(acc[2] + j);
          (Vec::loadu(acc[3] + j) + gr).store(acc[3] + j);
        };
        int64_t j = 0;
        for (; j + kW <= n_units; j += kW) body(j, kW, std::true_type{});
        if (j < n_units) body(j, static_cast<int>(n_units - j), std::false_type{});
      }
      float* gc0 = a.gc0 + b * a.D + j0;
      float* part = a.partial + b * 4 * a.D + j0;
      for (int64_t j = 0; j < n_units; ++j) {
        gc0[j] = carry[j];
        for (int q = 0; q < 4; ++q) part[q * a.D + j] = acc[q][j];
      }
    }
    if (a.nt) stream_fence();
  });
}

// ---------------------------------------------------------------------------------
// Dispatch on dtypes and skip kind.

template <typename TU, typename TX>
void launch_fwd(int skip, const Args& a) {
  if (skip == kNoSkip) fwd_kernel<TU, TX, kNoSkip>(a);
  else if (skip == kSkipX) fwd_kernel<TU, TX, kSkipX>(a);
  else fwd_kernel<TU, TX, kSkipU3>(a);
}
template <typename TU, typename TX>
void launch_bwd(int skip, const Args& a) {
  if (skip == kNoSkip) bwd_kernel<TU, TX, kNoSkip>(a);
  else if (skip == kSkipX) bwd_kernel<TU, TX, kSkipX>(a);
  else bwd_kernel<TU, TX, kSkipU3>(a);
}

template <bool BWD>
void launch(at::ScalarType tu, at::ScalarType tx, int skip, const Args& a) {
  auto go = [&](auto u_tag, auto x_tag) {
    using TU = decltype(u_tag);
    using TX = decltype(x_tag);
    if constexpr (BWD) launch_bwd<TU, TX>(skip, a); else launch_fwd<TU, TX>(skip, a);
  };
  const bool ub = tu == at::kBFloat16, xb = tx == at::kBFloat16;
  if (skip != kSkipX) {  // x unused: one instantiation per U dtype
    if (ub) go(BFloat16{}, float{}); else go(float{}, float{});
  } else if (ub) {
    if (xb) go(BFloat16{}, BFloat16{}); else go(BFloat16{}, float{});
  } else {
    if (xb) go(float{}, BFloat16{}); else go(float{}, float{});
  }
}

void check_float_type(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "srupp cpu kernel: ", name, " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "srupp cpu kernel: ", name, " must be on the CPU");
}

Tensor last_dim_contiguous(const Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

Tensor small_f32(const Tensor& t) { return t.to(at::kFloat).contiguous(); }

struct Common {
  Tensor U, x, wc, bias, c0, mask, dm;
  int skip = kNoSkip;
};

Common prepare(Args& a, const Tensor& U_in, const std::optional<Tensor>& x_in,
               const Tensor& weight_c, const Tensor& bias,
               const std::optional<Tensor>& c0_in, const std::optional<Tensor>& mask_pad,
               const std::optional<Tensor>& dropout_mask, double scale_x, bool bidirectional) {
  Common cm;
  TORCH_CHECK(U_in.dim() == 4, "srupp cpu kernel: U must be (B, L, k, D), got ", U_in.sizes());
  check_float_type(U_in, "U");
  cm.U = last_dim_contiguous(U_in);
  const int64_t B = cm.U.size(0), L = cm.U.size(1), k = cm.U.size(2), D = cm.U.size(3);
  TORCH_CHECK(k == 3 || k == 4, "srupp cpu kernel: U must have k = 3 or 4 planes, got ", k);
  const bool has_x = x_in.has_value() && x_in->defined();
  TORCH_CHECK(!(k == 4 && has_x), "srupp cpu kernel: with k = 4 pass x = None");
  TORCH_CHECK(!bidirectional || D % 2 == 0, "srupp cpu kernel: bidirectional needs an even D");
  a.B = B; a.L = L; a.D = D; a.dirs = bidirectional ? 2 : 1;
  a.U = cm.U.data_ptr();
  a.sUb = cm.U.stride(0); a.sUt = cm.U.stride(1); a.sUk = cm.U.stride(2);
  if (k == 4) cm.skip = kSkipU3;
  if (has_x) {
    cm.skip = kSkipX;
    check_float_type(*x_in, "x");
    TORCH_CHECK(x_in->dim() == 3 && x_in->size(0) == B && x_in->size(1) == L && x_in->size(2) == D,
                "srupp cpu kernel: x must be (B, L, D) = (", B, ", ", L, ", ", D, "), got ", x_in->sizes());
    cm.x = last_dim_contiguous(*x_in);
    a.x = cm.x.data_ptr(); a.sxb = cm.x.stride(0); a.sxt = cm.x.stride(1);
  }
  TORCH_CHECK(weight_c.numel() == 2 * D && bias.numel() == 2 * D,
              "srupp cpu kernel: weight_c and bias must be (2, D)");
  cm.wc = small_f32(weight_c); a.wc = cm.wc.data_ptr<float>();
  cm.bias = small_f32(bias); a.bias = cm.bias.data_ptr<float>();
  if (c0_in.has_value() && c0_in->defined()) {
    TORCH_CHECK(c0_in->numel() == B * D, "srupp cpu kernel: c0 must be (B, D)");
    cm.c0 = small_f32(*c0_in); a.c0 = cm.c0.data_ptr<float>();
  }
  if (mask_pad.has_value() && mask_pad->defined()) {
    TORCH_CHECK(mask_pad->numel() == B * L, "srupp cpu kernel: mask_pad must be (B, L)");
    cm.mask = mask_pad->to(at::kBool).contiguous(); a.mask = cm.mask.data_ptr<bool>();
  }
  if (dropout_mask.has_value() && dropout_mask->defined()) {
    TORCH_CHECK(dropout_mask->numel() == B * D, "srupp cpu kernel: dropout_mask must be (B, D)");
    cm.dm = small_f32(*dropout_mask); a.dm = cm.dm.data_ptr<float>();
  }
  a.scale_x = static_cast<float>(scale_x);
  plan_chunks(a);
  return cm;
}

// ---------------------------------------------------------------------------------
// Few-row projections for decoding: y (R, O) = x (R, I) @ W (O, I)^T [+ bias].
//
// At one token per sequence a decode step is a chain of matrix-vector products, each
// reading its weight once; BLAS's GEMM treats a 1-row product as a small GEMM and
// reaches a fraction of the memory bandwidth. Here each task owns a range of output
// features and walks their rows of W once, with one dot product per row of x (x is
// converted to fp32 once; its rows stay in L1), four vector accumulators each. fp32 or
// bf16 (x, W and bias of one dtype); sums in fp32; the output rounds to the input dtype.

// Output features o0 .. o1 - 1 of the product (the range a task or a thread owns).
// y's rows are ldy apart.
template <typename T>
void linear_rows_range(const float* x, const T* w, int64_t ldw, const T* bias, T* y, int64_t ldy,
                       int64_t R, int64_t I, int64_t o0, int64_t o1) {
    alignas(64) float lanes[kW];
    for (int64_t o = o0; o < o1; ++o) {
      const T* wr = w + o * ldw;
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + r * I;
        Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
        int64_t i = 0;
        for (; i + 4 * kW <= I; i += 4 * kW) {
          a0 = at::vec::fmadd(IO<T>::load(wr + i), Vec::loadu(xr + i), a0);
          a1 = at::vec::fmadd(IO<T>::load(wr + i + kW), Vec::loadu(xr + i + kW), a1);
          a2 = at::vec::fmadd(IO<T>::load(wr + i + 2 * kW), Vec::loadu(xr + i + 2 * kW), a2);
          a3 = at::vec::fmadd(IO<T>::load(wr + i + 3 * kW), Vec::loadu(xr + i + 3 * kW), a3);
        }
        for (; i + kW <= I; i += kW) a0 = at::vec::fmadd(IO<T>::load(wr + i), Vec::loadu(xr + i), a0);
        if (i < I) {
          const int n = static_cast<int>(I - i);
          a1 = at::vec::fmadd(IO<T>::load(wr + i, n), Vec::loadu(xr + i, n), a1);
        }
        ((a0 + a1) + (a2 + a3)).store(lanes);
        float acc = 0.f;
        for (int k = 0; k < kW; ++k) acc += lanes[k];
        if (bias != nullptr) acc += static_cast<float>(bias[o]);
        y[r * ldy + o] = static_cast<T>(acc);
      }
    }
}

// a task reads at least ~64 KiB of W, so that 2 threads split a 256 x 256 product
inline int64_t rows_grain(int64_t I, int64_t bytes) {
  return std::max<int64_t>(4, (int64_t{1} << 16) / (bytes * std::max<int64_t>(I, 1)));
}

template <typename T>
void linear_rows_kernel(const float* x, const T* w, int64_t ldw, const T* bias, T* y, int64_t R,
                        int64_t I, int64_t O) {
  at::parallel_for(0, O, rows_grain(I, sizeof(T)), [&](int64_t o0, int64_t o1) {
    linear_rows_range<T>(x, w, ldw, bias, y, O, R, I, o0, o1);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// bf16 rows on CPUs with AVX512-BF16 (built with -march=native there): vdpbf16ps
// multiplies 32 bf16 pairs and adds them into 16 fp32 lanes in one instruction, so
// W is never widened (the generic kernel above spent more time converting W than
// reading it). x is the caller's bf16 x itself. Sums in fp32, as above, in another
// order: the output differs from the generic kernel's by bf16 rounding at most.
//
// Four output features at a time: each load of x serves four rows of W, and the four
// sums leave their vectors in one combined reduction. One row at a time, rows as short
// as SRU++'s (d/4 wide) spent as long on reloading x and reducing as on reading W.
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {  // (sum a0, .., sum a3)
  auto half = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)),
                                  _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

void linear_rows_bf16_dot_range(const BFloat16* x, const BFloat16* w, int64_t ldw,
                                const BFloat16* bias, BFloat16* y, int64_t ldy, int64_t R,
                                int64_t I, int64_t o0, int64_t o1) {
  constexpr int64_t kB = 32;    // bf16 per 512-bit vector
  constexpr int64_t kRows = 4;  // output features per pass
  const int tail = static_cast<int>(I % kB);
  const __mmask32 tail_mask = tail ? static_cast<__mmask32>((uint64_t{1} << tail) - 1) : 0;
  auto load = [](const BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  auto load_tail = [&](const BFloat16* p) {  // zeros beyond I multiply to zero
    return (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, p);
  };
    int64_t o = o0;
    for (; o + kRows <= o1; o += kRows) {
      const BFloat16* w0 = w + o * ldw;
      const BFloat16* w1 = w0 + ldw;
      const BFloat16* w2 = w1 + ldw;
      const BFloat16* w3 = w2 + ldw;
      for (int64_t r = 0; r < R; ++r) {
        const BFloat16* xr = x + r * I;
        // two accumulators per feature (even and odd vectors of the row): 8 chains
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t i = 0;
        for (; i + 2 * kB <= I; i += 2 * kB) {
          const __m512bh xa = load(xr + i), xb = load(xr + i + kB);
          a0 = _mm512_dpbf16_ps(a0, load(w0 + i), xa);
          a1 = _mm512_dpbf16_ps(a1, load(w1 + i), xa);
          a2 = _mm512_dpbf16_ps(a2, load(w2 + i), xa);
          a3 = _mm512_dpbf16_ps(a3, load(w3 + i), xa);
          b0 = _mm512_dpbf16_ps(b0, load(w0 + i + kB), xb);
          b1 = _mm512_dpbf16_ps(b1, load(w1 + i + kB), xb);
          b2 = _mm512_dpbf16_ps(b2, load(w2 + i + kB), xb);
          b3 = _mm512_dpbf16_ps(b3, load(w3 + i + kB), xb);
        }
        if (i + kB <= I) {
          const __m512bh xa = load(xr + i);
          a0 = _mm512_dpbf16_ps(a0, load(w0 + i), xa);
          a1 = _mm512_dpbf16_ps(a1, load(w1 + i), xa);
          a2 = _mm512_dpbf16_ps(a2, load(w2 + i), xa);
          a3 = _mm512_dpbf16_ps(a3, load(w3 + i), xa);
          i += kB;
        }
        if (tail) {
          const __m512bh xa = load_tail(xr + i);
          b0 = _mm512_dpbf16_ps(b0, load_tail(w0 + i), xa);
          b1 = _mm512_dpbf16_ps(b1, load_tail(w1 + i), xa);
          b2 = _mm512_dpbf16_ps(b2, load_tail(w2 + i), xa);
          b3 = _mm512_dpbf16_ps(b3, load_tail(w3 + i), xa);
        }
        alignas(16) float acc[4];
        _mm_store_ps(acc, sum4(_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1),
                               _mm512_add_ps(a2, b2), _mm512_add_ps(a3, b3)));
        for (int q = 0; q < 4; ++q) {
          const float v = bias != nullptr ? acc[q] + static_cast<float>(bias[o + q]) : acc[q];
          y[r * ldy + o + q] = static_cast<BFloat16>(v);
        }
      }
    }
    for (; o < o1; ++o) {  // the last features, one at a time
      const BFloat16* wr = w + o * ldw;
      for (int64_t r = 0; r < R; ++r) {
        const BFloat16* xr = x + r * I;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 2 * kB <= I; i += 2 * kB) {
          a0 = _mm512_dpbf16_ps(a0, load(wr + i), load(xr + i));
          a1 = _mm512_dpbf16_ps(a1, load(wr + i + kB), load(xr + i + kB));
        }
        if (i + kB <= I) {
          a0 = _mm512_dpbf16_ps(a0, load(wr + i), load(xr + i));
          i += kB;
        }
        if (tail) a1 = _mm512_dpbf16_ps(a1, load_tail(wr + i), load_tail(xr + i));
        // reduced in sum4's order, so a feature's value does not depend on its group
        const __m512 z = _mm512_setzero_ps();
        float acc = _mm_cvtss_f32(sum4(_mm512_add_ps(a0, a1), z, z, z));
        if (bias != nullptr) acc += static_cast<float>(bias[o]);
        y[r * ldy + o] = static_cast<BFloat16>(acc);
      }
    }
}

void linear_rows_bf16_dot(const BFloat16* x, const BFloat16* w, int64_t ldw,
                          const BFloat16* bias, BFloat16* y, int64_t R, int64_t I, int64_t O) {
  at::parallel_for(0, O, rows_grain(I, 2), [&](int64_t o0, int64_t o1) {
    linear_rows_bf16_dot_range(x, w, ldw, bias, y, O, R, I, o0, o1);
  });
}
#endif

// ---------------------------------------------------------------------------------
// Attention of one query per (batch, head) for decoding: o = softmax(scale q K^T) V.
//
// A decode step attends from one token to a window of cached keys and values:
// (1 x hd) against (S x hd). Through SDPA or two matmuls that is a few tiny GEMMs,
// whose fixed cost (and, in bf16, a slow small-GEMM path for P V) exceeds the work.
// Here a task walks its keys once for the scores (fp32 dot products, q widened once),
// takes the softmax in fp32, and walks the V rows once accumulating the p-weighted rows
// in fp32; the output rounds to the input dtype once. K and V are read in place at any
// row stride (a [K | V] cache).
//
// With fewer (batch, head) pairs than threads (batch-1 decoding) each pair's keys are
// split over the threads: each part keeps its own max, sum and weighted rows, merged
// at the end (the flash-decoding split), so the second thread is not idle. The sums
// then run in another order: results depend on the thread count, within rounding.

inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(__m512(v));
#else
  alignas(64) float lanes[kW];
  v.store(lanes);
  float s = 0.f;
  for (int l = 0; l < kW; ++l) s += lanes[l];
  return s;
#endif
}

constexpr int64_t kMinKeysPerPart = 32;  // fewer keys per thread cost more than they save

// One query's softmax pieces over keys j0 .. j1 - 1: returns their max score m (-inf when
// every one is padded) and writes l = sum exp(s - m) to *l and sum exp(s - m) v_j to acc
// (hd_pad floats). qf: the query in fp32 (hd_pad, zero beyond hd); p: j1 - j0 floats.
// Key j is padding when j < pad_len and pad[j] (pad null: none is).
template <typename T>
float attend_keys(const float* qf, const T* kb, int64_t skr, const T* vb, int64_t svr,
                  int64_t j0, int64_t j1, int64_t hd, float scale, const bool* pad,
                  int64_t pad_len, float* p, float* acc, float* l) {
  const int64_t full = hd / kW * kW;
  const int tail = static_cast<int>(hd - full);
  auto padded = [&](int64_t j) { return pad != nullptr && j < pad_len && pad[j]; };
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = j0; j < j1; ++j) {
    float& pj = p[j - j0];
    if (padded(j)) {
      pj = -std::numeric_limits<float>::infinity();
      continue;
    }
    const T* kr = kb + j * skr;
    Vec a0(0.f), a1(0.f);
    int64_t i = 0;
    for (; i + 2 * kW <= full; i += 2 * kW) {
      a0 = at::vec::fmadd(IO<T>::load(kr + i), Vec::loadu(qf + i), a0);
      a1 = at::vec::fmadd(IO<T>::load(kr + i + kW), Vec::loadu(qf + i + kW), a1);
    }
    for (; i < full; i += kW) a0 = at::vec::fmadd(IO<T>::load(kr + i), Vec::loadu(qf + i), a0);
    if (tail) a1 = at::vec::fmadd(IO<T>::load(kr + i, tail), Vec::loadu(qf + i), a1);
    pj = hsum(a0 + a1) * scale;
    mx = std::max(mx, pj);
  }
  const bool none = mx == -std::numeric_limits<float>::infinity();  // every key padded
  float sum = 0.f;
  for (int64_t j = j0; j < j1; ++j) {
    float& pj = p[j - j0];
    pj = none ? 0.f : std::exp(pj - mx);
    sum += pj;
  }
  std::fill(acc, acc + (hd + kW - 1) / kW * kW, 0.f);
  for (int64_t j = j0; j < j1; ++j) {
    if (padded(j)) continue;
    const T* vr = vb + j * svr;
    const Vec pj(p[j - j0]);
    int64_t i = 0;
    for (; i < full; i += kW)
      at::vec::fmadd(pj, IO<T>::load(vr + i), Vec::loadu(acc + i)).store(acc + i);
    if (tail) at::vec::fmadd(pj, IO<T>::load(vr + i, tail), Vec::loadu(acc + i)).store(acc + i);
  }
  *l = sum;
  return mx;
}

// The attention of B x H single queries as tasks for a team of threads: task t covers
// (batch, head) t / parts and its keys' part t % parts (plan above); finish(n) merges
// pair n's parts into o when the keys were split. q (B, H, hd) at strides sq, K and V
// (B, H, S, hd) at strides sk and sv; key_pad (B, >= pad_len) at row stride spad, or
// null. o (B*H, hd) contiguous.
template <typename T>
struct OneQuery {
  const T *q, *k, *v;
  T* o;
  int64_t B, H, S, hd;
  const int64_t *sq, *sk, *sv;
  float scale;
  const bool* key_pad;
  int64_t spad, pad_len;
  int64_t hd_pad, NH, parts;
  std::vector<float> part_m, part_l, part_acc;  // per task when the keys are split

  OneQuery(const T* q_, const T* k_, const T* v_, T* o_, int64_t B_, int64_t H_, int64_t S_,
           int64_t hd_, const int64_t* sq_, const int64_t* sk_, const int64_t* sv_,
           float scale_, const bool* key_pad_, int64_t spad_, int64_t pad_len_,
           int64_t threads)
      : q(q_), k(k_), v(v_), o(o_), B(B_), H(H_), S(S_), hd(hd_), sq(sq_), sk(sk_), sv(sv_),
        scale(scale_), key_pad(key_pad_), spad(spad_), pad_len(pad_len_) {
    hd_pad = (hd + kW - 1) / kW * kW;
    NH = B * H;
    parts = NH == 0 || NH >= threads ? 1
        : std::max<int64_t>(1, std::min((threads + NH - 1) / NH, S / kMinKeysPerPart));
    if (parts > 1) {
      part_m.resize(NH * parts);
      part_l.resize(NH * parts);
      part_acc.resize(NH * parts * hd_pad);
    }
  }

  int64_t tasks() const { return NH * parts; }
  // floats of scratch a thread needs for its tasks
  int64_t scratch() const { return 2 * hd_pad + std::max<int64_t>((S + parts - 1) / parts, 1); }

  void task(int64_t t, float* scratch_) {
    float* qf = scratch_;
    float* acc = qf + hd_pad;
    float* p = acc + hd_pad;
    const int64_t n = t / parts, part = t % parts, b = n / H, h = n % H;
    const int64_t j0 = S * part / parts, j1 = S * (part + 1) / parts;
    const T* qp = q + b * sq[0] + h * sq[1];
    for (int64_t i = 0; i < hd; ++i) qf[i] = static_cast<float>(qp[i]);
    std::fill(qf + hd, qf + hd_pad, 0.f);
    const bool* pad = key_pad == nullptr ? nullptr : key_pad + b * spad;
    float* acc_t = parts > 1 ? part_acc.data() + t * hd_pad : acc;
    float l = 0.f;
    const float m = attend_keys<T>(qf, k + b * sk[0] + h * sk[1], sk[2], v + b * sv[0] + h * sv[1],
                                   sv[2], j0, j1, hd, scale, pad, pad_len, p, acc_t, &l);
    if (parts > 1) {
      part_m[t] = m;
      part_l[t] = l;
      return;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* op = o + n * hd;
    for (int64_t i = 0; i < hd; ++i) op[i] = static_cast<T>(acc[i] * inv);
  }

  // pair n's parts rescaled to their common max and added (out: hd_pad floats of scratch)
  void finish(int64_t n, float* out) const {
    if (parts == 1) return;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < parts; ++r) mx = std::max(mx, part_m[n * parts + r]);
    std::fill(out, out + hd_pad, 0.f);
    float sum = 0.f;
    if (mx != -std::numeric_limits<float>::infinity()) {
      for (int64_t r = 0; r < parts; ++r) {
        const int64_t t = n * parts + r;
        if (part_m[t] == -std::numeric_limits<float>::infinity()) continue;  // all padded
        const float w = std::exp(part_m[t] - mx);
        sum += w * part_l[t];
        const Vec wv(w);
        const float* a = part_acc.data() + t * hd_pad;
        for (int64_t i = 0; i < hd_pad; i += kW)
          at::vec::fmadd(wv, Vec::loadu(a + i), Vec::loadu(out + i)).store(out + i);
      }
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T* op = o + n * hd;
    for (int64_t i = 0; i < hd; ++i) op[i] = static_cast<T>(out[i] * inv);
  }
};

// key_pad (B, S) bool with row stride spad, or null: True keys are skipped; a query
// with no key left gets o = 0. Keys from pad_len on are never padding (-1: S).
template <typename T>
void one_query_kernel(const T* q, const T* k, const T* v, T* o, int64_t B, int64_t H,
                      int64_t S, int64_t hd, const int64_t* sq, const int64_t* sk,
                      const int64_t* sv, float scale, const bool* key_pad = nullptr,
                      int64_t spad = 0, int64_t pad_len = -1) {
  OneQuery<T> att(q, k, v, o, B, H, S, hd, sq, sk, sv, scale, key_pad, spad,
                  pad_len < 0 ? S : pad_len, at::get_num_threads());
  at::parallel_for(0, att.tasks(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(att.scratch());
    for (int64_t t = t0; t < t1; ++t) att.task(t, scratch.data());
  });
  std::vector<float> out(att.hd_pad);
  for (int64_t n = 0; n < att.NH; ++n) att.finish(n, out.data());
}

}  // namespace

// True when linear_rows' bf16 products use the AVX512-BF16 dot-product instruction.
bool linear_rows_bf16_native() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  return true;
#else
  return false;
#endif
}

// x (R, I) and weight (O, I) of one dtype (fp32 or bf16), x contiguous, weight's rows
// contiguous (any row stride: keys read in place from a cache); bias (O,) or None.
Tensor linear_rows_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "srupp linear_rows: x (R, I) and weight (O, I) expected, got ", x.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "srupp linear_rows: x and weight must both be float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.stride(1) == 1 && weight.stride(0) >= weight.size(1),
              "srupp linear_rows: x contiguous and weight rows contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                bias->numel() == weight.size(0), "srupp linear_rows: bias (O,) of x's dtype");
  }
  const int64_t R = x.size(0), I = x.size(1), O = weight.size(0);
  Tensor y = at::empty({R, O}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (x.scalar_type() == at::kBFloat16) {
    linear_rows_bf16_dot(x.data_ptr<BFloat16>(), weight.data_ptr<BFloat16>(), weight.stride(0),
                         has_bias ? bias->data_ptr<BFloat16>() : nullptr,
                         y.data_ptr<BFloat16>(), R, I, O);
    return y;
  }
#endif
  const Tensor xf = x.to(at::kFloat);
  if (x.scalar_type() == at::kFloat) {
    linear_rows_kernel<float>(xf.data_ptr<float>(), weight.data_ptr<float>(), weight.stride(0),
                              has_bias ? bias->data_ptr<float>() : nullptr,
                              y.data_ptr<float>(), R, I, O);
  } else {
    linear_rows_kernel<BFloat16>(xf.data_ptr<float>(), weight.data_ptr<BFloat16>(), weight.stride(0),
                                 has_bias ? bias->data_ptr<BFloat16>() : nullptr,
                                 y.data_ptr<BFloat16>(), R, I, O);
  }
  return y;
}

// q (B, H, 1, hd), k and v (B, H, S, hd), one dtype (fp32 or bf16), the last dim of
// each contiguous (any other strides); returns o (B, H, 1, hd) contiguous.
Tensor attend_one_query_cpu(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 &&
              k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
              q.size(3) == k.size(3),
              "srupp attend_one_query: q (B, H, 1, hd), k and v (B, H, S, hd) expected, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "srupp attend_one_query: q, k and v must all be float32 or all bfloat16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "srupp attend_one_query: the last dimension of q, k and v must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), S = k.size(2), hd = q.size(3);
  Tensor o = at::empty({B, H, 1, hd}, q.options());
  const int64_t sq[2] = {q.stride(0), q.stride(1)};
  const int64_t sk[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t sv[3] = {v.stride(0), v.stride(1), v.stride(2)};
  if (q.scalar_type() == at::kFloat) {
    one_query_kernel<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                            o.data_ptr<float>(), B, H, S, hd, sq, sk, sv,
                            static_cast<float>(scale));
  } else {
    one_query_kernel<BFloat16>(q.data_ptr<BFloat16>(), k.data_ptr<BFloat16>(),
                               v.data_ptr<BFloat16>(), o.data_ptr<BFloat16>(), B, H, S, hd,
                               sq, sk, sv, static_cast<float>(scale));
  }
  return o;
}

// ---------------------------------------------------------------------------------
// One SRU++ layer's decoding step (srupp::layer_step): one token per sequence, no
// gradient, every small operation of the layer in one call (srupp/ops/layer_step.py
// has its plain reference and the exact contract). At batch 1 the layer's Python path
// spent about half its time between ~30 small operations; here they are loops over
// a few thousand floats each, and the products are the few-rows kernel above (or
// ATen's GEMM for larger batches). Rounding follows the layer's modules: every
// intermediate the modules store in the weights' dtype (q, K and V, o, U, h) is
// rounded to it here too; sums, norms and the recurrence are in fp32.

// int8 products (further down), for quantized layers
Tensor linear_int8_rows_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale,
                            const std::optional<Tensor>& bias, bool plain);
Tensor linear_w8a8_rows_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale,
                            const std::optional<Tensor>& bias, bool plain);

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
// activations as they are, or int8 with the activations rounded per row (w8a8).
enum Quant : int64_t { kFloatWeights = 0, kInt8 = 1, kW8A8 = 2 };
constexpr int64_t kInt8FewRows = 32;  // srupp.ops.quant.INT8_FEW_ROWS

// y = x @ w^T: the few-rows kernel up to `few` rows, else ATen (oneDNN / BLAS). Quantized
// weights (w int8 with one scale per output) go where srupp.ops.quant sends them:
// weight-only int8 to its kernel up to 32 rows, else dequantized in fp32 and multiplied in
// x's dtype; w8a8 to its kernel at any rows (the same integer sums as its reference).
Tensor project(const Tensor& x, const Tensor& w, int64_t few, const Tensor* scale = nullptr,
               int64_t quant = kFloatWeights) {
  if (quant == kW8A8) return linear_w8a8_rows_cpu(x, w, *scale, std::nullopt, false);
  if (quant == kInt8) {
    if (x.size(0) <= kInt8FewRows) return linear_int8_rows_cpu(x, w, *scale, std::nullopt, false);
    return at::linear(x, (w.to(at::kFloat) * scale->to(at::kFloat).unsqueeze(1)).to(x.scalar_type()));
  }
  return x.size(0) <= few ? linear_rows_cpu(x, w, std::nullopt) : at::linear(x, w);
}

// LayerNorm of R rows of width N (row strides ldx, ldy), fp32 statistics, biased variance
template <typename T>
void layer_norm_rows(const T* x, int64_t ldx, const T* g, const T* b, float eps, T* y,
                     int64_t ldy, int64_t R, int64_t N) {
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * ldx;
    T* yr = y + r * ldy;
    float mean = 0.f, var = 0.f;
    for (int64_t i = 0; i < N; ++i) mean += static_cast<float>(xr[i]);
    mean /= static_cast<float>(N);
    for (int64_t i = 0; i < N; ++i) {
      const float d = static_cast<float>(xr[i]) - mean;
      var += d * d;
    }
    const float inv = 1.f / std::sqrt(var / static_cast<float>(N) + eps);
    for (int64_t i = 0; i < N; ++i)
      yr[i] = static_cast<T>((static_cast<float>(xr[i]) - mean) * inv * static_cast<float>(g[i]) +
                             static_cast<float>(b[i]));
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
// serial pieces (together about a third of a 5M model's step). Here the team enters
// once per layer; the products, the attention's keys and the recurrence's units are
// split over its threads, barriers stand between dependent pieces, the serial pieces run
// on thread 0, and the intermediates live in a reused workspace. The arithmetic is the
// other path's, piece for piece: the same kernels on the same rows, so the results are
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

bool team_enabled = true;  // tests turn it off to compare the two paths

template <typename T>
const T* ptr_or_null(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<T>() : nullptr;
}

// Raw pointers and sizes of one layer's step, as layer_step_run checked them.
template <typename T>
struct LayerView {
  const T* x;
  int64_t ldx, B, n_in, D, dp, kD, k, H, cached;
  const float* c;
  const T *w1, *w2, *w3;  // w3 null: no attention
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
};

template <typename T>
void layer_step_team(const LayerView<T>& L, T* h, float* c_new) {
  const int64_t B = L.B, dp = L.dp, D = L.D, S = L.cached + 1, hd = L.dp / L.H;
  const bool attention = L.w3 != nullptr;
  // fp32 copies of the products' inputs for the generic kernel (bf16 without the dot
  // instruction); fp32 tensors are their own copies
  constexpr bool widen = std::is_same<T, BFloat16>::value && !kBf16Dot;
  const int threads = at::get_num_threads();
  const int64_t sq[2] = {dp, hd};
  const int64_t skv[3] = {L.kv_s0, hd, L.kv_s1};
  // a layer without attention plans no keys: no split, no part buffers, no scratch for them
  OneQuery<T> att(nullptr, L.kv, attention ? L.kv + dp : nullptr, nullptr, B, L.H,
                  attention ? S : 0, hd, sq, skv, skv,
                  1.f / std::sqrt(static_cast<float>(hd)), L.pad, L.pad_s0, L.cached,
                  threads);
  const int64_t widest = std::max(L.n_in, dp);
  const int64_t att_stride = (att.scratch() + 15) / 16 * 16;  // floats per thread
  auto floats = [](int64_t bytes) { return static_cast<size_t>((bytes + 63) / 64 * 16); };
  Workspace ws(floats(B * L.n_in * sizeof(T)) + 4 * floats(B * dp * sizeof(T)) +
               floats(B * L.kD * sizeof(T)) + floats(B * widest * 4) +
               floats((threads * att_stride + att.hd_pad) * 4));
  T* xin = L.pre ? ws.take<T>(B * L.n_in) : const_cast<T*>(L.x);
  T* q = ws.take<T>(B * dp);
  T* o = ws.take<T>(B * dp);
  T* y = ws.take<T>(B * dp);
  T* yn = ws.take<T>(B * dp);
  T* U = ws.take<T>(B * L.kD);
  float* wide = widen ? ws.take<float>(B * widest) : nullptr;
  float* att_scratch = ws.take<float>(threads * att_stride + att.hd_pad);
  att.q = q;
  att.o = o;
  // widen: `wide` = the next product's input in fp32 (thread 0, before a barrier)
  auto widen_input = [&](const T* in, int64_t n) {
    if (widen)
      for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<float>(in[i]);
  };
  // this thread's share of out (B rows ldo apart) = in (B, I) @ w (O, I)^T
  auto product = [&](int tid, int nt, const T* in, const T* w, int64_t I, int64_t O, T* out,
                     int64_t ldo) {
    const int64_t chunk = ((O + nt - 1) / nt + 3) / 4 * 4;
    const int64_t o0 = std::min(O, tid * chunk), o1 = std::min(O, o0 + chunk);
    if (o0 >= o1) return;
    if constexpr (std::is_same<T, float>::value) {
      linear_rows_range<T>(in, w, I, nullptr, out, ldo, B, I, o0, o1);
    } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
      linear_rows_bf16_dot_range(in, w, I, nullptr, out, ldo, B, I, o0, o1);
#else
      linear_rows_range<T>(wide, w, I, nullptr, out, ldo, B, I, o0, o1);
#endif
    }
  };
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (!omp_in_parallel())
#endif
  {
    const int nt = team_size(), tid = team_rank();
    if (tid == 0) {
      if (L.pre)
        layer_norm_rows<T>(L.x, L.ldx, L.norm_w, L.norm_b, L.norm_eps, xin, L.n_in, B, L.n_in);
      if (L.memory != nullptr)
        for (int64_t r = 0; r < B; ++r)
          std::memcpy(L.memory + r * L.mem_s0, xin + r * (L.pre ? L.n_in : L.ldx),
                      sizeof(T) * L.n_in);
      widen_input(xin, B * L.n_in);
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    product(tid, nt, xin, L.w1, L.n_in, dp, q, dp);                       // q (B, d')
#ifdef _OPENMP
#pragma omp barrier
#endif
    const T* u_in = q;
    if (attention) {
      if (widen) {
        if (tid == 0) widen_input(q, B * dp);
#ifdef _OPENMP
#pragma omp barrier
#endif
      }
      product(tid, nt, q, L.w2, dp, 2 * dp, L.kv + L.cached * L.kv_s1, L.kv_s0);  // [K | V]
#ifdef _OPENMP
#pragma omp barrier
#endif
      float* mine = att_scratch + tid * att_stride;
      for (int64_t t = tid; t < att.tasks(); t += nt) att.task(t, mine);
#ifdef _OPENMP
#pragma omp barrier
#endif
      u_in = y;
      if (tid == 0) {
        for (int64_t n = 0; n < att.NH; ++n) att.finish(n, att_scratch + threads * att_stride);
        residual<T>(q, o, L.alpha, y, B * dp);
      }
    }
    if (tid == 0) {
      if (L.attn_norm_w != nullptr) {
        layer_norm_rows<T>(u_in, dp, L.attn_norm_w, L.attn_norm_b, L.attn_norm_eps, yn, dp, B, dp);
        u_in = yn;
      }
      widen_input(u_in, B * dp);
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    // every thread reads the same choice thread 0 made (the norm is uniform)
    const T* u_src = L.attn_norm_w != nullptr ? yn : (attention ? y : q);
    product(tid, nt, u_src, attention ? L.w3 : L.w2, dp, L.kD, U, L.kD);  // U (B, k*D)
#ifdef _OPENMP
#pragma omp barrier
#endif
    const int64_t cols = ((D + nt - 1) / nt + kW - 1) / kW * kW;
    const int64_t j0 = std::min(D, tid * cols), j1 = std::min(D, j0 + cols);
    if (j0 < j1)
      recurrence_cols<T>(U, L.k, L.x, L.ldx, L.c, L.wc, L.bias, L.scale_x, h, c_new, D, 0, B,
                         j0, j1);
    if (L.post) {
#ifdef _OPENMP
#pragma omp barrier
#endif
      if (tid == 0) layer_norm_rows<T>(h, D, L.norm_w, L.norm_b, L.norm_eps, h, D, B, D);
    }
  }
}

// layer_step_cpu, with the projections' weights W1, W2, W3 optionally int8: `quant` says
// how (enum Quant) and scales[0..2] hold their scales (fp32, one per output feature).
std::tuple<Tensor, Tensor> layer_step_run(
    const Tensor& x, const Tensor& c, const Tensor& w1, const Tensor& w2,
    const std::optional<Tensor>& w3, const std::optional<Tensor>& alpha,
    const std::optional<Tensor>& norm_weight, const std::optional<Tensor>& norm_bias,
    const std::optional<Tensor>& attn_norm_weight, const std::optional<Tensor>& attn_norm_bias,
    const Tensor& weight_c, const Tensor& bias, const std::optional<Tensor>& kv,
    const std::optional<Tensor>& memory, const std::optional<Tensor>& memory_pad,
    int64_t kv_start, int64_t memory_start, int64_t cached, double norm_eps, double attn_norm_eps, double scale_x, int64_t num_heads,
    bool normalize_after, int64_t few_rows, int64_t quant, const std::optional<Tensor>* scales) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "srupp layer_step: float32 or bfloat16 tensors, got ", dt);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "srupp layer_step: x (B, n_in) contiguous");
  for (const Tensor* t : {&weight_c, &bias})
    TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous(),
                "srupp layer_step: weights contiguous, of x's dtype");
  TORCH_CHECK(quant == kFloatWeights || quant == kInt8 || quant == kW8A8,
              "srupp layer_step: quant must be 0 (float), 1 (int8) or 2 (w8a8)");
  const bool attention = w3.has_value() && w3->defined();
  const Tensor* proj[3] = {&w1, &w2, attention ? &*w3 : nullptr};
  const Tensor* wscale[3] = {nullptr, nullptr, nullptr};  // the projections' int8 scales
  for (int i = 0; i < 3; ++i) {
    if (proj[i] == nullptr) continue;
    if (quant == kFloatWeights) {
      TORCH_CHECK(proj[i]->scalar_type() == dt && proj[i]->is_contiguous(),
                  "srupp layer_step: weights contiguous, of x's dtype");
      continue;
    }
    TORCH_CHECK(proj[i]->scalar_type() == at::kChar && proj[i]->is_contiguous() &&
                    scales != nullptr && scales[i].has_value() && scales[i]->defined() &&
                    scales[i]->numel() == proj[i]->size(0),
                "srupp layer_step: quantized projections take contiguous int8 weights with "
                "one scale per output feature");
    wscale[i] = &*scales[i];
  }
  const int64_t B = x.size(0), D = weight_c.size(1);
  TORCH_CHECK(weight_c.dim() == 2 && weight_c.size(0) == 2 && D >= 1 &&
                  bias.numel() == 2 * D, "srupp layer_step: weight_c and bias (2, D), D >= 1");
  TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.size(0) == B &&
              c.size(1) == D, "srupp layer_step: c (B, D) float32 contiguous");
  const int64_t kD = (attention ? *w3 : w2).size(0), k = kD / D;
  TORCH_CHECK(kD % D == 0 && ((k == 3 && x.size(1) == D) || k == 4),
              "srupp layer_step: U must have 3 planes (n_in == D) or 4, got ", kD,
              " rows for D = ", D);
  const bool pre = !normalize_after && norm_weight.has_value() && norm_weight->defined();
  TORCH_CHECK(cached >= 0 && kv_start >= 0 && memory_start >= 0,
              "srupp layer_step: kv_start, memory_start and cached must be >= 0");
  const bool has_memory = memory.has_value() && memory->defined();
  if (has_memory) {
    TORCH_CHECK(memory->scalar_type() == dt && memory->dim() == 3 && memory->size(0) == B &&
                memory->size(2) == x.size(1) && memory->stride(2) == 1 &&
                memory_start + cached < memory->size(1),
                "srupp layer_step: memory (B, > memory_start + cached, n_in) of x's dtype, "
                "last dim contiguous");
  }
  const int64_t dp = w1.size(0);
  const int64_t S = cached + 1, H = num_heads, hd = H >= 1 ? dp / H : 0;  // keys: cached, then x's
  Tensor pad;  // (B, cached) bool, last dim contiguous, or undefined
  if (attention) {
    TORCH_CHECK(kv.has_value() && kv->defined() && kv->scalar_type() == dt && kv->dim() == 3 &&
                kv->size(0) == B && kv->size(2) == 2 * dp && kv->stride(2) == 1 &&
                kv_start + cached < kv->size(1),
                "srupp layer_step: kv (B, > kv_start + cached, 2*d') of x's dtype, last dim "
                "contiguous");
    TORCH_CHECK(H >= 1 && dp % H == 0, "srupp layer_step: num_heads must divide d'");
    TORCH_CHECK(alpha.has_value() && alpha->defined() && alpha->scalar_type() == dt &&
                alpha->numel() == 1, "srupp layer_step: alpha (1,) of x's dtype");
    if (memory_pad.has_value() && memory_pad->defined()) {
      TORCH_CHECK(memory_pad->scalar_type() == at::kBool && memory_pad->dim() == 2 &&
                  memory_pad->size(0) == B && memory_pad->size(1) == S - 1,
                  "srupp layer_step: memory_pad (B, M) bool");
      pad = memory_pad->stride(1) == 1 ? *memory_pad : memory_pad->contiguous();
    }
  }
  // the products' shapes (the one-region path reads the weights raw)
  const int64_t n_in = x.size(1);
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == n_in && w2.dim() == 2 && w2.size(1) == dp &&
                  w2.size(0) == (attention ? 2 * dp : kD) &&
                  (!attention || (w3->dim() == 2 && w3->size(1) == dp)),
              "srupp layer_step: w1 (d', n_in), w2 (2 d', d') and w3 (k D, d') with attention, "
              "w2 (k D, d') without; got ", w1.sizes(), " and ", w2.sizes());
  auto check_norm = [&](const std::optional<Tensor>& g, const std::optional<Tensor>& b,
                        int64_t n, const char* name) {
    if (!g.has_value() || !g->defined()) return;
    TORCH_CHECK(b.has_value() && b->defined() && g->numel() == n && b->numel() == n &&
                    g->scalar_type() == dt && b->scalar_type() == dt && g->is_contiguous() &&
                    b->is_contiguous(),
                "srupp layer_step: ", name, " weight and bias (", n, ",) of x's dtype");
  };
  check_norm(norm_weight, norm_bias, normalize_after ? D : n_in, "norm");
  check_norm(attn_norm_weight, attn_norm_bias, dp, "attn_norm");
  if (quant == kFloatWeights && B <= few_rows && team_enabled) {  // the one-region path
    Tensor h = at::empty({B, D}, x.options());
    Tensor c_new = at::empty({B, D}, c.options());
    SRUPP_DISPATCH_F32_BF16(dt, [&] {
      using T = scalar_t;
      LayerView<T> L;
      L.x = x.data_ptr<T>(); L.ldx = x.stride(0); L.B = B; L.n_in = x.size(1); L.D = D;
      L.dp = dp; L.kD = kD; L.k = k; L.H = attention ? H : 1; L.cached = cached;
      L.c = c.data_ptr<float>();
      L.w1 = w1.data_ptr<T>(); L.w2 = w2.data_ptr<T>();
      L.w3 = attention ? w3->data_ptr<T>() : nullptr;
      L.alpha = attention ? static_cast<float>(*alpha->data_ptr<T>()) : 0.f;
      L.norm_w = ptr_or_null<T>(norm_weight); L.norm_b = ptr_or_null<T>(norm_bias);
      L.attn_norm_w = ptr_or_null<T>(attn_norm_weight);
      L.attn_norm_b = ptr_or_null<T>(attn_norm_bias);
      L.norm_eps = static_cast<float>(norm_eps); L.attn_norm_eps = static_cast<float>(attn_norm_eps);
      L.scale_x = static_cast<float>(scale_x);
      L.pre = pre; L.post = normalize_after && L.norm_w != nullptr;
      L.wc = weight_c.data_ptr<T>(); L.bias = bias.data_ptr<T>();
      L.kv = attention ? kv->data_ptr<T>() + kv_start * kv->stride(1) : nullptr;
      L.kv_s0 = attention ? kv->stride(0) : 0; L.kv_s1 = attention ? kv->stride(1) : 0;
      L.memory = has_memory ? memory->data_ptr<T>() + (memory_start + cached) * memory->stride(1)
                            : nullptr;
      L.mem_s0 = has_memory ? memory->stride(0) : 0;
      L.pad = pad.defined() ? pad.data_ptr<bool>() : nullptr;
      L.pad_s0 = pad.defined() ? pad.stride(0) : 0;
      layer_step_team<T>(L, h.data_ptr<T>(), c_new.data_ptr<float>());
    });
    return {h, c_new};
  }
  const Tensor xin = pre ? maybe_norm(x, norm_weight, norm_bias, norm_eps) : x;  // (B, n_in)
  if (has_memory) write_row(*memory, memory_start + cached, xin);
  const Tensor q = project(xin, w1, few_rows, wscale[0], quant);                  // (B, d')
  Tensor U;
  if (attention) {
    write_row(*kv, kv_start + cached,
              project(q, w2, few_rows, wscale[1], quant).contiguous());           // new [K | V]
    Tensor o = at::empty({B, dp}, x.options());
    const int64_t sq[2] = {dp, hd};
    const int64_t sk[3] = {kv->stride(0), hd, kv->stride(1)};
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    Tensor y = at::empty({B, dp}, x.options());
    SRUPP_DISPATCH_F32_BF16(dt, [&] {
      const float a = static_cast<float>(*alpha->data_ptr<scalar_t>());
      const scalar_t* kvp = kv->data_ptr<scalar_t>() + kv_start * kv->stride(1);
      one_query_kernel<scalar_t>(q.data_ptr<scalar_t>(), kvp, kvp + dp, o.data_ptr<scalar_t>(),
                                 B, H, S, hd, sq, sk, sk, scale,
                                 pad.defined() ? pad.data_ptr<bool>() : nullptr,
                                 pad.defined() ? pad.stride(0) : 0, cached);
      residual<scalar_t>(q.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), a,
                         y.data_ptr<scalar_t>(), B * dp);
    });
    U = project(maybe_norm(y, attn_norm_weight, attn_norm_bias, attn_norm_eps), *w3,
                few_rows, wscale[2], quant);                                       // (B, k*D)
  } else {
    U = project(maybe_norm(q, attn_norm_weight, attn_norm_bias, attn_norm_eps), w2, few_rows,
                wscale[1], quant);
  }
  U = U.contiguous();
  Tensor h = at::empty({B, D}, x.options());
  Tensor c_new = at::empty({B, D}, c.options());
  SRUPP_DISPATCH_F32_BF16(dt, [&] {
    recurrence_step<scalar_t>(U.data_ptr<scalar_t>(), k, x.data_ptr<scalar_t>(), x.stride(0),
                              c.data_ptr<float>(), weight_c.data_ptr<scalar_t>(),
                              bias.data_ptr<scalar_t>(), static_cast<float>(scale_x),
                              h.data_ptr<scalar_t>(), c_new.data_ptr<float>(), B, D);
  });
  if (normalize_after) h = maybe_norm(h, norm_weight, norm_bias, norm_eps);
  return {h, c_new};
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
      x, c, w1, w2, w3, alpha, norm_weight, norm_bias, attn_norm_weight, attn_norm_bias,
      weight_c, bias, kv, memory, memory_pad, kv_start, memory_start, cached, norm_eps,
      attn_norm_eps, scale_x, num_heads, normalize_after, few_rows,
      layer_step_impl::kFloatWeights, nullptr);
}

namespace layer_step_impl {

using OptTensors = std::vector<std::optional<Tensor>>;

// A stack's per-layer arguments, as stack_step_cpu (below) documents them.
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
  const OptTensors& scales;
  const std::vector<int64_t>& quant;

  // the number of layers, after checking every list has its entries for c's layers
  size_t check(const Tensor& c, const char* op) const {
    TORCH_CHECK(c.dim() == 3 && c.scalar_type() == at::kFloat && c.is_contiguous(),
                "srupp ", op, ": c (layers, B, D) float32 contiguous");
    const auto n = static_cast<size_t>(c.size(0));
    TORCH_CHECK(weights.size() == 10 * n && kv.size() == n && memory.size() == n &&
                    norm_eps.size() == n && attn_norm_eps.size() == n && scale_x.size() == n &&
                    num_heads.size() == n && normalize_after.size() == n &&
                    scales.size() == 3 * n && quant.size() == n,
                "srupp ", op, ": 10 weights, 3 scales and one of each per-layer argument for "
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

  static bool has(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

  // One token x (B, n_in) through every layer, layer l at row offsets kv_start[l] and
  // memory_start[l] with `cached` rows before the token's: returns the last layer's h
  // (B, D) and writes each layer's new c into c_out (layers, B, D).
  Tensor run(const Tensor& x, const Tensor& c, Tensor& c_out,
             const std::optional<Tensor>& memory_pad, const int64_t* kv_start,
             const int64_t* memory_start, int64_t cached) const {
    Tensor h = x;
    for (size_t l = 0; l < memory.size(); ++l) {
      const std::optional<Tensor>* w = &weights[10 * l];
      auto [h_next, c_next] = layer_step_run(
          h, c.select(0, static_cast<int64_t>(l)), *w[0], *w[1], w[2], w[3], w[4], w[5], w[6],
          w[7], *w[8], *w[9], kv[l], memory[l], memory_pad, kv_start[l], memory_start[l],
          cached, norm_eps[l], attn_norm_eps[l], scale_x[l], num_heads[l],
          normalize_after[l] != 0, few_rows, quant[l], &scales[3 * l]);
      const int64_t BD = c_next.numel();
      std::memcpy(c_out.data_ptr<float>() + static_cast<int64_t>(l) * BD,
                  c_next.data_ptr<float>(), sizeof(float) * BD);
      h = std::move(h_next);
    }
    return h;
  }

  // The views rows start[l] + first .. + kept - 1 of each layer's memory and kv buffers
  // (None for a layer without a memory buffer).
  std::pair<OptTensors, OptTensors> views(const int64_t* kv_start, const int64_t* memory_start,
                                          int64_t first, int64_t kept) const {
    OptTensors mem_views(memory.size()), kv_views(memory.size());
    for (size_t l = 0; l < memory.size(); ++l) {
      if (!has(memory[l])) continue;
      mem_views[l] = memory[l]->narrow(1, memory_start[l] + first, kept);
      kv_views[l] = kv[l]->narrow(1, kv_start[l] + first, kept);
    }
    return {mem_views, kv_views};
  }
};

}  // namespace layer_step_impl

// A whole stack's decoding step: layer_step_cpu for each layer in turn, h feeding the
// next, in one call from Python (srupp/nn/srupp.py, _step_fused). Per layer, the Python
// loop, its argument passing and the views of the rows kept cost some 10 µs: a tenth of
// a small model's step. Layer l reads weights[10l .. 10l+9] (layer_step's w1, w2, w3,
// alpha, norm_weight, norm_bias, attn_norm_weight, attn_norm_bias, weight_c, bias), its
// buffers kv[l] and memory[l] (None: none) at row offsets kv_start[l] and
// memory_start[l], and its own scalars; `cached` and memory_pad are the stack's. quant[l]
// says how layer l's W1, W2, W3 are held (0 float, 1 int8, 2 w8a8: enum Quant above),
// and scales[3l .. 3l+2] hold their scales when they are int8 (else None).
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
               int64_t few_rows, const std::vector<std::optional<Tensor>>& scales,
               const std::vector<int64_t>& quant) {
  const layer_step_impl::Stack stack{weights, kv, memory, norm_eps, attn_norm_eps, scale_x,
                                     num_heads, normalize_after, few_rows, scales, quant};
  const size_t n = stack.check(c, "stack_step");
  TORCH_CHECK(kv_start.size() == n && memory_start.size() == n,
              "srupp stack_step: one kv_start and one memory_start per layer");
  TORCH_CHECK(first >= 0 && kept >= 0, "srupp stack_step: first and kept must be >= 0");
  Tensor c_out = at::empty_like(c);
  Tensor h = stack.run(x, c, c_out, memory_pad, kv_start.data(), memory_start.data(), cached);
  auto [mem_views, kv_views] = stack.views(kv_start.data(), memory_start.data(), first, kept);
  return {h, c_out, mem_views, kv_views};
}

namespace decode_impl {

// srupp.models.lm.sample, ATen op for ATen op, so that a seeded generator draws the
// very tokens the Python loop draws. top_k <= 0 and top_p outside (0, 1) are off.
Tensor sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
              const std::optional<at::Generator>& generator) {
  if (temperature == 0) return logits.argmax(-1);
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

// How the LM's output layer computes its logits at these rows, chosen in Python
// (srupp/models/lm.py, _output_route) by the rules its module's forward follows.
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

}  // namespace decode_impl

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
// Returns the tokens (B, t <= n) long, the new c, the next logits, and as stack_step
// each layer's memory and [K | V] views after the last step, and `shift`, how far the
// window moved every layer's first row (their views start at start[l] + shift).
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
                const std::vector<std::optional<Tensor>>& scales,
                const std::vector<int64_t>& quant, int64_t n, bool final, double temperature,
                int64_t top_k, double top_p, std::optional<at::Generator> generator,
                int64_t eos_id) {
  using layer_step_impl::Stack;
  const Stack stack{weights, kv, memory, norm_eps, attn_norm_eps, scale_x,
                    num_heads, normalize_after, few_rows, scales, quant};
  const size_t L = stack.check(c, "decode_loop");
  const int64_t B = c.size(1);
  TORCH_CHECK(kv_start.size() == L && memory_start.size() == L,
              "srupp decode_loop: one kv_start and one memory_start per layer");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == B && done.dim() == 1 &&
                  done.size(0) == B && done.scalar_type() == at::kBool && done.is_contiguous(),
              "srupp decode_loop: logits (B, V) and done (B,) bool contiguous");
  TORCH_CHECK(embedding.dim() == 2 && n >= 0 && cached >= 0,
              "srupp decode_loop: embedding (V, n_in), n >= 0 and cached >= 0");
  bool keep = false;  // whether the token's row stays in memory (else M stays 0)
  for (size_t l = 0; l < L; ++l) keep = keep || Stack::has(memory[l]);
  const bool has_pad = memory_pad.has_value() && memory_pad->defined();
  // the step after token t reads the pad of at most cached + t - 1 rows
  TORCH_CHECK(!has_pad || (memory_pad->dim() == 2 && memory_pad->size(0) == B &&
                           memory_pad->size(1) >= cached + n - 1),
              "srupp decode_loop: memory_pad (B, >= cached + n - 1) bool");
  std::vector<int64_t> ks(kv_start), ms(memory_start);  // where each layer's rows start now
  Tensor tokens = at::empty({B, n}, logits.options().dtype(at::kLong));
  Tensor next_logits = logits, c_cur = c;
  int64_t M = cached, shift = 0, t = 0;
  while (t < n) {
    const Tensor token = decode_impl::sample(next_logits, temperature, top_k, top_p, generator);
    tokens.select(1, t).copy_(token);
    ++t;
    if (eos_id >= 0) {
      done.logical_or_(token == eos_id);
      if (done.all().item<bool>()) break;
    }
    if (final && t == n) break;
    const Tensor x = at::embedding(embedding, token);                       // (B, n_in)
    std::optional<Tensor> pad;
    if (has_pad && M > 0) pad = memory_pad->narrow(1, shift, M);
    Tensor c_next = at::empty_like(c_cur);
    const Tensor h = stack.run(x, c_cur, c_next, pad, ks.data(), ms.data(), M);
    c_cur = std::move(c_next);
    next_logits = decode_impl::output(h, out_weight, out_bias, out_scale, out_route);
    if (keep) {  // the memory window after the token: its last `kept` rows
      const int64_t kept = mem_len < 0 ? M + 1 : std::min(M + 1, mem_len);
      const int64_t first = M + 1 - kept;
      for (size_t l = 0; l < L; ++l)
        if (Stack::has(memory[l])) { ks[l] += first; ms[l] += first; }
      shift += first;
      M = kept;
    }
  }
  auto [mem_views, kv_views] = stack.views(ks.data(), ms.data(), 0, M);
  return {tokens.narrow(1, 0, t), c_cur, next_logits, mem_views, kv_views, shift};
}

// Returns h (B, L, D) in U's dtype, c_last (B, D) fp32, and c_all (B, L, D) fp32 with
// the state after every step when store_c, else an empty tensor.
std::tuple<Tensor, Tensor, Tensor> sru_fwd_cpu(
    const Tensor& U, const std::optional<Tensor>& x, const Tensor& weight_c, const Tensor& bias,
    const std::optional<Tensor>& c0, const std::optional<Tensor>& mask_pad,
    const std::optional<Tensor>& dropout_mask, double scale_x, bool bidirectional, bool store_c) {
  Args a;
  Common cm = prepare(a, U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional);
  const bool nan = debug_nan_fill();
  const auto f32 = U.options().dtype(at::kFloat);
  Tensor h = maybe_nan(empty_out({a.B, a.L, a.D}, {}, U.scalar_type()), nan);
  Tensor c_last = maybe_nan(at::empty({a.B, a.D}, f32), nan);
  Tensor c_all = store_c ? maybe_nan(empty_out({a.B, a.L, a.D}, {}, at::kFloat), nan)
                         : at::empty({0}, f32);
  a.nt = stream_outputs(h.nbytes() + c_all.nbytes());
  a.h = h.data_ptr();
  a.c_last = c_last.data_ptr<float>();
  a.c_all = store_c ? c_all.data_ptr<float>() : nullptr;
  launch<false>(cm.U.scalar_type(), cm.x.defined() ? cm.x.scalar_type() : at::kFloat, cm.skip, a);
  return {h, c_last, c_all};
}

// Returns grad_U (U's shape and dtype), grad_x (x's dtype; empty when x is None or
// need_grad_x is false), grad_weight_c (2, D) and grad_bias (2, D) in their parameters'
// dtypes, and grad_c0 (B, D) fp32.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sru_bwd_cpu(
    const Tensor& U, const std::optional<Tensor>& x, const Tensor& weight_c, const Tensor& bias,
    const std::optional<Tensor>& c0, const std::optional<Tensor>& mask_pad,
    const std::optional<Tensor>& dropout_mask, const Tensor& c_all, const Tensor& grad_h,
    const std::optional<Tensor>& grad_c_last, double scale_x, bool bidirectional,
    bool need_grad_x) {
  Args a;
  Common cm = prepare(a, U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional);
  TORCH_CHECK(c_all.scalar_type() == at::kFloat && c_all.numel() == a.B * a.L * a.D,
              "srupp cpu kernel: the backward needs the forward's per-step state c_all "
              "(B, L, D) fp32; run the forward with store_c=True");
  Tensor c_all_c = c_all.contiguous();
  a.c_all_in = c_all_c.data_ptr<float>();
  TORCH_CHECK(grad_h.dim() == 3 && grad_h.size(0) == a.B && grad_h.size(1) == a.L &&
              grad_h.size(2) == a.D, "srupp cpu kernel: grad_h must be (B, L, D)");
  Tensor gh = last_dim_contiguous(grad_h.to(cm.U.scalar_type()));
  a.gh = gh.data_ptr(); a.sghb = gh.stride(0); a.sght = gh.stride(1);
  Tensor gcl;
  if (grad_c_last.has_value() && grad_c_last->defined()) {
    gcl = small_f32(*grad_c_last); a.gcl = gcl.data_ptr<float>();
  }
  const bool nan = debug_nan_fill();
  const auto f32 = U.options().dtype(at::kFloat);
  Tensor gU = maybe_nan(empty_like_dense(cm.U), nan);
  a.gU = gU.data_ptr(); a.sgUb = gU.stride(0); a.sgUt = gU.stride(1); a.sgUk = gU.stride(2);
  Tensor gx;
  if (cm.skip == kSkipX && need_grad_x) {
    gx = maybe_nan(empty_like_dense(cm.x), nan);
    a.gx = gx.data_ptr(); a.sgxb = gx.stride(0); a.sgxt = gx.stride(1);
  } else {
    gx = at::empty({0}, x.has_value() && x->defined() ? x->options() : U.options());
  }
  Tensor gc0 = maybe_nan(at::empty({a.B, a.D}, f32), nan);
  Tensor partial = maybe_nan(at::empty({a.B, 4, a.D}, f32), nan);
  a.gc0 = gc0.data_ptr<float>();
  a.partial = partial.data_ptr<float>();
  a.nt = stream_outputs(gU.nbytes() + (a.gx ? gx.nbytes() : 0));
  launch<true>(cm.U.scalar_type(), cm.x.defined() ? cm.x.scalar_type() : at::kFloat, cm.skip, a);

  // Reduce the per-row partial sums over B, serially in b for every column.
  Tensor red = maybe_nan(at::empty({4, a.D}, f32), nan);
  {
    const float* p = a.partial;
    float* o = red.data_ptr<float>();
    const int64_t cols = 4 * a.D, B = a.B;
    at::parallel_for(0, cols, 2048, [&](int64_t c0i, int64_t c1i) {
      for (int64_t c = c0i; c < c1i; ++c) o[c] = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        const float* pb = p + b * cols;
        for (int64_t c = c0i; c < c1i; ++c) o[c] += pb[c];
      }
    });
  }
  // Copies, so that no two outputs share storage.
  Tensor g_wc = red.narrow(0, 0, 2).to(weight_c.scalar_type(), false, true).view(weight_c.sizes());
  Tensor g_bias = red.narrow(0, 2, 2).to(bias.scalar_type(), false, true).view(bias.sizes());
  return {gU, gx, g_wc, g_bias, gc0};
}

// ---------------------------------------------------------------------------------
// int8 weights for decoding (srupp/ops/quant.py): y (R, O) = (x (R, I) @ Wq (O, I)^T) *
// scale (O) [+ bias (O)], Wq int8 with one scale per output feature (symmetric).
//
// Decoding reads every weight once per token, so one byte per weight instead of two or
// four is what makes it faster; the arithmetic must keep up with the bytes. Each task
// owns a range of output features and walks their rows of Wq once: 16 int8 weights are
// widened to fp32 in registers (vpmovsxbd + vcvtdq2ps) and multiplied into every row of
// x (x is converted to fp32 once; its rows stay in L1); the scale multiplies the sum
// once at the end. The activations stay fp32 or bf16 (weight-only quantization):
// VNNI's integer dot products would need int8 activations too, which changes the
// numbers. The plain loop below serves CPUs without AVX-512 (and the tests).

// The arguments of the int8 products below (linear_int8_rows, linear_w8a8_rows): x (R, I)
// fp32 or bf16, weight (O, I) int8 contiguous, scale (O,), bias (O,) or None. Returns
// whether there is a bias.
bool check_int8_product(const char* name, const Tensor& x, const Tensor& weight,
                        const Tensor& scale, const std::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "srupp ", name, ": x (R, I) and weight (O, I) expected, got ", x.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "srupp ", name, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "srupp ", name, ": weight must be a contiguous int8 tensor");
  TORCH_CHECK(scale.numel() == weight.size(0),
              "srupp ", name, ": scale must have one value per output feature");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == weight.size(0),
              "srupp ", name, ": bias must have one value per output feature");
  return has_bias;
}

namespace int8_rows {

template <typename T>
void store_row(T* y, int64_t o, float v) { y[o] = static_cast<T>(v); }

// One group of up to 8 rows of x, plain C++: the reference order of the sums is free.
template <typename T>
void plain(const float* x, int64_t R, const int8_t* w, int64_t I, const float* scale,
           const float* bias, T* y, int64_t O, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wr = w + o * I;
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * I;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 4 <= I; i += 4)
        for (int k = 0; k < 4; ++k) acc[k] += static_cast<float>(wr[i + k]) * xr[i + k];
      for (; i < I; ++i) acc[0] += static_cast<float>(wr[i]) * xr[i];
      float v = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * scale[o];
      if (bias != nullptr) v += bias[o];
      store_row(y + r * O, o, v);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kAvx512 = true;

// R rows of x at once (R fixed at compile time keeps the accumulators in registers);
// U independent accumulators per row hide the FMA latency when R is small.
template <int R, typename T>
void avx512(const float* x, const int8_t* w, int64_t I, const float* scale, const float* bias,
            T* y, int64_t O, int64_t o0, int64_t o1) {
  constexpr int U = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  constexpr int64_t kStep = 16 * U;
  const int tail = static_cast<int>(I % 16);
  const __mmask16 tail_mask = static_cast<__mmask16>((1u << tail) - 1);
  auto widen = [](const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wr = w + o * I;
    __m512 acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kStep <= I; i += kStep) {
      for (int u = 0; u < U; ++u) {
        const __m512 wv = widen(wr + i + 16 * u);
        for (int r = 0; r < R; ++r)
          acc[r][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * I + i + 16 * u), acc[r][u]);
      }
    }
    for (; i + 16 <= I; i += 16) {
      const __m512 wv = widen(wr + i);
      for (int r = 0; r < R; ++r)
        acc[r][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * I + i), acc[r][0]);
    }
    if (tail) {  // zeros beyond I multiply to zero
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail_mask, wr + i)));
      for (int r = 0; r < R; ++r)
        acc[r][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail_mask, x + r * I + i), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      __m512 s = acc[r][0];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[r][u]);
      float v = _mm512_reduce_add_ps(s) * scale[o];
      if (bias != nullptr) v += bias[o];
      store_row(y + r * O, o, v);
    }
  }
}

template <typename T>
void avx512_rows(const float* x, int64_t R, const int8_t* w, int64_t I, const float* scale,
                 const float* bias, T* y, int64_t O, int64_t o0, int64_t o1) {
  switch (R) {
    case 1: avx512<1>(x, w, I, scale, bias, y, O, o0, o1); break;
    case 2: avx512<2>(x, w, I, scale, bias, y, O, o0, o1); break;
    case 3: avx512<3>(x, w, I, scale, bias, y, O, o0, o1); break;
    case 4: avx512<4>(x, w, I, scale, bias, y, O, o0, o1); break;
    case 5: avx512<5>(x, w, I, scale, bias, y, O, o0, o1); break;
    case 6: avx512<6>(x, w, I, scale, bias, y, O, o0, o1); break;
    case 7: avx512<7>(x, w, I, scale, bias, y, O, o0, o1); break;
    default: avx512<8>(x, w, I, scale, bias, y, O, o0, o1); break;
  }
}
#else
constexpr bool kAvx512 = false;
#endif

template <typename T>
void run(const float* x, int64_t R, const int8_t* w, int64_t I, const float* scale,
         const float* bias, T* y, int64_t O, bool use_plain) {
  // a task reads at least ~64 KiB of Wq, so that 2 threads split a 256 x 256 product
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(I, 1));
  at::parallel_for(0, O, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {  // groups of 8 rows: each reads Wq once more
      const int64_t n = std::min<int64_t>(8, R - r0);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      if (!use_plain) {
        avx512_rows(x + r0 * I, n, w, I, scale, bias, y + r0 * O, O, o0, o1);
        continue;
      }
#endif
      plain(x + r0 * I, n, w, I, scale, bias, y + r0 * O, O, o0, o1);
    }
  });
}

}  // namespace int8_rows

// x (R, I) fp32 or bf16, contiguous; weight (O, I) int8, contiguous; scale (O,) and bias
// (O,) or None, fp32 or bf16. Returns y (R, O) in x's dtype. plain=True takes the plain
// loop even where AVX-512 is built in (for the tests).
Tensor linear_int8_rows_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale,
                            const std::optional<Tensor>& bias, bool plain) {
  const bool has_bias = check_int8_product("linear_int8_rows", x, weight, scale, bias);
  const int64_t R = x.size(0), I = x.size(1), O = weight.size(0);
  const Tensor xf = x.to(at::kFloat).contiguous();
  const Tensor sf = scale.to(at::kFloat).contiguous();
  const Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : Tensor();
  Tensor y = at::empty({R, O}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* b = has_bias ? bf.data_ptr<float>() : nullptr;
  const bool use_plain = plain || !int8_rows::kAvx512;
  if (x.scalar_type() == at::kFloat) {
    int8_rows::run<float>(xf.data_ptr<float>(), R, w, I, sf.data_ptr<float>(), b,
                          y.data_ptr<float>(), O, use_plain);
  } else {
    int8_rows::run<BFloat16>(xf.data_ptr<float>(), R, w, I, sf.data_ptr<float>(), b,
                             y.data_ptr<BFloat16>(), O, use_plain);
  }
  return y;
}

// Whether linear_int8_rows runs its AVX-512 loop (else the plain one).
bool linear_int8_rows_avx512() { return int8_rows::kAvx512; }

// ---------------------------------------------------------------------------------
// w8a8 for decoding (srupp/ops/quant.py, linear_w8a8): int8 weights and int8 activations,
// y (R, O) = (xq (R, I) . Wq (O, I)^T) * sx (R) * scale (O) [+ bias (O)], where each row
// of x is rounded to int8 with its own scale sx = max|x_row| / 127 at every call.
//
// The sums are exact integers, so every path below computes the same ones. VNNI's
// vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes per instruction, adding each
// group of 4 into an int32 lane: x goes in as xq + 128 (in [1, 255]) and the offset is
// taken back out with the weight row's own sum (the same instruction against ones), so
// each 64 weights cost one load and two instructions instead of widening to fp32. The
// plain loop sums xq * Wq in int32 directly.

namespace w8a8_rows {

// sx[r] and xq for each row of x (R, I) fp32; xq rows are padded to Ip with zeros. The
// rounding matches srupp.ops.quant._symmetric_rows: x / scale in fp32, half to even. A
// row holding inf or nan gets scale nan and zeros, so its outputs are nan.
void quantize(const float* x, int64_t R, int64_t I, int64_t Ip, int8_t* xq, float* sx) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * I;
    int8_t* qr = xq + r * Ip;
    float amax = 0.f;
    for (int64_t i = 0; i < I; ++i) amax = std::max(amax, std::fabs(xr[i]));
    std::fill(qr, qr + Ip, int8_t{0});
    bool finite = std::isfinite(amax);
    for (int64_t i = 0; i < I && finite; ++i) finite = !std::isnan(xr[i]);
    if (!finite) {
      sx[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    sx[r] = s;
    for (int64_t i = 0; i < I; ++i) {
      const float q = std::nearbyint(xr[i] / s);
      qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
    }
  }
}

template <typename T>
void finish(int32_t dot, float sx, float scale, const float* bias, int64_t o, T* y) {
  float v = static_cast<float>(dot) * (sx * scale);
  if (bias != nullptr) v += bias[o];
  y[o] = static_cast<T>(v);
}

template <typename T>
void plain(const int8_t* xq, int64_t R, int64_t Ip, const float* sx, const int8_t* w,
           int64_t I, const float* scale, const float* bias, T* y, int64_t O, int64_t o0,
           int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wr = w + o * I;
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * Ip;
      int32_t dot = 0;
      for (int64_t i = 0; i < I; ++i) dot += static_cast<int32_t>(xr[i]) * wr[i];
      finish(dot, sx[r], scale[o], bias, o, y + r * O);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;

// R rows at once (xu: xq + 128 as bytes); U accumulators per row hide vpdpbusd's latency
// when R is small.
template <int R, typename T>
void vnni(const uint8_t* xu, int64_t Ip, const float* sx, const int8_t* w, int64_t I,
          const float* scale, const float* bias, T* y, int64_t O, int64_t o0, int64_t o1) {
  constexpr int U = R == 1 ? 4 : (R >= 4 ? 1 : 2);
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t full = I / (64 * U) * (64 * U);
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wr = w + o * I;
    __m512i acc[R][U], accw[U];
    for (int u = 0; u < U; ++u) {
      accw[u] = _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) acc[r][u] = _mm512_setzero_si512();
    }
    int64_t i = 0;
    for (; i < full; i += 64 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512i wv = _mm512_loadu_si512(wr + i + 64 * u);
        accw[u] = _mm512_dpbusd_epi32(accw[u], ones, wv);
        for (int r = 0; r < R; ++r)
          acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], _mm512_loadu_si512(xu + r * Ip + i + 64 * u), wv);
      }
    }
    for (; i < I; i += 64) {  // the rest, the last block masked (zeros add nothing)
      const int64_t left = std::min<int64_t>(64, I - i);
      const __mmask64 m = left == 64 ? ~__mmask64{0} : ((__mmask64{1} << left) - 1);
      const __m512i wv = _mm512_maskz_loadu_epi8(m, wr + i);
      accw[0] = _mm512_dpbusd_epi32(accw[0], ones, wv);
      for (int r = 0; r < R; ++r)
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], _mm512_loadu_si512(xu + r * Ip + i), wv);
    }
    __m512i sw = accw[0];
    for (int u = 1; u < U; ++u) sw = _mm512_add_epi32(sw, accw[u]);
    const int32_t wsum = _mm512_reduce_add_epi32(sw);
    for (int r = 0; r < R; ++r) {
      __m512i s = acc[r][0];
      for (int u = 1; u < U; ++u) s = _mm512_add_epi32(s, acc[r][u]);
      finish(_mm512_reduce_add_epi32(s) - 128 * wsum, sx[r], scale[o], bias, o, y + r * O);
    }
  }
}

template <typename T>
void vnni_rows(const uint8_t* xu, int64_t R, int64_t Ip, const float* sx, const int8_t* w,
               int64_t I, const float* scale, const float* bias, T* y, int64_t O, int64_t o0,
               int64_t o1) {
  switch (R) {
    case 1: vnni<1>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    case 2: vnni<2>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    case 3: vnni<3>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    case 4: vnni<4>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    case 5: vnni<5>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    case 6: vnni<6>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    case 7: vnni<7>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
    default: vnni<8>(xu, Ip, sx, w, I, scale, bias, y, O, o0, o1); break;
  }
}
#else
constexpr bool kVnni = false;
#endif

template <typename T>
void run(const int8_t* xq, int64_t R, int64_t Ip, const float* sx, const int8_t* w,
         int64_t I, const float* scale, const float* bias, T* y, int64_t O, bool use_plain) {
  std::vector<uint8_t> xu;  // xq + 128 for vpdpbusd's unsigned operand
  if (!use_plain) {
    xu.resize(static_cast<size_t>(R * Ip));
    for (int64_t k = 0; k < R * Ip; ++k) xu[k] = static_cast<uint8_t>(xq[k] + 128);
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(I, 1));
  at::parallel_for(0, O, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {  // groups of 8 rows: each reads Wq once more
      const int64_t n = std::min<int64_t>(8, R - r0);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (!use_plain) {
        vnni_rows(xu.data() + r0 * Ip, n, Ip, sx + r0, w, I, scale, bias, y + r0 * O, O, o0, o1);
        continue;
      }
#endif
      plain(xq + r0 * Ip, n, Ip, sx + r0, w, I, scale, bias, y + r0 * O, O, o0, o1);
    }
  });
}

}  // namespace w8a8_rows

// x (R, I) fp32 or bf16; weight (O, I) int8, contiguous; scale (O,) and bias (O,) or None.
// Returns y (R, O) in x's dtype. plain=True takes the plain loop even where VNNI is built.
Tensor linear_w8a8_rows_cpu(const Tensor& x, const Tensor& weight, const Tensor& scale,
                            const std::optional<Tensor>& bias, bool plain) {
  const bool has_bias = check_int8_product("linear_w8a8_rows", x, weight, scale, bias);
  TORCH_CHECK(x.size(1) <= 65536,
              "srupp linear_w8a8_rows: at most 65536 input features (its sums are int32); "
              "quantize such a layer with int8 (weights only) instead");
  const int64_t R = x.size(0), I = x.size(1), O = weight.size(0);
  const int64_t Ip = (I + 63) / 64 * 64;
  const Tensor xf = x.to(at::kFloat).contiguous();
  const Tensor sf = scale.to(at::kFloat).contiguous();
  const Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : Tensor();
  std::vector<int8_t> xq(static_cast<size_t>(R * Ip));
  std::vector<float> sx(static_cast<size_t>(R));
  w8a8_rows::quantize(xf.data_ptr<float>(), R, I, Ip, xq.data(), sx.data());
  Tensor y = at::empty({R, O}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* b = has_bias ? bf.data_ptr<float>() : nullptr;
  const bool use_plain = plain || !w8a8_rows::kVnni;
  if (x.scalar_type() == at::kFloat) {
    w8a8_rows::run<float>(xq.data(), R, Ip, sx.data(), w, I, sf.data_ptr<float>(), b,
                          y.data_ptr<float>(), O, use_plain);
  } else {
    w8a8_rows::run<BFloat16>(xq.data(), R, Ip, sx.data(), w, I, sf.data_ptr<float>(), b,
                             y.data_ptr<BFloat16>(), O, use_plain);
  }
  return y;
}

// Whether linear_w8a8_rows runs its VNNI loop (else the plain one).
bool linear_w8a8_rows_vnni() { return w8a8_rows::kVnni; }

std::string capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

// srupp::layer_step is a dispatcher op (its schema, fake kernel and reference live in
// srupp/ops/layer_step.py, which defines the schema before this library loads): eager
// calls reach this kernel through C++ only.
TORCH_LIBRARY_IMPL(srupp, CPU, m) { m.impl("layer_step", &layer_step_cpu); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "srupp: fused multithreaded CPU kernels of the SRU recurrence";
  m.def("sru_fwd", &sru_fwd_cpu, "SRU recurrence forward (CPU)");
  m.def("sru_bwd", &sru_bwd_cpu, "SRU recurrence backward (CPU)");
  m.def("linear_rows", &linear_rows_cpu, "x @ weight^T (+ bias) for a few rows (decoding)");
  m.def("stack_step", &stack_step_cpu,
        "an SRU++ stack's decoding step: layer_step for each layer, in one call");
  m.def("decode_loop", &decode_loop_cpu,
        "up to n tokens of an LM with an SRU++ stack: sample, embed, stack_step, output");
  m.def("attend_one_query", &attend_one_query_cpu,
        "softmax(scale q K^T) V for one query per (batch, head) (decoding)");
  m.def("linear_rows_bf16_native", &linear_rows_bf16_native,
        "whether linear_rows' bf16 products use AVX512-BF16 dot products");
  m.def("linear_int8_rows", &linear_int8_rows_cpu,
        "(x @ int8 weight^T) * scale (+ bias) for a few rows (decoding)");
  m.def("linear_int8_rows_avx512", &linear_int8_rows_avx512,
        "whether linear_int8_rows runs its AVX-512 loop");
  m.def("linear_w8a8_rows", &linear_w8a8_rows_cpu,
        "(int8 x per row . int8 weight^T) * scales (+ bias) for a few rows (decoding)");
  m.def("linear_w8a8_rows_vnni", &linear_w8a8_rows_vnni,
        "whether linear_w8a8_rows runs its VNNI loop");
  m.def("empty_cache", []() { return static_cast<int64_t>(BlockCache::get().release()); },
        "free the cached output blocks; returns the bytes released");
  m.def("set_cache_limit", [](int64_t bytes) { BlockCache::get().set_cap(static_cast<size_t>(std::max<int64_t>(0, bytes))); },
        "most bytes of freed output blocks to keep for reuse (0: none)");
  m.def("cache_limit", []() { return static_cast<int64_t>(BlockCache::get().cap()); },
        "current limit of the output-block cache, in bytes");
  m.def("cached_bytes", []() { return static_cast<int64_t>(BlockCache::get().cached()); },
        "bytes held in the output-block cache");
  m.def("capability", &capability, "vector ISA the extension was compiled for");
  m.def("set_layer_step_team", [](bool on) { layer_step_impl::team_enabled = on; },
        "tests: whether a layer's step at few rows runs in one parallel region (default on)");
  m.def("vector_width", []() { return static_cast<int64_t>(kW); }, "floats per vector");
}
