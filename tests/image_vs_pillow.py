#!/usr/bin/env python3
"""Checks the C image preprocessing bit-for-bit against openpi's Python (Pillow + numpy).

    python3 tests/image_vs_pillow.py build/tests/image_tool [--cases N] [--seed S]

Needs Pillow and numpy (pip install pillow numpy). Build the tool first (see tests/image_tool.c).
Every case runs the tool on a random image and compares its bytes with the reference below:
  * resize: pi0_resize_with_pad_u8 vs openpi_client.image_tools.resize_with_pad, random sizes (upscale,
    downscale, mixed, extreme aspect ratios, tiny images, sizes near the target) and random targets;
  * preprocess: pi0_image_preprocess vs openpi's whole image path (uint8 or float32 input, HWC or CHW,
    float values in and out of [0, 1]) down to the float32 bits.
Prints one summary line; exits 1 on any mismatch.

Pillow version: openpi's uv.lock pins Pillow 11.2.1, whose resize always runs the horizontal pass before
the vertical one. Pillow 12.2 (#9524: images over 100x taller than wide) and 13.0 (#9549: height shrinking
more than twice as much as width) run the vertical pass first for some shapes, which moves some pixels by 1.
On those versions the reference requests the two passes one at a time, which is exactly what the older
single call computes; the summary also reports how often the installed Pillow's own order disagrees.
"""

import argparse
import subprocess
import sys

import numpy as np
import PIL
from PIL import Image

TARGET = 224
PILLOW_VERSION = tuple(int(p) for p in PIL.__version__.split(".")[:2])
PILLOW_REORDERS_PASSES = PILLOW_VERSION >= (12, 2)


