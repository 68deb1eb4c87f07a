/*
 * test_image.c - image preprocessing: resize_with_pad geometry and hand-checked Pillow values, the float and
 * CHW input paths, and argument errors. The bit-for-bit comparison with Pillow on random images lives in
 * tests/image_vs_pillow.py (it needs Python), which drives tests/image_tool.c.
 */
#include <stdint.h>

#include "check.h"
#include "model/image.h"

#define S 224

static uint32_t rng_state = 0x9e3779b9u;

static uint8_t random_byte(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return (uint8_t)(rng_state >> 24);
}

/* Observation.from_dict's value for a uint8 pixel: np.float32(u) / 255.0 * 2.0 - 1.0 in float32. */
static float scaled(uint8_t u) {
    return (float)u / 255.0f * 2.0f - 1.0f;
}

static pi0_image hwc_image(const void *data, pi0_pixel_type type, int height, int width) {
    return (pi0_image){.data = data, .type = type, .layout = PI0_LAYOUT_HWC, .height = height, .width = width,
                       .channels = 3};
}

static void test_identity_at_target_size(void) {
    static uint8_t img[S * S * 3], resized[S * S * 3];
    static float out[S * S * 3];
    for (size_t i = 0; i < sizeof img; i++) img[i] = random_byte();
    pi0_image im = hwc_image(img, PI0_PIXEL_U8, S, S);
    REQUIRE(pi0_image_preprocess(&im, S, out, NULL) == PI0_OK, "preprocess failed");
    int mismatches = 0;
    for (size_t i = 0; i < sizeof img; i++) mismatches += out[i] != scaled(img[i]);
    CHECK(mismatches == 0, "%d values differ from x / 255 * 2 - 1", mismatches);
    REQUIRE(pi0_resize_with_pad_u8(img, S, S, S, S, resized, NULL) == PI0_OK, "resize failed");
    CHECK(!memcmp(img, resized, sizeof img), "an image of the target size must come back unchanged");
}

/* Golden float32 values from numpy: np.array([...], np.uint8).astype(np.float32) / 255.0 * 2.0 - 1.0. */
static void test_scaling_matches_numpy(void) {
    static const uint8_t u[7] = {0, 1, 2, 127, 128, 254, 255};
    static const float want[7] = {-1.0f, -0.992156863f, -0.984313726f, -0.00392156839f, 0.003921628f, 0.992156863f,
                                  1.0f};
    for (int i = 0; i < 7; i++) CHECK(scaled(u[i]) == want[i], "%d -> %.9g, numpy %.9g", u[i], scaled(u[i]), want[i]);
    uint8_t px[3] = {128, 128, 128};
    float out[3];
    pi0_image im = hwc_image(px, PI0_PIXEL_U8, 1, 1);
    REQUIRE(pi0_image_preprocess(&im, 1, out, NULL) == PI0_OK, "preprocess failed");
    CHECK(out[0] == want[4] && out[2] == want[4], "1x1 at out_size 1: %.9g", out[0]);
}

/*
 * openpi's resize_with_pad geometry (ratio = max(w / 224, h / 224), new = int(side / ratio),
 * pad = int((224 - new) / 2)), checked on constant images: the resized block keeps the value exactly
 * (Pillow's weights sum to 1 in fixed point) and everything around it is zero. Rows from openpi's Python.
 */
static void test_padding_geometry(void) {
    static const struct {
        int h, w, new_h, new_w, pad_y, pad_x;
    } cases[] = {
        {480, 640, 168, 224, 28, 0}, {100, 300, 74, 224, 75, 0}, {300, 100, 224, 74, 0, 75},
        {1, 1, 224, 224, 0, 0},      {1000, 7, 224, 1, 0, 111},  {7, 1000, 1, 224, 111, 0},
        {224, 100, 224, 100, 0, 62}, {100, 224, 100, 224, 62, 0}, {720, 1280, 126, 224, 49, 0},
        {2, 3, 149, 224, 37, 0},
        {1, 1000, 1, 224, 111, 0}, /* openpi raises here (0 rows); the C code keeps one row */
    };
    static uint8_t out[S * S * 3];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int h = cases[c].h, w = cases[c].w;
        uint8_t *img = malloc((size_t)h * w * 3);
        REQUIRE(img, "out of memory");
        memset(img, 200, (size_t)h * w * 3);
        pi0_error err = {0};
        pi0_status st = pi0_resize_with_pad_u8(img, h, w, S, S, out, &err);
        free(img);
        REQUIRE(st == PI0_OK, "%dx%d: %s", h, w, err.message);
        int wrong = 0;
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++) {
                int inside = y >= cases[c].pad_y && y < cases[c].pad_y + cases[c].new_h && x >= cases[c].pad_x &&
                             x < cases[c].pad_x + cases[c].new_w;
                for (int k = 0; k < 3; k++) wrong += out[(y * S + x) * 3 + k] != (inside ? 200 : 0);
            }
        CHECK(wrong == 0, "%dx%d: %d wrong bytes for a %dx%d block at (%d, %d)", h, w, wrong, cases[c].new_h,
              cases[c].new_w, cases[c].pad_y, cases[c].pad_x);
    }
}

