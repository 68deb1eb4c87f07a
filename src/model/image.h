/*
 * image.h - camera image preprocessing, bit-for-bit like openpi's policy transforms.
 *
 * openpi turns a camera frame into model input in three steps (docs/policy.md#images):
 *   1. the robot's input transform (e.g. libero_policy._parse_image): float -> uint8 by
 *      `(255 * img).astype(np.uint8)`, then CHW -> HWC;
 *   2. transforms.ResizeImages: openpi_client.image_tools.resize_with_pad (Pillow bilinear resize that
 *      keeps the aspect ratio, pasted centred on a zero image);
 *   3. Observation.from_dict: `img.astype(np.float32) / 255.0 * 2.0 - 1.0`.
 * This file reproduces each step exactly, including Pillow's fixed-point resampling arithmetic (as of the
 * Pillow 11.2.1 openpi pins; see image.c for the pass order newer Pillow uses on very tall images).
 */
#ifndef PI0_MODEL_IMAGE_H
#define PI0_MODEL_IMAGE_H

#include <stdint.h>

#include "pi0.h"

typedef enum { PI0_PIXEL_U8, PI0_PIXEL_F32 } pi0_pixel_type; /* float images are in [0,1] */
typedef enum { PI0_LAYOUT_HWC, PI0_LAYOUT_CHW } pi0_image_layout;

typedef struct {
    const void *data;
    pi0_pixel_type type;
    pi0_image_layout layout;
    int height, width, channels;
} pi0_image;

/*
 * openpi's whole image path: CHW -> HWC if needed; float -> uint8 like numpy's `(255 * x).astype(np.uint8)`
 * on x86-64 (truncation, and values outside [0, 1] wrap modulo 256 rather than saturate: see image.c);
 * resize_with_pad to out_size x out_size unless the image already has that size; then x / 255 * 2 - 1.
 * `out` receives out_size * out_size * 3 floats, HWC. `channels` must be 3.
 */
pi0_status pi0_image_preprocess(const pi0_image *img, int out_size, float *out, pi0_error *err);

/* openpi's first step alone: the frame as uint8 HWC (height * width * 3 bytes into hwc), what pi0_frame holds. */
pi0_status pi0_image_to_frame(const pi0_image *img, uint8_t *hwc, pi0_error *err);

/*
 * openpi's resize_with_pad on one uint8 HWC RGB image: dst is out_h x out_w x 3. Scales by
 * 1 / max(width / out_w, height / out_h) with Pillow's BILINEAR filter (antialiased when shrinking) and
 * centres the result on zeros. An image that already has the target size is copied unchanged.
 */
pi0_status pi0_resize_with_pad_u8(const uint8_t *src, int height, int width, int out_h, int out_w, uint8_t *dst,
                                  pi0_error *err);

/* ---- the pieces, for a backend that resizes on its own device (the CUDA backend) ---- */

/*
 * openpi_client.image_tools.resize_with_pad's geometry: a height x width frame is scaled to new_h x new_w
 * (Pillow resamples only along an axis whose size changes) and pasted at (pad_y, pad_x) on an out_h x out_w
 * image of zeros. A frame that already has the output size is returned as is (new = size, pads 0). Sides in
 * 1 .. 2^24.
 */
void pi0_resize_with_pad_geometry(int height, int width, int out_h, int out_w, int *new_h, int *new_w, int *pad_y,
                                  int *pad_x);

/*
 * Pillow's BILINEAR resampling along one axis, in_size -> out_size samples: output i is
 * clip8((2^21 + sum_t weights[i * max_taps + t] * in[first[i] + t]) >> 22) over t < count[i], saturated to
 * 0..255 (22-bit fixed-point weights). The sum fits int32 when max_taps <= PI0_RESIZE_INT32_TAPS (Pillow's own
 * accumulator); beyond, it is done in int64.
 */
#define PI0_RESIZE_PRECISION_BITS 22
#define PI0_RESIZE_INT32_TAPS 4096
typedef struct {
    int *first;
    int *count;
    int32_t *weights;
    size_t max_taps;
} pi0_axis_weights;

pi0_status pi0_axis_weights_init(pi0_axis_weights *k, int in_size, int out_size, pi0_error *err);
void pi0_axis_weights_free(pi0_axis_weights *k);

#endif
