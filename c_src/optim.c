/* optim.c - sparse SGD and Adam/AdamW (LAZY and EXACT semantics, see
 * stella_optim.h). Element arithmetic is float32 in torch's operation order
 * (no FMA contraction: -ffp-contract=off); per-step scalars are double. */
#include "optim_internal.h"
#include "simd_internal.h"
#include <math.h>
#include <string.h>
#if STELLA_X86
#include <immintrin.h>
#endif

enum { SHORT_GAP = 16, TAB = 64 };

/* Everything a kernel needs, derived once per call. */
typedef struct {
    int kind, exact, nesterov, maximize, amsgrad;
    int has_mom, has_wd, coupled, decoupled;
    double lr, wd, mu, damp, b1, b2, eps;
    float wd_f, mu_f, damp1_f, neg_lr_f;          /* SGD */
    float b2_f, w1_f, w1c_f, w2_f, eps_f, decay_f; /* Adam */
    /* Adam per-step scalars for steps (tab_end - TAB, tab_end] */
    int64_t tab_end;
    float tab_neg_ss[TAB], tab_bc2s[TAB];
} prm;

static int hp_valid(const stella_optim_hparams *hp) {
    if (hp->reserved != 0) return 0;
    if (hp->mode != STELLA_OPTIM_LAZY && hp->mode != STELLA_OPTIM_EXACT) return 0;
    if (hp->flags & ~(STELLA_OPTIM_NESTEROV | STELLA_OPTIM_MAXIMIZE | STELLA_OPTIM_AMSGRAD)) return 0;
    if (!(isfinite(hp->lr) && hp->lr >= 0)) return 0;
    if (!(isfinite(hp->weight_decay) && hp->weight_decay >= 0)) return 0;
    switch (hp->kind) {
    case STELLA_OPTIM_SGD:
        if (hp->flags & STELLA_OPTIM_AMSGRAD) return 0;
        if (!(isfinite(hp->momentum) && hp->momentum >= 0)) return 0;
        if (!(hp->dampening >= 0 && hp->dampening <= 1)) return 0;
        if ((hp->flags & STELLA_OPTIM_NESTEROV) && !(hp->momentum > 0 && hp->dampening == 0)) return 0;
        return 1;
    case STELLA_OPTIM_ADAM:
    case STELLA_OPTIM_ADAMW:
        if (hp->flags & STELLA_OPTIM_NESTEROV) return 0;
        if (!(hp->beta1 >= 0 && hp->beta1 < 1 && hp->beta2 >= 0 && hp->beta2 < 1)) return 0;
        if (!(isfinite(hp->eps) && hp->eps >= 0)) return 0;
        return 1;
    default:
        return 0;
    }
}

int stella_optim_check(const stella_optim_hparams *hp, const stella_optim_tensor *t) {
    if (!hp || !t) return STELLA_ERR_NULL;
    if (!hp_valid(hp)) return STELLA_ERR_ARG;
    if (t->n < 0) return STELLA_ERR_ARG;
    if (t->n == 0) return STELLA_OK;
    if (!t->param) return STELLA_ERR_NULL;
    if (hp->mode == STELLA_OPTIM_EXACT && !t->last) return STELLA_ERR_NULL;
    if (hp->kind == STELLA_OPTIM_SGD) {
        if (hp->momentum != 0 && !t->buf1) return STELLA_ERR_NULL;
    } else {
        if (!t->buf1 || !t->buf2) return STELLA_ERR_NULL;
        if ((hp->flags & STELLA_OPTIM_AMSGRAD) && !t->buf3) return STELLA_ERR_NULL;
    }
    return STELLA_OK;
}

/* torch's per-step Adam scalars: -lr / (1 - beta1^step) and sqrt(1 - beta2^step). */
static void adam_scalars(const prm *P, int64_t step, float *neg_ss, float *bc2s) {
    double bc1 = 1.0 - pow(P->b1, (double)step);
    double bc2 = 1.0 - pow(P->b2, (double)step);
    *neg_ss = (float)(-(P->lr / bc1));
    *bc2s = (float)sqrt(bc2);
}

