/*
 * image.c - openpi's image preprocessing: uint8 conversion, Pillow's bilinear resize_with_pad and the
 * [-1, 1] scaling, each written to give the same bits as the Python code it replaces.
 *
 * The resize reproduces Pillow's ImagingResample (src/libImaging/Resample.c) for 8-bit RGB with the
 * BILINEAR filter: a separable convolution, horizontal pass first, whose triangle filter is widened by the
 * shrink factor (so downscaling averages over the whole footprint instead of sampling), with per-output
 * coefficients computed in double, normalized, rounded to 22-bit fixed point and accumulated in integers.
 *
 * Pillow version: openpi's uv.lock pins Pillow 11.2.1, and every Pillow up to 12.1 runs the horizontal pass
 * first. Pillow 12.2 (images over 100x taller than wide) and 13.0 (height shrinking by more than twice the
 * width's shrink) run the vertical pass first, which moves some pixels of such images by 1.
 */
#include "model/image.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util/error.h"

/* Pillow's PRECISION_BITS (32 - 8 - 2): fixed-point weights are round(w * 2^22). */
#define PRECISION_BITS PI0_RESIZE_PRECISION_BITS
/* Sides above this are refused so that every index and bound below fits an int (Pillow uses int too). */
#define MAX_SIDE (1 << 24)

/* ---- Pillow's resampling ------------------------------------------------------------------------------ */

/* Pillow's bilinear_filter: the triangle 1 - |x| on (-1, 1); its support is 1.0. */
static double bilinear_filter(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

void pi0_axis_weights_free(pi0_axis_weights *k) {
    free(k->first);
    free(k->count);
    free(k->weights);
}

/* Fixed-point weights of output sample `out_index` (Pillow's precompute_coeffs loop body followed by
 * normalize_coeffs_8bpc), in the same double operations and the same order. */
static void axis_kernel_sample(pi0_axis_weights *k, int out_index, int in_size, double scale, double filter_scale,
                               double support, double *w) {
    double center = (out_index + 0.5) * scale;
    double inv_filter_scale = 1.0 / filter_scale;
    /* Pillow's "Round the value": truncation toward zero of x + 0.5, then clamped to the image. */
    int lo = (int)(center - support + 0.5);
    int hi = (int)(center + support + 0.5);
    if (lo < 0) lo = 0;
    if (hi > in_size) hi = in_size;
    int taps = hi - lo;

    double sum = 0.0;
    for (int t = 0; t < taps; t++) {
        w[t] = bilinear_filter((t + lo - center + 0.5) * inv_filter_scale);
        sum += w[t];
    }
    int32_t *fixed = k->weights + (size_t)out_index * k->max_taps;
    for (int t = 0; t < taps; t++) {
        double normalized = sum != 0.0 ? w[t] / sum : w[t];
        /* Bilinear weights are never negative, so Pillow's rounding is always the +0.5 branch. */
        fixed[t] = (int32_t)(0.5 + normalized * (1 << PRECISION_BITS));
    }
    k->first[out_index] = lo;
    k->count[out_index] = taps;
}

/* Pillow's precompute_coeffs for the default box (0, in_size): the filter keeps its own width when
 * enlarging and is stretched by in/out when shrinking, which is what antialiases downscaled images.
 * The caller has checked the sizes (1 .. MAX_SIDE). */
pi0_status pi0_axis_weights_init(pi0_axis_weights *k, int in_size, int out_size, pi0_error *err) {
    /* Pillow takes the box as floats: scale = (double)(in1 - in0) / outSize. */
    double scale = (double)(float)in_size / out_size;
    double filter_scale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filter_scale; /* BILINEAR.support * filterscale */
    k->max_taps = (size_t)ceil(support) * 2 + 1;
    k->first = malloc((size_t)out_size * sizeof *k->first);
    k->count = malloc((size_t)out_size * sizeof *k->count);
    k->weights = calloc((size_t)out_size * k->max_taps, sizeof *k->weights);
    double *w = malloc(k->max_taps * sizeof *w);
    if (!k->first || !k->count || !k->weights || !w) {
        free(w);
        pi0_axis_weights_free(k);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for the resampling weights of %d -> %d pixels",
                        in_size, out_size);
    }
    for (int i = 0; i < out_size; i++) axis_kernel_sample(k, i, in_size, scale, filter_scale, support, w);
    free(w);
    return PI0_OK;
}

/* Pillow's clip8: the accumulator's integer part, saturated to [0, 255]. */
static uint8_t clip8(int64_t acc) {
    if (acc < 0) return 0;
    int64_t v = acc >> PRECISION_BITS;
    return v > 255 ? 255 : (uint8_t)v;
}

