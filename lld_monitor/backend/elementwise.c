/* exp, log, sin, cos and sqrt as fixed sequences of IEEE-754 operations, for the trainer's pinned numerics.
 *
 * Why these exist: ATen computes torch.exp, log, sqrt, sin and cos on float tensors with MKL's VML
 * (vmsExp, vmsLn, vmsSqrt, ...), and VML picks its code by CPU vendor and instruction set, ignoring
 * MKL_CBWR on non-Intel CPUs. The code an AMD EPYC gets computes sqrt through `rsqrtps`, an approximate
 * instruction whose bits differ between vendors (docs/backend.md, "Reproducibility"). Here every result
 * is a function of its input alone:
 *   - only +, -, *, / and the square-root instruction, each correctly rounded by IEEE 754 on every CPU;
 *     no libm call, no table, no approximate instruction; compiled with -ffp-contract=off (no fused
 *     operation the source does not write) and without -ffast-math (no reordering);
 *   - elementwise: a vectorizing compiler runs the same operations per element, so the bits do not depend
 *     on the vector width either.
 * float32 inputs are computed in double and rounded once, so the float32 results are correctly rounded
 * except where the exact value lies within ~1e-16 (relative) of a rounding boundary; the double results
 * are within a few units in the last place. sin and cos reduce their argument with a three-part pi/2:
 * accurate for |x| < 1e6 (rotary embeddings use |x| < 1e5), still a fixed function of x beyond.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline double bits_to_double(uint64_t u) { double d; memcpy(&d, &u, sizeof d); return d; }
static inline uint64_t double_to_bits(double d) { uint64_t u; memcpy(&u, &d, sizeof u); return u; }

/* round-to-nearest-even of |t| < 2^51, as a double, by the add/subtract of 1.5 * 2^52 */
static inline double nearest(double t) { return (t + 0x1.8p52) - 0x1.8p52; }

/* p(x) = c[0] x^(n-1) + ... + c[n-1], by Horner's rule in this order (one multiply, one add per step) */
static inline double horner(const double *c, size_t n, double x) {
    double p = c[0];
    for (size_t i = 1; i < n; i++) p = p * x + c[i];
    return p;
}

