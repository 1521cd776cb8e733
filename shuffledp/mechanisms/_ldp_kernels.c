/* Fused row loops for the eps0-LDP randomizers R_1 and R_inf (spec 001 section 3), and for PVEC's rounding (spec 000
 * Alg 1 lines 3-5 after the clip and shift of Alg 2 line 4: round_rows).
 *
 * numpy needs 4-5 passes over the (k, d) batch X for what these loops do in one read: the benchmark target
 * (benchmarks/bench_ldp.py, encode <= 3x the cost of its random draws, issue 2) is out of numpy's reach for R_1.
 * No randomness and no privacy decision here: the kernels return dot products, l_1 norms and "entry above the bound"
 * flags; the Python callers raise on bad rows and draw the coins (R_1's privacy does not even rest on its norm check:
 * z is clamped to [-1, 1]). round_rows takes its uniforms from the caller (the CSPRNG) too; what PVEC's privacy rests
 * on there, xhat in {0..g}, holds for any finite input by the clamp to [0, 1] before the rounding. Memory safety
 * does not depend on the caller: every buffer length is checked here.
 *
 * Each kernel exists twice: baseline x86-64/any-CPU code, and (x86-64 with GCC or clang) the same source compiled
 * for AVX2, chosen at run time when the CPU has it. `portable=True` forces the baseline so tests cover both.
 * Floating point: no -ffast-math (the l_1 sums must carry NaN and inf to the caller); sums run in 8 lanes, so
 * their rounding differs from numpy's by a few ulp, which is harmless: R_1 clamps z to [-1, 1] before its coin and
 * the norm check has a relative slack (ldp_common.NORM_RTOL).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __FAST_MATH__
#error "_ldp_kernels.c must not be compiled with -ffast-math: non-finite inputs would go undetected"
#endif

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_VARIANT 1
#endif

typedef double v4 __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));

static inline v4 load4(const double *p) {
    v4 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline v4 vabs(v4 x) {
    const v4i mask = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX}; /* clear the sign bit */
    return (v4)((v4i)x & mask);
}