static void prm_init(prm *P, const stella_optim_hparams *hp, int64_t step) {
    memset(P, 0, sizeof(*P));
    P->kind = hp->kind;
    P->exact = hp->mode == STELLA_OPTIM_EXACT;
    P->nesterov = (hp->flags & STELLA_OPTIM_NESTEROV) != 0;
    P->maximize = (hp->flags & STELLA_OPTIM_MAXIMIZE) != 0;
    P->amsgrad = (hp->flags & STELLA_OPTIM_AMSGRAD) != 0;
    P->lr = hp->lr; P->wd = hp->weight_decay; P->mu = hp->momentum; P->damp = hp->dampening;
    P->b1 = hp->beta1; P->b2 = hp->beta2; P->eps = hp->eps;
    P->has_wd = hp->weight_decay != 0;
    P->has_mom = hp->kind == STELLA_OPTIM_SGD && hp->momentum != 0;
    P->coupled = hp->kind == STELLA_OPTIM_ADAM && P->has_wd;
    P->decoupled = hp->kind == STELLA_OPTIM_ADAMW && P->has_wd;
    P->wd_f = (float)hp->weight_decay;
    P->mu_f = (float)hp->momentum;
    P->damp1_f = (float)(1.0 - hp->dampening);
    P->neg_lr_f = (float)(-hp->lr);
    P->b2_f = (float)hp->beta2;
    P->w1_f = (float)(1.0 - hp->beta1);
    P->w1c_f = 1.0f - P->w1_f;
    P->w2_f = (float)(1.0 - hp->beta2);
    P->eps_f = (float)hp->eps;
    P->decay_f = (float)(1.0 - hp->lr * hp->weight_decay);
    P->tab_end = step;
    if (hp->kind != STELLA_OPTIM_SGD)
        for (int j = 0; j < TAB; j++) {
            int64_t s = step - j;
            if (s < 1) break;
            adam_scalars(P, s, &P->tab_neg_ss[TAB - 1 - j], &P->tab_bc2s[TAB - 1 - j]);
        }
}

static inline int have_tab(const prm *P, int64_t s) { return s <= P->tab_end && s > P->tab_end - TAB && s >= 1; }

/* ---------------------------------------------------------------- SGD */

/* One step of torch's SGD on one coordinate with gradient g. */
static inline void sgd_one(const prm *P, float *p, float *b, float g, int first) {
    float d = P->maximize ? -g : g;
    if (P->has_wd) d = d + P->wd_f * *p;
    float upd = d;
    if (P->has_mom) {
        float bb = first ? d : *b * P->mu_f + P->damp1_f * d;
        *b = bb;
        upd = P->nesterov ? d + P->mu_f * bb : bb;
    }
    *p = *p + P->neg_lr_f * upd;
}

/* sum_{j=1..k} mu^j for mu > 0 */
static double geom(double mu, int64_t k) {
    if (mu == 1.0) return (double)k;
    double lm = log(mu);
    return mu * (-expm1((double)k * lm)) / (1.0 - mu);
}

typedef struct { double a, b, c, d; } mat2;
static mat2 mmul(mat2 x, mat2 y) {
    mat2 r = { x.a * y.a + x.b * y.c, x.a * y.b + x.b * y.d, x.c * y.a + x.d * y.c, x.c * y.b + x.d * y.d };
    return r;
}
static mat2 mpow(mat2 m, int64_t k) {
    mat2 r = { 1, 0, 0, 1 };
    while (k) {
        if (k & 1) r = mmul(r, m);
        m = mmul(m, m);
        k >>= 1;
    }
    return r;
}