/* exp(r) for |r| <= 0.3466: its Taylor series to r^13 / 13! (the remainder is below 1e-17 relative) */
static const double EXP_COEFS[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                   1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                                   1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
/* log(m) = 2 s + 2 s z q(z), s = (m - 1) / (m + 1), z = s^2: q(z) = 1/3 + z/5 + ... + z^10/23 */
static const double LOG_COEFS[] = {1.0 / 23.0, 1.0 / 21.0, 1.0 / 19.0, 1.0 / 17.0, 1.0 / 15.0, 1.0 / 13.0,
                                   1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0};
/* sin(r) = r - r z p(z) and cos(r) = 1 - z p(z), z = r^2, |r| <= pi/4: Taylor to r^17/17! and r^18/18! */
static const double SIN_COEFS[] = {-1.0 / 355687428096000.0, 1.0 / 1307674368000.0, -1.0 / 6227020800.0,
                                   1.0 / 39916800.0, -1.0 / 362880.0, 1.0 / 5040.0, -1.0 / 120.0, 1.0 / 6.0};
static const double COS_COEFS[] = {1.0 / 6402373705728000.0, -1.0 / 20922789888000.0, 1.0 / 87178291200.0,
                                   -1.0 / 479001600.0, 1.0 / 3628800.0, -1.0 / 40320.0, 1.0 / 720.0, -1.0 / 24.0,
                                   0.5};

/* ln 2 split so that k * LN2_HI is exact for |k| < 2^20 (fdlibm's constants) */
static const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;
static const double INV_LN2 = 1.44269504088896338700e+00;

static double exp_d(double x) {
    if (x != x) return x;
    if (x > 709.782712893384) return 1.0 / 0.0;
    if (x < -745.2) return 0.0;
    double kd = nearest(x * INV_LN2);
    double r = (x - kd * LN2_HI) - kd * LN2_LO; /* |r| <= 0.3466 */
    double p = horner(EXP_COEFS, sizeof EXP_COEFS / sizeof EXP_COEFS[0], r);
    int64_t k = (int64_t)kd;
    if (k > 1000) return (p * bits_to_double((uint64_t)(k - 1000 + 1023) << 52)) * 0x1p1000;
    if (k < -1000) return (p * bits_to_double((uint64_t)(k + 1000 + 1023) << 52)) * 0x1p-1000;
    return p * bits_to_double((uint64_t)(k + 1023) << 52);
}

static double log_d(double x) {
    if (x != x) return x;
    if (x < 0.0) return 0.0 / 0.0;
    if (x == 0.0) return -1.0 / 0.0;
    if (x == 1.0 / 0.0) return x;
    int64_t e = 0;
    if (x < 0x1p-1022) { x *= 0x1p54; e = -54; } /* subnormal */
    uint64_t u = double_to_bits(x);
    e += (int64_t)((u >> 52) & 0x7ff) - 1023;
    double m = bits_to_double((u & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL); /* [1, 2) */
    if (m > 1.4142135623730951) { m *= 0.5; e += 1; } /* [0.707, 1.414] */
    double f = m - 1.0;
    double s = f / (2.0 + f); /* log(m) = 2 atanh(s), |s| <= 0.1716 */
    double z = s * s;
    double q = horner(LOG_COEFS, sizeof LOG_COEFS / sizeof LOG_COEFS[0], z);
    double logm = 2.0 * s + 2.0 * s * (z * q);
    double ed = (double)e;
    return ed * LN2_HI + (ed * LN2_LO + logm);
}

/* pi/2 in three parts of 33 bits each (fdlibm's pio2_1, pio2_2, pio2_3) and 2/pi */
static const double PIO2_1 = 1.57079632673412561417e+00, PIO2_2 = 6.07710050630396597660e-11,
                    PIO2_3 = 2.02226624871116645580e-21, INV_PIO2 = 6.36619772367581382433e-01;

static inline double sin_poly(double r) {
    double z = r * r;
    double p = horner(SIN_COEFS, sizeof SIN_COEFS / sizeof SIN_COEFS[0], z);
    return r - r * (z * p);
}

static inline double cos_poly(double r) {
    double z = r * r;
    double p = horner(COS_COEFS, sizeof COS_COEFS / sizeof COS_COEFS[0], z);
    return 1.0 - z * p;
}

/* x = k pi/2 + r: returns the quadrant k mod 4 and r (|r| <= pi/4 plus rounding) */
static inline int reduce_pio2(double x, double *r) {
    double kd = nearest(x * INV_PIO2);
    *r = ((x - kd * PIO2_1) - kd * PIO2_2) - kd * PIO2_3;
    return (int)((int64_t)kd & 3);
}

static double sin_d(double x) {
    if (x != x || x - x != 0.0) return 0.0 / 0.0; /* NaN, +-inf */
    if (x > -0x1p-26 && x < 0x1p-26) return x;    /* sin(x) = x to double precision (keeps -0) */
    if (x > 1e15 || x < -1e15) return 0.0 / 0.0;  /* beyond the reduction's range: not a number, say so */
    double r;
    switch (reduce_pio2(x, &r)) {
        case 0: return sin_poly(r);
        case 1: return cos_poly(r);
        case 2: return -sin_poly(r);
        default: return -cos_poly(r);
    }
}

static double cos_d(double x) {
    if (x != x || x - x != 0.0) return 0.0 / 0.0;
    if (x > 1e15 || x < -1e15) return 0.0 / 0.0;
    double r;
    switch (reduce_pio2(x, &r)) {
        case 0: return cos_poly(r);
        case 1: return -sin_poly(r);
        case 2: return -cos_poly(r);
        default: return sin_poly(r);
    }
}

/* ------------------------------------------------------------------ the exported loops (x may be y) */
#define LOOPS(name, fn)                                                                        \
    void lld_##name##_f32(const float *x, float *y, int64_t n) {                               \
        for (int64_t i = 0; i < n; i++) y[i] = (float)fn((double)x[i]);                        \
    }                                                                                          \
    void lld_##name##_f64(const double *x, double *y, int64_t n) {                             \
        for (int64_t i = 0; i < n; i++) y[i] = fn(x[i]);                                       \
    }

LOOPS(exp, exp_d)
LOOPS(log, log_d)
LOOPS(sin, sin_d)
LOOPS(cos, cos_d)

/* the square-root instruction is correctly rounded (IEEE 754); -fno-math-errno keeps it one instruction */
void lld_sqrt_f32(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = __builtin_sqrtf(x[i]);
}
void lld_sqrt_f64(const double *x, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = __builtin_sqrt(x[i]);
}