static inline double hsum(v4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

/* H[a, b] of the Sylvester-Hadamard matrix: (-1)^popcount(a & b). */
static inline double hsign(uint64_t a, uint64_t b) { return (__builtin_popcountll(a & b) & 1) ? -1.0 : 1.0; }

/* dots[i] = <X[i], H[rows[i], :d]>, l1[i] = ||X[i]||_1 (NaN or inf if X[i] is not finite).
 * H_D = H_M (x) H_B with B = 2^b: H[l, j] = H[l >> b, j >> b] * H[l & (B-1), j & (B-1)], so each block of B inputs
 * is dotted with one row of the cached table H_B (B x B) and weighted by one sign. */
static inline void dots_l1_body(const double *X, const int64_t *rows, Py_ssize_t k, Py_ssize_t d, int b,
                                const double *table, double *dots, double *l1) {
    const Py_ssize_t B = (Py_ssize_t)1 << b;
    for (Py_ssize_t i = 0; i < k; i++) {
        const double *x = X + i * d;
        const uint64_t l = (uint64_t)rows[i];
        const double *low = table + (l & (uint64_t)(B - 1)) * B;
        double dot = 0.0, norm = 0.0;
        for (Py_ssize_t h = 0; h * B < d; h++) {
            const double *xb = x + h * B;
            const Py_ssize_t n = d - h * B < B ? d - h * B : B;
            v4 s0 = {0}, s1 = {0}, a0 = {0}, a1 = {0}; /* 2 x 4 lanes: independent add chains */
            Py_ssize_t j = 0;
            for (; j + 8 <= n; j += 8) {
                const v4 x0 = load4(xb + j), x1 = load4(xb + j + 4);
                s0 += x0 * load4(low + j);
                s1 += x1 * load4(low + j + 4);
                a0 += vabs(x0);
                a1 += vabs(x1);
            }
            double s = hsum(s0 + s1), a = hsum(a0 + a1);
            for (; j < n; j++) {
                s += xb[j] * low[j];
                a += fabs(xb[j]);
            }
            dot += hsign(l >> b, (uint64_t)h) * s;
            norm += a;
        }
        dots[i] = dot;
        l1[i] = norm;
    }
}

/* out[i] = 1 if some |X[i, j]| > bound or is NaN, else 0 (bound >= 0 finite). For doubles >= 0 the IEEE bit
 * patterns, read as int64, are ordered like the values, and inf < NaN patterns; so |x| > bound iff
 * bits(bound) - bits(|x|) < 0, and one OR over a row keeps any negative sign. Integer ops only: no NaN pitfalls. */
static inline void rows_over_body(const double *X, Py_ssize_t k, Py_ssize_t d, double bound, uint8_t *out) {
    int64_t tb;
    memcpy(&tb, &bound, sizeof tb);
    const v4i t = {tb, tb, tb, tb}, mask = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    for (Py_ssize_t i = 0; i < k; i++) {
        const double *x = X + i * d;
        v4i o0 = {0}, o1 = {0};
        Py_ssize_t j = 0;
        for (; j + 8 <= d; j += 8) {
            o0 |= t - ((v4i)load4(x + j) & mask);
            o1 |= t - ((v4i)load4(x + j + 4) & mask);
        }
        o0 |= o1;
        int64_t o = o0[0] | o0[1] | o0[2] | o0[3];
        for (; j < d; j++) {
            int64_t b;
            memcpy(&b, x + j, sizeof b);
            o |= tb - (b & INT64_MAX);
        }
        out[i] = o < 0;
    }
}

/* PVEC's rounding of k rows (spec 000 Alg 1 lines 3-5 on Alg 2 line 4's shift), the same arithmetic as numpy's
 * clip_rows + shift_to_units + _round_units (mechanisms/pvec.py) in one read of each row instead of ~12 passes:
 *   x' = x scaled to l2 norm <= delta2 (x * (delta2 / ||x||), and once more by 1 - 4 eps if that overshoots),
 *   u = clamp((x' + delta2) / (2 delta2), 0, 1), v = u g, xhat = floor(v) + (U < v - floor(v)),
 * U[i, j] the caller's uniforms in [0, 1). xhat is written as unsigned integers of `width` bytes (1, 2, 4 or 8).
 * Returns the first row with a NaN or inf (nothing written from it on), or -1. The norm's sum runs in 4 lanes, so it
 * may differ from numpy's by an ulp: the clip decision then differs only for a row within an ulp of delta2. A row of
 * finite values whose squares overflow is scaled by its largest entry first (as clip_rows does). */
typedef int32_t v4i32 __attribute__((vector_size(16)));
typedef uint16_t v4u16 __attribute__((vector_size(8)));
typedef uint8_t v4u8 __attribute__((vector_size(4)));

/* One row's output loop for output type T, truncating through the signed type I, y = X's value as clipped (Y: x,
 * x * scale, or x * scale * (1 - 4 eps), unswitched so that the loop has no branch). Scalar: the tail of the
 * 4-lane loop below, and every value where g >= 2^31. */
#define ROUND_LOOP(T, I, Y)                                                                                          \
    for (; j < d; j++) {                                                                                             \
        const double y = (Y);                                                                                        \
        double v = (y + delta2) / two;                                                                               \
        v = v < 0.0 ? 0.0 : (v > 1.0 ? 1.0 : v);                                                                     \
        v *= g;                                                                                                      \
        const I low = (I)v; /* v in [0, g]: truncation is floor, exactly */                                         \
        o[j] = (T)(low + (I)(u[j] < v - (double)low));                                                               \
    }

/* The same arithmetic on 4 values at a time where g < 2^31 (int32 lanes): the clamp as bit masks (the scalar
 * ternaries are control flow to the vectorizer), truncation by cvttpd2dq. STORE writes the 4 int32 results r. */
#define ROUND_LOOP4(Y, STORE)                                                                                        \
    for (; j + 4 <= d; j += 4) {                                                                                     \
        const v4 y = (Y);                                                                                            \
        v4 v = (y + d2v) / twov;                                                                                     \
        v = (v4)((v4i)v & ~(v < zerov));                                                                             \
        const v4i over = v > onev;                                                                                   \
        v = (v4)(((v4i)v & ~over) | ((v4i)onev & over));                                                             \
        v *= gv;                                                                                                     \
        const v4i32 low = __builtin_convertvector(v, v4i32);                                                         \
        const v4i take = load4(u + j) < v - __builtin_convertvector(low, v4);                                        \
        const v4i32 r = low - __builtin_convertvector(take, v4i32); /* take: -1 where the coin says up */           \
        STORE;                                                                                                       \
    }

/* VEC: 1 for the 4-lane loop first (g < 2^31), 0 for the scalar loop alone */
#define ROUND_ROW(T, I, STORE, VEC)                                                                                  \
    do {                                                                                                             \
        T *o = (T *)out + i * d;                                                                                     \
        Py_ssize_t j = 0;                                                                                            \
        if (!scaled) {                                                                                               \
            if (VEC) ROUND_LOOP4(load4(x + j), STORE)                                                                \
            ROUND_LOOP(T, I, x[j])                                                                                   \
        } else if (!shrink) {                                                                                        \
            if (VEC) ROUND_LOOP4(load4(x + j) * scalev, STORE)                                                       \
            ROUND_LOOP(T, I, x[j] * scale)                                                                           \
        } else {                                                                                                     \
            if (VEC) ROUND_LOOP4(load4(x + j) * scalev * shrinkv, STORE)                                             \
            ROUND_LOOP(T, I, x[j] * scale * (1.0 - 4.0 * DBL_EPSILON))                                               \
        }                                                                                                            \
    } while (0)

#define STORE_U8                                                                                                     \
    do {                                                                                                             \
        const v4u8 n = __builtin_convertvector(r, v4u8);                                                             \
        memcpy(o + j, &n, sizeof n);                                                                                 \
    } while (0)
#define STORE_U16                                                                                                    \
    do {                                                                                                             \
        const v4u16 n = __builtin_convertvector(r, v4u16);                                                           \
        memcpy(o + j, &n, sizeof n);                                                                                 \
    } while (0)
#define STORE_U32 memcpy(o + j, &r, sizeof r) /* 0 <= r <= g < 2^31: the same bits as uint32 */
#define STORE_U64                                                                                                    \
    do {                                                                                                             \
        const v4i n = __builtin_convertvector(r, v4i);                                                               \
        memcpy(o + j, &n, sizeof n);                                                                                 \
    } while (0)
#define STORE_NONE (void)r

/* always_inline: the AVX2 variant below must get its own copy of this body (GCC called the baseline one) */
static inline __attribute__((always_inline)) Py_ssize_t round_rows_body(const double *X, const double *U, void *out,
                                                                        Py_ssize_t k, Py_ssize_t d, double delta2,
                                                                        double g, int width) {
    int64_t tmax;
    const double dmax = DBL_MAX;
    memcpy(&tmax, &dmax, sizeof tmax);
    const v4i t = {tmax, tmax, tmax, tmax}, mask = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    const double two = 2.0 * delta2;
    for (Py_ssize_t i = 0; i < k; i++) {
        const double *x = X + i * d, *u = U + i * d;
        v4 s0 = {0}, s1 = {0};
        v4i o0 = {0}, o1 = {0}; /* negative lane: an entry above DBL_MAX in magnitude, i.e. inf or NaN */
        Py_ssize_t j = 0;
        for (; j + 8 <= d; j += 8) {
            const v4 x0 = load4(x + j), x1 = load4(x + j + 4);
            s0 += x0 * x0;
            s1 += x1 * x1;
            o0 |= t - ((v4i)x0 & mask);
            o1 |= t - ((v4i)x1 & mask);
        }
        o0 |= o1;
        int64_t bad = o0[0] | o0[1] | o0[2] | o0[3];
        double ss = hsum(s0 + s1);
        for (; j < d; j++) {
            int64_t b;
            memcpy(&b, x + j, sizeof b);
            bad |= tmax - (b & INT64_MAX);
            ss += x[j] * x[j];
        }
        if (bad < 0) return i;
        double norm = sqrt(ss);
        if (isinf(ss)) { /* finite entries whose squares overflow: the norm of x / max|x|, times max|x| */
            double top = 0.0, s = 0.0;
            for (j = 0; j < d; j++) top = fabs(x[j]) > top ? fabs(x[j]) : top;
            for (j = 0; j < d; j++) s += (x[j] / top) * (x[j] / top);
            norm = top * sqrt(s);
        }
        int scaled = 0, shrink = 0;
        double scale = 1.0;
        if (norm > delta2) {
            scaled = 1;
            scale = delta2 / norm;
            double s = 0.0;
            for (j = 0; j < d; j++) s += (x[j] * scale) * (x[j] * scale);
            shrink = sqrt(s) > delta2; /* float rounding left it an ulp above delta2 */
        }
        const v4 d2v = {delta2, delta2, delta2, delta2}, twov = {two, two, two, two}, gv = {g, g, g, g};
        const v4 zerov = {0}, onev = {1.0, 1.0, 1.0, 1.0}, scalev = {scale, scale, scale, scale};
        const double sh = 1.0 - 4.0 * DBL_EPSILON;
        const v4 shrinkv = {sh, sh, sh, sh};
        if (width == 1)
            ROUND_ROW(uint8_t, int32_t, STORE_U8, 1);
        else if (width == 2)
            ROUND_ROW(uint16_t, int32_t, STORE_U16, 1);
        else if (g < 2147483648.0 && width == 4)
            ROUND_ROW(uint32_t, int32_t, STORE_U32, 1);
        else if (width == 4)
            ROUND_ROW(uint32_t, int64_t, STORE_NONE, 0);
        else if (g < 2147483648.0) /* int64 output (round_counts' default) of a g that int32 lanes hold */
            ROUND_ROW(uint64_t, int32_t, STORE_U64, 1);
        else
            ROUND_ROW(uint64_t, int64_t, STORE_NONE, 0);
    }
    return -1;
}

static void dots_l1_base(const double *X, const int64_t *rows, Py_ssize_t k, Py_ssize_t d, int b,
                         const double *table, double *dots, double *l1) {
    dots_l1_body(X, rows, k, d, b, table, dots, l1);
}

static void rows_over_base(const double *X, Py_ssize_t k, Py_ssize_t d, double bound, uint8_t *out) {
    rows_over_body(X, k, d, bound, out);
}

static Py_ssize_t round_rows_base(const double *X, const double *U, void *out, Py_ssize_t k, Py_ssize_t d,
                                  double delta2, double g, int width) {
    return round_rows_body(X, U, out, k, d, delta2, g, width);
}

#ifdef HAVE_AVX2_VARIANT
__attribute__((target("avx2"))) static void dots_l1_avx2(const double *X, const int64_t *rows, Py_ssize_t k,
                                                         Py_ssize_t d, int b, const double *table, double *dots,
                                                         double *l1) {
    dots_l1_body(X, rows, k, d, b, table, dots, l1);
}

__attribute__((target("avx2"))) static void rows_over_avx2(const double *X, Py_ssize_t k, Py_ssize_t d, double bound,
                                                           uint8_t *out) {
    rows_over_body(X, k, d, bound, out);
}

__attribute__((target("avx2"))) static Py_ssize_t round_rows_avx2(const double *X, const double *U, void *out,
                                                                 Py_ssize_t k, Py_ssize_t d, double delta2, double g,
                                                                 int width) {
    return round_rows_body(X, U, out, k, d, delta2, g, width);
}

static int use_avx2(int portable) { return !portable && __builtin_cpu_supports("avx2"); }
#endif

static int check_len(const Py_buffer *buf, Py_ssize_t items, const char *name) {
    if (buf->len != items * (Py_ssize_t)sizeof(double)) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", name, buf->len, items * sizeof(double));
        return 0;
    }
    return 1;
}

