// Hand-written CPU loops of the point-wise normalizers gamma * f(alpha * x + s) + beta and of RMSNorm, in
// float32 and float64 (normexp/norms/kernels/native.py builds and loads this file). One pass each way: the
// backward computes dL/dx and accumulates the per-channel sums of the parameters' gradients in the same loop,
// which torch.compile's CPU code generator does not fuse (it emits one loop per output).
//
// Every function f supplies its value f(u) and its slope f'(u, t = f(u)), mirroring
// normexp/norms/kernels/pointwise.py:FUNCTIONS, which the tests check it against; the function-property
// options (Derf, arXiv 2512.10938, Sec. 3 and 7) are applied around it as pointwise.py:transformed does.

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include <omp.h>

namespace {

template <class T> inline T sgn(T u) { return T(u > T(0)) - T(u < T(0)); }
template <class T> inline T inside(T v, T low, T high) { return (v > low && v < high) ? T(1) : T(0); }
template <class T> inline T nonzero(T u) { return u != T(0) ? T(1) : T(0); }
template <class T> inline T clamp(T v, T low, T high) { return v < low ? low : (v > high ? high : v); }

// tanh and erf as the odd rational functions of pointwise.py (fast_tanh, fast_erf)
template <class T> inline T fast_tanh(T z) {
  z = clamp(z, T(-9), T(9));
  const T s = z * z;
  T p = T(1.3184672548e-08);
  p = p * s + T(2.0472125529e-05); p = p * s + T(0.0034865983045); p = p * s + T(0.13373210947);
  p = p * s + T(0.99999990631);
  T q = T(7.7028391063e-07);
  q = q * s + T(0.00032714133389); q = q * s + T(0.025842039893); q = q * s + T(0.46706507791); q = q * s + T(1);
  return z * p / q;
}

template <class T> inline T fast_erf(T z) {
  z = clamp(z, T(-3.92), T(3.92));
  const T s = z * z;
  T p = T(-1.0883767249e-08);
  p = p * s + T(4.2703968976e-06); p = p * s + T(0.000363434369); p = p * s + T(0.0037526428218);
  p = p * s + T(0.053798876744); p = p * s + T(0.18389709003); p = p * s + T(1.1283791754);
  T q = T(5.9239031228e-05);
  q = q * s + T(0.00126638203); q = q * s + T(0.015210239557); q = q * s + T(0.11311338814);
  q = q * s + T(0.49630801902); q = q * s + T(1);
  return z * p / q;
}

template <class T> inline T power23(T u) { return sgn(u) * std::exp(std::log(std::fabs(u)) * T(2.0 / 3.0)); }
template <class T> inline T saturlog(T u) {
  const T l = std::log(std::fabs(u) + T(1));
  return sgn(u) * l / (l + T(1));
}

constexpr double kPi = 3.14159265358979323846;
constexpr double kTwoOverSqrtPi = 1.12837916709551257390;

// One struct per f: value(u) and slope(u, t). The list below names them in the order ids are given.
#define POINT_FUNCTION(NAME, VALUE, SLOPE)                         \
  struct NAME {                                                    \
    template <class T> static inline T value(T u) { return VALUE; } \
    template <class T> static inline T slope(T u, T t) { (void)t; return SLOPE; } \
  };

POINT_FUNCTION(Tanh, fast_tanh(u), T(1) - t * t)
POINT_FUNCTION(Sigmoid, T(0.5) + T(0.5) * fast_tanh(T(0.5) * u), t * (T(1) - t))
POINT_FUNCTION(Hardtanh, clamp(u, T(-1), T(1)), inside(u, T(-1), T(1)))
POINT_FUNCTION(Identity, u, T(1))
POINT_FUNCTION(Erf, fast_erf(u), T(kTwoOverSqrtPi) * std::exp(-u * u))
POINT_FUNCTION(Satursin, std::sin(clamp(u, T(-kPi / 2), T(kPi / 2))),
               std::cos(u) * inside(u, T(-kPi / 2), T(kPi / 2)))
POINT_FUNCTION(Isru, u / std::sqrt(u * u + T(1)), T(1) / ((u * u + T(1)) * std::sqrt(u * u + T(1))))
POINT_FUNCTION(Expsign, sgn(u) * (T(1) - std::exp(-std::fabs(u))), nonzero(u) * std::exp(-std::fabs(u)))
POINT_FUNCTION(Smoothsign, u / (T(1) + std::fabs(u)), T(1) / ((T(1) + std::fabs(u)) * (T(1) + std::fabs(u))))
POINT_FUNCTION(Relsign, u / (std::sqrt(u * u + T(1)) + T(1)),
               T(1) / (std::sqrt(u * u + T(1)) * (std::sqrt(u * u + T(1)) + T(1))))
POINT_FUNCTION(Cubsign, u * u * u / (std::fabs(u) * u * u + T(1)),
               T(3) * u * u / ((std::fabs(u) * u * u + T(1)) * (std::fabs(u) * u * u + T(1))))
POINT_FUNCTION(Exproot, sgn(u) * (T(1) - std::exp(-std::sqrt(std::fabs(u)))),
               nonzero(u) * std::exp(-std::sqrt(std::fabs(u))) / (T(2) * std::sqrt(std::fabs(u))))
POINT_FUNCTION(Saturlog, saturlog(u), nonzero(u) * (T(1) - std::fabs(t)) * (T(1) - std::fabs(t)) / (std::fabs(u) + T(1)))
POINT_FUNCTION(Arctan, std::atan(u) * T(2 / kPi), T(2 / kPi) / (T(1) + u * u))
POINT_FUNCTION(LinearClip, clamp(u, T(-1), T(1)), inside(t, T(-1), T(1)))
POINT_FUNCTION(Power23Clip, clamp(power23(u), T(-1), T(1)), inside(t, T(-1), T(1)) * T(2.0 / 3.0) * t / u)
POINT_FUNCTION(LogsignClip, clamp(sgn(u) * std::log(std::fabs(u) + T(1)), T(-1), T(1)),
               inside(t, T(-1), T(1)) * nonzero(u) / (std::fabs(u) + T(1)))
POINT_FUNCTION(SmoothsignClip, clamp(u / (T(1) + std::fabs(u)), T(-1), T(1)),
               inside(t, T(-1), T(1)) / ((T(1) + std::fabs(u)) * (T(1) + std::fabs(u))))
POINT_FUNCTION(LogquadClip, clamp(sgn(u) * std::log(u * u + T(1)), T(-1), T(1)),
               inside(t, T(-1), T(1)) * T(2) * std::fabs(u) / (u * u + T(1)))
POINT_FUNCTION(ArcsinhClip, clamp(std::asinh(u), T(-1), T(1)), inside(t, T(-1), T(1)) / std::sqrt(u * u + T(1)))
POINT_FUNCTION(Arcsinh, std::asinh(u), T(1) / std::sqrt(u * u + T(1)))
POINT_FUNCTION(Logsign, sgn(u) * std::log(std::fabs(u) + T(1)), nonzero(u) / (std::fabs(u) + T(1)))
POINT_FUNCTION(Logquad, sgn(u) * std::log(u * u + T(1)), T(2) * std::fabs(u) / (u * u + T(1)))
POINT_FUNCTION(Power23, power23(u), T(2.0 / 3.0) * t / u)
// cos(u) as sin(u + pi/2): a sin and a cos of one argument become one scalar sincos call, which does not vectorize
POINT_FUNCTION(Sin, std::sin(u), std::sin(u + T(kPi / 2)))
POINT_FUNCTION(Dampx, T(2) * u / (T(1) + u * u), T(2) * (T(1) - u * u) / ((T(1) + u * u) * (T(1) + u * u)))
POINT_FUNCTION(Dampexp, T(2.72) * u * std::exp(-std::fabs(u)), T(2.72) * std::exp(-std::fabs(u)) * (T(1) - std::fabs(u)))

// X(struct, name): the names are pointwise.py's FUNCTIONS keys ("linear" is the identity under its Table 2 name)
#define FUNCTION_LIST(X)                                                                                    \
  X(Tanh, "tanh") X(Sigmoid, "sigmoid") X(Hardtanh, "hardtanh") X(Identity, "identity") X(Erf, "erf")      \
  X(Satursin, "satursin") X(Isru, "isru") X(Expsign, "expsign") X(Smoothsign, "smoothsign")               \
  X(Relsign, "relsign") X(Cubsign, "cubsign") X(Exproot, "exproot") X(Saturlog, "saturlog")               \
  X(Arctan, "arctan") X(LinearClip, "linear_clip") X(Power23Clip, "power23_clip")                        \
  X(LogsignClip, "logsign_clip") X(SmoothsignClip, "smoothsign_clip") X(LogquadClip, "logquad_clip")      \
  X(ArcsinhClip, "arcsinh_clip") X(Arcsinh, "arcsinh") X(Logsign, "logsign") X(Logquad, "logquad")        \
  X(Power23, "power23") X(Identity, "linear") X(Sin, "sin") X(Dampx, "dampx") X(Dampexp, "dampexp")

#define NAME_OF(S, N) N,
const char* const kFunctionNames[] = {FUNCTION_LIST(NAME_OF)};
#undef NAME_OF
constexpr int kFunctionCount = sizeof(kFunctionNames) / sizeof(kFunctionNames[0]);

// pointwise.py:PointOptions, read from a double[8]: prescale, flat, clip (or NaN for none), negate, blend,
// output_shift, plus whether any differs from its default (else the plain f, no extra arithmetic)
template <class T> struct Options {
  T prescale, flat, clip, sign, blend, output_shift;
  bool has_flat, has_clip;
  explicit Options(const double* o)
      : prescale(T(o[0])), flat(T(o[1])), clip(std::isnan(o[2]) ? T(0) : T(o[2])), sign(o[3] != 0 ? T(-1) : T(1)),
        blend(T(o[4])), output_shift(T(o[5])), has_flat(o[1] != 0), has_clip(!std::isnan(o[2])) {}
};

// g(u) and g'(u): f under the options (pointwise.py:transformed); GENERAL false is the plain f
template <class F, bool GENERAL, class T> inline T value(T u, const Options<T>& o) {
  if (!GENERAL) return F::value(u);
  T v = u * o.prescale;
  if (o.has_flat) v = (v - o.flat * sgn(v)) * T(std::fabs(v) > o.flat);
  T y = F::value(v);
  if (o.has_clip) y = clamp(y, -o.clip, o.clip);
  return (T(1) - o.blend) * (o.sign * y) + o.blend * v + o.output_shift;
}

template <class F, bool GENERAL, class T> inline T value_and_slope(T u, const Options<T>& o, T* slope) {
  if (!GENERAL) {
    const T t = F::value(u);
    *slope = F::slope(u, t);
    return t;
  }
  T v = u * o.prescale, outside = T(1);
  if (o.has_flat) {
    outside = T(std::fabs(v) > o.flat);
    v = (v - o.flat * sgn(v)) * outside;
  }
  const T t = F::value(v);
  T y = t, g = F::slope(v, t);
  if (o.has_clip) {
    y = clamp(t, -o.clip, o.clip);
    g = g * inside(t, -o.clip, o.clip);
  }
  *slope = ((T(1) - o.blend) * (o.sign * g) + o.blend) * outside * o.prescale;
  return (T(1) - o.blend) * (o.sign * y) + o.blend * v + o.output_shift;
}

// The layout: x is (outer, C, inner), contiguous; channels last is inner == 1.
struct Shape {
  int64_t outer, channels, inner;
};

template <class F, bool GENERAL, class T>
void pointwise_forward(const T* __restrict x, T* __restrict y, Shape n, T alpha, const T* __restrict shift,
                       const T* __restrict w, const T* __restrict b, const Options<T>& o, int threads) {
  const int64_t C = n.channels;
  if (n.inner == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n.outer; ++r) {
      const T* __restrict xr = x + r * C;
      T* __restrict yr = y + r * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = w[c] * value<F, GENERAL>(alpha * xr[c] + shift[c], o) + b[c];
    }
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t rc = 0; rc < n.outer * C; ++rc) {
    const int64_t c = rc % C;
    const T wc = w[c], bc = b[c], sc = shift[c];
    const T* __restrict xr = x + rc * n.inner;
    T* __restrict yr = y + rc * n.inner;
#pragma omp simd
    for (int64_t s = 0; s < n.inner; ++s) yr[s] = wc * value<F, GENERAL>(alpha * xr[s] + sc, o) + bc;
  }
}