/* Zero-gradient steps s+1 .. e of one coordinate (e > s >= 0). */
static void sgd_catch(const prm *P, float *p, float *b, int64_t s, int64_t e) {
    if (!P->has_mom && !P->has_wd) return;
    if (e - s <= SHORT_GAP) {
        for (int64_t tau = s + 1; tau <= e; tau++) sgd_one(P, p, b, 0.0f, tau == 1);
        return;
    }
    if (!P->has_mom) { /* p *= (1 - lr*wd)^k */
        *p = (float)((double)*p * pow(1.0 - P->lr * P->wd, (double)(e - s)));
        return;
    }
    if (s == 0) { sgd_one(P, p, b, 0.0f, 1); s = 1; }
    int64_t k = e - s;
    double mu = P->mu;
    if (!P->has_wd) {
        double b0 = *b, G = geom(mu, k);
        double fac = P->nesterov ? mu * G : G;
        *p = (float)((double)*p - P->lr * fac * b0);
        *b = (float)(b0 * pow(mu, (double)k));
        return;
    }
    /* (p, buf) <- M (p, buf); nesterov requires dampening 0 */
    double c = (1.0 - P->damp) * P->wd, lr = P->lr;
    mat2 m;
    if (P->nesterov) { m.a = 1.0 - lr * P->wd - lr * mu * c; m.b = -lr * mu * mu; }
    else { m.a = 1.0 - lr * c; m.b = -lr * mu; }
    m.c = c; m.d = mu;
    mat2 r = mpow(m, k);
    double p0 = *p, b0 = *b;
    *p = (float)(r.a * p0 + r.b * b0);
    *b = (float)(r.c * p0 + r.d * b0);
}

/* ---------------------------------------------------------------- Adam */

static inline float lerp_f(float a, float b, float w, float wc) {
    /* at::lerp for float: the branch keeps it exact at both ends */
    return (fabsf(w) < 0.5f) ? a + w * (b - a) : b - (b - a) * wc;
}

static inline float fmax_nan(float a, float b) { /* torch.maximum: NaN propagates */
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
}

static inline void adam_one(const prm *P, float *p, float *m, float *v, float *vm, float g,
                            float neg_ss, float bc2s) {
    float d = P->maximize ? -g : g;
    float pp = *p;
    if (P->decoupled) pp = pp * P->decay_f;
    else if (P->coupled) d = d + P->wd_f * pp;
    float mm = lerp_f(*m, d, P->w1_f, P->w1c_f);
    float vv = *v * P->b2_f + P->w2_f * d * d;
    *m = mm;
    *v = vv;
    if (P->amsgrad) { vv = fmax_nan(*vm, vv); *vm = vv; }
    float denom = sqrtf(vv) / bc2s + P->eps_f;
    *p = pp + neg_ss * (mm / denom);
}

static void adam_catch(const prm *P, float *p, float *m, float *v, float *vm, int64_t s, int64_t e) {
    int64_t k = e - s;
    float vmax = P->amsgrad ? *vm : 0.0f;
    if (k > SHORT_GAP && *m == 0.0f && P->eps > 0 && !P->coupled && *v == *v && vmax == vmax) {
        /* m stays 0 so p only sees AdamW's decay; v decays; the max stays */
        *v = (float)((double)*v * pow(P->b2, (double)k));
        if (P->decoupled) *p = (float)((double)*p * pow(1.0 - P->lr * P->wd, (double)k));
        return;
    }
    int64_t tau = s + 1;
    float dummy = 0.0f;
    float *vmp = P->amsgrad ? vm : &dummy;
    /* steps not in the table: scalars from running powers */
    if (!have_tab(P, tau)) {
        double b1p = pow(P->b1, (double)(tau - 1)), b2p = pow(P->b2, (double)(tau - 1));
        for (; tau <= e && !have_tab(P, tau); tau++) {
            b1p *= P->b1;
            b2p *= P->b2;
            float neg_ss = (float)(-(P->lr / (1.0 - b1p)));
            float bc2s = (float)sqrt(1.0 - b2p);
            adam_one(P, p, m, v, vmp, 0.0f, neg_ss, bc2s);
        }
    }
    for (; tau <= e; tau++) {
        int j = (int)(TAB - 1 - (P->tab_end - tau));
        adam_one(P, p, m, v, vmp, 0.0f, P->tab_neg_ss[j], P->tab_bc2s[j]);
    }
}

/* ---------------------------------------------------------------- entry points */

static inline void catch_one(const prm *P, const stella_optim_tensor *t, int64_t c, int64_t s, int64_t e) {
    if (P->kind == STELLA_OPTIM_SGD)
        sgd_catch(P, t->param + c, P->has_mom ? t->buf1 + c : NULL, s, e);
    else
        adam_catch(P, t->param + c, t->buf1 + c, t->buf2 + c, P->amsgrad ? t->buf3 + c : NULL, s, e);
}