/*
 * ImagingResampleHorizontal_8bpc: along each of `rows` rows, output pixel i gets, per RGB channel,
 * clip8(2^21 + sum_t w[t] * in[first + t]), the 2^21 rounding the fixed-point sum to nearest. Pillow
 * accumulates in int, which is exact while the weights' sum stays near 2^22 (up to PI0_RESIZE_INT32_TAPS
 * taps: every resize a policy does); int64 keeps huge shrink factors exact too.
 */

static void resample_rows(const pi0_axis_weights *k, int out_w, int rows, const uint8_t *src, size_t src_row, uint8_t *dst,
                          size_t dst_row) {
    int narrow = k->max_taps <= PI0_RESIZE_INT32_TAPS;
    for (int y = 0; y < rows; y++) {
        const uint8_t *in = src + (size_t)y * src_row;
        uint8_t *out = dst + (size_t)y * dst_row;
        for (int i = 0; i < out_w; i++) {
            const int32_t *w = k->weights + (size_t)i * k->max_taps;
            const uint8_t *p = in + (size_t)k->first[i] * 3;
            int n = k->count[i];
            if (narrow) {
                int32_t r = 1 << (PRECISION_BITS - 1), g = r, b = r;
                for (int t = 0; t < n; t++, p += 3) r += p[0] * w[t], g += p[1] * w[t], b += p[2] * w[t];
                out[(size_t)i * 3] = clip8(r), out[(size_t)i * 3 + 1] = clip8(g), out[(size_t)i * 3 + 2] = clip8(b);
                continue;
            }
            int64_t acc[3] = {1 << (PRECISION_BITS - 1), 1 << (PRECISION_BITS - 1), 1 << (PRECISION_BITS - 1)};
            for (int t = 0; t < n; t++, p += 3)
                for (int c = 0; c < 3; c++) acc[c] += (int64_t)p[c] * w[t];
            for (int c = 0; c < 3; c++) out[(size_t)i * 3 + c] = clip8(acc[c]);
        }
    }
}

/*
 * ImagingResampleVertical_8bpc: output row i is, byte by byte, the same fixed-point sum over input rows
 * first[i] .. first[i] + count[i] - 1. Row by row (each tap a contiguous row, one accumulator per byte of
 * the row), which gives the same integer sums as Pillow's order and lets the compiler vectorize.
 */
static void resample_columns(const pi0_axis_weights *k, int out_h, size_t row_bytes, const uint8_t *src, size_t src_row,
                             uint8_t *dst, size_t dst_row, int64_t *acc) {
    int32_t *acc32 = (int32_t *)acc;
    int narrow = k->max_taps <= PI0_RESIZE_INT32_TAPS;
    for (int i = 0; i < out_h; i++) {
        const int32_t *w = k->weights + (size_t)i * k->max_taps;
        uint8_t *out = dst + (size_t)i * dst_row;
        if (narrow) {
            for (size_t x = 0; x < row_bytes; x++) acc32[x] = 1 << (PRECISION_BITS - 1);
            for (int t = 0; t < k->count[i]; t++) {
                const uint8_t *in = src + (size_t)(k->first[i] + t) * src_row;
                for (size_t x = 0; x < row_bytes; x++) acc32[x] += in[x] * w[t];
            }
            for (size_t x = 0; x < row_bytes; x++) out[x] = clip8(acc32[x]);
            continue;
        }
        for (size_t x = 0; x < row_bytes; x++) acc[x] = 1 << (PRECISION_BITS - 1);
        for (int t = 0; t < k->count[i]; t++) {
            const uint8_t *in = src + (size_t)(k->first[i] + t) * src_row;
            for (size_t x = 0; x < row_bytes; x++) acc[x] += (int64_t)in[x] * w[t];
        }
        for (size_t x = 0; x < row_bytes; x++) out[x] = clip8(acc[x]);
    }
}

/*
 * Pillow's Image.resize(size, BILINEAR) of an RGB image (ImagingResampleInner up to Pillow 12.1): a pass runs
 * only along an axis whose size changes, the horizontal one first; with neither the image is copied. Writes
 * new_h rows of new_w * 3 bytes to dst, `dst_row` bytes apart.
 */
