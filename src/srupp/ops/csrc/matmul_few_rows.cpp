// Few-row projections for decoding: y (R, O) = x (R, I) @ W (O, I)^T [+ bias].
//
// At one token per sequence a decode step is a chain of matrix-vector products, each
// reading its weight once; BLAS's GEMM treats a 1-row product as a small GEMM and
// reaches a fraction of the memory bandwidth. Here each task owns a range of output
// features and walks their rows of W once, with one dot product per row of x (x is
// converted to fp32 once; its rows stay in L1), four vector accumulators each. fp32 or
// bf16 (x, W and bias of one dtype); sums in fp32; the output rounds to the input dtype.

#include "common.h"

namespace srupp_cpu {

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

template void linear_rows_range<float>(const float*, const float*, int64_t, const float*, float*,
                                       int64_t, int64_t, int64_t, int64_t, int64_t);
template void linear_rows_range<BFloat16>(const float*, const BFloat16*, int64_t, const BFloat16*,
                                          BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t);

namespace {

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

}  // namespace

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
namespace {

inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {  // (sum a0, .., sum a3)
  auto half = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)),
                                  _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

}  // namespace

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

namespace {

void linear_rows_bf16_dot(const BFloat16* x, const BFloat16* w, int64_t ldw,
                          const BFloat16* bias, BFloat16* y, int64_t R, int64_t I, int64_t O) {
  at::parallel_for(0, O, rows_grain(I, 2), [&](int64_t o0, int64_t o1) {
    linear_rows_bf16_dot_range(x, w, ldw, bias, y, O, R, I, o0, o1);
  });
}

}  // namespace
#endif

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

}  // namespace srupp_cpu