/*
 * Pillow's bilinear by hand (Resample.c precompute_coeffs), confirmed with Image.resize:
 * upscaling [0, 101] from 2 to 4 columns: support 1, centres 0.25 .. 1.75, weights (1), (3/4, 1/4),
 * (1/4, 3/4), (1): 0, 25.25, 75.75, 101, rounded to nearest -> 0, 25, 76, 101 (rows are copies: 1 -> 2).
 */
static void test_hand_checked_upscale(void) {
    uint8_t src[1 * 2 * 3] = {0, 0, 0, 101, 101, 101};
    uint8_t dst[2 * 4 * 3];
    REQUIRE(pi0_resize_with_pad_u8(src, 1, 2, 2, 4, dst, NULL) == PI0_OK, "resize failed");
    static const uint8_t want[4] = {0, 25, 76, 101};
    for (int y = 0; y < 2; y++)
        for (int x = 0; x < 4; x++)
            CHECK(dst[(y * 4 + x) * 3 + 1] == want[x], "(%d, %d): %d, Pillow %d", y, x, dst[(y * 4 + x) * 3 + 1],
                  want[x]);
}

/*
 * Downscaling 2x4 -> 1x2 widens the triangle to support 2: column 0 averages input columns 0..2 with weights
 * 3/7, 3/7, 1/7, so 70 at (0, 0) gives 30; the vertical pass averages the two rows: 15. Pillow agrees.
 */
static void test_hand_checked_downscale(void) {
    uint8_t src[2 * 4 * 3] = {0};
    src[0] = src[1] = src[2] = 70;
    uint8_t dst[1 * 2 * 3];
    REQUIRE(pi0_resize_with_pad_u8(src, 2, 4, 1, 2, dst, NULL) == PI0_OK, "resize failed");
    CHECK(dst[0] == 15 && dst[2] == 15 && dst[3] == 0, "got %d %d", dst[0], dst[3]);
}

static void test_chw_equals_hwc(void) {
    enum { H = 37, W = 53 };
    static uint8_t hwc[H * W * 3], chw[3 * H * W];
    static float out_hwc[S * S * 3], out_chw[S * S * 3];
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            for (int c = 0; c < 3; c++) hwc[(y * W + x) * 3 + c] = chw[(c * H + y) * W + x] = random_byte();
    pi0_image a = hwc_image(hwc, PI0_PIXEL_U8, H, W);
    pi0_image b = a;
    b.data = chw, b.layout = PI0_LAYOUT_CHW;
    REQUIRE(pi0_image_preprocess(&a, S, out_hwc, NULL) == PI0_OK, "HWC preprocess failed");
    REQUIRE(pi0_image_preprocess(&b, S, out_chw, NULL) == PI0_OK, "CHW preprocess failed");
    CHECK(!memcmp(out_hwc, out_chw, sizeof out_hwc), "CHW and HWC inputs must give the same output");
}

/* A float image of (u + 0.5) / 255 truncates back to u, so it must match the uint8 path exactly. */
static void test_float_path_matches_uint8(void) {
    enum { H = 90, W = 160 };
    static uint8_t u8[H * W * 3];
    static float f32[H * W * 3], out_u8[S * S * 3], out_f32[S * S * 3];
    for (int i = 0; i < H * W * 3; i++) {
        u8[i] = random_byte();
        f32[i] = ((float)u8[i] + 0.5f) / 255.0f;
    }
    pi0_image a = hwc_image(u8, PI0_PIXEL_U8, H, W);
    pi0_image b = a;
    b.data = f32, b.type = PI0_PIXEL_F32;
    REQUIRE(pi0_image_preprocess(&a, S, out_u8, NULL) == PI0_OK, "uint8 preprocess failed");
    REQUIRE(pi0_image_preprocess(&b, S, out_f32, NULL) == PI0_OK, "float preprocess failed");
    CHECK(!memcmp(out_u8, out_f32, sizeof out_u8), "float and uint8 inputs must give the same output");
}