/* X must hold exactly k rows of d >= 1 doubles. Checked by division: k * d * 8 could wrap around for a huge d and
 * let a short buffer pass. */
static int check_matrix(const Py_buffer *X, Py_ssize_t k, Py_ssize_t d) {
    const Py_ssize_t items = X->len / (Py_ssize_t)sizeof(double);
    if (X->len % (Py_ssize_t)sizeof(double) || items % d || items / d != k) {
        PyErr_Format(PyExc_ValueError, "X has %zd bytes, expected %zd rows of %zd doubles", X->len, k, d);
        return 0;
    }
    return 1;
}

static PyObject *hadamard_dots_l1(PyObject *self, PyObject *args) {
    Py_buffer X, rows, table, dots, l1;
    Py_ssize_t d;
    int b, portable = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*ni|p:hadamard_dots_l1", &X, &rows, &table, &dots, &l1, &d, &b,
                          &portable))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t k = rows.len / (Py_ssize_t)sizeof(int64_t);
    if (d < 1 || b < 0 || b > 15) {
        PyErr_Format(PyExc_ValueError, "need d >= 1 and 0 <= b <= 15, got d=%zd, b=%d", d, b);
    } else if (check_len(&rows, k, "rows") && check_matrix(&X, k, d) && check_len(&dots, k, "dots") &&
               check_len(&l1, k, "l1") && check_len(&table, (Py_ssize_t)1 << (2 * b), "table")) {
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX2_VARIANT
        if (use_avx2(portable))
            dots_l1_avx2(X.buf, rows.buf, k, d, b, table.buf, dots.buf, l1.buf);
        else
#endif
            dots_l1_base(X.buf, rows.buf, k, d, b, table.buf, dots.buf, l1.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&X);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&table);
    PyBuffer_Release(&dots);
    PyBuffer_Release(&l1);
    return result;
}