def pillow_resize_bilinear(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Image.resize(size, BILINEAR) as computed by the Pillow openpi pins (horizontal pass first)."""
    if not PILLOW_REORDERS_PASSES:
        return image.resize(size, resample=Image.BILINEAR)
    width, height = image.size
    if size[0] != width:
        image = image.resize((size[0], height), resample=Image.BILINEAR)
    if size[1] != height:
        image = image.resize(size, resample=Image.BILINEAR)
    return image


def openpi_resize_with_pad(image: np.ndarray, height: int, width: int, resize=pillow_resize_bilinear) -> np.ndarray:
    """openpi packages/openpi-client/src/openpi_client/image_tools.py, resize_with_pad and _resize_with_pad_pil
    for one HWC image. Upstream raises when a side rounds to 0 pixels (Pillow: "height and width must be > 0");
    the C code keeps 1 pixel there (the max(1, ...) below), which callers count separately."""
    if image.shape[-3:-1] == (height, width):
        return image  # "If the images are already the correct size, return them as is."
    pil = Image.fromarray(image)
    cur_width, cur_height = pil.size
    ratio = max(cur_width / width, cur_height / height)
    resized_height = max(1, int(cur_height / ratio))
    resized_width = max(1, int(cur_width / ratio))
    resized_image = resize(pil, (resized_width, resized_height))
    zero_image = Image.new(resized_image.mode, (width, height), 0)
    pad_height = max(0, int((height - resized_height) / 2))
    pad_width = max(0, int((width - resized_width) / 2))
    zero_image.paste(resized_image, (pad_width, pad_height))
    assert zero_image.size == (width, height)
    return np.asarray(zero_image)


def upstream_rounds_to_zero(h: int, w: int, out_h: int, out_w: int) -> bool:
    ratio = max(w / out_w, h / out_h)
    return (h, w) != (out_h, out_w) and (int(h / ratio) == 0 or int(w / ratio) == 0)


def openpi_preprocess(data: np.ndarray, chw: bool, size: int) -> np.ndarray:
    """The policy's image path: libero_policy._parse_image (float -> uint8, CHW -> HWC), transforms.ResizeImages
    and Observation.from_dict's uint8 -> [-1, 1] conversion."""
    image = data
    if np.issubdtype(image.dtype, np.floating):
        with np.errstate(invalid="ignore", over="ignore"):
            image = (255 * image).astype(np.uint8)
    if chw:
        image = np.ascontiguousarray(image.transpose(1, 2, 0))  # einops "c h w -> h w c"
    image = openpi_resize_with_pad(image, size, size)
    return image.astype(np.float32) / 255.0 * 2.0 - 1.0


def random_shape(rng: np.random.Generator) -> tuple[int, int]:
    kind = rng.integers(6)
    if kind == 0:  # anything up to VGA-ish, up or down
        return int(rng.integers(1, 700)), int(rng.integers(1, 700))
    if kind == 1:  # camera frames
        shapes = [(480, 640), (720, 1280), (1080, 1920), (240, 320), (256, 256), (96, 96), (128, 128),
                  (224, 224), (200, 200), (480, 848), (360, 640), (512, 512), (256, 320), (180, 320)]
        h, w = shapes[rng.integers(len(shapes))]
        return (h, w) if rng.random() < 0.7 else (w, h)
    if kind == 2:  # extreme aspect ratios
        thin, long = int(rng.integers(1, 41)), int(rng.integers(100, 3000))
        return (thin, long) if rng.random() < 0.5 else (long, thin)
    if kind == 3:  # tiny images: large upscales
        return int(rng.integers(1, 17)), int(rng.integers(1, 17))
    if kind == 4:  # near the target: scale factors close to 1 both ways
        return int(rng.integers(200, 250)), int(rng.integers(200, 250))
    return int(rng.integers(1, 2000)), int(rng.integers(1, 2000))


def random_pixels(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    kind = rng.integers(4)
    if kind == 0:
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if kind == 1:  # smooth gradients with a little noise
        y, x = np.mgrid[0:h, 0:w]
        base = (x * rng.uniform(0, 4) + y * rng.uniform(0, 4))[..., None] + rng.uniform(0, 255, 3)
        return np.clip(base + rng.normal(0, 3, (h, w, 3)), 0, 255).astype(np.uint8)
    if kind == 2:  # hard 0/255 edges: rounding and clipping extremes
        return (rng.integers(0, 2, (h, w, 3)) * 255).astype(np.uint8)
    return np.full((h, w, 3), rng.integers(0, 256, 3), dtype=np.uint8)


def random_floats(rng: np.random.Generator, u8: np.ndarray) -> np.ndarray:
    kind = rng.integers(3)
    if kind == 0:  # exact k/255: truncation of 255 * x decides between k and k - 1
        return u8.astype(np.float32) / np.float32(255)
    if kind == 1:
        return rng.random(u8.shape, dtype=np.float32)
    x = rng.uniform(-2.5, 3.5, u8.shape).astype(np.float32)  # out of range: numpy's wrapping cast
    specials = np.array([np.nan, np.inf, -np.inf, 1e7, -1e7, 8421504.0, -0.0], np.float32)
    mask = rng.random(u8.shape) < 0.02
    x[mask] = rng.choice(specials, int(mask.sum()))
    return x


def run_tool(cmd: list[str], payload: bytes) -> bytes:
    result = subprocess.run(cmd, input=payload, capture_output=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.decode().strip()}")
    return result.stdout


def describe_mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.argwhere(got != want)
    first = tuple(int(i) for i in bad[0])
    return f"{len(bad)} values differ, first at {first}: got {got[first].item()!r}, want {want[first].item()!r}"


def check_resize(tool: str, rng: np.random.Generator, stats: dict) -> str | None:
    h, w = random_shape(rng)
    out_h, out_w = (TARGET, TARGET) if rng.random() < 0.75 else (int(rng.integers(1, 300)), int(rng.integers(1, 300)))
    image = random_pixels(rng, h, w)
    got = np.frombuffer(run_tool([tool, "resize", str(h), str(w), str(out_h), str(out_w)], image.tobytes()), np.uint8)
    if got.size != out_h * out_w * 3:
        return f"resize {h}x{w} -> {out_h}x{out_w}: tool wrote {got.size} bytes"
    got = got.reshape(out_h, out_w, 3)
    want = openpi_resize_with_pad(image, out_h, out_w)
    stats["thin"] += upstream_rounds_to_zero(h, w, out_h, out_w)
    direct = openpi_resize_with_pad(image, out_h, out_w, lambda im, size: im.resize(size, resample=Image.BILINEAR))
    stats["installed_order_differs"] += not np.array_equal(got, direct)
    if not np.array_equal(got, want):
        return f"resize {h}x{w} -> {out_h}x{out_w}: {describe_mismatch(got, want)}"
    return None


def check_preprocess(tool: str, rng: np.random.Generator, stats: dict) -> str | None:
    h, w = random_shape(rng)
    size = TARGET if rng.random() < 0.8 else int(rng.integers(1, 300))
    as_float, chw = rng.random() < 0.5, rng.random() < 0.5
    data = random_pixels(rng, h, w)
    if as_float:
        data = random_floats(rng, data)
    if chw:
        data = np.ascontiguousarray(data.transpose(2, 0, 1))
    cmd = [tool, "preprocess", "f32" if as_float else "u8", "chw" if chw else "hwc", str(h), str(w), str(size)]
    got = np.frombuffer(run_tool(cmd, data.tobytes()), np.float32)
    what = f"preprocess {cmd[2]} {cmd[3]} {h}x{w} -> {size}"
    if got.size != size * size * 3:
        return f"{what}: tool wrote {got.size} floats"
    got = got.reshape(size, size, 3)
    want = openpi_preprocess(data, chw, size)
    stats["thin"] += upstream_rounds_to_zero(h, w, size, size)
    stats["float"] += as_float
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        return f"{what}: {describe_mismatch(got, want)}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", help="path to the built tests/image_tool")
    parser.add_argument("--cases", type=int, default=1000, help="random cases per check (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    stats = {"thin": 0, "float": 0, "installed_order_differs": 0}
    failures = []
    for check in (check_resize, check_preprocess):
        for _ in range(args.cases):
            failure = check(args.tool, rng, stats)
            if failure:
                failures.append(failure)
    for failure in failures[:20]:
        print("MISMATCH", failure)
    total = 2 * args.cases
    print(f"image_vs_pillow: {total - len(failures)}/{total} cases bit-exact ({args.cases} resize_with_pad, "
          f"{args.cases} preprocess of which {stats['float']} float) against Pillow {PIL.__version__} in openpi's "
          f"pass order and numpy {np.__version__}; {stats['thin']} thin images where upstream openpi raises; "
          f"installed Pillow's own pass order differs in {stats['installed_order_differs']} resize cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
