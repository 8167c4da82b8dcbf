/* A blend's indices: which dataset each sample comes from, and its sample number there.

   The same numbers as megatron-core's `build_blending_indices` and
   `build_exhaustive_blending_indices` (megatron/core/datasets/helpers.cpp): sample s goes
   to the dataset of largest error w[i] * max(s, 1) - counts[i], the lowest index among
   equals, each error computed as there in doubles, a product then a difference (built
   with -ffp-contract=off: no fused multiply-add). megatron compares every dataset at
   every sample, O(samples x datasets). Here a sample compares a few, the hot ones:

   - When the hot set is chosen (sample t), it holds the datasets whose errors are within
     `spread` of the largest (`spread` adapts to keep them few), `theta` is the largest
     error of the others and `wmax` their largest weight. An error grows by its weight a
     sample while its dataset is not sampled, so at sample s no other dataset's error
     exceeds theta + wmax (s - t): while the best hot error does, it is the largest.
   - A sampled dataset leaves the hot set; its error, one lower, and its weight join the
     others'.
   - When the bound cannot tell, the hot set is chosen again; when even a fresh one cannot
     (more errors equal to the last bit than a hot set holds, as with many equal weights),
     every dataset is compared, for a number of samples that doubles while that lasts.

   The comparisons that pick a sample's dataset are megatron's own, on the same doubles;
   the bound, with a margin above the rounding of every error it covers, only decides which
   datasets take part. A sample costs about the same at 1 dataset and at 195 (a choice
   every dozen samples, a scan of a few dozen errors the compiler vectorizes): per-sample
   figures, megatron's beside, in docs/data.md ("Training data at scale"). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HOT_MIN 4
#define HOT_MAX 32

typedef struct {
    int32_t n;
    double *w, *c, *e;   /* each dataset's weight, count (as megatron's double), error */
    const int64_t *caps; /* exhaustive: no dataset beyond its size; else NULL */
    double margin;       /* above the rounding of any error up to the last sample */
    /* the hot set, HOT_MAX entries; an unused or sampled one has weight 0, count inf */
    double hot_w[HOT_MAX], hot_c[HOT_MAX], hot_e[HOT_MAX];
    int32_t hot_id[HOT_MAX], hot_size, alive;  /* hot_size: entries used, HOT_MAX at most */
    double theta, wmax, spread;
    int64_t chosen_at, compare_all_until, backoff;
} Blend;

static inline double sample_double(int64_t s) { return s < 1 ? 1.0 : (double)s; }

/* Every error at sample double `sd` into b->e; the largest. */
static double errors(Blend *b, double sd) {
    const double *w = b->w, *c = b->c;
    double *e = b->e, top = -INFINITY;
    int32_t n = b->n;
#pragma omp simd reduction(max : top)
    for (int32_t k = 0; k < n; k++) {
        e[k] = w[k] * sd - c[k];
        top = e[k] > top ? e[k] : top;
    }
    return top;
}

static int32_t at_least(const Blend *b, double cut) {
    const double *e = b->e;
    int32_t n = b->n, count = 0;
#pragma omp simd reduction(+ : count)
    for (int32_t k = 0; k < n; k++) count += e[k] >= cut;
    return count;
}

/* The hot set at sample s: the errors within `spread` of the largest, HOT_MIN to HOT_MAX
   of them where the errors allow; none when more than HOT_MAX tie for the largest. Unused
   entries have weight 0 and count inf: an error of -inf. */
static void choose_hot(Blend *b, int64_t s) {
    double top = errors(b, sample_double(s));
    int32_t count = at_least(b, top - b->spread);
    for (int tries = 0; tries < 8; tries++) {
        if (count > HOT_MAX && b->spread > b->margin) b->spread *= 0.25;
        else if (count < HOT_MIN && count < b->n && b->spread < 2.0) b->spread *= 4.0;
        else break;
        count = at_least(b, top - b->spread);
    }
    double cut = count <= HOT_MAX ? top - b->spread : INFINITY, theta = -INFINITY, wmax = 0;
    int32_t h = 0;
    for (int32_t k = 0; k < b->n; k++) {  /* in id order */
        double e = b->e[k], w = b->w[k];
        if (e >= cut) {  /* a few in many: a branch the predictor learns */
            b->hot_id[h] = k;
            b->hot_w[h] = w;
            b->hot_c[h++] = b->c[k];
        } else {
            theta = e > theta ? e : theta;
            wmax = w > wmax ? w : wmax;
        }
    }
    for (int32_t k = h; k < b->hot_size; k++) {
        b->hot_id[k] = INT32_MAX;
        b->hot_w[k] = 0.0;
        b->hot_c[k] = INFINITY;
    }
    b->alive = h;
    b->theta = theta;
    b->wmax = wmax;
    b->chosen_at = s;
}