static PyObject *rows_over(PyObject *self, PyObject *args) {
    Py_buffer X, out;
    Py_ssize_t d;
    double bound;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*w*nd|p:rows_over", &X, &out, &d, &bound, &portable)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t k = out.len;
    if (d < 1 || !(bound >= 0.0 && isfinite(bound))) {
        PyErr_Format(PyExc_ValueError, "need d >= 1 and a finite bound >= 0, got d=%zd, bound=%R", d,
                     PyTuple_GET_ITEM(args, 3));
    } else if (check_matrix(&X, k, d)) {
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX2_VARIANT
        if (use_avx2(portable))
            rows_over_avx2(X.buf, k, d, bound, out.buf);
        else
#endif
            rows_over_base(X.buf, k, d, bound, out.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&X);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *round_rows(PyObject *self, PyObject *args) {
    Py_buffer X, U, out;
    Py_ssize_t d;
    double delta2, g;
    int width, portable = 0;
    if (!PyArg_ParseTuple(args, "y*y*w*nddi|p:round_rows", &X, &U, &out, &d, &delta2, &g, &width, &portable))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t k = d >= 1 ? U.len / (Py_ssize_t)sizeof(double) / d : 0;
    /* g < 2^53: every count up to g is an exact double and v's truncation is its floor */
    if (d < 1 || !(delta2 > 0.0 && isfinite(delta2)) || !(g >= 1.0 && g < 9007199254740992.0 && g == floor(g)) ||
        !(width == 1 || width == 2 || width == 4 || width == 8) || (width < 8 && g >= ldexp(1.0, 8 * width))) {
        PyErr_Format(PyExc_ValueError,
                     "need d >= 1, a finite delta2 > 0, an integer 1 <= g < 2^53 that fits width in {1, 2, 4, 8} "
                     "bytes, got d=%zd, delta2=%R, g=%R, width=%d",
                     d, PyTuple_GET_ITEM(args, 4), PyTuple_GET_ITEM(args, 5), width);
    } else if (check_len(&U, k * d, "U") && check_matrix(&X, k, d)) {
        if (out.len != k * d * width) {
            PyErr_Format(PyExc_ValueError, "out has %zd bytes, expected %zd", out.len, k * d * width);
        } else {
            Py_ssize_t bad;
            Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX2_VARIANT
            if (use_avx2(portable))
                bad = round_rows_avx2(X.buf, U.buf, out.buf, k, d, delta2, g, width);
            else
#endif
                bad = round_rows_base(X.buf, U.buf, out.buf, k, d, delta2, g, width);
            Py_END_ALLOW_THREADS
            result = PyLong_FromSsize_t(bad);
        }
    }
    PyBuffer_Release(&X);
    PyBuffer_Release(&U);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"hadamard_dots_l1", hadamard_dots_l1, METH_VARARGS,
     "hadamard_dots_l1(X, rows, table, dots, l1, d, b, portable=False): for the k = len(rows) rows of the C-order "
     "float64 X (k, d), dots[i] = <X[i], H[rows[i], :d]> and l1[i] = ||X[i]||_1; table is H_{2^b} as float64."},
    {"rows_over", rows_over, METH_VARARGS,
     "rows_over(X, out, d, bound, portable=False): out[i] = 1 if some |X[i, j]| > bound or is NaN, else 0, for the "
     "k = len(out) rows of the C-order float64 X (k, d); out is a writable buffer of k bytes (numpy bool)."},
    {"round_rows", round_rows, METH_VARARGS,
     "round_rows(X, U, out, d, delta2, g, width, portable=False): PVEC's rounding of the k = len(U) / d rows of the "
     "C-order float64 X (k, d) with the uniforms U (k, d): each row clipped to l2 norm <= delta2, shifted to "
     "u = (x + delta2) / (2 delta2) in [0, 1], and xhat = floor(u g) + (U < frac(u g)) written to out as unsigned "
     "integers of width bytes. Returns the first row holding a NaN or inf (rows from it on unwritten), or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ldp_kernels",
                                    "Fused row loops for R_1, R_inf and PVEC's rounding.", -1, methods};

PyMODINIT_FUNC PyInit__ldp_kernels(void) {
#ifdef HAVE_AVX2_VARIANT
    __builtin_cpu_init(); /* use_avx2 may run before libgcc's own initializer in some load orders */
#endif
    return PyModule_Create(&module);
}