constexpr int64_t kRowBlock = 32;  // rows summed in T before they join the thread's float64 sums

// dL/dx and the parameters' gradients from the per-channel sums (float64) of g_u * x, g_u, dL/dy * g(u) and
// dL/dy (g_u = dL/dy * g'(u)): grads = [dL/dalpha, dL/dshift (shift_size: 1 or C), dL/dgamma (C), dL/dbeta (C)]
template <class F, bool GENERAL, class T>
void pointwise_backward(const T* __restrict gy, const T* __restrict x, T* __restrict gx, T* __restrict grads,
                        Shape n, T alpha, const T* __restrict shift, int64_t shift_size, const T* __restrict w,
                        const Options<T>& o, int threads) {
  const int64_t C = n.channels;
  std::vector<double> partial(static_cast<size_t>(threads) * 4 * C, 0.0);
#pragma omp parallel num_threads(threads)
  {
    double* __restrict mine = partial.data() + static_cast<size_t>(omp_get_thread_num()) * 4 * C;
    if (n.inner == 1) {
      std::vector<T> block(4 * C);
      T* __restrict s_ux = block.data();
      T* __restrict s_u = s_ux + C;
      T* __restrict s_yt = s_u + C;
      T* __restrict s_y = s_yt + C;
#pragma omp for schedule(static)
      for (int64_t r0 = 0; r0 < n.outer; r0 += kRowBlock) {
        std::fill(block.begin(), block.end(), T(0));
        const int64_t r1 = r0 + kRowBlock < n.outer ? r0 + kRowBlock : n.outer;
        for (int64_t r = r0; r < r1; ++r) {
          const T* __restrict gr = gy + r * C;
          const T* __restrict xr = x + r * C;
          T* __restrict gxr = gx + r * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) {
            T slope;
            const T xv = xr[c], g = gr[c];
            const T t = value_and_slope<F, GENERAL>(alpha * xv + shift[c], o, &slope);
            const T gu = g * slope;
            gxr[c] = gu * (w[c] * alpha);
            s_ux[c] += gu * xv;
            s_u[c] += gu;
            s_yt[c] += g * t;
            s_y[c] += g;
          }
        }
        for (int64_t i = 0; i < 4 * C; ++i) mine[i] += block[i];
      }
    } else {
#pragma omp for schedule(static)
      for (int64_t rc = 0; rc < n.outer * C; ++rc) {
        const int64_t c = rc % C;
        const T wa = w[c] * alpha, sc = shift[c];
        const T* __restrict gr = gy + rc * n.inner;
        const T* __restrict xr = x + rc * n.inner;
        T* __restrict gxr = gx + rc * n.inner;
        T a_ux = 0, a_u = 0, a_yt = 0, a_y = 0;
#pragma omp simd reduction(+ : a_ux, a_u, a_yt, a_y)
        for (int64_t s = 0; s < n.inner; ++s) {
          T slope;
          const T xv = xr[s], g = gr[s];
          const T t = value_and_slope<F, GENERAL>(alpha * xv + sc, o, &slope);
          const T gu = g * slope;
          gxr[s] = gu * wa;
          a_ux += gu * xv;
          a_u += gu;
          a_yt += g * t;
          a_y += g;
        }
        mine[c] += a_ux;
        mine[C + c] += a_u;
        mine[2 * C + c] += a_yt;
        mine[3 * C + c] += a_y;
      }
    }
  }
  std::vector<double> sums(4 * C, 0.0);
  for (int t = 0; t < threads; ++t)
    for (int64_t i = 0; i < 4 * C; ++i) sums[i] += partial[static_cast<size_t>(t) * 4 * C + i];
  double g_alpha = 0, g_shift = 0;
  for (int64_t c = 0; c < C; ++c) {
    g_alpha += w[c] * sums[c];
    g_shift += w[c] * sums[C + c];
    if (shift_size != 1) grads[1 + c] = T(w[c] * sums[C + c]);
    grads[1 + shift_size + c] = T(sums[2 * C + c]);
    grads[1 + shift_size + C + c] = T(sums[3 * C + c]);
  }
  grads[0] = T(g_alpha);
  if (shift_size == 1) grads[1] = T(g_shift);
}