/* The best hot error at `sd` and its entry: the first equal to it, the lowest id (the
   entries are in id order; a sampled or unused one's error is -inf). */
static int32_t hot_best(Blend *b, double sd, double *best) {
    double top = -INFINITY, *e = b->hot_e;
#pragma omp simd reduction(max : top)
    for (int32_t k = 0; k < b->hot_size; k++) {
        e[k] = b->hot_w[k] * sd - b->hot_c[k];
        top = e[k] > top ? e[k] : top;
    }
    int32_t at = 0;
    while (e[at] != top) at++;
    *best = top;
    return at;
}

/* The dataset of sample s, and its hot entry (-1: not hot). */
static int32_t pick(Blend *b, int64_t s, int32_t *entry) {
    double sd = sample_double(s), best;
    if (s >= b->compare_all_until) {
        if (b->alive == 0) choose_hot(b, s);
        for (;;) {
            if (b->alive > 0) {
                int32_t at = hot_best(b, sd, &best);
                double others = b->theta + b->wmax * (double)(s - b->chosen_at) + 4 * b->margin;
                if (best > others) {
                    if (b->chosen_at == s) b->backoff = 1;
                    *entry = at;
                    return b->hot_id[at];
                }
            }
            if (b->chosen_at == s) break;
            choose_hot(b, s);
        }
        /* Not even a fresh hot set can tell: compare every dataset for a while (doubling
           while it lasts), instead of choosing a hot set at every sample. */
        b->compare_all_until = s + b->backoff;
        b->backoff = b->backoff < 4096 ? 2 * b->backoff : b->backoff;
    }
    double top = errors(b, sd);  /* megatron's way: every dataset */
    int32_t i = 0;
    while (b->e[i] != top) i++;
    b->alive = 0;  /* the winner may be hot or not: a new hot set when next chosen */
    *entry = -1;
    return i;
}

/* Dataset i (hot entry `entry`, or -1) took sample s: its count; its error, one lower,
   and its weight under the others' bound. */
static void sampled(Blend *b, int32_t i, int32_t entry, int64_t s) {
    b->c[i] += 1.0;
    if (b->caps && b->c[i] >= (double)b->caps[i]) {  /* exhausted: never again */
        b->w[i] = 0.0;
        b->c[i] = INFINITY;
    }
    if (entry >= 0) {
        b->hot_w[entry] = 0.0;  /* its error is now -inf: never above a live one's */
        b->hot_c[entry] = INFINITY;
        b->alive--;
    }
    double now = b->w[i] * sample_double(s) - b->c[i];
    b->theta = now > b->theta ? now : b->theta;
    b->wmax = b->w[i] > b->wmax ? b->w[i] : b->wmax;
}

/* Samples [start, start + count) of the blend of `n` datasets of `weights`, from `counts`
   (each dataset's samples before `start`; updated). `caps`: the exhaustive blend's sizes,
   else NULL. `dataset_index` and `dataset_sample_index` may be NULL (the counts only).
   Returns 0, or -1 when out of memory. */
int stem_blend(const double *weights, int32_t n, const int64_t *caps, int64_t start,
               int64_t count, int64_t *counts, int16_t *dataset_index,
               int64_t *dataset_sample_index) {
    Blend b;
    memset(&b, 0, sizeof b);
    b.n = n;
    b.caps = caps;
    b.spread = 0.125;
    b.backoff = 1;
    b.hot_size = n < HOT_MAX ? (n + 3) / 4 * 4 : HOT_MAX;
    b.w = malloc(sizeof(double) * n);
    b.c = malloc(sizeof(double) * n);
    b.e = malloc(sizeof(double) * n);
    if (!b.w || !b.c || !b.e) {
        free(b.w);
        free(b.c);
        free(b.e);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        int spent = caps && counts[i] >= caps[i];
        b.w[i] = spent ? 0.0 : weights[i];
        b.c[i] = spent ? INFINITY : (double)counts[i];
    }
    /* An error's rounding is below (s + 2) ulp(1); the bound's own arithmetic likewise. */
    b.margin = ((double)(start + count) + 2) * 0x1p-51;
    for (int64_t s = start; s < start + count; s++) {
        int32_t entry, i = pick(&b, s, &entry);
        if (dataset_index) {
            dataset_index[s - start] = (int16_t)i;
            dataset_sample_index[s - start] = counts[i];
        }
        counts[i] += 1;
        sampled(&b, i, entry, s);
    }
    free(b.w);
    free(b.c);
    free(b.e);
    return 0;
}
