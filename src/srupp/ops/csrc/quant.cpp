// int8 weights for decoding (srupp/ops/quant.py): the few-rows products with int8 weights
// and float activations (linear_int8_rows, here) or int8 activations (linear_w8a8_rows,
// further down).
//
// int8: y (R, O) = (x (R, I) @ Wq (O, I)^T) * scale (O) [+ bias (O)], Wq int8 with one
// scale per output feature (symmetric).
//
// Decoding reads every weight once per token, so one byte per weight instead of two or
// four is what makes it faster; the arithmetic must keep up with the bytes. Each task
// owns a range of output features and walks their rows of Wq once: 16 int8 weights are
// widened to fp32 in registers (vpmovsxbd + vcvtdq2ps) and multiplied into every row of
// x (x is converted to fp32 once; its rows stay in L1); the scale multiplies the sum
// once at the end. The activations stay fp32 or bf16 (weight-only quantization):
// VNNI's integer dot products would need int8 activations too, which changes the
// numbers. The plain loop below serves CPUs without AVX-512 (and the tests).

#include "common.h"

namespace srupp_cpu {
namespace {

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

}  // namespace

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

}  // namespace srupp_cpu