static pi0_status pillow_resize_bilinear(const uint8_t *src, int height, int width, int new_h, int new_w,
                                         uint8_t *dst, size_t dst_row, pi0_error *err) {
    int horizontal = new_w != width, vertical = new_h != height;
    size_t src_row = (size_t)width * 3;
    if (!horizontal && !vertical) {
        for (int y = 0; y < height; y++) memcpy(dst + (size_t)y * dst_row, src + (size_t)y * src_row, src_row);
        return PI0_OK;
    }

    pi0_axis_weights kx = {0}, ky = {0};
    uint8_t *tmp = NULL;
    pi0_status st = PI0_OK;
    if (horizontal && (st = pi0_axis_weights_init(&kx, width, new_w, err)) != PI0_OK) return st;
    if (vertical && (st = pi0_axis_weights_init(&ky, height, new_h, err)) != PI0_OK) goto done;

    /* the vertical pass reads `rows` rows of row_bytes: the horizontal pass's output, or the source */
    size_t row_bytes = (size_t)(horizontal ? new_w : width) * 3;
    tmp = malloc((horizontal && vertical ? (size_t)height * row_bytes : 0) + (vertical ? row_bytes * sizeof(int64_t) : 0) + 1);
    if (!tmp) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for a %dx%d resize buffer", height, new_w);
        goto done;
    }
    int64_t *acc = (int64_t *)tmp; /* the vertical pass's accumulators, then the horizontal pass's rows */
    uint8_t *rows = tmp + (vertical ? row_bytes * sizeof(int64_t) : 0);
    if (horizontal && vertical) {
        resample_rows(&kx, new_w, height, src, src_row, rows, row_bytes);
        resample_columns(&ky, new_h, row_bytes, rows, row_bytes, dst, dst_row, acc);
    } else if (horizontal) {
        resample_rows(&kx, new_w, height, src, src_row, dst, dst_row);
    } else {
        resample_columns(&ky, new_h, row_bytes, src, src_row, dst, dst_row, acc);
    }
done:
    free(tmp);
    pi0_axis_weights_free(&kx);
    pi0_axis_weights_free(&ky);
    return st;
}

/* ---- openpi's resize_with_pad --------------------------------------------------------------------------- */

/*
 * openpi_client/image_tools.py _resize_with_pad_pil, in the same double arithmetic:
 *     ratio = max(cur_width / width, cur_height / height)
 *     resized_height = int(cur_height / ratio); resized_width = int(cur_width / ratio)
 *     pad_height = max(0, int((height - resized_height) / 2)); pad_width likewise
 * openpi raises (Pillow: "height and width must be > 0") when a very thin image's short side rounds to
 * 0 pixels; here that side keeps 1 pixel instead, so every image gets an answer.
 */
void pi0_resize_with_pad_geometry(int height, int width, int out_h, int out_w, int *new_h, int *new_w, int *pad_y,
                                  int *pad_x) {
    double ratio_w = (double)width / out_w, ratio_h = (double)height / out_h;
    double ratio = ratio_w >= ratio_h ? ratio_w : ratio_h;
    *new_h = (int)(height / ratio);
    *new_w = (int)(width / ratio);
    if (*new_h < 1) *new_h = 1;
    if (*new_w < 1) *new_w = 1;
    /* Python's int((height - resized) / 2) truncates toward zero, as C's integer division does. */
    *pad_y = (out_h - *new_h) / 2;
    *pad_x = (out_w - *new_w) / 2;
    if (*pad_y < 0) *pad_y = 0;
    if (*pad_x < 0) *pad_x = 0;
}

static pi0_status check_side(const char *what, int side, pi0_error *err) {
    if (side <= 0 || side > MAX_SIDE)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s %d is out of range (1 .. %d)", what, side, MAX_SIDE);
    return PI0_OK;
}

pi0_status pi0_resize_with_pad_u8(const uint8_t *src, int height, int width, int out_h, int out_w, uint8_t *dst,
                                  pi0_error *err) {
    pi0_status st;
    if (!src || !dst) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "resize_with_pad: NULL image buffer");
    if ((st = check_side("image height", height, err)) || (st = check_side("image width", width, err)) ||
        (st = check_side("target height", out_h, err)) || (st = check_side("target width", out_w, err)))
        return st;

    size_t dst_row = (size_t)out_w * 3;
    /* resize_with_pad returns an image that already has the target size as is. */
    if (height == out_h && width == out_w) {
        memcpy(dst, src, (size_t)out_h * dst_row);
        return PI0_OK;
    }
    int new_h, new_w, pad_y, pad_x;
    pi0_resize_with_pad_geometry(height, width, out_h, out_w, &new_h, &new_w, &pad_y, &pad_x);
    /* Image.new(mode, (width, height), 0) then paste at (pad_width, pad_height). */
    memset(dst, 0, (size_t)out_h * dst_row);
    uint8_t *region = dst + (size_t)pad_y * dst_row + (size_t)pad_x * 3;
    return pillow_resize_bilinear(src, height, width, new_h, new_w, region, dst_row, err);
}

/* ---- the whole image path -------------------------------------------------------------------------------- */