template <class T>
void forward_dispatch(int fn, const T* x, T* y, Shape n, T alpha, const T* shift, const T* w, const T* b,
                      const double* options, int threads) {
  const Options<T> o(options);
  const bool general = options[6] != 0;
  int id = 0;
#define CASE(S, N)                                                                                  \
  if (fn == id++) {                                                                                 \
    if (general) pointwise_forward<S, true>(x, y, n, alpha, shift, w, b, o, threads);               \
    else pointwise_forward<S, false>(x, y, n, alpha, shift, w, b, o, threads);                      \
    return;                                                                                         \
  }
  FUNCTION_LIST(CASE)
#undef CASE
}

template <class T>
void backward_dispatch(int fn, const T* gy, const T* x, T* gx, T* grads, Shape n, T alpha, const T* shift,
                       int64_t shift_size, const T* w, const double* options, int threads) {
  const Options<T> o(options);
  const bool general = options[6] != 0;
  int id = 0;
#define CASE(S, N)                                                                                  \
  if (fn == id++) {                                                                                 \
    if (general) pointwise_backward<S, true>(gy, x, gx, grads, n, alpha, shift, shift_size, w, o, threads); \
    else pointwise_backward<S, false>(gy, x, gx, grads, n, alpha, shift, shift_size, w, o, threads);       \
    return;                                                                                         \
  }
  FUNCTION_LIST(CASE)
#undef CASE
}