/* ---------------------------------------------------------------- one zero-gradient step on a block
 * The catch-up of a whole 16-float block that is exactly one step behind (what a caller that
 * catches up after every step sees everywhere): the same IEEE operations as sgd_one/adam_one
 * with g = 0, lane by lane, so every path gives the same bits. Adam with coupled weight decay
 * or amsgrad keeps the scalar path. */

static int block_simd_ok(const prm *P) {
    if (P->kind == STELLA_OPTIM_SGD) return P->has_mom || P->has_wd;
    return !P->coupled && !P->amsgrad;
}

static void zero_step_scalar(const prm *P, const stella_optim_tensor *t, int64_t c, int64_t len, int64_t step) {
    for (int64_t i = c; i < c + len; i++) catch_one(P, t, i, step - 1, step);
}

#if STELLA_X86
STELLA_TARGET_AVX512 static void zero_step_avx512(const prm *P, const stella_optim_tensor *t, int64_t c, int64_t step) {
    float *p = t->param + c;
    __m512 zero = _mm512_set1_ps(P->maximize ? -0.0f : 0.0f);
    __m512 pp = _mm512_loadu_ps(p);
    if (P->kind == STELLA_OPTIM_SGD) {
        __m512 d = zero;
        if (P->has_wd) d = _mm512_add_ps(d, _mm512_mul_ps(_mm512_set1_ps(P->wd_f), pp));
        __m512 upd = d;
        if (P->has_mom) {
            float *b = t->buf1 + c;
            __m512 mu = _mm512_set1_ps(P->mu_f);
            __m512 bb = step == 1 ? d : _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(b), mu),
                                                      _mm512_mul_ps(_mm512_set1_ps(P->damp1_f), d));
            _mm512_storeu_ps(b, bb);
            upd = P->nesterov ? _mm512_add_ps(d, _mm512_mul_ps(mu, bb)) : bb;
        }
        _mm512_storeu_ps(p, _mm512_add_ps(pp, _mm512_mul_ps(_mm512_set1_ps(P->neg_lr_f), upd)));
        return;
    }
    int j = (int)(TAB - 1);  /* step is the table's last entry */
    float *m = t->buf1 + c, *v = t->buf2 + c;
    if (P->decoupled) pp = _mm512_mul_ps(pp, _mm512_set1_ps(P->decay_f));
    __m512 mm = _mm512_loadu_ps(m);
    if (fabsf(P->w1_f) < 0.5f) mm = _mm512_add_ps(mm, _mm512_mul_ps(_mm512_set1_ps(P->w1_f), _mm512_sub_ps(zero, mm)));
    else mm = _mm512_sub_ps(zero, _mm512_mul_ps(_mm512_sub_ps(zero, mm), _mm512_set1_ps(P->w1c_f)));
    __m512 g2 = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(P->w2_f), zero), zero);
    __m512 vv = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(P->b2_f)), g2);
    _mm512_storeu_ps(m, mm);
    _mm512_storeu_ps(v, vv);
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), _mm512_set1_ps(P->tab_bc2s[j])), _mm512_set1_ps(P->eps_f));
    _mm512_storeu_ps(p, _mm512_add_ps(pp, _mm512_mul_ps(_mm512_set1_ps(P->tab_neg_ss[j]), _mm512_div_ps(mm, denom))));
}

