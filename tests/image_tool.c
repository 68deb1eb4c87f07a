/*
 * image_tool.c - runs the image preprocessing on raw bytes, for tests/image_vs_pillow.py.
 *
 *   image_tool resize H W OUT_H OUT_W [IN [OUT]]
 *       IN: H*W*3 uint8 HWC RGB; OUT: OUT_H*OUT_W*3 uint8 (pi0_resize_with_pad_u8)
 *   image_tool preprocess u8|f32 hwc|chw H W OUT_SIZE [IN [OUT]]
 *       IN: H*W*3 uint8 or float32 in the given layout; OUT: OUT_SIZE^2*3 float32 HWC (pi0_image_preprocess)
 *
 * IN and OUT default to stdin and stdout ("-" too). Build it next to the tests, e.g.
 *   cc -std=c11 -O2 -D_GNU_SOURCE -Iinclude -Isrc tests/image_tool.c build/libpi0.a -ljansson -lm -fopenmp \
 *      -o build/tests/image_tool
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/image.h"

static int usage(void) {
    fprintf(stderr, "usage: image_tool resize H W OUT_H OUT_W [IN [OUT]]\n"
                    "       image_tool preprocess u8|f32 hwc|chw H W OUT_SIZE [IN [OUT]]\n");
    return 2;
}

static FILE *open_or_std(const char *path, const char *mode, FILE *std) {
    return !path || !strcmp(path, "-") ? std : fopen(path, mode);
}

/* Reads exactly n bytes from `path` (or stdin); NULL on a short file. */
static void *read_exact(const char *path, size_t n) {
    FILE *f = open_or_std(path, "rb", stdin);
    void *buf = f ? malloc(n ? n : 1) : NULL;
    int ok = buf && fread(buf, 1, n, f) == n && fgetc(f) == EOF;
    if (f && f != stdin) fclose(f);
    if (!ok) {
        fprintf(stderr, "image_tool: expected exactly %zu bytes of input\n", n);
        free(buf);
        return NULL;
    }
    return buf;
}

static int write_all(const char *path, const void *buf, size_t n) {
    FILE *f = open_or_std(path, "wb", stdout);
    int ok = f && fwrite(buf, 1, n, f) == n;
    if (f && f != stdout) ok = fclose(f) == 0 && ok;
    else if (f) ok = fflush(f) == 0 && ok;
    return ok ? 0 : 1;
}

static int run_resize(int argc, char **argv) {
    if (argc < 6) return usage();
    int h = atoi(argv[2]), w = atoi(argv[3]), oh = atoi(argv[4]), ow = atoi(argv[5]);
    if (h <= 0 || w <= 0 || oh <= 0 || ow <= 0) return usage();
    uint8_t *src = read_exact(argc > 6 ? argv[6] : NULL, (size_t)h * w * 3);
    uint8_t *dst = malloc((size_t)oh * ow * 3);
    pi0_error err = {0};
    int rc = 1;
    if (src && dst && pi0_resize_with_pad_u8(src, h, w, oh, ow, dst, &err) == PI0_OK)
        rc = write_all(argc > 7 ? argv[7] : NULL, dst, (size_t)oh * ow * 3);
    else if (src && dst)
        fprintf(stderr, "image_tool: %s\n", err.message);
    free(src);
    free(dst);
    return rc;
}

static int run_preprocess(int argc, char **argv) {
    if (argc < 7) return usage();
    pi0_image img = {.channels = 3, .height = atoi(argv[4]), .width = atoi(argv[5])};
    int out_size = atoi(argv[6]);
    if (strcmp(argv[2], "u8") && strcmp(argv[2], "f32")) return usage();
    if (strcmp(argv[3], "hwc") && strcmp(argv[3], "chw")) return usage();
    if (img.height <= 0 || img.width <= 0 || out_size <= 0) return usage();
    img.type = strcmp(argv[2], "u8") ? PI0_PIXEL_F32 : PI0_PIXEL_U8;
    img.layout = strcmp(argv[3], "hwc") ? PI0_LAYOUT_CHW : PI0_LAYOUT_HWC;
    size_t pixel_bytes = img.type == PI0_PIXEL_U8 ? 1 : sizeof(float);
    void *src = read_exact(argc > 7 ? argv[7] : NULL, (size_t)img.height * img.width * 3 * pixel_bytes);
    size_t out_n = (size_t)out_size * out_size * 3;
    float *out = malloc(out_n * sizeof *out);
    pi0_error err = {0};
    int rc = 1;
    img.data = src;
    if (src && out && pi0_image_preprocess(&img, out_size, out, &err) == PI0_OK)
        rc = write_all(argc > 8 ? argv[8] : NULL, out, out_n * sizeof *out);
    else if (src && out)
        fprintf(stderr, "image_tool: %s\n", err.message);
    free(src);
    free(out);
    return rc;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "resize")) return run_resize(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "preprocess")) return run_preprocess(argc, argv);
    return usage();
}