// RMSNorm (Zhang & Sennrich, arXiv 1910.07467): y = x * rstd * w, rstd = 1 / sqrt(sum_c x^2 / C + eps);
// sum_square (outer, inner) is saved for the backward, as rms.py's compiled path saves it
template <class T>
void rms_forward(const T* __restrict x, T* __restrict y, T* __restrict sum_square, Shape n, const T* __restrict w,
                 T eps, int threads) {
  const int64_t C = n.channels, inner = n.inner;
  if (inner == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n.outer; ++r) {
      const T* __restrict xr = x + r * C;
      T* __restrict yr = y + r * C;
      T ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
      sum_square[r] = ss;
      const T rstd = T(1) / std::sqrt(ss / T(C) + eps);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * rstd * w[c];
    }
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < n.outer; ++o) {
    const T* __restrict xo = x + o * C * inner;
    T* __restrict yo = y + o * C * inner;
    T* __restrict ss = sum_square + o * inner;
    std::fill(ss, ss + inner, T(0));
    for (int64_t c = 0; c < C; ++c) {
#pragma omp simd
      for (int64_t s = 0; s < inner; ++s) ss[s] += xo[c * inner + s] * xo[c * inner + s];
    }
    std::vector<T> rstd(inner);
    for (int64_t s = 0; s < inner; ++s) rstd[s] = T(1) / std::sqrt(ss[s] / T(C) + eps);
    for (int64_t c = 0; c < C; ++c) {
#pragma omp simd
      for (int64_t s = 0; s < inner; ++s) yo[c * inner + s] = xo[c * inner + s] * rstd[s] * w[c];
    }
  }
}