STELLA_TARGET_AVX2 static void zero_step_avx2(const prm *P, const stella_optim_tensor *t, int64_t c, int64_t step) {
    for (int h = 0; h < 16; h += 8) {
        float *p = t->param + c + h;
        __m256 zero = _mm256_set1_ps(P->maximize ? -0.0f : 0.0f);
        __m256 pp = _mm256_loadu_ps(p);
        if (P->kind == STELLA_OPTIM_SGD) {
            __m256 d = zero;
            if (P->has_wd) d = _mm256_add_ps(d, _mm256_mul_ps(_mm256_set1_ps(P->wd_f), pp));
            __m256 upd = d;
            if (P->has_mom) {
                float *b = t->buf1 + c + h;
                __m256 mu = _mm256_set1_ps(P->mu_f);
                __m256 bb = step == 1 ? d : _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(b), mu),
                                                          _mm256_mul_ps(_mm256_set1_ps(P->damp1_f), d));
                _mm256_storeu_ps(b, bb);
                upd = P->nesterov ? _mm256_add_ps(d, _mm256_mul_ps(mu, bb)) : bb;
            }
            _mm256_storeu_ps(p, _mm256_add_ps(pp, _mm256_mul_ps(_mm256_set1_ps(P->neg_lr_f), upd)));
            continue;
        }
        int j = (int)(TAB - 1);
        float *m = t->buf1 + c + h, *v = t->buf2 + c + h;
        if (P->decoupled) pp = _mm256_mul_ps(pp, _mm256_set1_ps(P->decay_f));
        __m256 mm = _mm256_loadu_ps(m);
        if (fabsf(P->w1_f) < 0.5f) mm = _mm256_add_ps(mm, _mm256_mul_ps(_mm256_set1_ps(P->w1_f), _mm256_sub_ps(zero, mm)));
        else mm = _mm256_sub_ps(zero, _mm256_mul_ps(_mm256_sub_ps(zero, mm), _mm256_set1_ps(P->w1c_f)));
        __m256 g2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(P->w2_f), zero), zero);
        __m256 vv = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v), _mm256_set1_ps(P->b2_f)), g2);
        _mm256_storeu_ps(m, mm);
        _mm256_storeu_ps(v, vv);
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), _mm256_set1_ps(P->tab_bc2s[j])), _mm256_set1_ps(P->eps_f));
        _mm256_storeu_ps(p, _mm256_add_ps(pp, _mm256_mul_ps(_mm256_set1_ps(P->tab_neg_ss[j]), _mm256_div_ps(mm, denom))));
    }
}
#endif

/* 16 coordinates from c, all at step - 1, to step. */
static void zero_step_block(const prm *P, const stella_optim_tensor *t, int64_t c, int64_t step, int lvl) {
#if STELLA_X86
    if (lvl >= STELLA_SIMD_AVX512) { zero_step_avx512(P, t, c, step); return; }
    if (lvl >= STELLA_SIMD_AVX2) { zero_step_avx2(P, t, c, step); return; }
#endif
    (void)lvl;
    zero_step_scalar(P, t, c, 16, step);
}

int stella_optim_validate_entries(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                                  const uint32_t *idx, int64_t lo, int64_t hi, int64_t step,
                                  int64_t cmin, int64_t cmax) {
    int exact = hp->mode == STELLA_OPTIM_EXACT;
    int64_t prev = cmin - 1;
    for (int64_t j = lo; j < hi; j++) {
        int64_t c = idx[j];
        if (c <= prev || c >= cmax) return STELLA_ERR_MALFORMED;
        prev = c;
        if (exact) {
            int32_t s = t->last[c];
            if (s < 0 || s >= step) return STELLA_ERR_ARG;
        }
    }
    return STELLA_OK;
}

void stella_optim_apply_unchecked(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                                  const uint32_t *idx, const float *val, int64_t lo, int64_t hi,
                                  int64_t step) {
    if (hi <= lo) return;
    prm P;
    prm_init(&P, hp, step);
    float *p = t->param, *b1 = t->buf1, *b2 = t->buf2, *b3 = t->buf3;
    int32_t *last = t->last;
    if (hp->kind == STELLA_OPTIM_SGD) {
        int first = step == 1;
        for (int64_t j = lo; j < hi; j++) {
            int64_t c = idx[j];
            if (P.exact) {
                int64_t s = last[c];
                if (s < step - 1) sgd_catch(&P, p + c, P.has_mom ? b1 + c : NULL, s, step - 1);
                last[c] = (int32_t)step;
            }
            sgd_one(&P, p + c, P.has_mom ? b1 + c : NULL, val[j], first);
        }
    } else {
        float neg_ss = P.tab_neg_ss[TAB - 1], bc2s = P.tab_bc2s[TAB - 1];
        float dummy = 0.0f;
        for (int64_t j = lo; j < hi; j++) {
            int64_t c = idx[j];
            float *vm = P.amsgrad ? b3 + c : &dummy;
            if (P.exact) {
                int64_t s = last[c];
                if (s < step - 1) adam_catch(&P, p + c, b1 + c, b2 + c, vm, s, step - 1);
                last[c] = (int32_t)step;
            }
            adam_one(&P, p + c, b1 + c, b2 + c, vm, val[j], neg_ss, bc2s);
        }
    }
}