/*
 * openpi's float -> uint8 step, `(255 * img).astype(np.uint8)` (libero_policy._parse_image, the other
 * robots' input transforms and openpi_client.image_tools.convert_to_uint8; no clipping upstream). The
 * product is float32 (a Python scalar does not promote the array) and numpy's cast on x86-64 is the C cast
 * through int32: truncate toward zero (cvttss2si), keep the low 8 bits. So values in [0, 1] truncate
 * (0.999 -> 254), slightly negative ones wrap (-0.004 -> 255), 1.5 -> 126, and NaN, infinities and
 * |255 x| >= 2^31 become 0.
 */
static uint8_t float_to_u8_like_numpy(float x) {
    float scaled = 255.0f * x;
    if (!(scaled >= -2147483648.0f && scaled < 2147483648.0f)) return 0; /* cvttss2si's INT32_MIN */
    return (uint8_t)(int32_t)scaled;
}

/* CHW -> HWC (openpi: einops.rearrange(image, "c h w -> h w c")) and float -> uint8, in one sweep. */
static void image_to_hwc_u8(const pi0_image *img, uint8_t *hwc) {
    if (img->layout == PI0_LAYOUT_HWC && img->type == PI0_PIXEL_U8) { /* already openpi's uint8 HWC */
        memcpy(hwc, img->data, (size_t)img->height * img->width * 3);
        return;
    }
    size_t h = (size_t)img->height, w = (size_t)img->width;
    const uint8_t *u8 = img->data;
    const float *f32 = img->data;
    for (size_t y = 0; y < h; y++)
        for (size_t x = 0; x < w; x++)
            for (size_t c = 0; c < 3; c++) {
                size_t from = img->layout == PI0_LAYOUT_HWC ? (y * w + x) * 3 + c : (c * h + y) * w + x;
                hwc[(y * w + x) * 3 + c] = img->type == PI0_PIXEL_U8 ? u8[from] : float_to_u8_like_numpy(f32[from]);
            }
}

static pi0_status check_image(const pi0_image *img, const void *out, pi0_error *err) {
    if (!img || !img->data || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "image: NULL image or output");
    if (img->type != PI0_PIXEL_U8 && img->type != PI0_PIXEL_F32)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "image: unknown pixel type %d", (int)img->type);
    if (img->layout != PI0_LAYOUT_HWC && img->layout != PI0_LAYOUT_CHW)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "image: unknown layout %d", (int)img->layout);
    int chw = img->layout == PI0_LAYOUT_CHW;
    int d0 = chw ? img->channels : img->height, d1 = chw ? img->height : img->width;
    int d2 = chw ? img->width : img->channels;
    if (img->channels != 3 || img->height <= 0 || img->width <= 0 || img->height > MAX_SIDE || img->width > MAX_SIDE)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                        "image of shape (%d, %d, %d) %s: expected 3 channels and sides in 1 .. %d", d0, d1, d2,
                        chw ? "CHW" : "HWC", MAX_SIDE);
    return PI0_OK;
}

pi0_status pi0_image_to_frame(const pi0_image *img, uint8_t *hwc, pi0_error *err) {
    pi0_status st = check_image(img, hwc, err);
    if (st != PI0_OK) return st;
    image_to_hwc_u8(img, hwc);
    return PI0_OK;
}

pi0_status pi0_image_preprocess(const pi0_image *img, int out_size, float *out, pi0_error *err) {
    pi0_status st = check_image(img, out, err);
    if (st == PI0_OK) st = check_side("image output size", out_size, err);
    if (st != PI0_OK) return st;

    size_t in_bytes = (size_t)img->height * (size_t)img->width * 3, out_bytes = (size_t)out_size * out_size * 3;
    int resize = img->height != out_size || img->width != out_size;
    int as_is = img->layout == PI0_LAYOUT_HWC && img->type == PI0_PIXEL_U8; /* already openpi's uint8 HWC */
    uint8_t *owned = as_is ? NULL : malloc(in_bytes), *resized = resize ? malloc(out_bytes) : NULL;
    const uint8_t *hwc = as_is ? img->data : owned;
    if ((!as_is && !owned) || (resize && !resized)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for a %dx%d image", img->height, img->width);
        goto done;
    }
    if (!as_is) image_to_hwc_u8(img, owned);
    if (resize && (st = pi0_resize_with_pad_u8(hwc, img->height, img->width, out_size, out_size, resized, err)))
        goto done;
    /* Observation.from_dict: img.astype(np.float32) / 255.0 * 2.0 - 1.0, each step rounded to float32: a
     * table of the 256 values, computed by that very expression. */
    float value[256];
    for (int v = 0; v < 256; v++) value[v] = (float)v / 255.0f * 2.0f - 1.0f;
    const uint8_t *pixels = resize ? resized : hwc;
    for (size_t i = 0; i < out_bytes; i++) out[i] = value[pixels[i]];
done:
    free(resized);
    free(owned);
    return st;
}