// dL/dx = rstd * (g - x_hat * sum_c(g * x_hat) / C), g = dL/dy * w, x_hat = x * rstd; and per channel
// sum(dL/dy * x_hat) into weight_grad[0:C] (float64)
template <class T>
void rms_backward(const T* __restrict gy, const T* __restrict x, const T* __restrict sum_square, T* __restrict gx,
                  double* __restrict weight_grad, Shape n, const T* __restrict w, T eps, int threads) {
  const int64_t C = n.channels, inner = n.inner;
  std::vector<double> partial(static_cast<size_t>(threads) * C, 0.0);
#pragma omp parallel num_threads(threads)
  {
    double* __restrict mine = partial.data() + static_cast<size_t>(omp_get_thread_num()) * C;
    if (inner == 1) {
      std::vector<T> block(C);
      T* __restrict s_w = block.data();
#pragma omp for schedule(static)
      for (int64_t r0 = 0; r0 < n.outer; r0 += kRowBlock) {
        std::fill(block.begin(), block.end(), T(0));
        const int64_t r1 = r0 + kRowBlock < n.outer ? r0 + kRowBlock : n.outer;
        for (int64_t r = r0; r < r1; ++r) {
          const T* __restrict gr = gy + r * C;
          const T* __restrict xr = x + r * C;
          T* __restrict gxr = gx + r * C;
          const T rstd = T(1) / std::sqrt(sum_square[r] / T(C) + eps);
          T dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < C; ++c) dot += gr[c] * w[c] * xr[c];
          const T k = dot * rstd * rstd / T(C);
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) {
            gxr[c] = rstd * (gr[c] * w[c] - xr[c] * k);
            s_w[c] += gr[c] * xr[c] * rstd;
          }
        }
        for (int64_t i = 0; i < C; ++i) mine[i] += block[i];
      }
    } else {
      std::vector<T> rstd(inner), k(inner);
#pragma omp for schedule(static)
      for (int64_t o = 0; o < n.outer; ++o) {
        const T* __restrict go = gy + o * C * inner;
        const T* __restrict xo = x + o * C * inner;
        T* __restrict gxo = gx + o * C * inner;
        const T* __restrict ss = sum_square + o * inner;
        for (int64_t s = 0; s < inner; ++s) {
          rstd[s] = T(1) / std::sqrt(ss[s] / T(C) + eps);
          k[s] = 0;
        }
        for (int64_t c = 0; c < C; ++c) {
          const T wc = w[c];
#pragma omp simd
          for (int64_t s = 0; s < inner; ++s) k[s] += go[c * inner + s] * wc * xo[c * inner + s];
        }
        for (int64_t s = 0; s < inner; ++s) k[s] *= rstd[s] * rstd[s] / T(C);
        for (int64_t c = 0; c < C; ++c) {
          const T wc = w[c];
          T acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t s = 0; s < inner; ++s) {
            const int64_t i = c * inner + s;
            gxo[i] = rstd[s] * (go[i] * wc - xo[i] * k[s]);
            acc += go[i] * xo[i] * rstd[s];
          }
          mine[c] += acc;
        }
      }
    }
  }
  std::memset(weight_grad, 0, sizeof(double) * C);
  for (int t = 0; t < threads; ++t)
    for (int64_t i = 0; i < C; ++i) weight_grad[i] += partial[static_cast<size_t>(t) * C + i];
}

}  // namespace