int stella_optim_apply(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                       const uint32_t *idx, const float *val, int64_t k, int64_t lo, int64_t hi,
                       int64_t step) {
    int rc = stella_optim_check(hp, t);
    if (rc) return rc;
    if (k < 0 || lo < 0 || hi < lo || hi > k) return STELLA_ERR_ARG;
    if (step < 1 || step > STELLA_OPTIM_MAX_STEP) return STELLA_ERR_ARG;
    if (hi == lo) return STELLA_OK;
    if (!idx || !val) return STELLA_ERR_NULL;
    rc = stella_optim_validate_entries(hp, t, idx, lo, hi, step, 0, t->n);
    if (rc) return rc;
    stella_optim_apply_unchecked(hp, t, idx, val, lo, hi, step);
    return STELLA_OK;
}

int stella_optim_validate(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                          const uint32_t *idx, int64_t k, int64_t step) {
    int rc = stella_optim_check(hp, t);
    if (rc) return rc;
    if (k < 0 || step < 1 || step > STELLA_OPTIM_MAX_STEP) return STELLA_ERR_ARG;
    if (k == 0) return STELLA_OK;
    if (!idx) return STELLA_ERR_NULL;
    return stella_optim_validate_entries(hp, t, idx, 0, k, step, 0, t->n);
}

int stella_optim_catch_up(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                          int64_t c0, int64_t c1, int64_t step) {
    int rc = stella_optim_check(hp, t);
    if (rc) return rc;
    if (c0 < 0 || c1 < c0 || c1 > t->n) return STELLA_ERR_ARG;
    if (step < 0 || step > STELLA_OPTIM_MAX_STEP) return STELLA_ERR_ARG;
    if (hp->mode != STELLA_OPTIM_EXACT || c1 == c0) return STELLA_OK;
    prm P;
    prm_init(&P, hp, step);
    int32_t *last = t->last;
    int bad = 0;
    int trivial = hp->kind == STELLA_OPTIM_SGD && !P.has_mom && !P.has_wd;
    int lvl = block_simd_ok(&P) && step >= 1 ? stella_simd_level_internal() : STELLA_SIMD_SCALAR;
    int64_t c = c0;
    while (c < c1) {
        if (lvl > STELLA_SIMD_SCALAR && (c & 15) == 0 && c + 16 <= c1) {
            /* whole block: all current, or all exactly one step behind, takes the vector path */
            int behind = 0, current = 0;
            for (int i = 0; i < 16; i++) {
                behind += last[c + i] == step - 1;
                current += last[c + i] == step;
            }
            if (current == 16) { c += 16; continue; }
            if (behind == 16) {
                zero_step_block(&P, t, c, step, lvl);
                for (int i = 0; i < 16; i++) last[c + i] = (int32_t)step;
                c += 16;
                continue;
            }
        }
        int64_t s = last[c];
        if (s != step) {
            if (s < 0 || s > step) bad = 1;
            else {
                if (!trivial) catch_one(&P, t, c, s, step);
                last[c] = (int32_t)step;
            }
        }
        c++;
    }
    return bad ? STELLA_ERR_ARG : STELLA_OK;
}

int stella_optim_lower_bound(const uint32_t *idx, int64_t k, int64_t coord, int64_t *pos) {
    if (!pos) return STELLA_ERR_NULL;
    if (k < 0) return STELLA_ERR_ARG;
    if (k > 0 && !idx) return STELLA_ERR_NULL;
    int64_t lo = 0, hi = k;
    if (coord <= 0) { *pos = 0; return STELLA_OK; }
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if ((int64_t)idx[mid] < coord) lo = mid + 1;
        else hi = mid;
    }
    *pos = lo;
    return STELLA_OK;
}
