// The fused SRU element-wise recurrence on the CPU, forward and backward (sru_fwd,
// sru_bwd; srupp/ops/recurrence.py runs them as its "cpu" backend). common.h lists the
// other kernel families.
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
// on the thread count. (The decoding attention, attention_one_query.cpp, cuts keys into
// fixed blocks from the newest key, so it too depends on neither the thread count nor
// the batch.)
//
// Memory. The loops are bandwidth-bound, so the big outputs (h, the stored c, grad_U,
// grad_x) are written with streaming stores when they are too large to stay in cache,
// and are allocated on 2 MiB pages from a small cache of freed blocks (HugePageAllocator,
// below): fresh 4 KiB pages would cost more in faults and zeroing than the recurrence
// itself.
//
// Debugging. With the environment variable SRUPP_DEBUG_NAN_FILL=1 (read at every call,
// as the Triton kernels read it) every output buffer is filled with NaN before the kernel
// writes it, so an element that is never written shows up in the tests.

#include "common.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace srupp_cpu {
namespace {

constexpr int64_t kMaxChunk = 512;         // units per task at most (state arrays fit L1)
static_assert(kMaxChunk % 16 == 0, "kMaxChunk must be a multiple of every vector width");

// ---------------------------------------------------------------------------------
// Streaming stores, and the loads and stores of a whole or partial vector.

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

}  // namespace

// The cache of freed blocks, for srupp.ops.cpu_kernels.
size_t empty_cache() { return BlockCache::get().release(); }
void set_cache_limit(size_t bytes) { BlockCache::get().set_cap(bytes); }
size_t cache_limit() { return BlockCache::get().cap(); }
size_t cached_bytes() { return BlockCache::get().cached(); }


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

}  // namespace srupp_cpu