/*
 * openpi's `(255 * img).astype(np.uint8)` on float32, values from numpy (1.26 and 2.x, x86-64): truncation,
 * wrap-around modulo 256 out of [0, 1], and 0 for NaN, infinities and |255 x| >= 2^31.
 */
static void test_float_cast_matches_numpy(void) {
    static const float x[20] = {-1.0f, -0.5f, -0.004f, 0.0f,  0.5f,      0.999f,    1.0f,      1.003f, 1.5f,   2.0f,
                                3.0f,  100.f, 1e7f,    1e10f, INFINITY, -INFINITY, NAN, -1e10f, -300.0f, 8421504.0f};
    static const uint8_t numpy[20] = {1, 129, 255, 0, 127, 254, 255, 255, 126, 254,
                                      253, 156, 0, 0, 0, 0, 0, 0, 44, 128};
    enum { N = 5 }; /* a 5x5 image at out_size 5: no resize, 75 values cycling through the table */
    float img[N * N * 3], out[N * N * 3];
    for (int i = 0; i < N * N * 3; i++) img[i] = x[i % 20];
    pi0_image im = hwc_image(img, PI0_PIXEL_F32, N, N);
    REQUIRE(pi0_image_preprocess(&im, N, out, NULL) == PI0_OK, "preprocess failed");
    for (int i = 0; i < 20; i++)
        CHECK(out[i] == scaled(numpy[i]), "%g -> %.9g, numpy gives uint8 %d", x[i], out[i], numpy[i]);
}

static void test_invalid_arguments(void) {
    static uint8_t px[480 * 640 * 4];
    static float out[S * S * 3];
    pi0_error err = {0};
    pi0_image im = hwc_image(px, PI0_PIXEL_U8, 480, 640);
    im.channels = 4;
    CHECK(pi0_image_preprocess(&im, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "4 channels must fail");
    CHECK(strstr(err.message, "(480, 640, 4) HWC"), "message names the shape: %s", err.message);
    im.layout = PI0_LAYOUT_CHW, im.channels = 1;
    CHECK(pi0_image_preprocess(&im, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "1 channel must fail");
    CHECK(strstr(err.message, "(1, 480, 640) CHW"), "message names the shape: %s", err.message);
    im.channels = 3, im.height = 0;
    CHECK(pi0_image_preprocess(&im, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "height 0 must fail");
    im.height = 480, im.width = -3;
    CHECK(pi0_image_preprocess(&im, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "negative width must fail");
    im.width = 640;
    CHECK(pi0_image_preprocess(&im, 0, out, &err) == PI0_ERR_INVALID_ARGUMENT, "out_size 0 must fail");
    CHECK(pi0_image_preprocess(&im, S, NULL, &err) == PI0_ERR_INVALID_ARGUMENT, "NULL output must fail");
    im.type = (pi0_pixel_type)9;
    CHECK(pi0_image_preprocess(&im, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "unknown pixel type must fail");
    im.type = PI0_PIXEL_U8, im.data = NULL;
    CHECK(pi0_image_preprocess(&im, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "NULL data must fail");
    CHECK(pi0_image_preprocess(NULL, S, out, &err) == PI0_ERR_INVALID_ARGUMENT, "NULL image must fail");

    uint8_t dst[4 * 4 * 3];
    CHECK(pi0_resize_with_pad_u8(px, 0, 4, 4, 4, dst, &err) == PI0_ERR_INVALID_ARGUMENT, "height 0 must fail");
    CHECK(pi0_resize_with_pad_u8(px, 4, 4, 4, -1, dst, &err) == PI0_ERR_INVALID_ARGUMENT, "target width -1 must fail");
    CHECK(strstr(err.message, "target width -1"), "message: %s", err.message);
    CHECK(pi0_resize_with_pad_u8(NULL, 4, 4, 4, 4, dst, &err) == PI0_ERR_INVALID_ARGUMENT, "NULL source must fail");
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(test_identity_at_target_size);
    RUN(test_scaling_matches_numpy);
    RUN(test_padding_geometry);
    RUN(test_hand_checked_upscale);
    RUN(test_hand_checked_downscale);
    RUN(test_chw_equals_hwc);
    RUN(test_float_path_matches_uint8);
    RUN(test_float_cast_matches_numpy);
    RUN(test_invalid_arguments);
    return check_finish();
}