extern "C" {

int normexp_function_count() { return kFunctionCount; }
const char* normexp_function_name(int i) { return i >= 0 && i < kFunctionCount ? kFunctionNames[i] : nullptr; }

// dtype: 0 float32, 1 float64; shape: outer, channels, inner
#define POINTER(T, p) static_cast<T*>(p)
void normexp_pointwise_forward(int dtype, int fn, const void* x, void* y, const int64_t* shape, double alpha,
                               const void* shift, const void* w, const void* b, const double* options, int threads) {
  const Shape n{shape[0], shape[1], shape[2]};
  if (dtype == 0)
    forward_dispatch<float>(fn, POINTER(const float, x), POINTER(float, y), n, float(alpha), POINTER(const float, shift),
                            POINTER(const float, w), POINTER(const float, b), options, threads);
  else
    forward_dispatch<double>(fn, POINTER(const double, x), POINTER(double, y), n, alpha, POINTER(const double, shift),
                             POINTER(const double, w), POINTER(const double, b), options, threads);
}

void normexp_pointwise_backward(int dtype, int fn, const void* gy, const void* x, void* gx, void* grads,
                                const int64_t* shape, double alpha, const void* shift, int64_t shift_size,
                                const void* w, const double* options, int threads) {
  const Shape n{shape[0], shape[1], shape[2]};
  if (dtype == 0)
    backward_dispatch<float>(fn, POINTER(const float, gy), POINTER(const float, x), POINTER(float, gx),
                             POINTER(float, grads), n, float(alpha), POINTER(const float, shift), shift_size,
                             POINTER(const float, w), options, threads);
  else
    backward_dispatch<double>(fn, POINTER(const double, gy), POINTER(const double, x), POINTER(double, gx),
                              POINTER(double, grads), n, alpha, POINTER(const double, shift), shift_size,
                              POINTER(const double, w), options, threads);
}

void normexp_rms_forward(int dtype, const void* x, void* y, void* sum_square, const int64_t* shape, const void* w,
                         double eps, int threads) {
  const Shape n{shape[0], shape[1], shape[2]};
  if (dtype == 0)
    rms_forward<float>(POINTER(const float, x), POINTER(float, y), POINTER(float, sum_square), n,
                       POINTER(const float, w), float(eps), threads);
  else
    rms_forward<double>(POINTER(const double, x), POINTER(double, y), POINTER(double, sum_square), n,
                        POINTER(const double, w), eps, threads);
}

void normexp_rms_backward(int dtype, const void* gy, const void* x, const void* sum_square, void* gx,
                          double* weight_grad, const int64_t* shape, const void* w, double eps, int threads) {
  const Shape n{shape[0], shape[1], shape[2]};
  if (dtype == 0)
    rms_backward<float>(POINTER(const float, gy), POINTER(const float, x), POINTER(const float, sum_square),
                        POINTER(float, gx), weight_grad, n, POINTER(const float, w), float(eps), threads);
  else
    rms_backward<double>(POINTER(const double, gy), POINTER(const double, x), POINTER(const double, sum_square),
                         POINTER(double, gx), weight_grad, n, POINTER(const double, w), eps, threads);
}

}  // extern "C"
